# session 8, run 6 (4 x H200): GPU tests (collectives, routed) on the final code, then a second
# process start of the bench (2-GPU reduce_scatter / all_reduce, 4-GPU all_reduce, 256 MiB-1 GiB)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export LOGS=/tmp/L BENCH_TIMEOUT=150; rm -rf $LOGS /tmp/braid_cache; mkdir -p $LOGS
S="bash scripts/device_run.sh"
F='^ +[0-9]|calibrat|^# [a-z]'
timeout 200 python3 -m pytest tests/gpu/test_gpu_collectives.py tests/gpu/test_gpu_routed.py tests/gpu/test_gpu_backend.py -q -x 2>&1 | tee $LOGS/gpu_tests.log | tail -3
BENCH_OP=reduce_scatter BENCH_SIZES=256M:1G $S bench2 | grep -E "$F"
BENCH_OP=all_reduce BENCH_SIZES=256M:1G $S bench2 | grep -E "$F"
BENCH_OP=all_reduce BENCH_SIZES=256M:1G $S bench4 | grep -E "$F"
cp -r /tmp/braid_cache $LOGS/cache 2>/dev/null
cp .carry/s8r6.sh $LOGS/
$S pack >/dev/null
