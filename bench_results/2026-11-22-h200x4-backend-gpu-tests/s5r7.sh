# session 5, run 7 (4 x H200): the backend's GPU tests (2 GPUs), whole file
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export LOGS=/tmp/L; mkdir -p $LOGS
timeout 150 python3 -m pytest tests/gpu/test_gpu_backend.py -q 2>&1 | tee $LOGS/gpu_backend.log | tail -4
tar czf $OUT/run.tgz -C $LOGS .
