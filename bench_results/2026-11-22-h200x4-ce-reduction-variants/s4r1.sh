# session 4, run 1 (4 x H200): 2-GPU reduction pipelines (direct vs rsag, piece rule), 4-GPU RS, routed a2a feedback
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export LOGS=/tmp/L BENCH_TIMEOUT=60 BENCH_SIZES=256M:1G; mkdir -p $LOGS
S="bash scripts/device_run.sh"
t0=$(date +%s)
el() { echo "+$(( $(date +%s) - t0 )) s"; }
CUDA_VISIBLE_DEVICES=0,1 timeout 100 python3 -m pytest tests/gpu/test_gpu_reductions.py -q -x -s -k pipelines_agree 2>&1 | grep -v Warning | tee $LOGS/gpu_pair.log | grep -E "agree|passed|failed|Error|assert" | tail -8
el
export CUDA_VISIBLE_DEVICES=0,1
for v in "direct 0 ce=0.92,host=0.08" "rsag 0 ce=0.92,host=0.08" "rsag 128 ce=0.92,host=0.08" "direct 0 ce=1" "rsag 0 ce=1"; do
  set -- $v
  echo "# AR2 pair=$1 piece_mb=$2 shares=$3"
  BRAID_CE_PAIR=$1 BRAID_CE_PIECE_MB=$2 BENCH_OP=all_reduce BENCH_TAG=ar2_$1_$2_$3 BENCH_EXTRA="--shares $3" $S bench2 | grep -E "^ +[0-9]"
done
for v in "0 ce=0.92,host=0.08" "128 ce=0.92,host=0.08"; do
  set -- $v
  echo "# RS2 piece_mb=$1 shares=$2"
  BRAID_CE_PIECE_MB=$1 BENCH_OP=reduce_scatter BENCH_TAG=rs2_$1_$2 BENCH_EXTRA="--shares $2" $S bench2 | grep -E "^ +[0-9]"
done
el
unset CUDA_VISIBLE_DEVICES
for v in "0 ce=0.95,host=0.05" "128 ce=0.95,host=0.05"; do
  set -- $v
  echo "# RS4 piece_mb=$1 shares=$2"
  BRAID_CE_PIECE_MB=$1 BENCH_OP=reduce_scatter BENCH_TAG=rs4_$1_$2 BENCH_EXTRA="--shares $2" $S bench4 | grep -E "^ +[0-9]"
done
timeout 60 python3 scripts/profile_call.py --nproc 4 --op reduce_scatter --size 256M --shares ce=0.95,host=0.05 2>&1 | grep -v Warning | tee $LOGS/profile_rs4_256M.log | head -30
el
left=$(( 540 - ($(date +%s) - t0) ))
[ $left -gt 60 ] && BENCH_TIMEOUT=$left BENCH_OP=all_to_all_single BENCH_SIZES=64M:1G BENCH_TAG=hot BENCH_EXTRA="--hot-fraction 0.7,1.0" $S bench4 | grep -E "^ +[0-9]|calibration|^# [a-z]"
el
$S pack
