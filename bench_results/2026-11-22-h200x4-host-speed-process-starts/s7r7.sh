# session 7, run 7 (4 x H200, GPUs 0-1): is the 2x spread of host time per call (reduce_scatter
# 256 MiB, copy engines alone) the CPU the ranks land on? topology, then the probe unpinned and
# pinned (taskset) to GPU 0's NUMA node, three times each, interleaved
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
export LOGS=/tmp/L; rm -rf $LOGS /tmp/braid_cache; mkdir -p $LOGS
{ nvidia-smi topo -m; lscpu | grep -i -E "numa|model name|^cpu\(s\)|mhz|thread|socket"; } > $LOGS/topo.txt 2>&1
cat $LOGS/topo.txt | head -20
NODE0=$(lscpu | awk -F: '/NUMA node0 CPU/ {gsub(/ /,"",$2); print $2}')
echo "node0 cpus: $NODE0"
for k in 1 2 3; do
  for v in free pinned; do
    if [ $v = pinned ]; then T="taskset -c $NODE0"; else T=""; fi
    $T timeout 100 python3 scripts/profile_call.py --nproc 2 --op reduce_scatter --size 256M --shares ce=1 > $LOGS/prof_${v}_$k.log 2>&1
    echo "$v $k: $(grep 'host time per call' $LOGS/prof_${v}_$k.log)"
  done
done
cp .carry/s7r7.sh $LOGS/
cd $LOGS && tar czf $OUT/run.tgz . && ls $OUT
