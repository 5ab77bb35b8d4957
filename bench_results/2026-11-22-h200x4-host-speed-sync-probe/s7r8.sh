# session 7, run 8 (4 x H200, GPUs 0-1): what makes some process starts of the 2-GPU 256 MiB
# copy-engine reduce_scatter serialise host and GPU (~850 us/call against ~470): five starts of
# .carry/syncprobe.py (per-call host times, suspects' time, torch's sync debug warnings)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
export LOGS=/tmp/L; rm -rf $LOGS /tmp/braid_cache; mkdir -p $LOGS
for k in 1 2 3 4 5; do timeout 60 python3 .carry/syncprobe.py 2>&1 | grep "^rank" | tee -a $LOGS/syncprobe.log; done
cp .carry/s7r8.sh .carry/syncprobe.py $LOGS/
cd $LOGS && tar czf $OUT/run.tgz . && ls $OUT
