"""Where a GPU fault scenario of tests/gpu/test_gpu_faults.py hangs: runs one scenario with NCCL's
abort on (as shipped) or off (--no-nccl-abort), with a heartbeat thread per rank writing the time
to /tmp/braid-hb-<rank> every 0.5 s (a heartbeat that stops while a rank hangs: the GIL is held).
Usage: python3 scripts/probes/gpu_fault_probe.py exit0 [--no-nccl-abort]"""
import os
import sys
import threading
import time

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", "..", "tests"),
                os.path.join(os.path.dirname(__file__), "..", "..", "tests", "gpu")]


def _worker(rank, w, scenario, faulty, fault_at, survivors, folder):
    if os.environ.get("PROBE_NO_NCCL_ABORT") == "1":
        from braid.comm import ledger
        ledger.Faults.abort_groups = lambda self, groups: None

    def beat():
        import torch
        while True:
            state = ""
            try:
                import braid
                c = braid._default
                if c is not None:
                    q = {"caller": torch.cuda.current_stream(c.device).query()}
                    for name, lane in c._lanes.items():
                        st = getattr(lane, "stream", None)
                        if st is not None:
                            q[name] = st.query()
                    lay, seg = c.layout, c.segment
                    flags = {k: [seg.get(lay.counter(k, i)) for i in range(lay.world_size ** 2)]
                             for k in ("flag_ready", "flag_done")}
                    state = f" streams idle {q} flags {flags} aborted {c.aborted!r:.60}"
            except Exception as exc:  # noqa: BLE001
                state = f" ({exc!r:.100})"
            with open(f"/tmp/braid-hb-{rank}", "w") as f:
                f.write(f"{time.time():.1f}{state}")
            time.sleep(0.5)
    threading.Thread(target=beat, daemon=True).start()
    from test_gpu_faults import _gpu_worker
    _gpu_worker(rank, w, scenario, faulty, fault_at, survivors, folder)


if __name__ == "__main__":
    scenario = sys.argv[1]
    if "--no-nccl-abort" in sys.argv:
        os.environ["PROBE_NO_NCCL_ABORT"] = "1"
    from test_gpu_faults import ENV, GPU_SCENARIOS
    from test_faults_cpu import NODES_ENV, _run
    env = dict(ENV, **NODES_ENV) if scenario.endswith("_nodes") else dict(ENV)
    env["PROBE_NO_NCCL_ABORT"] = os.environ.get("PROBE_NO_NCCL_ABORT", "0")
    if "--unprepared" in sys.argv:
        env["BRAID_PREPARED"] = "0"
    t_end = time.time()
    res = _run(scenario, worker=_worker, env=env, init_pg=False, scenarios=GPU_SCENARIOS)
    t_end = time.time()
    for r, rep in res["reports"].items():
        print(f"rank {r}: {rep}")
    w = GPU_SCENARIOS[scenario][0]
    for r in range(w):
        try:
            t, _, state = open(f"/tmp/braid-hb-{r}").read().partition(" ")
            print(f"rank {r} heartbeat last {t_end - float(t):.1f} s before the end:{state}")
        except (OSError, ValueError):
            pass
    print("hung:", (res["hung"] or "")[-5000:])
