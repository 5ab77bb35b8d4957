"""First calibration: time each lane alone at each op, fit latency + bandwidth, refine, cache.

Stage 1 of FlexLink's balancer, in its simplest form (the full two-stage balancer is the next
issue; this module's output, a LaneCost per lane and op, is what it will start from):

1. every lane alone, at two sizes -> LaneCost(latency, bandwidth) by a straight-line fit (a third,
   between them, when the smaller one turns out bound by the host: `planner.model.fit_points`);
2. all lanes together with the equal-finish split of those costs, each lane timed on its own
   stream -> each lane's bandwidth re-estimated from the bytes it moved and its time while the
   others ran (lanes that share links slow each other); repeated `rounds` times.

The result is cached in BRAID_CACHE_DIR under a key of everything that makes it valid (GPU model
and count, peer topology, driver, torch and NCCL versions, world size), read by rank 0 and
broadcast so every rank plans from the same numbers.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time

import torch
import torch.distributed as dist

from . import envs
from .planner.model import LaneCost, fit_points, fixed_bound

log = logging.getLogger("braid")

# (floor size, two sizes for the latency/bandwidth line). The line is fitted where the device is
# the bottleneck (host-side work hides behind the transfer there; a host-bound small size is
# replaced by half the large one); the floor is the end-to-end time of a small call, host-side
# work included.
GPU_SIZES = (1 << 20, 64 << 20, 512 << 20)
CPU_SIZES = (64 << 10, 1 << 20, 8 << 20)
# Calls per timed point, after warm-up calls, as the bench times them. A window of few calls adds
# one exposed host-side start per window: with 5 calls and 1 warm-up the copy engines' 256 MiB
# all_reduce on 2 x H200 timed 935-966 us a call, with 20 and 5 816-828 (NCCL: 924-929 / 898), and
# the calibration kept NCCL where the copy engines are 9% faster (2026-11-22, scripts/calprobe.py).
LINE_ITERS = 20
LINE_WARMUP = 5


def machine_key(comm) -> dict:
    key = {"world_size": comm.world_size, "torch": torch.__version__, "lanes": sorted(comm.lanes_for(comm.device))}
    if comm.cuda:
        n = torch.cuda.device_count()
        key.update(gpu=torch.cuda.get_device_name(comm.device), gpus=n,
                   peer=[[int(i == j or torch.cuda.can_device_access_peer(i, j)) for j in range(n)] for i in range(n)],
                   cuda=torch.version.cuda, nccl=".".join(map(str, torch.cuda.nccl.version())),
                   driver=_driver_version())
        if envs.get("BRAID_SHARED_GPU"):    # NCCL over its network transport, ranks taking turns on a GPU
            key["shared_gpu"] = True
    else:
        key.update(cpu=platform.processor() or platform.machine(), cores=os.cpu_count())
    return key


def _driver_version() -> str:
    try:
        with open("/proc/driver/nvidia/version") as f:
            return f.readline().strip()
    except OSError:
        return ""


def cache_path(comm) -> str:
    digest = hashlib.sha1(json.dumps(machine_key(comm), sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(envs.get("BRAID_CACHE_DIR"), f"calib-{digest}.json")


def load(comm) -> dict | None:
    if envs.get("BRAID_CALIBRATE") in ("off", "force"):
        return None
    try:
        with open(cache_path(comm)) as f:
            obj = json.load(f)
        return obj["table"]
    except (OSError, ValueError, KeyError):
        return None


def save(comm, table: dict) -> str:
    """Merge `table` into the cached one (ops calibrated earlier stay) and write it atomically."""
    path = cache_path(comm)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        with open(path) as f:
            table = {**json.load(f)["table"], **table}
    except (OSError, ValueError, KeyError):
        pass
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"key": machine_key(comm), "created": time.strftime("%Y-%m-%d %H:%M:%S"), "table": table}, f, indent=1)
    os.replace(tmp, path)
    return path


def time_call(comm, fn, iters: int, warmup: int = 1) -> float:
    """Microseconds per call, the slowest rank's (every rank calls this together)."""
    return time_call_host(comm, fn, iters, warmup)[0]


def time_call_host(comm, fn, iters: int, warmup: int = 1) -> tuple[float, float]:
    """(microseconds per call, host microseconds per call), each the slowest rank's. Host time is
    the caller's clock from entering the first call to returning from the last, per call: what
    issuing the calls costs the CPU (on GPUs the calls return before the GPU work ends; on CPU
    lanes it is the whole call)."""
    for _ in range(warmup):
        fn()
    _sync(comm)
    dist.barrier(group=comm.gloo_group)
    if comm.cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        host = (time.perf_counter() - t0) * 1e6 / iters
        end.record()
        end.synchronize()
        torch.cuda.synchronize(comm.device)
        wall = (time.perf_counter() - t0) * 1e6 / iters
        # the events see the caller's stream; work a call left on another stream (a baseline
        # that returns before its copies end) only the device-wide wait sees
        mine = max(start.elapsed_time(end) * 1e3 / iters, wall)
    else:
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        mine = host = (time.perf_counter() - t0) * 1e6 / iters
    return tuple(_max_over_ranks(comm, [mine, host]))


def _sync(comm) -> None:
    if comm.cuda:
        torch.cuda.synchronize(comm.device)


def _max_over_ranks(comm, values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=comm.gloo_group)
    return t.tolist()


def calibrate_op(comm, op: str, lanes: list[str], sizes=None, iters: int = 5, rounds: int = 2) -> dict[str, LaneCost]:
    """LaneCost for each lane at `op` (collective over every rank)."""
    from .workloads import make
    sizes = sizes or (GPU_SIZES if comm.cuda else CPU_SIZES)
    tiny, small, large = sizes
    costs: dict[str, LaneCost] = {}
    loads = {n: make(comm, op, n, torch.uint8 if not comm.cuda else torch.bfloat16) for n in sizes}
    mid = None
    li, lw = (LINE_ITERS, LINE_WARMUP) if comm.cuda else (iters, 1)
    for lane in lanes:
        with comm.fixed_shares({lane: 1.0}):
            floor = time_call(comm, loads[tiny].braid, iters * 4, warmup=2)
            ta = time_call(comm, loads[small].braid, li, lw)
            tb = time_call(comm, loads[large].braid, li, lw)
            points = [(loads[small].nbytes, ta), (loads[large].nbytes, tb)]
            if fixed_bound(loads[small].nbytes, ta, loads[large].nbytes, tb):
                # the small size is bound by the host: time one between it and the large one
                mid = mid or make(comm, op, large // 2, torch.uint8 if not comm.cuda else torch.bfloat16)
                points.insert(1, (mid.nbytes, time_call(comm, mid.braid, li, lw)))
        costs[lane] = fit_points(floor, points)
    del mid
    big = loads[large]
    for _ in range(rounds):
        shares = comm.split_rule(op, costs, big.nbytes)
        if len(shares) < 2:
            break
        with comm.fixed_shares(shares, timed=True):
            for _ in range(2):
                big.braid()
            _sync(comm)
            times: dict[str, float] = {}
            for _ in range(iters):
                big.braid()
                if big.participates and comm.last_handle is not None:
                    for k, v in comm.last_handle.lane_times_us().items():
                        times[k] = times.get(k, 0.0) + v / iters
        names = sorted(shares)
        slowest = _max_over_ranks(comm, [times.get(k, 0.0) for k in names])
        for k, t in zip(names, slowest):
            # bytes this lane moved, scaled back to the op's size, over its time beside the others
            frac = shares.get(k, 0.0)
            if frac <= 0 or t <= costs[k].latency_us:
                continue
            costs[k] = LaneCost(costs[k].latency_us, frac * big.nbytes / (t - costs[k].latency_us) / 1e3,
                                costs[k].floor_us)
    return costs


# Sizes where the split and each lane alone are timed against NCCL's own call. From 1 MiB: a
# repeated split call on the copy engines costs about NCCL's host time (prepared calls), so the
# copy engines alone can win from a few MiB (one pull at ~387 GB/s against NCCL's 171-230 GB/s
# busbw on 2 GPUs), and only a measurement says from where.
PROBE_SIZES_GPU = (1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30)
PROBE_SIZES_CPU = (1 << 20, 4 << 20, 16 << 20)


ALONE_OPS = ("all_reduce", "reduce_scatter")    # CPU-free reductions of the copy engines' own
# Where the model keeps NCCL alone for one of those ops but puts the copy engines alone within this
# factor of it, they are timed too: their line is fitted worst near their fixed cost (4 x H200,
# 2026-11-22: 2-GPU reduce_scatter at 256 MiB modelled 703 us on the copy engines against NCCL's
# 577, kept on NCCL (1.00), where the copy engines alone had run 1.28-1.29x NCCL in an earlier bench).
ALONE_CHECK = 1.5
# Another lane or a split replaces the native library only when it measured this much faster:
# at 1-4 MiB NCCL's own time on 2 x H200 moved 29-41 us from one run to the next, and a
# calibration that took the copy engines on a point within that noise left broadcast and send/recv
# at 4 MiB at 0.84 of NCCL in the sweep that followed (2026-11-26). A tie goes to NCCL.
NATIVE_MARGIN = 0.05
# A split over several lanes replaces the fastest single lane only when it measured this much
# faster than that lane: in a job it costs more than its timed calls show (its first calls and
# every 64th are posted and timed for the balancer, each move of the balancer builds the shape
# anew). On 2 x H200 (2026-11-28) a DDP job's 64 MiB all_reduce buckets, calibrated to a
# balanced split of several lanes, ran 2270 us a call in the job's trial against 782 whole (the copy
# engines alone had run 704 and been kept), and the trial sent them whole.
SPLIT_MARGIN = 0.05          # the default of BRAID_SPLIT_MARGIN_PCT


def ce_alone_ok(comm, op: str, costs: dict) -> bool:
    """May the copy engines alone replace the native call for `op`? On GPUs, for every op but a
    broadcast beyond 2 ranks (braid's broadcast is a star from the root there)."""
    return "ce" in costs and not (op == "broadcast" and getattr(comm, "world_size", 2) > 2)


def split_pays(comm, op: str, costs: dict[str, LaneCost], iters: int | None = None,
               record: dict | None = None) -> dict[str, bool | str | dict]:
    """Per size bucket (log2 bytes) where the model splits or puts a lane alone: what measured
    fastest? True: the split; False: the native lane (NCCL / gloo) alone; a lane name: that lane
    alone (the copy engines, `ce_alone_ok`). Also where the model keeps NCCL alone but the copy
    engines alone come within ALONE_CHECK of it: NCCL alone (False) or the copy engines alone
    ("ce"). The cost model can be
    wrong near the crossover (run 2: a predicted 5% gain ran 23% slower), and a split's host work
    adds up over its lanes (2 x H200, 256 MiB all_reduce: copy engines + host lane 1.45 ms of
    host time per call, copy engines alone 0.81 ms end to end, NCCL 0.89).

    The split is timed with its shares balanced at that size first (`balance_at`, FlexLink's
    stage 1): when it wins, the verdict is those shares (a dict), which the ops then start from.
    The model's split alone lost to the copy engines alone at 1 GiB reduce_scatter on 2 x H200
    (2026-11-22: its host share 0.095 made the host lane the slowest), where ce 0.92 + host 0.08 ran
    3.6% faster than the copy engines alone in alternating windows."""
    from .planner.balancer import OnlineBalancer
    from .workloads import make
    single = "nccl" if "nccl" in costs else "gloo" if "gloo" in costs else None
    out: dict[str, bool | str] = {}
    iters, warm = (iters or LINE_ITERS, LINE_WARMUP) if comm.cuda else (iters or 5, 1)
    if single is None:
        return out
    split_margin = envs.get("BRAID_SPLIT_MARGIN_PCT") / 100
    for n in (PROBE_SIZES_GPU if comm.cuda else PROBE_SIZES_CPU):
        shares = comm.split_rule(op, costs, n)
        alone = [single] + (["ce"] if ce_alone_ok(comm, op, costs) else [])
        near = len(alone) > 1 and costs["ce"].time_us(n) <= ALONE_CHECK * costs[single].time_us(n)
        if len(shares) < 2 and set(shares) == {single} and not near:
            continue
        load = make(comm, op, n, torch.bfloat16 if comm.cuda else torch.float32)
        cands: list = []
        if len(shares) > 1:
            shares = balance_at(comm, load, shares, costs)
            cands.append((True, shares))
        cands += [(False if lane == single else lane, {lane: 1.0}) for lane in alone]
        timed: dict = {}
        for _ in range(2):          # in turn, best of two each: a drift in between favours nobody
            for key, sh in cands:
                with comm.fixed_shares(sh):
                    t = time_call(comm, load.braid, iters, warm)
                timed[key] = min(timed.get(key, t), t)
        best = min(timed, key=lambda k: (timed[k], str(k)))
        if best is True:            # the split against the fastest single lane: a tie goes to the lane
            lane = min((k for k in timed if k is not True), key=lambda k: (timed[k], str(k)))
            if timed[True] > (1 - split_margin) * timed[lane]:
                best = lane
        if best is not False and False in timed and timed[best] > (1 - NATIVE_MARGIN) * timed[False]:
            best = False            # within the margin of the native library: it keeps the call
        bucket = str(OnlineBalancer.bucket(op, load.nbytes)[1])
        out[bucket] = dict(shares) if best is True else best
        if record is not None:      # what was timed, for the table (why a bucket went where it did)
            record[bucket] = {("split" if k is True else single if k is False else k): round(v, 1)
                              for k, v in timed.items()}
            if len(shares) > 1:
                record[bucket]["split_shares"] = dict(shares)
        del load
    return out


BALANCE_ROUNDS = 3      # equal-finish rounds per split size in split_pays
BALANCE_CALLS = 5       # calls whose lane times make one round
BALANCE_SPREAD = 0.05   # done when the slowest and fastest lane differ by less than this


def balance_at(comm, load, shares: dict[str, float], costs: dict[str, LaneCost],
               rounds: int = BALANCE_ROUNDS) -> dict[str, float]:
    """FlexLink's stage 1 at one size: run the split, take each lane's mean time over a few calls
    (the slowest rank's), move the shares toward equal finish (`planner.balancer.rate_step`), and
    repeat until the lanes finish within BALANCE_SPREAD of each other. Every rank ends with the
    same shares (the times are agreed first)."""
    from .planner.balancer import rate_step, spread
    lat = {k: costs[k].latency_us for k in shares if k in costs}
    for _ in range(rounds):
        times: dict[str, float] = {}
        with comm.fixed_shares(shares, timed=True):
            for _ in range(2):
                load.braid()
            for _ in range(BALANCE_CALLS):
                load.braid()
                handle = getattr(comm, "last_handle", None)
                if getattr(load, "participates", True) and handle is not None:
                    for k, v in handle.lane_times_us().items():
                        times[k] = times.get(k, 0.0) + v / BALANCE_CALLS
        names = sorted(shares)
        times = dict(zip(names, _max_over_ranks(comm, [times.get(k, 0.0) for k in names])))
        if min(times.values()) <= 0 or spread(times) <= BALANCE_SPREAD:
            break
        shares = {k: round(v, 4) for k, v in rate_step(shares, times, lat, gain=0.8).items() if v > 0}
    return shares


def calibrate(comm, ops=("send_recv", "broadcast", "all_gather", "all_to_all_single", "all_reduce", "reduce_scatter",
                         "reduce"), save_to_disk: bool = True,
              sizes=None) -> dict:
    """Calibrate every op on every usable lane, agree across ranks, install and cache the result."""
    lanes = comm.lanes_for(comm.device)
    table = {}
    t0 = time.perf_counter()
    for op in ops:
        if op == "send_recv" and comm.world_size < 2:
            continue
        costs = calibrate_op(comm, op, lanes, sizes=sizes) if len(lanes) > 1 else {}
        table[f"{op}/{comm.world_size}"] = {k: c.to_dict() for k, c in costs.items()}
        if costs:
            timed: dict = {}
            table[f"{op}/{comm.world_size}/pays"] = split_pays(comm, op, costs, record=timed)
            table[f"{op}/{comm.world_size}/timed"] = timed
    box = [table]
    dist.broadcast_object_list(box, src=0, group=comm.gloo_group)
    table = box[0]
    comm.set_calibration(table)
    if save_to_disk and comm.rank == 0:
        path = save(comm, table)
        log.info("braid: calibration saved to %s (%.1f s)", path, time.perf_counter() - t0)
    return table
