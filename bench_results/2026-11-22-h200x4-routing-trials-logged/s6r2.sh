# session 6, run 2 (4 x H200): where MoE 64 MiB's time goes (cProfile of rank 0, native and auto),
# the trial decisions logged at 256 MiB h = 0.7, then the hot sweep (every fraction), balanced and
# 1 MiB hot, MoE 64 MiB-1 GiB, and the small messages again (reduce and send/recv now direct)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export LOGS=/tmp/L BENCH_TIMEOUT=200; rm -rf $LOGS /tmp/braid_cache; mkdir -p $LOGS
S="bash scripts/device_run.sh"
timeout 100 python3 scripts/profile_call.py --nproc 4 --op moe --size 64M --shares auto 2>&1 | grep -v Warning > $LOGS/profile_moe64_auto.log; head -60 $LOGS/profile_moe64_auto.log
BENCH_OP=all_to_all_single BENCH_SIZES=256M:1G BENCH_TAG=hot_a BENCH_EXTRA="--hot-fraction 0.4,0.7,0.9,1.0" $S bench4 | grep -E "^ +[0-9]|calibrat|^# [a-z]"
cp -r /tmp/braid_cache $LOGS/cache 2>/dev/null
BRAID_LOG_LEVEL=debug BENCH_OP=all_to_all_single BENCH_SIZES=256M:256M BENCH_TAG=hot_dbg BENCH_EXTRA="--hot-fraction 0.7 --no-calibrate" $S bench4 | grep -E "^ +[0-9]|^# [a-z]"
grep "route rank 0" $LOGS/bench4_hot_dbg.log | sed -E 's/.*route rank 0 //' > $LOGS/decisions_rank0_hot_dbg.txt; wc -l $LOGS/decisions_rank0_hot_dbg.txt
BENCH_OP=all_to_all_single BENCH_SIZES=1M:1M BENCH_TAG=hot_1m BENCH_EXTRA="--hot-fraction 0.7,1.0 --no-calibrate" $S bench4 | grep -E "^ +[0-9]|^# [a-z]"
BENCH_OP=all_to_all_single BENCH_SIZES=1G:1G BENCH_TAG=balanced BENCH_EXTRA="--no-calibrate" $S bench4 | grep -E "^ +[0-9]|^# [a-z]"
BENCH_OP=moe BENCH_SIZES=64M:1G BENCH_TAG=moe BENCH_EXTRA="--no-calibrate" $S bench4 | grep -E "^ +[0-9]|^# [a-z]"
BENCH_OP=all BENCH_SIZES=64K:1M BENCH_TAG=small_2 BENCH_EXTRA="--no-calibrate" $S bench4 | grep -E "^ +[0-9]|^# [a-z]"
$S pack
