# session 4, run 2: GPU timelines of the reductions (where the time goes)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
L=/tmp/L; mkdir -p $L
t0=$(date +%s)
T="timeout 60 python3 scripts/timeline.py"
export CUDA_VISIBLE_DEVICES=0,1
$T --nproc 2 --size 1G --shares ce=1 --env BRAID_CE_PAIR=rsag --env BRAID_CE_PIECE_MB=128 --out $L/tl_ar2_1G_rsag128.json.gz 2>&1 | grep -v Warn > $L/tl_ar2_1G_rsag128.log
$T --nproc 2 --size 1G --shares ce=1 --env BRAID_CE_PAIR=rsag --out $L/tl_ar2_1G_rsag.json.gz 2>&1 | grep -v Warn > $L/tl_ar2_1G_rsag.log
$T --nproc 2 --size 1G --shares ce=1 --env BRAID_CE_PAIR=direct --out $L/tl_ar2_1G_direct.json.gz 2>&1 | grep -v Warn > $L/tl_ar2_1G_direct.log
$T --nproc 2 --size 256M --shares ce=0.92,host=0.08 --env BRAID_CE_PAIR=rsag --out $L/tl_ar2_256M_cehost.json.gz 2>&1 | grep -v Warn > $L/tl_ar2_256M_cehost.log
timeout 60 python3 scripts/profile_call.py --nproc 2 --op all_reduce --size 256M --shares ce=0.92,host=0.08 2>&1 | grep -v Warn > $L/prof_ar2_256M_cehost.log
echo "+$(( $(date +%s) - t0 )) s"
unset CUDA_VISIBLE_DEVICES
$T --nproc 4 --op reduce_scatter --size 256M --shares ce=0.95,host=0.05 --out $L/tl_rs4_256M.json.gz 2>&1 | grep -v Warn > $L/tl_rs4_256M.log
echo "+$(( $(date +%s) - t0 )) s"
BRAID_CACHE_DIR=$L/cache timeout 80 python3 -m braid bench --op all_to_all_single --nproc 4 --sizes 256M:256M --hot-fraction 0.7 --plain --json $L/hot07.json 2>&1 | grep -E "^ +[0-9]|calib"
echo "+$(( $(date +%s) - t0 )) s"
for f in $L/*.log; do echo "== $f"; head -12 $f; done
tar czf $OUT/run.tgz -C $L .
