# session 4, run 3 (4 x H200): after the calibration fix (host-bound sizes) and the per-bucket verdict
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export LOGS=/tmp/L BENCH_TIMEOUT=100; mkdir -p $LOGS
S="bash scripts/device_run.sh"
t0=$(date +%s)
el() { echo "+$(( $(date +%s) - t0 )) s"; }
export CUDA_VISIBLE_DEVICES=0,1
for op in all_reduce reduce_scatter; do
  BENCH_OP=$op BENCH_SIZES=16M:1G BENCH_TAG=${op}_2gpu $S bench2 | grep -E "^ +[0-9]|calibration|B=|^(all|reduce)"
done
el
unset CUDA_VISIBLE_DEVICES
for op in reduce_scatter all_reduce; do
  BENCH_OP=$op BENCH_SIZES=64M:1G BENCH_TAG=$op $S bench4 | grep -E "^ +[0-9]|calibration|B="
done
el
BENCH_OP=all_to_all_single BENCH_SIZES=64M:1G BENCH_TAG=hot BENCH_EXTRA="--hot-fraction 0.7,1.0" $S bench4 | grep -E "^ +[0-9]|calibration|^# [a-z]"
el
left=$(( 500 - ($(date +%s) - t0) ))
[ $left -gt 40 ] && BENCH_TIMEOUT=$left BENCH_OP=moe BENCH_SIZES=64M:1G BENCH_TAG=moe $S bench4 | grep -E "^ +[0-9]|calibration"
el
left=$(( 575 - ($(date +%s) - t0) ))
[ $left -gt 60 ] && CUDA_VISIBLE_DEVICES=0,1 timeout $left python3 -m pytest tests/gpu/test_gpu_reductions.py -q -x -s -k two 2>&1 | grep -v Warning | tee $LOGS/gpu_red2.log | grep -E "world|passed|failed|Error|assert" | tail -8
cp -r /tmp/braid_cache $LOGS/cache 2>/dev/null
$S pack
