# session 7, run 6 (4 x H200, GPUs 0-1): 2-GPU reduce_scatter 256 MiB on the copy engines alone took
# 562 us in run 5 against 456 in session 4 (s4-run3/run5); the same probe on session 4's code
# (df9a115, .carry/old) and on this one, twice each, interleaved
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export LOGS=/tmp/L; rm -rf $LOGS /tmp/braid_cache; mkdir -p $LOGS
for k in 1 2; do
  for v in old new; do
    if [ $v = old ]; then P=$PWD/.carry/old/src; SC=.carry/old/scripts; else P=$PWD/src; SC=scripts; fi
    echo "== $v $k"
    PYTHONPATH=$P timeout 120 python3 $SC/profile_call.py --nproc 2 --op reduce_scatter --size 256M --shares ce=1 > $LOGS/prof_rs256_${v}_$k.log 2>&1
    grep "host time per call" $LOGS/prof_rs256_${v}_$k.log
  done
done
grep -A30 "Ordered by: internal" $LOGS/prof_rs256_new_1.log | head -34
grep -A30 "Ordered by: internal" $LOGS/prof_rs256_old_1.log | head -34
cp .carry/s7r6.sh $LOGS/
cd $LOGS && tar czf $OUT/run.tgz . && ls -la $OUT
