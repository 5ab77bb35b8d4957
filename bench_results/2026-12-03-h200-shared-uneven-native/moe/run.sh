#!/usr/bin/env bash
# the MoE exchange in the bench (host time per layer, copy engines alone) with the native uneven
# call and without; the backend's and prepared send/recv's GPU tests on this tree
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
L=/tmp/logs; mkdir -p $L; date > $L/date.txt
LOGS=$L AB_ROUNDS=1 AB_ENVS="BRAID_NATIVE_CALL=1;BRAID_NATIVE_CALL=0" BENCH_OP=moe BENCH_SIZES=4M:64M BENCH_FACTOR=4 \
  BENCH_TIMEOUT=100 bash scripts/device_run.sh ab2 > $L/out_ab2.log 2>&1
grep -E "^ +[0-9]+ |host per call|^---" $L/ab2.log | head -40
LOGS=$L TEST_TIMEOUT=150 bash scripts/device_run.sh guard_backend > $L/out_backend.log 2>&1
LOGS=$L TEST_TIMEOUT=150 bash scripts/device_run.sh guard_p2p > $L/out_p2p.log 2>&1
grep -h "passed\|failed\|error" $L/gpu_guard_backend.log $L/gpu_guard_p2p.log | tail -4
tar czf $OUT/logs.tgz -C /tmp logs
