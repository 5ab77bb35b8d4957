# session 5, run 6 (4 x H200): backend GPU tests after the coalescing fix; 64 MiB hot all_to_all
# with routing off (braid's native path alone) against auto, no debug logging
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export LOGS=/tmp/L BENCH_TIMEOUT=100; mkdir -p $LOGS
S="bash scripts/device_run.sh"
timeout 150 python3 -m pytest tests/gpu/test_gpu_backend.py -q -x 2>&1 | tee $LOGS/gpu_backend.log | tail -3
cp -r .carry/cache /tmp/braid_cache 2>/dev/null
BRAID_ROUTE=off BENCH_OP=all_to_all_single BENCH_SIZES=64M:64M BENCH_TAG=h64_off BENCH_EXTRA="--hot-fraction 0.4,0.7 --no-calibrate" $S bench4 | grep -E "^ +[0-9]|^# [a-z]"
BENCH_OP=all_to_all_single BENCH_SIZES=64M:64M BENCH_TAG=h64_auto BENCH_EXTRA="--hot-fraction 0.4,0.7 --no-calibrate" $S bench4 | grep -E "^ +[0-9]|^# [a-z]"
$S pack
