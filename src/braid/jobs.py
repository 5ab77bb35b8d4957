"""Training steps for `braid bench --workload ddp,fsdp,moe_layer`.

Every rank builds identical replicas of one model from one seed: a braid replica (its collectives
on the default group, backend "braid"), a baseline replica (a plain NCCL group on GPUs, gloo on
CPUs) and, where the communication can be taken out, a floor replica that runs the same step with
none. The replicas train on the same inputs in alternating timed windows; rank 0 prints each
side's median step time, their ratio, the share of the communication time braid removed, and
whether braid's losses and final parameters matched the baseline's.
"""
from __future__ import annotations

import copy
import gc
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

WORKLOADS = ("ddp", "fsdp", "moe_layer")
# the ops each workload runs on braid: what the bench calibrates before timing it
OPS_OF = {"ddp": ("all_reduce",), "fsdp": ("all_gather", "reduce_scatter"), "moe_layer": ("all_to_all_single",)}
# When braid's results are not bitwise equal to the baseline's, how far they may be. Data movement
# is bitwise, but braid reduces a gradient in rank order (half types in float32, rounded once) where
# NCCL/gloo use their own order and round each partial sum: with 3+ ranks the sums may round
# differently (with 2 ranks a + b == b + a: expect bitwise there).
# Losses: the largest relative difference of any step's loss.
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
# Gradients and weights: |a - b| / |b| (L2 norms) per tensor. A ring rounds a bf16 partial sum at
# each of its world - 1 hops (2**-8 each at most); 3e-2 covers 8 ranks' worst case.
TENSOR_TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
LR = 1e-3
SEED = 1234
# defaults per machine kind: (GPU, CPU)
DEFAULTS = {"width": (8192, 256), "depth": (8, 3), "batch": (16, 8), "bucket_mb": (25, 25),
            "tokens": (8192, 64), "steps": (20, 5), "warmup": (3, 1), "repeat": (9, 5)}


def parse_workloads(text: str) -> tuple[str, ...]:
    """'ddp,moe_layer' -> ('ddp', 'moe_layer'); 'all' -> every workload. SystemExit on a bad name."""
    names = [x.strip().lower() for x in text.split(",") if x.strip()]
    if names == ["all"]:
        return WORKLOADS
    bad = [x for x in names if x not in WORKLOADS]
    if bad or not names:
        raise SystemExit(f"braid bench: --workload {text!r}: workloads are a comma list of "
                         f"{', '.join(WORKLOADS)}, or 'all' (unknown: {', '.join(bad) or 'none given'})")
    return tuple(dict.fromkeys(names))


def settings(cfg, cuda: bool) -> dict:
    """The shape and timing numbers of a run: the flags given, else this machine kind's defaults."""
    pick = 0 if cuda else 1
    out = {k: (getattr(cfg, k, None) or v[pick]) for k, v in DEFAULTS.items()}
    out["warmup"] = cfg.warmup if cfg.warmup is not None else DEFAULTS["warmup"][pick]
    dtype = cfg.dtype or ("bfloat16" if cuda else "float32")
    if getattr(torch, dtype) not in TOLERANCE:
        raise SystemExit(f"braid bench --workload: --dtype {dtype} cannot train a model; "
                         f"use one of bfloat16, float16, float32, float64")
    out["dtype"] = dtype
    return out


@dataclass
class Ctx:
    """What every workload of one run shares on this rank."""
    rank: int
    world: int
    cuda: bool
    device: torch.device
    dtype: torch.dtype
    base: object            # the baseline's process group (NCCL or gloo)
    timer: object           # gloo group for the window barriers and the slowest-rank times
    s: dict                 # settings(): width, depth, batch, bucket_mb, tokens, steps, warmup, repeat
    comm: object = None     # braid's communicator (its prepared calls' counts go into the row)

    @property
    def baseline(self) -> str:
        return "nccl" if self.cuda else "gloo"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


def make_ctx(comm, s: dict) -> Ctx:
    """Collective: every rank makes the two groups in the same order."""
    base = dist.new_group(backend="nccl" if comm.cuda else "gloo")
    timer = dist.new_group(backend="gloo")
    return Ctx(comm.rank, comm.world_size, comm.cuda, comm.device, getattr(torch, s["dtype"]), base, timer, s, comm)


@dataclass
class Replica:
    """One model with its optimizer, behind `step(k)` -> the k-th step's loss (detached, on the
    device: no host sync inside the timed loop)."""
    name: str
    step: Callable[[int], torch.Tensor]
    module: torch.nn.Module
    losses: list = field(default_factory=list)
    done: int = 0

    def run(self, n: int) -> None:
        for _ in range(n):
            self.losses.append(self.step(self.done))
            self.done += 1


def _seeded(ctx: Ctx, seed: int, build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """build() with the global RNG seeded, restored afterwards (the caller's RNG is left alone)."""
    with torch.random.fork_rng(devices=[ctx.device.index] if ctx.cuda else []):
        torch.manual_seed(seed)
        return build()


def _mlp(ctx: Ctx) -> torch.nn.Sequential:
    w, layers = ctx.s["width"], []
    for i in range(ctx.s["depth"]):
        layers.append(torch.nn.Linear(w, w, bias=False, device=ctx.device, dtype=ctx.dtype))
        if i < ctx.s["depth"] - 1:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def _trainer(ctx: Ctx, forward, params, rows: int) -> Callable[[int], torch.Tensor]:
    """One SGD step on `rows` x width inputs drawn from a seed of (rank, k): every replica's k-th
    step sees the same input on this rank, other ranks see other inputs."""
    opt = torch.optim.SGD(params, lr=LR)
    gen = torch.Generator(device=ctx.device)
    shape = (rows, ctx.s["width"])

    def step(k: int) -> torch.Tensor:
        # gradients are dropped at the start of a step rather than at its end: the same work, and
        # the last step's gradients stay for the check (in bf16 an SGD step of lr 1e-3 often
        # leaves the weights as they were, so losses alone would not show the gradients' bits)
        opt.zero_grad(set_to_none=True)
        gen.manual_seed(1_000_003 * (ctx.rank + 1) + k)
        x = torch.randn(shape, generator=gen, device=ctx.device, dtype=ctx.dtype)
        loss = forward(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        return loss.detach()
    return step


def _no_comm(state, bucket):
    """DDP comm hook of the floor: the bucket's local gradients, untouched, no communication."""
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def ddp_replicas(ctx: Ctx) -> list[Replica]:
    from torch.nn.parallel import DistributedDataParallel as DDP
    template = _seeded(ctx, SEED, lambda: _mlp(ctx))
    extra = {"device_ids": [ctx.device.index]} if ctx.cuda else {}

    def replica(name, group, hook=None) -> Replica:
        model = DDP(copy.deepcopy(template), process_group=group, bucket_cap_mb=ctx.s["bucket_mb"], **extra)
        if hook is not None:
            model.register_comm_hook(None, hook)
        return Replica(name, _trainer(ctx, model, model.parameters(), ctx.s["batch"]), model)
    reps = [replica("braid", dist.group.WORLD), replica("baseline", ctx.base), replica("floor", ctx.base, _no_comm)]
    template = None      # the replicas hold their own copies: free the template now
    return reps


def _fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard            # torch >= 2.6
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def fsdp_replicas(ctx: Ctx) -> list[Replica]:
    """FSDP2: each Linear its own unit, then the root. No floor: FSDP's gathers and reductions
    cannot be taken out of its step."""
    from torch.distributed.device_mesh import DeviceMesh
    fully_shard = _fully_shard()
    template = _seeded(ctx, SEED, lambda: _mlp(ctx))

    def replica(name, group) -> Replica:
        model = copy.deepcopy(template)      # every rank holds the same full tensors: fully_shard cuts them
        mesh = DeviceMesh.from_group(group, ctx.device.type)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return Replica(name, _trainer(ctx, model, model.parameters(), ctx.s["batch"]), model)
    reps = [replica("braid", dist.group.WORLD), replica("baseline", ctx.base)]
    template = None      # the replicas hold their own copies: free the template now
    return reps


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of rows; the gradient goes back the same way with the splits swapped."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def _fill_rows(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst's rows from src's, repeated from the top when dst has more (zeros when src has none)."""
    n = src.shape[0]
    if n == 0:
        return dst.zero_()
    for start in range(0, dst.shape[0], n):
        m = min(n, dst.shape[0] - start)
        dst[start:start + m].copy_(src[:m])
    return dst


class _SelfCopy(torch.autograd.Function):
    """The floor's exchange: every token "sent to itself". The output has the shape the exchange's
    would have (the received row count), filled by a local copy of the input's rows; the gradient
    is a copy of the same kind back to the input's shape. Same bytes written, no communication."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.rows = x.shape[0]
        return _fill_rows(x.new_empty((sum(out_splits),) + tuple(x.shape[1:])), x)

    @staticmethod
    def backward(ctx, grad):
        return _fill_rows(grad.new_empty((ctx.rows,) + tuple(grad.shape[1:])), grad), None, None, None


def moe_replicas(ctx: Ctx) -> list[Replica]:
    """One MoE layer: input projection, dispatch (all_to_all), this rank's expert + ReLU, combine
    (the reverse all_to_all). Token counts per (source, destination) rank follow a Zipf-skewed
    expert load that every rank computes alike; tokens arrive sorted by destination."""
    from .workloads import moe_matrix
    h, tokens = ctx.s["width"], ctx.s["tokens"]
    mat = moe_matrix(ctx.world, tokens, seed=SEED)
    ins = mat[ctx.rank]                               # rows this rank sends to each rank
    outs = [mat[src][ctx.rank] for src in range(ctx.world)]   # rows it receives from each
    # this rank's own projection and expert (other ranks hold others), the same on every replica
    template = _seeded(ctx, SEED + 7919 * (ctx.rank + 1), lambda: torch.nn.ModuleList([
        torch.nn.Linear(h, h, device=ctx.device, dtype=ctx.dtype),
        torch.nn.Linear(h, h, bias=False, device=ctx.device, dtype=ctx.dtype)]))

    def replica(name, exchange, group) -> Replica:
        layer = copy.deepcopy(template)
        proj, expert = layer[0], layer[1]

        def forward(x):
            mid = exchange.apply(proj(x), outs, ins, group)                      # dispatch
            return exchange.apply(torch.relu(expert(mid)), ins, outs, group)     # combine
        return Replica(name, _trainer(ctx, forward, layer.parameters(), tokens), layer)
    reps = [replica("braid", _AllToAll, dist.group.WORLD), replica("baseline", _AllToAll, ctx.base),
            replica("floor", _SelfCopy, None)]
    template = None      # the replicas hold their own copies: free the template now
    return reps


BUILDERS = {"ddp": ddp_replicas, "fsdp": fsdp_replicas, "moe_layer": moe_replicas}


def _window(ctx: Ctx, rep: Replica) -> tuple[float, float, float]:
    """One window of `steps` steps of one replica, the slowest rank's: (ms per step, the host's
    ms per step to queue them, ms the device took after the host had queued the last one). A
    host that queues a step in about the window's time per step, its device finishing right
    after it, bounds the step (the device waited for it); a device that finishes long after
    the host bounds it."""
    steps = ctx.s["steps"]
    ctx.sync()
    dist.barrier(group=ctx.timer)
    t0 = time.perf_counter()
    rep.run(steps)
    t1 = time.perf_counter()
    ctx.sync()
    t2 = time.perf_counter()
    took = torch.tensor([t2 - t0, t1 - t0, t2 - t1], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX, group=ctx.timer)
    wall, host, tail = took.tolist()
    return wall * 1e3 / steps, host * 1e3 / steps, tail * 1e3


TRIAL_STEPS_MAX = 500        # warm-up steps at most while braid's whole-or-split trials run
TRIAL_SECONDS_MAX = 120.0


def _handing_off():
    """The backend's test of a hand-off on its way (backend.py, `handing_off`) where the default
    group is braid's, else None."""
    if not dist.is_initialized():
        return None
    return getattr(dist.distributed_c10d._get_default_group(), "handing_off", None)


def settle_trials(ctx: Ctx, by: dict) -> tuple[int, float | None]:
    """Warm-up steps beyond `warmup` while braid's whole-or-split trials (comm/arbiter.py) have
    no verdict yet: (steps, braid's ms per step in them). A job of thousands of steps spends its
    first tens of steps in those trials (up to 400 calls of a shape, half of them split) and then
    runs on the verdicts; the timed windows measure that steady state, and the trial's steps are
    reported beside them. The steps run in runs of a window's length, as the timed windows run
    them: the ranks' flags (are trials under way?) are reduced on the timer group between runs
    only, since a host sync at every step kept the ranks' hosts in step, and DDP's split calls ran
    faster under it (680-720 us a call, 2 x H200, 2026-11-27) than in the windows (760-1070), where
    the same trials, run again, sent them whole. Where every call has gone whole since the
    backend's last look, the steps go on until its hand-off (backend.py, `handing_off`) is in
    place too: a job's first ~256 whole calls after its trials are not its steady state. The
    baseline runs as many extra steps, so the losses compare step by step. Every rank stops at
    the same step."""
    arb = getattr(ctx.comm, "_arbiter", None)
    if arb is None or not arb.enabled:
        return 0, None
    handing = _handing_off()
    steps, t0 = 0, time.perf_counter()
    rep = by["braid"]
    run = max(1, ctx.s["steps"])
    while True:
        over = steps >= TRIAL_STEPS_MAX or time.perf_counter() - t0 > TRIAL_SECONDS_MAX
        busy = arb.trying() or (handing is not None and handing())
        flag = torch.tensor([2 if over else int(busy)], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ctx.timer)
        if int(flag.item()) != 1:
            break
        k = min(run, TRIAL_STEPS_MAX - steps)
        rep.run(k)
        steps += k
    ctx.sync()
    took = (time.perf_counter() - t0) * 1e3 / steps if steps else None
    by["baseline"].run(steps)
    return steps, took


def time_replicas(ctx: Ctx, reps: list[Replica], trial: list | None = None,
                  host: dict | None = None) -> dict[str, list[float]]:
    """Warm every replica up (braid's longer while its whole-or-split trials run: settle_trials,
    whose (steps, ms per step) go into `trial`), then `repeat` rounds of one window each: baseline
    first in even rounds, braid first in odd ones (the machine's drift hits both alike); the floor
    last. Returns each replica's ms per step per window; `host` gets, per replica, the host's ms
    per step to queue each window and the device's ms after it (`_window`)."""
    by = {r.name: r for r in reps}
    for rep in reps:
        rep.run(ctx.s["warmup"])
    got = settle_trials(ctx, by) if "braid" in by and "baseline" in by else (0, None)
    if trial is not None:
        trial[:] = got
    windows: dict[str, list[float]] = {r.name: [] for r in reps}
    queued: dict[str, list] = {r.name: [[], []] for r in reps}
    for k in range(ctx.s["repeat"]):
        order = ["baseline", "braid"] if k % 2 == 0 else ["braid", "baseline"]
        for name in order + [n for n in by if n not in order]:
            ms, host_ms, tail_ms = _window(ctx, by[name])
            windows[name].append(ms)
            queued[name][0].append(host_ms)
            queued[name][1].append(tail_ms)
    if host is not None:
        host.update({name: {"host_ms_per_step": q[0], "device_tail_ms": q[1]} for name, q in queued.items()})
    return windows


def compare(got, want, tol: float) -> dict:
    """Two loss sequences: bitwise equal, or their largest relative difference and whether it is
    within `tol`. NaN or a length mismatch count as an infinite difference."""
    a = torch.as_tensor(got, dtype=torch.float64).reshape(-1)
    b = torch.as_tensor(want, dtype=torch.float64).reshape(-1)
    if a.shape != b.shape:
        return {"bitwise": False, "max_rel_diff": math.inf, "ok": False}
    if torch.equal(a, b):       # float32/bf16 -> float64 is exact: equal here iff equal before
        return {"bitwise": True, "max_rel_diff": 0.0, "ok": True}
    rel = ((a - b).abs() / b.abs().clamp_min(1e-30)).nan_to_num(nan=math.inf)
    worst = float(rel.max()) if rel.numel() else 0.0
    return {"bitwise": False, "max_rel_diff": worst, "ok": worst <= tol}


def describe(result: dict, tol: float) -> str:
    """The table's losses cell."""
    if result["bitwise"]:
        return "bitwise"
    diff = f"max rel diff {result['max_rel_diff']:.1g} (tol {tol:g})"
    return diff if result["ok"] else "MISMATCH: " + diff


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    """A tensor as this rank holds it: FSDP's DTensors give their local shard."""
    if t is None:
        return None
    t = t.detach()
    return t.to_local() if hasattr(t, "to_local") else t


def compare_modules(a: torch.nn.Module, b: torch.nn.Module, grads: bool) -> dict:
    """Parameters (or their gradients) of two replicas, tensor by tensor: bitwise equal, or the
    largest |a - b| / |b| in L2 norm (an element-wise ratio would blow up at elements near 0)."""
    bitwise, worst = True, 0.0
    for pa, pb in zip(a.parameters(), b.parameters()):
        ta, tb = _local(pa.grad if grads else pa), _local(pb.grad if grads else pb)
        if ta is None or tb is None:
            if ta is not tb:
                bitwise, worst = False, math.inf
            continue
        if torch.equal(ta, tb):
            continue
        bitwise = False
        da, db = ta.double(), tb.double()
        rel = float(torch.linalg.vector_norm(da - db)) / max(float(torch.linalg.vector_norm(db)), 1e-30)
        worst = max(worst, math.inf if math.isnan(rel) else rel)
    return {"bitwise": bitwise, "max_rel_diff": worst}


def _param_sum(module: torch.nn.Module) -> float:
    """Sum of this rank's parameters (FSDP: its local shards) in float64."""
    return sum(float(_local(p).double().sum()) for p in module.parameters())


def agree(ctx: Ctx, braid: Replica, base: Replica, start: float) -> dict:
    """braid against the baseline, worst over the ranks: every step's loss, the last step's
    gradients and the final weights. `start`: the weights' sum before training (did they move?)."""
    tol, ttol = TOLERANCE[ctx.dtype], TENSOR_TOLERANCE[ctx.dtype]
    loss = compare(torch.stack(braid.losses).cpu(), torch.stack(base.losses).cpu(), tol)
    grad = compare_modules(braid.module, base.module, grads=True)
    param = compare_modules(braid.module, base.module, grads=False)
    moved = _param_sum(braid.module) != start
    mine = [float(not loss["bitwise"]), float(not (grad["bitwise"] and param["bitwise"])), loss["max_rel_diff"],
            grad["max_rel_diff"], param["max_rel_diff"], float(not moved)]
    worst = torch.tensor(mine, dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=ctx.timer)
    loss_differs, tensors_differ, loss_rel, grad_rel, param_rel, unmoved = worst.tolist()
    loss_res = {"bitwise": not loss_differs, "max_rel_diff": loss_rel, "ok": loss_rel <= tol}
    ok = loss_res["ok"] and max(grad_rel, param_rel) <= ttol
    if tensors_differ:
        first = "losses bitwise" if not loss_differs else f"max rel diff {loss_rel:.1g} (tol {tol:g})"
        cell = f"{first}; grads {grad_rel:.1g}, weights {param_rel:.1g} (tol {ttol:g})"
        cell = cell if ok else "MISMATCH: " + cell
    else:
        cell = describe(loss_res, tol)
    if unmoved:
        cell += " (weights did not move)"
    return {"ok": ok, "bitwise": not loss_differs and not tensors_differ, "cell": cell, "tol": tol, "tensor_tol": ttol,
            "loss_rel": loss_rel, "grad_rel": grad_rel, "param_rel": param_rel, "params_moved": unmoved == 0}


def _size_of(name: str, s: dict, params: int) -> tuple[str, dict]:
    """The size cell and the shape flags that made it."""
    if name == "moe_layer":
        return f"{s['tokens']} tok x {s['width']}", {"tokens": s["tokens"], "hidden": s["width"]}
    shape = {"width": s["width"], "depth": s["depth"], "batch": s["batch"]}
    if name == "ddp":
        shape["bucket_mb"] = s["bucket_mb"]
    return f"{_count(params)} params", shape


def _count(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(int(n))


def build(ctx: Ctx, name: str) -> tuple[list[Replica] | None, str]:
    """The replicas of one workload, or (None, why) when this torch cannot build them here; every
    rank agrees before any of them goes on. Only FSDP's build is guarded: it runs no collective
    (DDP's broadcasts its weights, so a rank failing there would leave the others waiting)."""
    reps, why = None, ""
    if name == "fsdp":
        try:
            reps = fsdp_replicas(ctx)
        except Exception as exc:       # a torch without FSDP2, or one whose FSDP2 lacks this device
            why = f"{type(exc).__name__}: {exc}"
    else:
        reps = BUILDERS[name](ctx)
    failed = torch.tensor([1.0 if why else 0.0])
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=ctx.timer)
    if failed.item():
        where = "on GPU" if ctx.cuda else "on CPU"
        return None, f"not available {where}: {why or 'it failed on another rank'}"
    return reps, ""


def run_workload(ctx: Ctx, name: str) -> dict:
    """Build, time and check one workload on every rank; the row rank 0 reports."""
    reps, why = build(ctx, name)
    if reps is None:
        return {"workload": name, "world_size": ctx.world, "error": why}
    braid, base = reps[0], reps[1]
    params = sum(_local(p).numel() for p in braid.module.parameters())
    if name != "ddp":           # FSDP: local shards; moe_layer: every rank its own expert
        t = torch.tensor([params], dtype=torch.int64)
        dist.all_reduce(t, group=ctx.timer)
        params = int(t.item())
    start = _param_sum(braid.module)
    prep = getattr(ctx.comm, "_prepared", None)
    before = dict(prep.stats) if prep is not None else {}
    arb = getattr(ctx.comm, "_arbiter", None)
    tried = arb.count if arb is not None else 0
    trial: list = [0, None]
    host: dict = {}
    windows = time_replicas(ctx, reps, trial, host)
    # the whole-or-split trials the job ran (comm/arbiter.py): shape, pace split / whole (us), verdict
    new = arb.count - tried if arb is not None else 0
    # (the watch's: split's pace since the trial / the trial's whole pace, "whole (watch)")
    learned = [[str(k), s, w, ("whole" if wh else "split") + (" (watch)" if by == "watch" else "")]
               for k, s, w, wh, by in arb.decisions[-new:]] if new else []
    # braid's split calls over the run (warm-up and check steps too): built = agreed and planned
    # anew (a new shape or buffer), hits = taken from the prepared cache, replays = graph launches
    split_calls = {k: v - before.get(k, 0) for k, v in prep.stats.items()} if prep is not None else {}
    check = agree(ctx, braid, base, start)
    t_braid, t_base = statistics.median(windows["braid"]), statistics.median(windows["baseline"])
    t_floor = statistics.median(windows["floor"]) if "floor" in windows else None
    # the share of the baseline's communication time braid saved; not a number where the baseline
    # spends under 2% of its step communicating (one rank, say): there it is noise over noise
    exposed = t_base - t_floor if t_floor is not None else 0.0
    removed = (t_base - t_braid) / exposed if exposed > 0.02 * t_base else None
    size, shape = _size_of(name, ctx.s, params)
    # the backend's hand-off (backend.py): the methods bound straight to the inner group at the end
    pg = dist.distributed_c10d._get_default_group()
    handed = ({"methods": list(pg._handed), "at_call": pg.handed_at, "forwarded": pg._forwarded}
              if getattr(pg, "_handed", None) else None)
    row = {"workload": name, "size": size, "world_size": ctx.world, "dtype": str(ctx.dtype).replace("torch.", ""),
           "params": params, **shape, "steps": ctx.s["steps"], "warmup": ctx.s["warmup"], "repeat": ctx.s["repeat"],
           "time_ms": t_braid, "baseline": {"name": ctx.baseline, "time_ms": t_base}, "floor_ms": t_floor,
           "ratio": t_base / t_braid, "comm_removed": removed,
           "losses_equal": check["ok"], "losses_bitwise": check["bitwise"],
           "loss_max_rel_diff": check["loss_rel"], "grad_max_rel_diff": check["grad_rel"],
           "param_max_rel_diff": check["param_rel"], "loss_tolerance": check["tol"],
           "tensor_tolerance": check["tensor_tol"], "losses_cell": check["cell"],
           "params_moved": check["params_moved"], "losses": torch.stack(braid.losses).float().cpu().tolist(),
           "windows": windows,
           # per replica: the host's ms per step to queue a window, the device's ms after it
           # (medians, and every window's)
           "host_time": {name: {**{k: statistics.median(v) for k, v in h.items()}, "windows": h}
                         for name, h in host.items()},
           "split_calls": split_calls, "learned": learned, "handed_off": handed,
           "trial_steps": trial[0], "trial_ms_per_step": trial[1]}
    del reps, braid, base
    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()
    return row


# ---------------------------------------------------------------------------------------------
# output (rank 0)
# ---------------------------------------------------------------------------------------------

HEADS = ("workload", "size", "world", "braid ms/step", "{b} ms/step", "ratio", "floor ms/step", "comm removed",
         "losses")
WIDTHS = (10, 22, 6, 14, 14, 7, 14, 13)


def header(baseline: str) -> str:
    heads = [h.format(b=baseline) for h in HEADS]
    return "# " + "".join(h.ljust(w) for h, w in zip(heads, WIDTHS)) + heads[-1]


def format_row(row: dict) -> str:
    if "error" in row:
        return "  " + row["workload"].ljust(WIDTHS[0]) + row["error"]
    floor = "-" if row["floor_ms"] is None else f"{row['floor_ms']:.2f}"
    removed = "-" if row["comm_removed"] is None else f"{row['comm_removed'] * 100:.0f}%"
    cells = [row["workload"], row["size"], str(row["world_size"]), f"{row['time_ms']:.2f}",
             f"{row['baseline']['time_ms']:.2f}", f"{row['ratio']:.2f}", floor, removed]
    return "  " + "".join(c.ljust(w) for c, w in zip(cells, WIDTHS)) + row["losses_cell"]


def host_line(host_time: dict) -> str:
    """Where each replica's step is bound: the host's ms per step to queue a window, and how long
    its GPU ran on after the host queued the last step (medians of the windows, slowest rank)."""
    parts = [f"{name} {h['host_ms_per_step']:.2f} ms (GPU {h['device_tail_ms']:.1f} ms after)"
             for name, h in host_time.items()]
    return ("host time to queue a step: " + ", ".join(parts)
            + " (a GPU that ends soon after its host queued the last step was waiting for the host)")


def run(comm, cfg, cuda: bool):
    """Every workload of cfg on every rank; rank 0 prints the table and writes the JSON. Returns
    what to do after the teardown: exit with WRONG_EXIT when the losses did not match."""
    import dataclasses
    from .bench.config import WRONG_EXIT
    from .bench.output import header_line, machine_info, split_calls_line, write_json
    from .bench.sweep import calibrate_for_bench
    s = settings(cfg, cuda)
    ctx = make_ctx(comm, s)
    r0 = comm.rank == 0
    say = (lambda text="": print(text, flush=True)) if r0 else (lambda text="": None)
    info = machine_info(comm)
    say(header_line("bench", info))
    for note in cfg.notes:
        say(f"note: {note}")
    say(f"world {ctx.world} ranks | dtype {s['dtype']} | steps {s['steps']} x {s['repeat']} windows per side, "
        f"warmup {s['warmup']} | braid lanes: {', '.join(comm.lanes_for(comm.device)) or 'none'} | "
        f"baseline: {ctx.baseline}")
    ops = tuple(dict.fromkeys(op for w in cfg.workloads for op in OPS_OF[w]))
    say(calibrate_for_bench(comm, dataclasses.replace(cfg, ops=ops), say) if ctx.world > 1
        else "calibration: one rank, nothing to split")
    say(header(ctx.baseline))
    rows: list[dict] = []
    with comm.fixed_shares(cfg.shares):
        for name in cfg.workloads:
            row = run_workload(ctx, name)
            row.update({k: v for k, v in info.items() if k not in row})
            rows.append(row)
            say(format_row(row))
            if row.get("split_calls", {}).get("built") or row.get("split_calls", {}).get("hits"):
                sc = row["split_calls"]
                say("  " + " " * WIDTHS[0] + split_calls_line(sc))
            if row.get("learned"):
                kept = [x[3] for x in row["learned"]]
                watched = kept.count("whole (watch)")
                say("  " + " " * WIDTHS[0] + f"learned in the job ({len(kept)} verdicts, the same on every rank): "
                    f"{kept.count('split')} kept split, {kept.count('whole') + watched} went whole"
                    + (f" ({watched} by the watch of a kept split)" if watched else "") + "; pace split/whole us: "
                    + ", ".join(f"{s:.0f}/{w:.0f}" for _, s, w, _ in row["learned"][:8])
                    + (" ..." if len(kept) > 8 else ""))
            if row.get("handed_off"):
                h = row["handed_off"]
                say("  " + " " * WIDTHS[0] + f"handed to the inner group from call #{h['at_call']} (every call whole "
                    f"for a window): {', '.join(h['methods'])}; {h['forwarded']} calls forwarded so far")
            if row.get("host_time") and cuda:
                say("  " + " " * WIDTHS[0] + host_line(row["host_time"]))
            if row.get("trial_steps"):
                say("  " + " " * WIDTHS[0] + f"the trials (and the hand-off, where one came) took "
                    f"{row['trial_steps']} warm-up steps before the timed windows, at "
                    f"{row['trial_ms_per_step']:.2f} ms/step (braid)")
            if r0 and cfg.json_path:
                write_json(cfg.json_path, rows)
    bad = [r["workload"] for r in rows if r.get("losses_equal") is False]
    say(f"# {'losses match the baseline' if not bad else 'FAILED: braid differs from the baseline beyond the tolerance in ' + ', '.join(bad)}"
        + (f"; results written to {cfg.json_path}" if cfg.json_path else ""))

    def after() -> None:
        if bad:
            sys.exit(WRONG_EXIT)
    return after
