# session 6, run 4 (4 x H200): GPU tests of the changed paths, then hot all_to_all (1 MiB, 64-256 MiB),
# MoE, and small messages (4 and 2 GPUs), on commit 86c1b81 + what the script's directory says
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export LOGS=/tmp/L BENCH_TIMEOUT=200; rm -rf $LOGS /tmp/braid_cache; mkdir -p $LOGS
S="bash scripts/device_run.sh"
timeout 200 python3 -m pytest tests/gpu/test_gpu_routed.py -q -x 2>&1 | tee $LOGS/gpu_routed.log | tail -2
timeout 200 python3 -m pytest tests/gpu/test_gpu_backend.py tests/gpu/test_gpu_collectives.py::test_two_gpus -q -x 2>&1 | tee $LOGS/gpu_fast2.log | tail -2
BENCH_OP=all_to_all_single BENCH_SIZES=1M:1M BENCH_TAG=hot_1m BENCH_EXTRA="--hot-fraction 0.4,0.7,0.9,1.0" $S bench4 | grep -E "^ +[0-9]|calibrat|^# [a-z]"
cp -r /tmp/braid_cache $LOGS/cache 2>/dev/null
BENCH_OP=all_to_all_single BENCH_SIZES=64M:256M BENCH_TAG=hot_c BENCH_EXTRA="--hot-fraction 0.4,0.7 --no-calibrate" $S bench4 | grep -E "^ +[0-9]|^# [a-z]"
BENCH_OP=moe BENCH_SIZES=64M:256M BENCH_TAG=moe BENCH_EXTRA="--no-calibrate" $S bench4 | grep -E "^ +[0-9]|^# [a-z]"
BENCH_OP=all BENCH_SIZES=64K:1M BENCH_TAG=small BENCH_EXTRA="--no-calibrate" $S bench4 | grep -E "^ +[0-9]|^# [a-z]"
BENCH_OP=all BENCH_SIZES=64K:1M BENCH_TAG=small BENCH_EXTRA="--no-calibrate" $S bench2 | grep -E "^ +[0-9]|^# [a-z]"
$S pack
