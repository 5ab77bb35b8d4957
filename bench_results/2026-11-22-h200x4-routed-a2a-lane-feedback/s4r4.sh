# session 4, run 4 (4 x H200): verdicts that may pick the copy engines alone; routed a2a with probing
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export LOGS=/tmp/L BENCH_TIMEOUT=100; mkdir -p $LOGS
S="bash scripts/device_run.sh"
t0=$(date +%s)
el() { echo "+$(( $(date +%s) - t0 )) s"; }
export CUDA_VISIBLE_DEVICES=0,1
for op in all_reduce reduce_scatter; do
  BENCH_OP=$op BENCH_SIZES=16M:1G BENCH_TAG=${op}_2gpu $S bench2 | grep -E "^ +[0-9]|calibration"
done
el
unset CUDA_VISIBLE_DEVICES
BENCH_OP=all_to_all_single BENCH_SIZES=64M:1G BENCH_TAG=hot BENCH_EXTRA="--hot-fraction 0.7,1.0,0.4" $S bench4 | grep -E "^ +[0-9]|calibration|^# [a-z]"
el
BENCH_OP=all_to_all_single BENCH_SIZES=64M:1G BENCH_TAG=a2a_balanced $S bench4 | grep -E "^ +[0-9]|calibration"
el
left=$(( 560 - ($(date +%s) - t0) ))
[ $left -gt 60 ] && timeout $left python3 -m pytest tests/gpu/test_gpu_routed.py -q -x -s -k four 2>&1 | grep -v Warning | tee $LOGS/gpu_routed4.log | grep -E "passed|failed|Error|assert" | tail -6
el
cp -r /tmp/braid_cache $LOGS/cache 2>/dev/null
$S pack
