# session 8, run 1 (4 x H200): where a 256 MiB split reduction's host time goes now (cProfile of
# rank 0), whether NCCL can take a share of a reduce_scatter (strided copy + NCCL on the part), and
# whether braid's per-call GPU work can be captured into a CUDA graph
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export LOGS=/tmp/L; rm -rf $LOGS /tmp/braid_cache; mkdir -p $LOGS
timeout 60 python3 .carry/graphprobe.py 2>&1 | grep -v Warn | tee $LOGS/graphprobe.log
timeout 150 python3 .carry/rsprobe.py 4 2>&1 | grep -v Warn | tee $LOGS/rsprobe4.log
P="timeout 100 python3 scripts/profile_call.py"
$P --nproc 2 --op reduce_scatter --size 256M --shares ce=1 > $LOGS/prof_rs2_ce.log 2>&1
$P --nproc 2 --op all_reduce --size 256M --shares ce=0.92,host=0.08 > $LOGS/prof_ar2_cehost.log 2>&1
$P --nproc 4 --op all_reduce --size 256M --shares nccl=0.93,host=0.07 > $LOGS/prof_ar4_ncclhost.log 2>&1
grep -h "host time per call" $LOGS/prof_*.log
cp .carry/s8r1.sh .carry/rsprobe.py .carry/graphprobe.py $LOGS/
bash scripts/device_run.sh pack >/dev/null
