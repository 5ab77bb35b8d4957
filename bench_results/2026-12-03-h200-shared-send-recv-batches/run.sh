#!/usr/bin/env bash
# prepared send/recv with its flag batches made once: host time per call; its GPU tests
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
L=/tmp/logs; mkdir -p $L; date > $L/date.txt
for nb in 1048576 16777216; do timeout 60 python3 scripts/probes/p2p_profile.py --nbytes $nb --calls 300 > $L/p2p_$nb.log 2>&1; done
grep -h "host per call" $L/p2p_*.log
LOGS=$L TEST_TIMEOUT=150 bash scripts/device_run.sh guard_p2p > $L/out_p2p.log 2>&1
grep -h "passed\|failed\|error" $L/gpu_guard_p2p.log | tail -3
tar czf $OUT/logs.tgz -C /tmp logs
