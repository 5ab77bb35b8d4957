"""Where an FSDP2 (or DDP) step spends its time under the `braid` backend against NCCL: the same
replicas `braid bench --workload fsdp` (`ddp`) trains, timed in alternating windows (wall and
process CPU time per step), then profiled with cProfile on every rank (rank 0's tables are
printed); with --kernels the GPU's side per kind of kernel or copy.

    torchrun --nproc-per-node 2 scripts/probes/fsdp_profile.py [--job fsdp|ddp] [--shares ce=1]
        [--steps 20] [--rounds 4] [--kernels [--trace]] [--second-nccl] [--out DIR]

--time-c10d: host clocks around torch.distributed's all-gather, reduce-scatter and all_reduce calls
per replica (FSDP2's calls, braid's and NCCL's alike).

--call-profile: cProfile around each of braid's backend calls and futures in the thread that
makes it (DDP calls its buckets' all_reduce from autograd's thread, which the main thread's
profile does not see), over the braid replica's windows; rank 0's tables printed and written.

--handoff: a third replica, "handoff": the braid replica with its group's all-gather, reduce-scatter
and all_reduce bound straight to braid's inner NCCL group while it runs (instance attributes over
the backend's Python methods): the step as it would be if braid's Python left the calls entirely.

--shares fixes braid's shares for every call (the in-job trial then keeps them): how a split the
job would not choose behaves inside its steps.

--trial (no --shares): the braid replica runs --trial-steps steps while the in-job trial
(comm/arbiter.py) alternates split and whole blocks, and rank 0 prints, per mode, the host time
of each call through the backend, the round of words inside it, and the host's time from the
previous call of the shape, for a block's first call and for the rest apart (a block's first
split call is where the ranks' hosts meet again after a whole block).
"""
import argparse
import cProfile
import gc
import io
import os
import pstats
import statistics
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

import braid  # noqa: F401  (registers the backend)
from braid import jobs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", choices=("fsdp", "ddp"), default="fsdp")
    ap.add_argument("--shares", default=None, help="fixed shares for braid's calls, e.g. ce=1 (default: braid decides)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--gc-off", action="store_true", help="no garbage collection inside the windows")
    ap.add_argument("--second-nccl", action="store_true",
                    help="a third and fourth replica, braid's (braid2) and one on another NCCL group made like the baseline's (nccl2)")
    ap.add_argument("--kernels", action="store_true",
                    help="also the GPU's side: time per step of each kernel kind (torch.profiler), per replica")
    ap.add_argument("--time-calls", action="store_true",
                    help="host time of braid's graph launches, rounds of words and whole calls in the braid replica's windows")
    ap.add_argument("--no-profile", action="store_true", help="windows only, no cProfile")
    ap.add_argument("--time-c10d", action="store_true",
                    help="host time of torch.distributed's all-gather, reduce-scatter and all_reduce calls per "
                         "replica (FSDP2 calls these; NCCL's replica too), in every window")
    ap.add_argument("--call-profile", action="store_true",
                    help="cProfile of braid's backend calls and their futures in whichever thread makes them "
                         "(DDP's autograd thread), over the braid replica's windows; rank 0's table printed")
    ap.add_argument("--handoff", action="store_true",
                    help="a third replica: braid's, its group's collectives bound straight to the inner NCCL group")
    ap.add_argument("--trace", action="store_true", help="with --kernels: a chrome trace per replica and rank in --out")
    ap.add_argument("--trial", action="store_true",
                    help="host times of the calls inside the in-job trial's split and whole blocks (see above)")
    ap.add_argument("--trial-steps", type=int, default=200)
    a = ap.parse_args()
    gc_time = [0.0, 0, 0.0]          # seconds in collections, collections, start of the current one

    def on_gc(phase, info):
        if phase == "start":
            gc_time[2] = time.perf_counter()
        else:
            gc_time[0] += time.perf_counter() - gc_time[2]
            gc_time[1] += 1
    gc.callbacks.append(on_gc)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    dist.init_process_group("braid", device_id=dev)
    s = jobs.settings(SimpleNamespace(dtype=None, warmup=None), True)
    comm = SimpleNamespace(rank=rank, world_size=world, cuda=True, device=dev)
    ctx = jobs.make_ctx(comm, s)
    make = jobs.fsdp_replicas if a.job == "fsdp" else jobs.ddp_replicas
    reps = {r.name: r for r in make(ctx)}
    if a.shares:
        shares = {k: float(v) for k, v in (kv.split("=") for kv in a.shares.split(","))}
        fixed = braid.init().fixed_shares(shares)     # for the whole run (kept: a dropped context would close)
        fixed.__enter__()
    if a.second_nccl:
        # another NCCL group made as the baseline's was: under a default group bound to a device,
        # torch makes both by splitting the default group's CUDA backend (braid's inner NCCL group)
        import dataclasses
        pair = make(dataclasses.replace(ctx, base=dist.new_group(backend="nccl")))
        pair[0].name, pair[1].name = "braid2", "nccl2"
        reps["braid2"], reps["nccl2"] = pair     # built third and fourth: tells build order from backend
    if a.handoff:
        reps["handoff"] = _HandedOff(reps["braid"], dist.distributed_c10d._get_default_group())
    names = list(reps)
    if rank == 0:
        comm_ = braid.init()
        print(f"braid: calibration {comm_.calib_digest}, fixed shares {comm_.policy.fixed}, "
              f"lanes {comm_.lanes_for(dev)}", flush=True)
    for r in reps.values():
        r.run(3)
    if a.trial:
        trial_calls(reps["braid"], a.trial_steps, rank)
    wall = {k: [] for k in reps}
    cpu = {k: [] for k in reps}
    gcs = {k: [0.0, 0] for k in reps}
    tail = {k: [] for k in reps}     # ms the host waited for the GPU after queuing a window
    timed = _time_calls() if a.time_calls else None
    if a.call_profile:
        timed = _profile_calls(timed)
    c10d = _time_c10d() if a.time_c10d else None
    for k in range(a.rounds):
        j = k % len(names)           # each replica in every position in turn
        for name in names[j:] + names[:j]:
            ctx.sync()
            dist.barrier(group=ctx.timer)
            if a.gc_off:
                gc.disable()
            g0, n0 = gc_time[0], gc_time[1]
            t0, c0 = time.perf_counter(), time.process_time()
            if timed is not None:
                timed["on"] = name == "braid"
            if c10d is not None:
                c10d["rep"] = name
            reps[name].run(a.steps)
            if timed is not None:
                timed["on"] = False
            if c10d is not None:
                c10d["rep"] = None
            t1 = time.perf_counter()
            ctx.sync()
            tail[name].append((time.perf_counter() - t1) * 1e3)
            gc.enable()
            gcs[name][0] += (gc_time[0] - g0) * 1e3 / a.steps / a.rounds
            gcs[name][1] += gc_time[1] - n0
            wall[name].append((time.perf_counter() - t0) * 1e3 / a.steps)
            cpu[name].append((time.process_time() - c0) * 1e3 / a.steps)
    for name in reps:           # every rank: its windows, its host's CPU time and its GPU's tail
        print(f"rank {rank} {name:9s} wall ms/step {statistics.median(wall[name]):.2f} {[round(x, 2) for x in wall[name]]}  "
              f"process cpu ms/step {statistics.median(cpu[name]):.2f} {[round(x, 2) for x in cpu[name]]}  "
              f"gc ms/step {gcs[name][0]:.2f} ({gcs[name][1]} collections)  GPU tail after queuing ms "
              f"{statistics.median(tail[name]):.2f} {[round(x, 1) for x in tail[name]]}", flush=True)
    if timed is not None and rank == 0:
        for what, xs in timed["us"].items():
            xs = sorted(xs)
            if xs:
                print(f"braid {what}: {len(xs)} calls, host us p50 {xs[len(xs) // 2]:.1f} p90 {xs[len(xs) * 9 // 10]:.1f} "
                      f"max {xs[-1]:.1f} total {sum(xs) / 1e3 / a.steps / a.rounds:.2f} ms/step", flush=True)
    if c10d is not None and rank == 0:
        for (rep, what), xs in sorted(c10d["us"].items()):
            xs = sorted(xs)
            print(f"c10d {rep:9s} {what}: {len(xs)} calls, host us p50 {xs[len(xs) // 2]:.1f} "
                  f"p90 {xs[len(xs) * 9 // 10]:.1f} total {sum(xs) / 1e3 / a.steps / a.rounds:.2f} ms/step", flush=True)
    if a.call_profile and rank == 0:
        path = os.path.join(a.out, f"{a.job}_call_profile.txt")
        text = _write_profile(timed["prof"], path, 35)
        print(f"braid: profile of the backend's calls in {path}", flush=True)
        print("\n".join(text.splitlines()[:50]), flush=True)
    if a.kernels:
        gpu_time(reps, ctx, a.steps, rank, a.out if a.trace else "")
    for name in ([] if a.no_profile else names):
        ctx.sync()
        dist.barrier(group=ctx.timer)
        prof = cProfile.Profile()
        prof.enable()
        reps[name].run(a.steps)
        ctx.sync()
        prof.disable()
        if rank == 0:
            path = os.path.join(a.out, f"{a.job}_profile_{name}.txt")
            _write_profile(prof, path, 30)
            print(f"{name}: profile of {a.steps} steps in {path}", flush=True)
    dist.destroy_process_group()


def _write_profile(prof, path: str, rows: int) -> str:
    """A cProfile's tables (the `rows` costliest functions by own time, then more by cumulative
    time) written to `path`; returns them."""
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("tottime").print_stats(rows)
    st.sort_stats("cumulative").print_stats(rows + 10)
    with open(path, "w") as f:
        f.write(buf.getvalue())
    return buf.getvalue()


def trial_calls(rep, steps: int, rank: int) -> None:
    """Run `steps` steps of the braid replica with every backend call of a shape on trial timed
    (see the module docstring); rank 0 prints the table."""
    from braid.backend import BraidProcessGroup
    from braid.comm import arbiter
    comm = braid.init()
    prep = comm._prepared
    rows = []                       # (key, whole, first of its block, call us, round us, gap us)
    state = {"answer": None, "last": {}, "mode": {}, "depth": 0}
    whole_of = arbiter.Arbiter.whole

    def whole(self, key):
        w = whole_of(self, key)
        state["answer"] = (key, w)
        return w
    arbiter.Arbiter.whole = whole
    saved = {}

    def wrap(name):
        fn = saved[name] = getattr(BraidProcessGroup, name)

        def timed(self, *args, **kw):
            if state["depth"]:                  # a coalesced call's own inner calls: counted once
                return fn(self, *args, **kw)
            state["answer"] = None
            state["depth"] += 1
            r0, t0 = prep.stats["round_us"], time.perf_counter()
            try:
                return fn(self, *args, **kw)
            finally:
                state["depth"] -= 1
                t1 = time.perf_counter()
                ans = state["answer"]
                if ans is not None:
                    key, w = ans
                    last = state["last"].get(key)
                    first = state["mode"].get(key) != w
                    state["mode"][key] = w
                    state["last"][key] = t0
                    rows.append((key, w, first, (t1 - t0) * 1e6, prep.stats["round_us"] - r0,
                                 (t0 - last) * 1e6 if last is not None else None))
        setattr(BraidProcessGroup, name, timed)
    for name in ("allreduce", "_allgather_base", "_reduce_scatter_base", "allgather_into_tensor_coalesced",
                 "reduce_scatter_tensor_coalesced"):
        if hasattr(BraidProcessGroup, name):
            wrap(name)
    try:
        rep.run(steps)
        torch.cuda.synchronize()
    finally:
        arbiter.Arbiter.whole = whole_of
        for name, fn in saved.items():
            setattr(BraidProcessGroup, name, fn)
    if rank != 0:
        return
    print(f"trial: {len(rows)} calls of shapes on trial in {steps} steps; verdicts "
          f"{[(str(k), round(sp), round(wh), 'whole' if w else 'split') for k, sp, wh, w in comm._arbiter.decisions]}",
          flush=True)

    def pct(xs, q):
        xs = sorted(x for x in xs if x is not None)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")
    for w in (False, True):
        for first in (True, False):
            sel = [r for r in rows if r[1] is w and r[2] is first]
            if sel:
                print(f"  {'whole' if w else 'split'} {'first of block' if first else 'rest':14s} {len(sel):5d} calls: "
                      f"call us p50 {pct([r[3] for r in sel], .5):.0f} p90 {pct([r[3] for r in sel], .9):.0f}; "
                      f"round us p50 {pct([r[4] for r in sel], .5):.0f} p90 {pct([r[4] for r in sel], .9):.0f}; "
                      f"from the previous call us p50 {pct([r[5] for r in sel], .5):.0f} "
                      f"p90 {pct([r[5] for r in sel], .9):.0f}", flush=True)


def _time_calls() -> dict:
    """Wrap braid's graph launch, round of words, the communicator's all_reduce / all_gather /
    reduce_scatter, the backend's calls and their futures with host clocks (kept while
    timed["on"])."""
    from braid import node
    from braid.comm import communicator
    from braid.lanes import _cuda
    timed = {"on": False, "us": {}}

    def wrap(owner, attr, what):
        fn = getattr(owner, attr)
        timed["us"][what] = []

        def timed_fn(*args, **kw):
            if not timed["on"]:
                return fn(*args, **kw)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                timed["us"][what].append((time.perf_counter() - t0) * 1e6)
        setattr(owner, attr, timed_fn)
    wrap(_cuda, "graph_launch", "graph launch")
    wrap(node.NodeSegment, "read_values", "round (read)")
    for op in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"):
        wrap(communicator.Communicator, op, op)
    from braid.backend import BraidProcessGroup
    from braid.backend_work import BraidWork
    for op in ("allreduce", "_allgather_base", "_reduce_scatter_base"):     # the whole backend call
        if hasattr(BraidProcessGroup, op):
            wrap(BraidProcessGroup, op, f"backend {op}")
    wrap(BraidWork, "get_future", "backend get_future")     # DDP asks each bucket's call for it
    return timed


class _HandedOff:
    """A replica's steps with the braid group's collectives bound straight to its inner NCCL group
    (instance attributes shadow the backend's Python methods while it runs; both ranks alike)."""

    NAMES = ("_allgather_base", "_reduce_scatter_base", "allreduce", "all_gather_single", "reduce_scatter_single")

    def __init__(self, rep, pg):
        self.rep, self.pg, self.name = rep, pg, "handoff"

    def run(self, steps: int) -> None:
        bound = [n for n in self.NAMES if hasattr(type(self.pg), n) and hasattr(self.pg.nccl, n)]
        for n in bound:
            setattr(self.pg, n, getattr(self.pg.nccl, n))
        try:
            self.rep.run(steps)
        finally:
            for n in bound:
                self.pg.__dict__.pop(n, None)


def _time_c10d() -> dict:
    """Wrap torch.distributed's module-level collectives that FSDP2 (and a user) call with host
    clocks, per replica (c10d["rep"], set around each window): the same calls on braid's group and
    on NCCL's, timed alike inside the job; the outermost call only (one may call another)."""
    c10d = {"rep": None, "us": {}, "depth": 0}
    for what in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_single", "reduce_scatter_single",
                 "all_reduce"):
        fn = getattr(dist, what, None)
        if fn is None:          # torch's names differ between versions
            continue

        def timed_fn(*args, _fn=fn, _what=what, **kw):
            rep = c10d["rep"]
            if rep is None or c10d["depth"]:
                return _fn(*args, **kw)
            c10d["depth"] += 1
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kw)
            finally:
                c10d["depth"] -= 1
                c10d["us"].setdefault((rep, _what), []).append((time.perf_counter() - t0) * 1e6)
        setattr(dist, what, timed_fn)
    return c10d


def _profile_calls(timed):
    """cProfile around each of braid's backend calls and futures, in the thread that makes it
    (cProfile follows one thread; DDP calls its buckets' all_reduce from autograd's thread), kept
    while timed["on"]; the outermost call only (a call's own inner calls are inside it)."""
    import threading
    from braid.backend import BraidProcessGroup
    from braid.backend_work import BraidWork
    if timed is None:
        timed = {"on": False, "us": {}}
    prof = timed["prof"] = cProfile.Profile()
    depth = threading.local()

    def wrap(owner, attr):
        fn = getattr(owner, attr)

        def profiled(*args, **kw):
            if not timed["on"] or getattr(depth, "n", 0):
                return fn(*args, **kw)
            depth.n = 1
            prof.enable()
            try:
                return fn(*args, **kw)
            finally:
                prof.disable()
                depth.n = 0
        setattr(owner, attr, profiled)
    for op in ("allreduce", "_allgather_base", "_reduce_scatter_base", "allgather_into_tensor_coalesced",
               "reduce_scatter_tensor_coalesced"):
        if hasattr(BraidProcessGroup, op):
            wrap(BraidProcessGroup, op)
    wrap(BraidWork, "get_future")
    wrap(BraidWork, "wait")
    return timed


def gpu_time(reps, ctx, steps: int, rank: int, out: str = "") -> None:
    """Kernel and copy time per step on the GPU for each replica (torch.profiler, CUDA activity),
    grouped by kind (NCCL's kernels by name, the rest as compute / memcpy / memset), and the GPU's
    busy span: tells a slower GPU side (NCCL's kernels themselves) from a slower host."""
    from torch.profiler import ProfilerActivity, profile
    for name in reps:
        ctx.sync()
        dist.barrier(group=ctx.timer)
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            reps[name].run(steps)
            ctx.sync()
        if out:
            prof.export_chrome_trace(os.path.join(out, f"trace_{name}_r{rank}.json"))
        kinds: dict = {}
        for ev in prof.events():
            if ev.device_type != torch.autograd.DeviceType.CUDA:
                continue
            low = ev.name.lower()
            key = (ev.name if "nccl" in low else "memcpy" if "memcpy" in low else "memset" if "memset" in low
                   else "gemm" if any(k in low for k in ("gemm", "nvjet", "cutlass", "xmma")) else
                   "elementwise" if "elementwise" in low else "reduce_kernel" if "reduce_kernel" in low else "other")
            n, t = kinds.get(key, (0, 0.0))
            kinds[key] = (n + 1, t + ev.time_range.elapsed_us())
        if rank == 0:
            rows = sorted(kinds.items(), key=lambda kv: -kv[1][1])
            print(f"{name} GPU per step: " + "; ".join(f"{k[:60]} x{n / steps:.1f} {t / steps / 1e3:.2f} ms"
                                                      for k, (n, t) in rows[:8]), flush=True)


if __name__ == "__main__":
    main()
