# session 6, run 5 (4 x H200): auto all_to_all GPU tests, then the hot sweep 64 MiB-1 GiB (calibrated),
# 1 MiB hot, MoE, and the 256 MiB h = 0.7 decisions logged, on the commit beside this script
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export LOGS=/tmp/L BENCH_TIMEOUT=240; rm -rf $LOGS /tmp/braid_cache; mkdir -p $LOGS
S="bash scripts/device_run.sh"
timeout 120 python3 -m pytest tests/gpu/test_gpu_routed.py -k auto -q -x 2>&1 | tee $LOGS/gpu_auto.log | tail -2
BENCH_OP=all_to_all_single BENCH_SIZES=64M:1G BENCH_TAG=hot BENCH_EXTRA="--hot-fraction 0.4,0.7,0.9,1.0" $S bench4 | grep -E "^ +[0-9]|calibrat|^# [a-z]"
cp -r /tmp/braid_cache $LOGS/cache 2>/dev/null
BENCH_OP=all_to_all_single BENCH_SIZES=1M:1M BENCH_TAG=hot_1m BENCH_EXTRA="--hot-fraction 0.4,0.7,0.9,1.0 --no-calibrate" $S bench4 | grep -E "^ +[0-9]|^# [a-z]"
BENCH_OP=moe BENCH_SIZES=64M:1G BENCH_TAG=moe BENCH_EXTRA="--no-calibrate" $S bench4 | grep -E "^ +[0-9]|^# [a-z]"
BRAID_LOG_LEVEL=debug BENCH_OP=all_to_all_single BENCH_SIZES=256M:256M BENCH_TAG=hot_dbg BENCH_EXTRA="--hot-fraction 0.7 --no-calibrate" $S bench4 | grep -E "^ +[0-9]|^# [a-z]"
grep "route rank 0" $LOGS/bench4_hot_dbg.log | sed -E 's/.*route rank 0 //' > $LOGS/decisions_rank0_hot_dbg.txt; wc -l $LOGS/decisions_rank0_hot_dbg.txt
$S pack
