"""`braid bench --trace CALLS [--slow LANE=FACTOR@A:B]`: the online balancer watched call by call.

Instead of the sweep, CALLS calls of one op at one size; for each, the shares braid used and every
lane's time (the slowest rank's). With --slow, calls A..B-1 run with one lane made slower: on CPU
ranks braid's shm or gloo lane is slowed by FACTOR inside braid (`comm.slowdown`); on GPUs the host
lane meets real competition, N x 256 MiB of device<->pinned-host copies on a side stream beside
each call. The table shows the balancer moving shares off the slowed lane and back.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .config import Config
from .output import print_trace, write_json


def parse_slow(text: str | None) -> tuple[str, float, int, int] | None:
    """'shm=4@10:30' -> ('shm', 4.0, 10, 30); None when not given."""
    if not text:
        return None
    try:
        lane, rest = text.split("=")
        factor, span = rest.split("@")
        a, b = span.split(":")
        return lane.strip(), float(factor), int(a), int(b)
    except ValueError:
        raise SystemExit(f"braid bench: --slow {text!r}: expected LANE=FACTOR@A:B, e.g. shm=4@10:30") from None


def _competing_copies(comm, slow):
    """On GPUs: a function that queues N x 256 MiB of D2H + H2D copies beside the caller's stream
    (the host lane's competition); None on CPUs. SystemExit for a lane that cannot be slowed."""
    if slow and comm.cuda:
        if slow[0] != "host":
            raise SystemExit("braid bench: on GPUs --slow host=N@A:B runs N x 256 MiB of competing PCIe copies "
                             "(D2H + H2D) beside each call in A..B; other GPU lanes cannot be slowed yet")
        side = torch.cuda.Stream(device=comm.device)
        dev_buf = torch.empty(256 << 20, dtype=torch.uint8, device=comm.device)
        pin_a = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()
        pin_b = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()

        def compete(copies: int) -> None:
            side.wait_stream(torch.cuda.current_stream(comm.device))
            with torch.cuda.stream(side):
                for _ in range(copies):
                    pin_a.copy_(dev_buf, non_blocking=True)
                    dev_buf.copy_(pin_b, non_blocking=True)
        return compete
    if slow and slow[0] not in ("shm", "gloo"):
        raise SystemExit("braid bench: on CPUs --slow slows the shm or gloo lane")
    return None


def run(comm, cfg: Config, info: dict):
    """Shares and lane times call by call, at one size: stage 2 of the balancer, observed."""
    from ..workloads import make
    op = cfg.ops[0]
    nbytes = cfg.sizes[0]
    slow = parse_slow(cfg.slow)
    compete = _competing_copies(comm, slow)
    load = make(comm, op, nbytes, getattr(torch, cfg.dtype))
    rows = [_traced_call(comm, load, op, nbytes, call, slow, compete, info) for call in range(cfg.trace)]
    comm.slowdown = {}
    if comm.rank == 0:
        print_trace(rows, op, nbytes, cfg.trace, comm.world_size, slow)
        if cfg.json_path:
            write_json(cfg.json_path, rows)

    def after() -> None:
        if comm.rank == 0 and cfg.plot_path:
            from .plots import plot_trace
            plot_trace(rows, cfg.plot_path, info)
    return after


def _traced_call(comm, load, op: str, nbytes: int, call: int, slow, compete, info: dict) -> dict:
    """One call of braid, slowed if `call` is in --slow's span; its row (every rank gets it)."""
    active = bool(slow and slow[2] <= call < slow[3])
    if compete is not None:
        comm.slowdown = {}
        if active:
            compete(max(1, int(slow[1])))
    else:
        comm.slowdown = {slow[0]: slow[1]} if active else {}
    t0 = time.perf_counter()
    load.braid()
    if comm.cuda:
        torch.cuda.synchronize(comm.device)
    wall_us = (time.perf_counter() - t0) * 1e6
    handle = comm.last_handle if load.participates else None
    mine = (handle.shares, handle.lane_times_us(), wall_us) if handle is not None else None
    got = [None] * comm.world_size
    dist.all_gather_object(got, mine, group=comm.gloo_group)
    views = [g for g in got if g is not None]
    lane_us: dict[str, float] = {}
    for _, times, _ in views:
        for k, v in times.items():
            lane_us[k] = max(lane_us.get(k, 0.0), v)
    return {"call": call, "op": op, "nbytes": nbytes, "world_size": comm.world_size,
            "shares": views[0][0] if views else {}, "lane_time_us": lane_us,
            "time_us": max(v[2] for v in views) if views else 0.0,
            "slowed": ({slow[0]: slow[1]} if active else {}), "machine": info.get("machine"),
            "date": info.get("date")}
