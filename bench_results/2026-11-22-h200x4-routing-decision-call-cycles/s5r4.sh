# session 5, run 4 (4 x H200): hot all_to_all + MoE, decisions learned from call cycles
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export LOGS=/tmp/L BENCH_TIMEOUT=150; mkdir -p $LOGS
S="bash scripts/device_run.sh"
BENCH_OP=all_to_all_single BENCH_SIZES=256M:1G BENCH_TAG=hot_a BENCH_EXTRA="--hot-fraction 0.7,0.9" $S bench4 | grep -E "^ +[0-9]|calibrat|^# [a-z]"
cp -r /tmp/braid_cache $LOGS/cache 2>/dev/null
BENCH_OP=all_to_all_single BENCH_SIZES=64M:1G BENCH_TAG=hot_b BENCH_EXTRA="--hot-fraction 0.4,0.7,0.9,1.0 --no-calibrate" $S bench4 | grep -E "^ +[0-9]|^# [a-z]"
BENCH_OP=moe BENCH_SIZES=64M:1G BENCH_TAG=moe BENCH_EXTRA="--no-calibrate" $S bench4 | grep -E "^ +[0-9]|^# [a-z]"
BENCH_OP=all_to_all_single BENCH_SIZES=64M:256M BENCH_TAG=hot_c BENCH_EXTRA="--hot-fraction 0.7,0.9 --no-calibrate" $S bench4 | grep -E "^ +[0-9]|^# [a-z]"
BENCH_OP=all_to_all_single BENCH_SIZES=1G:1G BENCH_TAG=balanced BENCH_EXTRA="--no-calibrate" $S bench4 | grep -E "^ +[0-9]|^# [a-z]"
$S pack
