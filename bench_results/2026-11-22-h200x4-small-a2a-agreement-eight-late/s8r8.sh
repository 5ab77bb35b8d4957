# session 8, run 8 (4 x H200): small uneven calls read their agreement DEFER_DEPTH (8) calls late
# (was: one call late): routed GPU tests, the 1 MiB probe, hot 64 KiB / 1 MiB bench
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export LOGS=/tmp/L BENCH_TIMEOUT=200; rm -rf $LOGS /tmp/braid_cache; mkdir -p $LOGS
S="bash scripts/device_run.sh"
timeout 200 python3 -m pytest tests/gpu/test_gpu_routed.py -q -x 2>&1 | tee $LOGS/gpu_routed.log | tail -2
timeout 120 python3 .carry/a2av_probe.py --nproc 4 2>&1 | grep "a2av probe" | tee $LOGS/a2av_probe4.log
BENCH_OP=all_to_all_single BENCH_SIZES=64K:1M BENCH_FACTOR=16 BENCH_TAG=hot_1m BENCH_EXTRA="--hot-fraction 0.4,0.7,0.9,1.0 --no-calibrate" $S bench4 | grep -E "^ +[0-9]|^# [a-z]"
cp .carry/s8r8.sh .carry/a2av_probe.py $LOGS/
$S pack >/dev/null
