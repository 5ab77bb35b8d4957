# session 6, run 7 (4 x H200): repeat on the final code (3f13694 + docs): hot all_to_all 256 MiB-1 GiB
# at h = 0.7 / 0.9 (calibrated), then small messages on 4 and 2 GPUs
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export LOGS=/tmp/L BENCH_TIMEOUT=200; rm -rf $LOGS /tmp/braid_cache; mkdir -p $LOGS
S="bash scripts/device_run.sh"
BENCH_OP=all_to_all_single BENCH_SIZES=256M:1G BENCH_TAG=hot BENCH_EXTRA="--hot-fraction 0.7,0.9" $S bench4 | grep -E "^ +[0-9]|calibrat|^# [a-z]"
cp -r /tmp/braid_cache $LOGS/cache 2>/dev/null
BENCH_OP=all BENCH_SIZES=64K:1M BENCH_TAG=small BENCH_EXTRA="--no-calibrate" $S bench4 | grep -E "^ +[0-9]|^# [a-z]"
BENCH_OP=all BENCH_SIZES=64K:1M BENCH_TAG=small BENCH_EXTRA="--no-calibrate" $S bench2 | grep -E "^ +[0-9]|^# [a-z]"
cp .carry/s6r7.sh $LOGS/
$S pack
