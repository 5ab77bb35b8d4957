# session 4, run 8 (4 x H200): probes that back off; MoE and hot all_to_all at 64-256 MiB
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export LOGS=/tmp/L BENCH_TIMEOUT=80; mkdir -p $LOGS
S="bash scripts/device_run.sh"
BENCH_OP=moe BENCH_SIZES=64M:256M BENCH_TAG=moe $S bench4 | grep -E "^ +[0-9]|calibration"
BENCH_OP=all_to_all_single BENCH_SIZES=64M:256M BENCH_TAG=hot BENCH_EXTRA="--hot-fraction 0.7,1.0 --no-calibrate" $S bench4 | grep -E "^ +[0-9]|calibration|^# [a-z]"
cp -r /tmp/braid_cache $LOGS/cache 2>/dev/null
$S pack
