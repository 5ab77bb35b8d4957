#!/usr/bin/env bash
# One device-machine session: environment, GPU tests, probes/bench. Usage: bash scripts/device_run.sh STEP...
# Steps: info | tests | probe2 | probe4 | bench2 | bench4   (logs under $OUT)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} BRAID_CACHE_DIR=${OUT:-/tmp}/cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case $step in
    info) nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nvidia-smi topo -m | head -8;
          python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())";
          df -h /dev/shm | tail -1 ;;
    tests) timeout ${TEST_TIMEOUT:-300} python3 -m pytest tests/gpu -q -x ${TEST_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.log" | tail -30 ;;
    probe2) timeout 240 python3 scripts/gpu_probe.py --nproc 2 ${PROBE_ARGS:-} 2>&1 | tee "$OUT/probe2.log" | grep -v Warning ;;
    probe4) timeout 300 python3 scripts/gpu_probe.py --nproc 4 ${PROBE_ARGS:-} 2>&1 | tee "$OUT/probe4.log" | grep -v Warning ;;
    bench4|bench2) n=${step#bench};
          timeout ${BENCH_TIMEOUT:-240} python3 -m braid bench --op ${BENCH_OP:-all} --nproc $n --sizes ${BENCH_SIZES:-1M:1G} --factor ${BENCH_FACTOR:-4} --plain \
            --json "$OUT/bench_h200x${n}.json" --plot "$OUT/bench_h200x${n}.png" 2>&1 | grep -v Warning | tee "$OUT/bench$n.log" ;;
    hot4) timeout 120 python3 -m braid bench --op all_to_all_single --nproc 4 --hot-bytes 1G --cold-bytes 8M --no-calibrate --plain \
            --json "$OUT/bench_h200x4_hot.json" 2>&1 | grep -v Warning | tee "$OUT/hot4.log" ;;
    trace4|trace2) n=${step#trace};
          timeout 200 python3 -m braid bench --op ${TRACE_OP:-all_gather} --nproc $n --sizes 1G:1G --trace 40 --slow ${TRACE_SLOW:-host=4@10:25} \
            --no-calibrate --json "$OUT/trace_h200x${n}.json" --plot "$OUT/trace_h200x${n}.png" 2>&1 | grep -v Warning | tee "$OUT/trace$n.log" ;;
    *) echo "unknown step $step" ;;
  esac
done
