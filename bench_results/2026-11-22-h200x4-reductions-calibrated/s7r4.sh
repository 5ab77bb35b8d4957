# session 7, run 4 (4 x H200): the issue-3 table on the current code (calibrated in the run:
# all_reduce / reduce_scatter, 256 MiB and 1 GiB, 4 and 2 GPUs) and a check that large skewed
# all_to_all and the MoE layer are unchanged by this session's agreement changes
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export LOGS=/tmp/L BENCH_TIMEOUT=170; rm -rf $LOGS /tmp/braid_cache; mkdir -p $LOGS
S="bash scripts/device_run.sh"
F='^ +[0-9]|calibrat|^# [a-z]'
BENCH_OP=all_reduce BENCH_SIZES=256M:1G $S bench4 | grep -E "$F"
BENCH_OP=reduce_scatter BENCH_SIZES=256M:1G $S bench4 | grep -E "$F"
BENCH_OP=all_reduce BENCH_SIZES=256M:1G $S bench2 | grep -E "$F"
BENCH_OP=reduce_scatter BENCH_SIZES=256M:1G $S bench2 | grep -E "$F"
BENCH_OP=all_to_all_single BENCH_SIZES=256M:1G BENCH_TAG=hot BENCH_EXTRA="--hot-fraction 0.7,1.0" $S bench4 | grep -E "$F"
BENCH_OP=moe BENCH_SIZES=64M:1G BENCH_TAG=moe BENCH_EXTRA="--no-calibrate" $S bench4 | grep -E "$F"
cp -r /tmp/braid_cache $LOGS/cache 2>/dev/null
cp .carry/s7r4.sh $LOGS/
$S pack
