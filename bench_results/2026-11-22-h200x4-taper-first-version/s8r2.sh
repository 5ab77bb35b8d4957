# session 8, run 2 (4 x H200): the tapered tail of the copy engines' pipelined reduction
# (BRAID_CE_TAIL_KB 0 vs 4096) against NCCL, alternating windows in one process per world size
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export LOGS=/tmp/L; rm -rf $LOGS /tmp/braid_cache; mkdir -p $LOGS
timeout 200 python3 .carry/tailprobe.py --nproc 2 reduce_scatter:1G:ce=0.92,host=0.08 reduce_scatter:1G:ce=1 \
  reduce_scatter:256M:ce=1 all_reduce:1G:ce=0.91,host=0.09 2>&1 | grep -v Warn | tee $LOGS/tail2.log
timeout 200 python3 .carry/tailprobe.py --nproc 4 reduce_scatter:1G:ce=0.95,host=0.05 reduce_scatter:1G:ce=1 \
  reduce_scatter:256M:ce=0.96,host=0.04 2>&1 | grep -v Warn | tee $LOGS/tail4.log
cp .carry/s8r2.sh .carry/tailprobe.py $LOGS/
bash scripts/device_run.sh pack >/dev/null
