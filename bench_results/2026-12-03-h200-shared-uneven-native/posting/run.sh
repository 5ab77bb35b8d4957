#!/usr/bin/env bash
# the uneven all_to_all on the copy engines posted natively vs in Python; its GPU tests
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
L=/tmp/logs; mkdir -p $L; date > $L/date.txt
P="python3 scripts/probes/prepared_profile.py --op all_to_all_uneven --sync-every 1"
for r in 1 2; do
  timeout 90 $P --nbytes 4194304 --nccl 3 > $L/u2_4m_native_$r.log 2>&1
  BRAID_NATIVE_CALL=0 timeout 90 $P --nbytes 4194304 --nccl 3 > $L/u2_4m_python_$r.log 2>&1
done
timeout 90 $P --nbytes 16777216 --nccl 3 > $L/u2_16m_native.log 2>&1
timeout 90 $P --nbytes 1048576 --nccl 3 > $L/u2_1m_native.log 2>&1
timeout 120 $P --nbytes 4194304 --nccl 3 --nproc 4 > $L/u4_4m_native.log 2>&1
for f in $L/u*.log; do echo "== $f"; grep -E "braid / NCCL|host per call median|Error|error" $f | head -4; done
LOGS=$L TEST_TIMEOUT=400 bash scripts/device_run.sh guard_fuzz > $L/out_fuzz.log 2>&1
grep -h "passed\|failed\|error" $L/gpu_guard_fuzz.log | tail -4
tar czf $OUT/logs.tgz -C /tmp logs
