# session 5, run 5 (4 x H200): backend GPU tests (2 GPUs) and routed GPU tests (4 GPUs) on the
# final code; hot all_to_all (calibrated, then 64 MiB-1 GiB with the decisions logged) and MoE
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export LOGS=/tmp/L BENCH_TIMEOUT=150; mkdir -p $LOGS
S="bash scripts/device_run.sh"
timeout 240 python3 -m pytest tests/gpu/test_gpu_backend.py tests/test_backend.py -q -x 2>&1 | tee $LOGS/gpu_backend.log | tail -4
timeout 150 python3 -m pytest tests/gpu/test_gpu_routed.py -q -x 2>&1 | tee $LOGS/gpu_routed4.log | tail -2
BENCH_OP=all_to_all_single BENCH_SIZES=256M:1G BENCH_TAG=hot_a BENCH_EXTRA="--hot-fraction 0.7,0.9" $S bench4 | grep -E "^ +[0-9]|calibrat|^# [a-z]"
cp -r /tmp/braid_cache $LOGS/cache 2>/dev/null
BRAID_LOG_LEVEL=debug BENCH_OP=all_to_all_single BENCH_SIZES=64M:1G BENCH_TAG=hot_b BENCH_EXTRA="--hot-fraction 0.4,0.7,0.9,1.0 --no-calibrate" $S bench4 | grep -E "^ +[0-9]|^# [a-z]"
grep "route rank 0" $LOGS/bench4_hot_b.log | sed -E 's/.*class \[?\(?([0-9]+), ([0-9-]+).*-> (.*)/\1 \2 \3/' | sort | uniq -c | head -30
BENCH_OP=moe BENCH_SIZES=64M:1G BENCH_TAG=moe BENCH_EXTRA="--no-calibrate" $S bench4 | grep -E "^ +[0-9]|^# [a-z]"
$S pack
