# session 6, run 6 (4 x H200): routed GPU tests, MoE 64 MiB host sections, then the hot sweep
# 64 MiB-1 GiB (calibrated), 1 MiB hot, MoE 64 MiB-1 GiB, balanced 1 GiB, on the commit beside this script
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export LOGS=/tmp/L BENCH_TIMEOUT=240; rm -rf $LOGS /tmp/braid_cache; mkdir -p $LOGS
S="bash scripts/device_run.sh"
timeout 150 python3 -m pytest tests/gpu/test_gpu_routed.py -q -x 2>&1 | tee $LOGS/gpu_routed.log | tail -2
timeout 100 python3 .carry/moe_probe.py 2>&1 | grep "moe probe" | tee $LOGS/moe_probe.log
BENCH_OP=all_to_all_single BENCH_SIZES=64M:1G BENCH_TAG=hot BENCH_EXTRA="--hot-fraction 0.4,0.7,0.9,1.0" $S bench4 | grep -E "^ +[0-9]|calibrat|^# [a-z]"
cp -r /tmp/braid_cache $LOGS/cache 2>/dev/null
BENCH_OP=moe BENCH_SIZES=64M:1G BENCH_TAG=moe BENCH_EXTRA="--no-calibrate" $S bench4 | grep -E "^ +[0-9]|^# [a-z]"
BENCH_OP=all_to_all_single BENCH_SIZES=1M:1M BENCH_TAG=hot_1m BENCH_EXTRA="--hot-fraction 0.4,0.7,0.9,1.0 --no-calibrate" $S bench4 | grep -E "^ +[0-9]|^# [a-z]"
BENCH_OP=all_to_all_single BENCH_SIZES=1G:1G BENCH_TAG=balanced BENCH_EXTRA="--no-calibrate" $S bench4 | grep -E "^ +[0-9]|^# [a-z]"
cp .carry/moe_probe.py .carry/s6r6.sh $LOGS/
$S pack
