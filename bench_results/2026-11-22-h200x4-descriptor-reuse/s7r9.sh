# session 7, run 9 (4 x H200): descriptor reuse (one digest round for a repeated call) and the
# copy-engines-alone check in calibration: GPU tests (reductions, collectives, routed), then
# 2-GPU reduce_scatter / all_reduce 256 MiB-1 GiB, 4-GPU all_reduce 1 GiB, hot all_to_all 256 MiB
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export LOGS=/tmp/L BENCH_TIMEOUT=150; rm -rf $LOGS /tmp/braid_cache; mkdir -p $LOGS
S="bash scripts/device_run.sh"
F='^ +[0-9]|calibrat|^# [a-z]'
timeout 250 python3 -m pytest tests/gpu/test_gpu_reductions.py tests/gpu/test_gpu_collectives.py tests/gpu/test_gpu_routed.py -q -x 2>&1 | tee $LOGS/gpu_tests.log | tail -3
BENCH_OP=reduce_scatter BENCH_SIZES=256M:1G $S bench2 | grep -E "$F"
BENCH_OP=all_reduce BENCH_SIZES=256M:1G $S bench2 | grep -E "$F"
BENCH_OP=all_reduce BENCH_SIZES=1G:1G $S bench4 | grep -E "$F"
BENCH_OP=all_to_all_single BENCH_SIZES=256M:256M BENCH_TAG=hot BENCH_EXTRA="--hot-fraction 0.7" $S bench4 | grep -E "$F"
cp -r /tmp/braid_cache $LOGS/cache 2>/dev/null
cp .carry/s7r9.sh $LOGS/
$S pack
