# session 4, run 5 (4 x H200): calibration timed like the bench (20 calls after 5 warm-up); the final auto sweeps
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
for op in all_reduce reduce_scatter all_to_all_single moe; do
  BENCH_OP=$op BENCH_SIZES=64M:1G BENCH_TAG=$op $S bench4 | grep -E "^ +[0-9]|calibration"
  el
done
cp -r /tmp/braid_cache $LOGS/cache 2>/dev/null
$S pack
