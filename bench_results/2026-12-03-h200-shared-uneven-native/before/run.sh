#!/usr/bin/env bash
# the uneven all_to_all on the copy engines: host time per repeated call and where it goes
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
L=/tmp/logs; mkdir -p $L; date > $L/date.txt; git log -1 --format=%h > $L/head.txt 2>/dev/null
P="python3 scripts/probes/prepared_profile.py --op all_to_all_uneven --sync-every 1"
timeout 100 $P --nbytes 4194304 --nccl 3 > $L/u2_4m.log 2>&1
timeout 100 $P --nbytes 16777216 --nccl 3 > $L/u2_16m.log 2>&1
timeout 100 $P --nbytes 4194304 --cprofile --calls 200 > $L/u2_4m_prof.log 2>&1
timeout 120 $P --nbytes 4194304 --nccl 3 --nproc 4 > $L/u4_4m.log 2>&1
timeout 100 python3 scripts/probes/prepared_profile.py --op all_to_all_equal --sync-every 1 --nbytes 4194304 --nccl 3 > $L/e2_4m.log 2>&1
tar czf $OUT/logs.tgz -C /tmp logs
for f in $L/u*.log $L/e2*.log; do echo "== $f"; grep -E "braid / NCCL|host per call median|Error|error" $f | head -5; done
