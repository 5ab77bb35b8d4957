# session 4, run 7 (4 x H200): routed all_to_all after the repeated-matrix memo; MoE
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export LOGS=/tmp/L BENCH_TIMEOUT=100; mkdir -p $LOGS
S="bash scripts/device_run.sh"
t0=$(date +%s)
BENCH_OP=all_to_all_single BENCH_SIZES=64M:1G BENCH_TAG=hot BENCH_EXTRA="--hot-fraction 0.7,1.0" $S bench4 | grep -E "^ +[0-9]|calibration|^# [a-z]"
echo "+$(( $(date +%s) - t0 )) s"
BENCH_OP=moe BENCH_SIZES=64M:1G BENCH_TAG=moe BENCH_EXTRA="--no-calibrate" $S bench4 | grep -E "^ +[0-9]|calibration"
echo "+$(( $(date +%s) - t0 )) s"
cp -r /tmp/braid_cache $LOGS/cache 2>/dev/null
$S pack
