#!/usr/bin/env bash
# One run on a GPU machine: environment, GPU tests, bench. Usage: bash scripts/device_run.sh STEP...
# Steps: info | tests | guard (or guard_prepared, guard_p2p, guard_backend, guard_deferred, guard2, guard_fuzz; guard1 = the first three) | faults | frameworks | bench2 | bench4 | mixed2 | ab2 | ab4 | work2 | work4 | workab2 | hot4 | trace2 | trace4 | first2 |
#        first4 | conformance | hier2 | moe2 | fsdp2 | cpuab | ddphost | fsdphost | relaunch | pack
# Logs and JSON go to $LOGS (default $OUT); `pack` tars $LOGS into $OUT/run.tgz (one file to copy
# back). bench: BENCH_OP, BENCH_SIZES, BENCH_FACTOR, BENCH_EXTRA (more flags),
# BENCH_TAG (file-name suffix, default the op). work: WORK (default all), WORK_EXTRA, WORK_TAG.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} BRAID_CACHE_DIR=${BRAID_CACHE_DIR:-/tmp/braid_cache}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
LOGS=${LOGS:-$OUT}; mkdir -p "$LOGS"
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case $step in
    info) nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nvidia-smi topo -m | head -8;
          python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())";
          df -h /dev/shm | tail -1; python3 -c "from braid.bench.sweep import host_memory_free as f; m = f(); print('host memory the bench may fill:', 'unknown' if m is None else f'{m / 2**30:.1f} GiB')";
          cat /sys/fs/cgroup/memory.max /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null | sed 's/^/memory cgroup limit: /' ;;
    tests) timeout ${TEST_TIMEOUT:-300} python3 -m pytest tests/gpu -q -x ${TEST_ARGS:-} 2>&1 | tee "$LOGS/gpu_tests${TEST_TAG:-}.log" | tail -30 ;;
    # the GPU tests that guard the hot path (prepared calls, the backend, collectives, the copy
    # engines' pipelined reductions, uneven all_to_all, the fuzz at half its count), over 25 minutes
    # on one H200 shared by 2-4 ranks: one device command runs 10 minutes at most, so they run in
    # parts of 5 minutes or less each (2026-12-02, one H200): guard_prepared (prepared calls, ~5
    # tests in 300 s), guard_p2p (prepared send/recv), guard_backend (the backend: its one run of
    # every case, a compiled step's five compilations included, 87 s), guard_deferred (the
    # deferred calls' tests, BRAID_DEFER=1, ~190 s), guard2 (collectives and reductions, ~300 s)
    # and guard_fuzz (uneven all_to_all and the fuzz); guard1 is prepared calls, send/recv and the
    # backend at once, guard all of them (for a machine without the 10-minute limit)
    guard|guard1|guard_prepared|guard_p2p|guard_backend|guard2|guard_fuzz|guard_deferred) gp="tests/gpu/test_gpu_prepared.py";
            gq="tests/gpu/test_gpu_prepared_p2p.py"; gb="tests/gpu/test_gpu_backend.py tests/gpu/test_gpu_backend_single.py"; g1="$gp $gq $gb";
            g2="tests/gpu/test_gpu_collectives.py tests/gpu/test_gpu_reductions.py"; gf="tests/gpu/test_gpu_uneven_a2a.py tests/gpu/test_gpu_fuzz.py::test_gpu_fuzz";
            sel=(); case $step in guard1) set_=$g1; sel=(-k "not deferred");; guard_deferred) set_=$g1; sel=(-k deferred);;
              guard_prepared) set_=$gp; sel=(-k "not deferred");; guard_p2p) set_=$gq; sel=(-k "not deferred");;
              guard_backend) set_=$gb; sel=(-k "not deferred");; guard2) set_=$g2;; guard_fuzz) set_=$gf;; *) set_="$g1 $g2 $gf";; esac;
            BRAID_GPU_FUZZ_OPS=${BRAID_GPU_FUZZ_OPS:-1000} timeout ${TEST_TIMEOUT:-540} python3 -m pytest -q -rfEx --timeout ${CASE_TIMEOUT:-420} \
            --durations=10 ${sel[@]+"${sel[@]}"} $set_ 2>&1 | tee "$LOGS/gpu_$step.log" | tail -30 ;;
    # every GPU fault scenario (a peer killed, exiting, raising, skipping, a mismatch, an abort, two
    # pretend nodes): every survivor raises a braid error or is ended by braid in time, ~100 s
    faults) timeout ${TEST_TIMEOUT:-330} python3 -m pytest -q -s -rfEx tests/gpu/test_gpu_faults.py 2>&1 \
            | tee "$LOGS/gpu_faults.log" | grep -E "^gpu fault|^  rank|passed|failed" ;;
    bench4|bench2) n=${step#bench}; op=${BENCH_OP:-all}; tag=${BENCH_TAG:-$op};
          timeout ${BENCH_TIMEOUT:-240} python3 -m braid bench --op $op --nproc $n --sizes ${BENCH_SIZES:-1M:1G} --factor ${BENCH_FACTOR:-4} --plain \
            ${BENCH_EXTRA:-} --json "$LOGS/bench_x${n}_$tag.json" 2>&1 | grep -v Warning | tee "$LOGS/bench${n}_$tag.log" ;;
    # host time of repeated splits over mixed lane sets, fixed shares (MIXED_SHARES, separated by
    # spaces), each against NCCL's own call: one JSON and log per lane set, ~40 s each at 1-64 MiB
    mixed2) for sh in ${MIXED_SHARES:-ce=0.7,host=0.3 nccl=0.7,host=0.3 nccl=0.5,ce=0.5 host=1}; do tag=$(echo "$sh" | tr ',=.' '___');
          timeout ${BENCH_TIMEOUT:-200} python3 -m braid bench --op ${BENCH_OP:-all_gather,broadcast,all_reduce,reduce_scatter} --nproc 2 \
            --sizes ${BENCH_SIZES:-1M:64M} --factor ${BENCH_FACTOR:-4} --plain --shares "$sh" --no-calibrate \
            --json "$LOGS/bench_x2_mixed_$tag.json" 2>&1 | grep -v Warning | tee "$LOGS/bench2_mixed_$tag.log" | grep -E "^ +[0-9]+ |host per call"; done ;;
    # the same bench under several settings in turn (AB_ENVS: settings separated by ';', each a
    # list of VAR=value; AB_ROUNDS rounds of all of them), one JSON per run
    ab2|ab4) n=${step#ab}; i=0; for r in $(seq ${AB_ROUNDS:-2}); do IFS=';' read -ra sets <<< "${AB_ENVS:-BRAID_CE_PUSH=0;BRAID_CE_PUSH=1}";
          for e in "${sets[@]}"; do i=$((i+1)); echo "--- $i: $e" | tee -a "$LOGS/ab$n.log";
            env $e timeout ${BENCH_TIMEOUT:-120} python3 -m braid bench --op ${BENCH_OP:-all_reduce} --nproc $n --sizes ${BENCH_SIZES:-4M:64M} \
              --factor ${BENCH_FACTOR:-4} --plain ${BENCH_EXTRA:---shares ce=1 --no-calibrate} --json "$LOGS/ab${n}_$i.json" 2>&1 \
              | grep -v Warning | tee -a "$LOGS/ab$n.log" | grep -E "^ +[0-9]+ |host per call" ; done; done ;;
    # CPU collectives against gloo under several settings in turn, at each of CPU_RANKS (AB_ENVS and
    # AB_ROUNDS as for ab2), one JSON per run; CPU_TESTS=1 runs the CPU tests of the segment path first
    cpuab) [ "${CPU_TESTS:-0}" = 1 ] && CUDA_VISIBLE_DEVICES= timeout 300 python3 -m pytest -q tests/test_cpu_native.py tests/test_cpu_shm.py 2>&1 \
            | tee "$LOGS/cpu_tests.log" | tail -3;
          i=0; for n in ${CPU_RANKS:-4 8}; do for r in $(seq ${AB_ROUNDS:-1}); do IFS=';' read -ra sets <<< "${AB_ENVS:-BRAID_CPU_NATIVE=1;BRAID_CPU_NATIVE=0}";
          for e in "${sets[@]}"; do i=$((i+1)); echo "--- $i: $n ranks, $e" | tee -a "$LOGS/cpuab.log";
            env $e timeout ${BENCH_TIMEOUT:-150} python3 -m braid bench --cpu --op ${BENCH_OP:-all_reduce} --nproc $n \
              --sizes ${BENCH_SIZES:-64K:64M} --factor ${BENCH_FACTOR:-4} --plain ${BENCH_EXTRA:-} --json "$LOGS/cpu_n${n}_$i.json" 2>&1 \
              | grep -v Warning | tee -a "$LOGS/cpuab.log" | grep -E "^ +[0-9]+ |host per call|copy ceiling" ; done; done; done ;;
    # training steps under several settings in turn (AB_ENVS as for ab2, AB_ROUNDS rounds), one JSON per run
    workab2) i=0; for r in $(seq ${AB_ROUNDS:-1}); do IFS=';' read -ra sets <<< "${AB_ENVS:-BRAID_DEFER=1;BRAID_DEFER=0}";
          for e in "${sets[@]}"; do i=$((i+1)); echo "--- $i: $e" | tee -a "$LOGS/workab2.log";
            env $e timeout ${WORK_TIMEOUT:-240} python3 -m braid bench --workload ${WORK:-ddp,fsdp} --nproc 2 --plain ${WORK_EXTRA:-} \
              --json "$LOGS/workab2_$i.json" 2>&1 | grep -v Warning | tee -a "$LOGS/workab2.log" | grep -E "^  [a-z]|split calls|learned" ; done; done ;;
    work4|work2) n=${step#work}; w=${WORK:-all}; tag=${WORK_TAG:-$w};
          timeout ${WORK_TIMEOUT:-240} python3 -m braid bench --workload $w --nproc $n --plain ${WORK_EXTRA:-} \
            --json "$LOGS/work_x${n}_$tag.json" 2>&1 | grep -v Warning | tee "$LOGS/work${n}_$tag.log" ;;
    hot4) timeout 120 python3 -m braid bench --op all_to_all_single --nproc 4 --hot-bytes 1G --cold-bytes 8M --no-calibrate --plain \
            --json "$LOGS/bench_x4_hot.json" 2>&1 | grep -v Warning | tee "$LOGS/hot4.log" ;;
    trace4|trace2) n=${step#trace};
          timeout 200 python3 -m braid bench --op ${TRACE_OP:-all_gather} --nproc $n --sizes 1G:1G --trace 40 --slow ${TRACE_SLOW:-host=4@10:25} \
            --no-calibrate --json "$LOGS/trace_x${n}.json" --plot "$LOGS/trace_x${n}.png" 2>&1 | grep -v Warning | tee "$LOGS/trace$n.log" ;;
    # Lightning, accelerate and the transformers Trainer on braid against NCCL (2 ranks, sharing the GPU where there is one)
    frameworks) BRAID_FW_DEVICE=cuda timeout ${TEST_TIMEOUT:-400} python3 -m pytest -q -s -rfEx --timeout 300 tests/frameworks \
            2>&1 | tee "$LOGS/frameworks_cuda.log" | tail -30 ;;
    # the process's first split call, without and with the communicator's warm-up, in turn
    first4|first2) n=${step#first}; for w in 0 1 0 1; do BRAID_WARM=$w timeout 150 python3 scripts/probes/prepared_profile.py \
            --op ${FIRST_OP:-all_reduce} --nbytes ${FIRST_BYTES:-16777216} --nproc $n --first --first-only 2>&1 | grep -v Warning \
            | tee -a "$LOGS/first$n.log" | grep "first call"; done ;;
    # torch's CUDA list on NCCL and on braid at once; with fewer GPUs than ranks they share them
    conformance) timeout ${CONF_TIMEOUT:-500} python3 tests/conformance/runner.py --compare --device cuda --parallel \
            --pairs ${CONF_PAIRS:-nccl,braid} ${CONF_EXTRA:-} 2>&1 | tee "$LOGS/conformance_cuda.log" | tail -60 ;;
    hier2) BRAID_FAKE_NODES=2 BRAID_HIER=1 timeout ${BENCH_TIMEOUT:-240} python3 -m braid bench --op ${BENCH_OP:-all_reduce} \
            --nproc 2 --sizes ${BENCH_SIZES:-1M:256M} --factor 4 --plain --json "$LOGS/bench_hier2_${BENCH_OP:-all_reduce}.json" \
            2>&1 | grep -v Warning | tee "$LOGS/hier2.log" ;;
    moe2) timeout ${TEST_TIMEOUT:-300} python3 -m pytest tests/gpu/test_gpu_uneven_a2a.py -q 2>&1 | tee "$LOGS/gpu_uneven.log" | tail -3;
          timeout ${BENCH_TIMEOUT:-240} python3 -m braid bench --op moe --nproc 2 --sizes ${BENCH_SIZES:-1M:256M} --factor 4 --repeat 3 --plain \
            --json "$LOGS/bench_x2_moe.json" 2>&1 | grep -v Warning | tee "$LOGS/bench2_moe.log" ;;
    fsdp2) timeout ${FSDP_TIMEOUT:-200} torchrun --nproc-per-node 2 scripts/probes/fsdp_profile.py --rounds ${FSDP_ROUNDS:-8} --kernels --second-nccl \
            --out "$LOGS" 2>&1 | grep -E "wall|GPU per step|profile" | tee "$LOGS/fsdp_profile.log" ;;
    # DDP's steps with the copy engines forced, host clocks around each call (the backend's call, its
    # future, the communicator's), under each of AB_ENVS in turn (default: the pieces' floor), ~25 s a run
    ddphost) for r in $(seq ${AB_ROUNDS:-1}); do IFS=';' read -ra sets <<< "${AB_ENVS:-BRAID_CE_MIN_PIECE_MB=16;BRAID_CE_MIN_PIECE_MB=64}";
          for e in "${sets[@]}"; do echo "--- $e" | tee -a "$LOGS/ddphost.log";
            env $e timeout 100 torchrun --nproc-per-node 2 scripts/probes/fsdp_profile.py --job ddp --shares ce=1 --steps 20 \
              --rounds ${FSDP_ROUNDS:-6} --no-profile --time-calls --out "$LOGS" 2>&1 | grep -E "rank 0 |^braid " | tee -a "$LOGS/ddphost.log"; done; done ;;
    # FSDP2's collectives timed on the host in both replicas (torch.distributed's own calls, braid's
    # group and NCCL's), every call whole through braid (FSDP_SHARES, default nccl=1), ~40 s
    fsdphost) timeout 150 torchrun --nproc-per-node 2 scripts/probes/fsdp_profile.py --job fsdp --shares ${FSDP_SHARES:-nccl=1} \
              --steps 10 --rounds ${FSDP_ROUNDS:-8} --no-profile --time-c10d ${FSDP_EXTRA:-} --out "$LOGS" 2>&1 | grep -E "rank 0 |^c10d " \
              | tee -a "$LOGS/fsdphost.log" ;;
    # does a graph's launch wait on the host while the same graph's last launch has not run? (~10 s)
    relaunch) timeout 120 python3 scripts/probes/graph_relaunch.py 2>&1 | grep -v Warning | tee "$LOGS/graph_relaunch.log" ;;
    pack) [ "$LOGS" != "$OUT" ] && tar czf "$OUT/run.tgz" -C "$LOGS" . && ls -la "$OUT" ;;
    *) echo "unknown step $step" ;;
  esac
done
