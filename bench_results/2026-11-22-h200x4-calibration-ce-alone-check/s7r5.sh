# session 7, run 5 (4 x H200): the calibration also times the copy engines alone where the model
# keeps NCCL alone for a reduction but puts them within 1.5x (calibrate.ALONE_CHECK): 2-GPU
# reduce_scatter / all_reduce and 4-GPU reduce_scatter, 256 MiB and 1 GiB, calibrated in the run
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export LOGS=/tmp/L BENCH_TIMEOUT=170; rm -rf $LOGS /tmp/braid_cache; mkdir -p $LOGS
S="bash scripts/device_run.sh"
F='^ +[0-9]|calibrat|^# [a-z]'
BENCH_OP=reduce_scatter BENCH_SIZES=256M:1G $S bench2 | grep -E "$F"
BENCH_OP=all_reduce BENCH_SIZES=256M:1G $S bench2 | grep -E "$F"
BENCH_OP=reduce_scatter BENCH_SIZES=256M:1G $S bench4 | grep -E "$F"
cp -r /tmp/braid_cache $LOGS/cache 2>/dev/null
python3 - <<'PY'
import json, glob
for f in glob.glob("/tmp/braid_cache/*.json"):
    t = json.load(open(f))["table"]
    print(f.split("/")[-1], {k: v for k, v in t.items() if k.endswith("/pays")})
PY
cp .carry/s7r5.sh $LOGS/
$S pack
