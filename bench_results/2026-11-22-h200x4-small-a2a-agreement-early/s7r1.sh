# session 7, run 1 (4 x H200): the uneven all_to_all's fast agreement (post early, read late, no
# prelude): GPU auto tests, the 1 MiB probe, the hot 1 MiB bench, small messages on 4 GPUs
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export LOGS=/tmp/L BENCH_TIMEOUT=200; rm -rf $LOGS /tmp/braid_cache; mkdir -p $LOGS
S="bash scripts/device_run.sh"
$S info 2>&1 | tail -3
timeout 150 python3 -m pytest tests/gpu/test_gpu_routed.py -q -x -k auto 2>&1 | tee $LOGS/gpu_auto.log | tail -2
timeout 90 python3 .carry/a2av_probe.py --nproc 4 2>&1 | grep "a2av probe" | tee $LOGS/a2av_probe4.log
timeout 60 python3 .carry/a2av_probe.py --nproc 2 2>&1 | grep "a2av probe" | tee $LOGS/a2av_probe2.log
BENCH_OP=all_to_all_single BENCH_SIZES=64K:1M BENCH_FACTOR=16 BENCH_TAG=hot_1m BENCH_EXTRA="--hot-fraction 0.4,0.7,0.9,1.0 --no-calibrate" $S bench4 | grep -E "^ +[0-9]|^# [a-z]"
BENCH_OP=all BENCH_SIZES=64K:1M BENCH_TAG=small BENCH_EXTRA="--no-calibrate" $S bench4 | grep -E "^ +[0-9]|^# [a-z]"
cp .carry/s7r1.sh .carry/a2av_probe.py $LOGS/
$S pack
