# session 8, run 3 (4 x H200): GPU reduction tests with the tapered tail (2 GPUs: taper from 1 MiB
# pieces; 4 GPUs: default), then the taper A/B (final rule) at 1 GiB on 2 GPUs
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export LOGS=/tmp/L; rm -rf $LOGS /tmp/braid_cache; mkdir -p $LOGS
timeout 330 python3 -m pytest tests/gpu/test_gpu_reductions.py -q -x 2>&1 | tee $LOGS/gpu_red.log | tail -3
timeout 150 python3 .carry/tailprobe.py --nproc 2 reduce_scatter:1G:ce=1 reduce_scatter:1G:ce=0.92,host=0.08 \
  all_reduce:1G:ce=0.91,host=0.09 2>&1 | grep -v Warn | tee $LOGS/tail2.log
cp .carry/s8r3.sh .carry/tailprobe.py $LOGS/
bash scripts/device_run.sh pack >/dev/null
