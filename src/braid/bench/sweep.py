"""The op sweep of `braid bench`, run on every rank: braid against its baseline (NCCL on GPUs,
gloo on the CPU lanes), point by point.

For each point every rank builds the same workload (`braid.workloads.make`: braid's call and the
baseline's on the same buffers), runs both once, the first calls of the shape, timed on the host
apart (`first_call_us`: braid's includes preparing the shape), and counts the bytes where braid's
output differs, then times the two in alternating windows (`braid.calibrate.time_call_host`: the slowest rank's
mean per call, and the host time per call). Large calls keep each side's best of `--repeat`
windows. Small calls, where one window of `--iters` calls would span well under ~20 ms, are timed
in at least SMALL_ROUNDS shorter windows of the same calls in total, alternating which side goes
first, and keep each side's median: host-bound calls drift with the machine's load, short
alternating windows let both sides meet the same quiet moments, and a median is not decided by
one lucky window (a min of 6 windows scattered +-20% between runs at 64 KiB-1 MiB).

Before the sweep the benched ops are calibrated once (`calibrate_for_bench`), so braid's shares
come from this machine as it is now. Rank 0 prints the table and, under it, the table's host
summary (`output.host_summary`: braid's host time against the baseline's, and the first calls),
writes the JSON after each point and returns the plot for after the teardown.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from . import baselines as alternatives
from .config import NO_GPU_LINE, SMALL_ROUNDS, WRONG_EXIT, Config
from .output import format_shares, header_line, host_summary, split_calls_line, human_bytes, machine_info, make_ui, write_json


def _sync(comm) -> None:
    if comm.cuda:
        torch.cuda.synchronize(comm.device)


def _sum_over_ranks(comm, value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, group=comm.gloo_group)
    return int(t.item())


def _unmeasured(comm) -> str:
    """What a call the calibration has not measured does (comm/policy.py)."""
    if comm.cuda and not comm.policy.model_unmeasured:
        return "NCCL whole for every call (BRAID_SPLIT_UNMEASURED=1: the built-in lane model's splits)"
    return "built-in lane model"


def calibrate_for_bench(comm, cfg: Config, say) -> str:
    """Calibrate the benched ops once (merged into the cache); returns a line for the header."""
    from .. import calibrate as cal
    from .. import envs
    if cfg.shares:
        return f"calibration: skipped, fixed shares {format_shares(cfg.shares)}"
    if not cfg.calibrate:
        return f"calibration: {'cached ' + comm.calib_digest if comm.calib else 'none cached: ' + _unmeasured(comm)} (--no-calibrate)"
    if envs.get("BRAID_CALIBRATE") == "off":
        return f"calibration: BRAID_CALIBRATE=off: {_unmeasured(comm)}"
    if len(comm.lanes_for(comm.device)) < 2:
        return f"calibration: not needed, one lane ({', '.join(comm.lanes_for(comm.device))})"
    ops = tuple(dict.fromkeys("all_to_all_single" if op == "moe" else op for op in cfg.ops))  # moe runs all_to_all
    say(f"calibrating {', '.join(ops)} on lanes {', '.join(comm.lanes_for(comm.device))} ...")
    t0 = time.perf_counter()
    table = cal.calibrate(comm, ops=ops, save_to_disk=False)
    path = ""
    if comm.rank == 0:
        merged = dict(cal.load(comm) or {})     # keep the cached ops this run did not measure
        merged.update(table)
        path = cal.save(comm, merged)
    return f"calibration: measured in {time.perf_counter() - t0:.1f} s ({comm.calib_digest}), cached at {path}"


def _points(cfg: Config) -> list[tuple[str, int | None, float | None]]:
    """The sweep's points in order: (op, nbytes, hot fraction); nbytes None is the one skewed
    all_to_all_single point of --hot-bytes."""
    plan = []
    for op in cfg.ops:
        if op == "all_to_all_single" and cfg.hot_bytes is not None:
            plan += [(op, None, None)]
        elif op == "all_to_all_single" and cfg.hot_fraction:
            plan += [(op, n, h) for h in cfg.hot_fraction for n in cfg.size_list()]
        else:
            plan += [(op, n, None) for n in cfg.size_list()]
    return plan


def run(comm, cfg: Config):
    """The sweep on every rank; rank 0 prints and returns what to do after the teardown (the plot)."""
    r0 = comm.rank == 0
    baseline = "nccl" if comm.cuda else "gloo"
    info = machine_info(comm)
    if comm.world_size < 2:
        from ..errors import MisuseError
        raise MisuseError("braid bench needs at least 2 ranks")
    if cfg.trace:
        from .trace import run as run_trace
        return run_trace(comm, cfg, info)
    plan = _points(cfg)
    ui = make_ui(len(plan), cfg.plain) if r0 else None
    say = ui.line if r0 else (lambda text="": None)
    results: list[dict] = []
    bad = 0
    try:
        lanes = comm.lanes_for(comm.device)
        _check_fixed_shares(comm, cfg, lanes)
        _say_header(comm, cfg, info, lanes, baseline, say)
        say(calibrate_for_bench(comm, cfg, say))
        common = {"world_size": comm.world_size, "dtype": cfg.dtype, "lanes": lanes, "iters": cfg.iters,
                  "warmup": cfg.warmup, "repeat": cfg.repeat, "calibration": comm.calib_digest,
                  "fixed_shares": cfg.shares, **info}
        if not comm.cuda:
            gbps = copy_ceiling(comm)
            common["copy_ceiling_gbps"] = gbps
            say(f"copy ceiling: {gbps:.1f} GB/s per rank (every rank copying 64 MiB at once, the slowest; "
                f"a CPU collective moves each byte at least twice)")
        if cfg.hot_bytes is not None:
            common.update(hot_nbytes=cfg.hot_bytes, cold_nbytes=cfg.cold_bytes)
        # the op rows time the calibration's verdict: a job's trials of whole against split
        # (comm/arbiter.py) measure the job's pace, which these alternating windows would break up
        with comm.fixed_shares(cfg.shares), comm.calibrated_verdict():
            bad = _sweep(comm, cfg, plan, common, info, baseline, ui, results)
        if r0:
            ui.end_op()
            sc = comm._prepared.stats
            if sc.get("hits") or sc.get("deferred"):
                say("# " + split_calls_line(sc))
            if cfg.check:
                say(f"# {'all outputs match the baseline' if not bad else f'FAILED: {bad} wrong bytes in total'}")
            if cfg.json_path:
                say(f"# results written to {cfg.json_path}")
    finally:
        if r0:
            ui.close()

    def after() -> None:
        if r0 and cfg.plot_path:
            from .plots import plot
            plot(results, cfg.plot_path, info)
        if bad:
            sys.exit(WRONG_EXIT)
    return after


def copy_ceiling(comm, nbytes: int = 64 << 20, reps: int = 3) -> float:
    """GB/s of one memory copy of `nbytes` on every rank at once (the slowest rank's best of
    `reps`): what a CPU collective's copies can reach on this machine with this many ranks."""
    return nbytes / copy_seconds(comm, nbytes, reps) / 1e9


def copy_seconds(comm, nbytes: int, reps: int = 3) -> float:
    """Seconds of one memory copy of `nbytes` on every rank at once, the slowest rank's best of
    `reps` (a collective call on every rank)."""
    a = torch.ones(max(nbytes, 1), dtype=torch.uint8)
    b = torch.empty_like(a)
    b.copy_(a)
    return _slowest_best(comm, lambda: None, lambda: b.copy_(a), reps)


def floor_seconds(comm, nbytes: int, dtype: torch.dtype, reps: int = 5) -> float | None:
    """Seconds of the memory's floor under braid's own CPU all_reduce of `nbytes`: every rank at
    once runs the native call's copies and reductions (the same stripes, chunks and slots) with no
    wait for a peer (`_cpucoll.c` run_floor), the slowest rank's best of `reps`. None where the
    native pool does not take the call (small, no compiler). A collective call on every rank."""
    cpu = getattr(comm, "_cpu", None)
    esz = torch.empty(0, dtype=dtype).element_size()
    scratch = torch.randn(max(nbytes // esz, 1)).to(dtype)
    ok = cpu is not None and cpu.all_reduce_floor(scratch)
    flags = torch.tensor([0.0 if ok else 1.0], dtype=torch.float64)
    dist.all_reduce(flags, group=comm.gloo_group)       # every rank runs it, or none
    if flags.item():
        return None
    # before each run the reductions get numbers again, not the garbage of the last run
    return _slowest_best(comm, scratch.normal_, lambda: cpu.all_reduce_floor(scratch), reps)


def _slowest_best(comm, prepare, run, reps: int) -> float:
    """Seconds of `run()` started on every rank at once (after `prepare()` and a barrier): each
    rank's best of `reps`, the slowest rank's of those (a collective call on every rank)."""
    best = float("inf")
    for _ in range(reps):
        prepare()
        dist.barrier(group=comm.gloo_group)
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    t = torch.tensor([best], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=comm.gloo_group)
    return float(t.item())


def _check_fixed_shares(comm, cfg: Config, lanes: list[str]) -> None:
    if cfg.shares and any(k not in lanes for k in cfg.shares):
        from ..errors import MisuseError
        raise MisuseError(f"--shares {format_shares(cfg.shares)}: lanes "
                          f"{[k for k in cfg.shares if k not in lanes]} are not usable here "
                          f"(usable: {lanes}; unavailable: {comm.unavailable}); `braid topo` says why")


def _say_header(comm, cfg: Config, info: dict, lanes: list[str], baseline: str, say) -> None:
    """The lines above the tables: machine, notes, world, lanes (and why others are off), baseline."""
    say(header_line("bench", info))
    if not comm.cuda and os.environ.get("RANK") is not None:
        say(NO_GPU_LINE)
    for note in cfg.notes:
        say(f"note: {note}")
    unavailable = {k: v for k, v in comm.unavailable.items() if comm.wanted is None or k in comm.wanted}
    say(f"world {comm.world_size} ranks | dtype {cfg.dtype} | iters {cfg.iters} warmup {cfg.warmup} repeat {cfg.repeat} | "
        f"braid lanes: {', '.join(lanes) or 'none'}"
        + (f" (unavailable: {'; '.join(f'{k}: {v}' for k, v in unavailable.items())})" if unavailable else "")
        + f" | baseline: {baseline}")


def _sweep(comm, cfg: Config, plan, common: dict, info: dict, baseline: str, ui, results: list[dict]) -> int:
    """Every point of `plan`, a table per (op, hot fraction); returns the wrong bytes summed over points."""
    from ..workloads import BUS_FACTOR, make
    r0 = comm.rank == 0
    dtype = getattr(torch, cfg.dtype)
    esz = torch.empty(0, dtype=dtype).element_size()
    bad, current = 0, None
    table: list[dict] = []      # rank 0: the current table's points (its summary is over them)
    for op, nbytes, hot in plan:
        if (op, hot) != current:
            if r0:
                ui.end_op()
                ui.start_op(op, _table_title(op, nbytes, hot, cfg, comm.world_size, info), baseline)
            current, table = (op, hot), []
            others = alternatives.statuses(comm, op, dtype)
            if r0 and others:
                ui.line("# other baselines: " + "; ".join(
                    f"{k}: {'timed beside ' + baseline if not v else 'unavailable (' + v + ')'}" for k, v in others.items()))
        if r0:
            ui.status(f"{op} {'skewed' if nbytes is None else human_bytes(nbytes)}")
        too_big = _too_big_for_host(comm, op, nbytes, esz) if nbytes is not None else ""
        if too_big:
            if r0:
                ui.line(f"# {human_bytes(nbytes)}: not run: {too_big}")
                ui.advance()
            continue
        if nbytes is None:
            load = make(comm, op, 0, dtype, hot_nbytes=cfg.hot_bytes, cold_nbytes=cfg.cold_bytes)
        else:
            load = make(comm, op, nbytes, dtype, hot_fraction=hot)
        first = _first_calls(comm, load)
        wrong = _count_wrong(comm, load) if cfg.check else None
        alts = _prepare_alternatives(comm, op, nbytes, dtype) if nbytes is not None else {}
        comm.last_handle = None
        t_base, t_braid, common["host_us"] = _time_point(comm, cfg, load, alts)
        got = _lane_views(comm, load)
        # a CPU all_reduce reads each input byte and writes each output byte at least once: it
        # cannot beat one copy of its tensor on every rank at once, which bounds its ratio
        cpu_ar = not comm.cuda and op == "all_reduce" and nbytes is not None and hot is None
        copy_us = copy_seconds(comm, load.nbytes) * 1e6 if cpu_ar else None
        # ...and it cannot beat its own copies and reductions with every wait taken out
        floor_s = floor_seconds(comm, load.nbytes, dtype) if cpu_ar else None
        if r0:
            point = _point(op, load, esz, cfg.dtype, comm.world_size, t_braid, t_base, wrong, got,
                           baseline, BUS_FACTOR[op](comm.world_size), common, first)
            if copy_us is not None:
                point["copy_us"] = copy_us
                point["ratio_bound"] = t_base / copy_us
            if floor_s is not None:
                point["floor_us"] = floor_s * 1e6
                point["ratio_floor"] = t_base / point["floor_us"]
            _add_alternatives(point, alts, baseline, t_base, t_braid)
            _record(comm, cfg, point, hot, ui, results, table)
        bad += wrong or 0
        del load
    return bad


def host_memory_free(root: str = "/") -> int | None:
    """Bytes this host (or the memory cgroup this process runs in, if smaller) can still give:
    /proc/meminfo's MemAvailable and the cgroup's limit less its usage (page cache it can drop not
    counted as used), v2 or v1, the files read under `root`. None where neither can be read."""
    free = []
    try:
        with open(os.path.join(root, "proc/meminfo")) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free.append(int(line.split()[1]) << 10)
    except (OSError, ValueError, IndexError):
        pass
    for limit_f, usage_f, stat_f, cache_key in (
            ("memory.max", "memory.current", "memory.stat", "inactive_file"),
            ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat", "total_inactive_file")):
        limit_f, usage_f, stat_f = (os.path.join(root, "sys/fs/cgroup", f) for f in (limit_f, usage_f, stat_f))
        try:
            with open(limit_f) as f:
                raw = f.read().strip()
            if raw == "max" or int(raw) >= 1 << 60:     # no limit
                continue
            with open(usage_f) as f:
                used = int(f.read().strip())
            try:
                with open(stat_f) as f:
                    stat = dict(line.split() for line in f if line.strip())
                used -= int(stat.get(cache_key, 0))
            except (OSError, ValueError):
                pass
            free.append(max(int(raw) - used, 0))
        except (OSError, ValueError):
            continue
    return min(free) if free else None


def _too_big_for_host(comm, op: str, nbytes: int, esz: int) -> str:
    """Why a CPU point cannot run on this host's memory ("" where it can, and on GPUs): every
    rank of the one host holds the point's buffers at once (`workloads.footprint`), and a point
    past what the host can give would have a rank killed by the kernel instead of an answer.
    Rank 0 decides for every rank (a collective call over gloo)."""
    from .. import envs
    from ..workloads import footprint
    if comm.cuda or not comm.single_node:
        return ""
    need = comm.world_size * footprint(op, nbytes, comm.world_size, esz)
    free = None
    if comm.rank == 0:
        cap = envs.get("BRAID_BENCH_HOST_MEMORY_GB")
        free = int(cap * (1 << 30)) if cap > 0 else host_memory_free()
    t = torch.tensor([need, -1 if free is None else free], dtype=torch.float64)
    dist.broadcast(t, 0, group=comm.gloo_group)
    need, free = t.tolist()
    if free < 0 or need <= 0.8 * free:
        return ""
    return (f"its buffers need about {human_bytes(need)} of host memory on {comm.world_size} ranks "
            f"(braid's, the baseline's and the check's) and the host can give {human_bytes(free)} "
            f"(BRAID_BENCH_HOST_MEMORY_GB sets what it may use)")


def _table_title(op: str, nbytes: int | None, hot: float | None, cfg: Config, world: int, info: dict) -> str:
    title = f"{op}  world {world}  {info['machine']}"
    if nbytes is None:
        title += f"  hot 0->1 {human_bytes(cfg.hot_bytes)}, cold {human_bytes(cfg.cold_bytes)}"
    if hot is not None:
        title += f"  hot fraction {hot:g} to rank {world - 1}"
    return title


def _first_calls(comm, load) -> dict[str, float]:
    """Run the baseline and braid once each, the first calls of the point's shape (before any
    warm-up), and return each one's host time in us, the slowest rank's: {"baseline", "braid"}.
    braid's includes preparing the shape (agreement, plan, GPU program); the baseline's whatever
    its library does on a first call. Each call is entered as a timed window is (GPU work
    drained, then a gloo barrier) and drained after, so nothing of the previous work or of the
    other side's call is counted; the clock runs from entering the call to its return."""
    mine = []
    for fn in (load.baseline, load.braid):
        _sync(comm)
        dist.barrier(group=comm.gloo_group)
        t0 = time.perf_counter()
        fn()
        mine.append((time.perf_counter() - t0) * 1e6)
        _sync(comm)
    t = torch.tensor(mine, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=comm.gloo_group)
    base, braid = t.tolist()
    return {"baseline": base, "braid": braid}


def _count_wrong(comm, load) -> int:
    """The bytes where braid's output differs from the baseline's, summed over the ranks (after
    `_first_calls` ran each once)."""
    return _sum_over_ranks(comm, load.wrong() if load.participates else 0)


def _prepare_alternatives(comm, op: str, nbytes: int, dtype) -> dict[str, dict]:
    """name -> {"status": "ok", "prepared": ...} or {"status": "unavailable"/"failed", "why": ...}
    for every other baseline of `op`. Every rank prepares; a failure on any rank fails it on all
    (agreed over gloo), so no rank times a call its peers skip."""
    out: dict[str, dict] = {}
    for alt in alternatives.for_op(op):
        why = alt.why_not(comm, dtype)
        if why:
            out[alt.name] = {"status": "unavailable", "why": why}
            continue
        err, prepared = "", None
        try:
            prepared = alt.prepare(comm, nbytes, dtype)
            prepared.run()
            prepared.copy_in()
            _sync(comm)
            err = prepared.check()          # a baseline whose output is wrong is not timed
        except Exception as exc:      # noqa: BLE001  reported in the table and the JSON
            err = f"{type(exc).__name__}: {exc}"[:300]
        failed = [None] * comm.world_size
        dist.all_gather_object(failed, err, group=comm.gloo_group)
        bad = [f"rank {r}: {e}" for r, e in enumerate(failed) if e]
        out[alt.name] = {"status": "failed", "why": bad[0]} if bad else {"status": "ok", "prepared": prepared}
    return out


def _add_alternatives(point: dict, alts: dict[str, dict], baseline: str, t_base: float, t_braid: float) -> None:
    """The JSON fields of the other baselines, and the best baseline of the point (the fastest
    of NCCL's call and every alternative that ran; copy-in not counted, reported beside)."""
    best_name, best_us = baseline, t_base
    fields = {}
    for name, a in alts.items():
        if a["status"] != "ok":
            fields[name] = {"status": a["status"], "why": a["why"]}
            continue
        fields[name] = {"status": "ok", "time_us": a["time_us"], "copy_in_us": a["copy_in_us"],
                        "ratio": a["time_us"] / t_braid}
        if a["time_us"] < best_us:
            best_name, best_us = name, a["time_us"]
    if fields:
        point["alternatives"] = fields
    point["best_baseline"] = {"name": best_name, "time_us": best_us}
    point["ratio_best"] = best_us / t_braid


def _time_point(comm, cfg: Config, load, alts: dict | None = None) -> tuple[float, float, dict[str, float]]:
    """(baseline us, braid us, {side: host us}) per call: alternating windows, slowest rank. The
    other baselines that can run are timed in the same windows (their times go into `alts`)."""
    from .. import calibrate as cal
    iters, rounds = cfg.iters, cfg.repeat
    if cfg.auto_iters:
        # small calls: time enough of them that each measurement spans >= ~20 ms, in at least
        # SMALL_ROUNDS shorter windows alternating baseline and braid (and which goes first):
        # host-bound small calls drift with the machine's load, and many short alternating
        # windows let both sides see the same quiet moments
        probe = cal.time_call(comm, load.baseline, 3, cfg.warmup)
        iters = max(cfg.iters, min(2000, int(20_000 / max(probe, 1.0))))
        if iters > cfg.iters:
            rounds = max(cfg.repeat, SMALL_ROUNDS)
            iters = max(cfg.iters, iters * cfg.repeat // rounds)
    bases, braids, hosts = [], [], {"braid": [], "baseline": []}
    ready = {k: a for k, a in (alts or {}).items() if a["status"] == "ok"}
    alt_t: dict[str, list] = {k: [] for k in ready}
    copy_t: dict[str, list] = {k: [] for k in ready}
    for k in range(rounds):
        first_base = k % 2 == 0
        for is_base in ((True, False) if first_base else (False, True)):
            side = "baseline" if is_base else "braid"
            t, host = cal.time_call_host(comm, load.baseline if is_base else load.braid, iters, cfg.warmup)
            (bases if is_base else braids).append(t)
            hosts[side].append(host)
        for name, a in ready.items():
            alt_t[name].append(cal.time_call_host(comm, a["prepared"].run, iters, cfg.warmup)[0])
            copy_t[name].append(cal.time_call_host(comm, a["prepared"].copy_in, iters, cfg.warmup)[0])
    # large calls: the best of the repeats; small ones (many alternating windows): each side's
    # median window, so one lucky quiet window does not decide the ratio
    pick = statistics.median if rounds >= SMALL_ROUNDS else min
    for name, a in ready.items():
        a["time_us"], a["copy_in_us"] = pick(alt_t[name]), pick(copy_t[name])
        del a["prepared"]
    return pick(bases), pick(braids), {k: statistics.median(v) for k, v in hosts.items()}


def _lane_views(comm, load) -> list:
    """Every rank's (shares, lane times) of its last timed braid call; None where it took no part."""
    handle = comm.last_handle if load.participates else None
    # a multi-node world's call ran as steps (node steps on braid's lanes, rail steps): which where
    steps = [list(x) for x in getattr(handle, "steps", [])] if handle is not None else []
    mine = (handle.shares, handle.lane_times_us(), steps) if handle is not None else None
    got = [None] * comm.world_size
    dist.all_gather_object(got, mine, group=comm.gloo_group)
    return got


def _record(comm, cfg: Config, point: dict, hot: float | None, ui, results: list[dict],
            table: list[dict]) -> None:
    """Rank 0: the point's extra fields, its table row, and the JSON so far. Every point of the
    table carries the table's host summary over its points so far (`host_summary`): the JSON
    stays a list of points, and the last point's summary is the one printed under the table."""
    if hot is not None:
        point["hot_fraction"] = hot
    if point["op"] == "all_to_all_single" and comm.last_route is not None:
        # the router's prediction for the last skewed call: routed vs NCCL's (us)
        point["route_predicted_us"] = {"routed": comm.last_route[0], "native": comm.last_route[1],
                                       "host": comm._routed.host_time_us()}
    table.append(point)
    summary = host_summary(table)
    for p in table:
        if summary is None:
            p.pop("host_summary", None)
        else:
            p["host_summary"] = summary
    results.append(point)
    ui.row(point)
    ui.advance()
    if cfg.json_path:
        write_json(cfg.json_path, results)


def _point(op, load, esz, dtype, world, t_braid, t_base, wrong, got, baseline, factor, common,
           first: dict[str, float] | None = None) -> dict:
    """One row of the JSON: braid's and the baseline's times and bandwidths, shares, lane times
    (slowest rank), the host time of each side's first call of the shape (`first`), and the
    run's common fields."""
    views = [g for g in got if g is not None]
    shares = views[0][0] if views else {}
    lane_us: dict[str, float] = {}
    for _, times, _ in views:
        for k, v in times.items():
            lane_us[k] = max(lane_us.get(k, 0.0), v)
    algbw = load.algbytes / t_braid / 1e3
    base_alg = load.algbytes / t_base / 1e3
    point = {"op": op, "nbytes": load.nbytes, "count": load.nbytes // esz, "algbytes": load.algbytes,
             "world_size": world, "dtype": dtype, "time_us": t_braid, "algbw_gbps": algbw,
             "busbw_gbps": algbw * factor, "wrong": wrong, "shares": shares,
             "lane_time_us": lane_us,
             "baseline": {"name": baseline, "time_us": t_base, "algbw_gbps": base_alg, "busbw_gbps": base_alg * factor},
             "ratio": t_base / t_braid}
    host = common.get("host_us")
    if host:      # per call, the median window's, slowest rank: braid's and the baseline's own
        point["host_us"] = host["braid"]
        point["baseline"]["host_us"] = host["baseline"]
    if first:     # the first call of the shape, once, before warm-up: not in host_us
        point["first_call_us"] = first["braid"]
        point["baseline"]["first_call_us"] = first["baseline"]
    if views and views[0][2]:
        point["steps"] = [{"step": a, "ran_on": b, "bytes": c} for a, b, c in views[0][2]]
    if any(v[0] != shares for v in views):
        point["shares_by_rank"] = [g[0] if g is not None else None for g in got]
    point.update({k: v for k, v in common.items() if k not in point and k != "host_us"})
    return point
