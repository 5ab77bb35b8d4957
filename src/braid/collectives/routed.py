"""Skewed all_to_all: every demand gets its own mix of lanes, from the router's plan.

A share-based split gives every pair of ranks the same fractions (say ce 0.9, host 0.1). For a
skewed matrix that is wrong both ways: the hot pair should offload as much as its PCIe path can
take, while the quiet pairs gain nothing from a second lane and only pay its setup. The router
(planner/router.py) solves exactly that: it spreads the matrix over each pair's candidate paths so
the most loaded link is as light as possible. Here its plan becomes a braid Plan:

    path kind  ->  lane              (GPU)     (CPU)
    direct          the NVLink lane   ce        shm
    host            the second lane   host      gloo
    relay:v         relay, via v      relay     relay     (build_plan(relay=True); run by
                                                            Communicator.run_plan)

Each demand's bytes are cut in path order into contiguous pieces (boundaries on 4 KiB pages), so
the destination receives every byte once, in place, whatever lane carried it.

The topology comes from the calibrated lane costs of all_to_all_single on this machine: a balanced
all_to_all of S bytes per rank moves S (w-1)/w through each GPU's port in time S / bw, so a port's
capacity is bw (w-1)/w; the second lane likewise. Relays are left out on a switch (they never
lower the most loaded link there; the router drops them anyway).
"""
from __future__ import annotations

import math
import statistics

from ..planner.model import MULTI_LANE_OVERHEAD_US, LaneCost
from ..planner.plan import LaneKind, Plan, Transfer, all_to_all_movement
from ..planner.router import Router, nvswitch

PATH_LANE = {"cuda": {"direct": "ce", "host": "host"}, "cpu": {"direct": "shm", "host": "gloo"}}
ALIGN = 4096


class RoutedAllToAll:
    """Per-communicator state: the topology built from lane costs, and a Router (plan cache with
    hysteresis) per topology."""

    # Host time of one routed call (planning, posting every piece on every lane), before any was
    # measured: ~1.2 ms per call on 4 x H200 (scripts/profile_call.py, MoE at 64 MiB/rank,
    # 2026-11-22), ~n^2 pieces: 75 us x n^2. A call whose GPU time is shorter than this is bound
    # by the host, which the byte model alone does not see.
    HOST_US_PER_PAIR = 75.0
    HOST_WINDOW = 8
    PROBE_EVERY = 8
    PROBE_MAX_GAP = 1024

    # Online correction of the second lane's port capacity from routed calls' lane times: a
    # ratio of finish times beyond HYSTERESIS moves the scale by its square root (at most 2x per
    # step), in quanta of 2^(1/8), within [1/4, 8].
    HYSTERESIS = 1.15
    SCALE_RANGE = (0.25, 8.0)

    # Learned corrections of the two predictions the decision compares, per shape class of the
    # matrix (size of the busiest port, skew): a call's measured cycle (start to the next call's
    # start on the caller's stream, the slowest rank's; see comm._Cycle) over its prediction, for
    # routed calls and for native calls that routing declined. 4 x H200, 2026-11-22, h = 0.7 at
    # 256 MiB: predicted routed 1967 us / NCCL 1772, measured 1557 / 2471, so the raw model
    # declined a call that routing ran 1.57x faster. A cycle can only be too long (work between
    # calls, a late peer), so a class's correction is the least ratio of its last FIX_WINDOW
    # samples, used once it has FIX_MIN. A class without them is explored (routed anyway, at
    # most EXPLORE_CALLS times) when the prediction is within EXPLORE of native; later declines
    # within CLOSE of native are re-checked by the backing-off probes.
    EXPLORE = 1.5
    EXPLORE_CALLS = 4
    CLOSE = 1.3
    FIX_RANGE = (0.25, 4.0)
    FIX_WINDOW = 6
    FIX_MIN = 2

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._routers: dict[tuple, Router] = {}
        self.host_us: float | None = None       # this rank's host time per routed call (median)
        self._host_seen: dict[tuple, list[float]] = {}   # per shape class (see host_time_us)
        self._host_cls: tuple | None = None     # the class host_us is of
        self.agreed_host: dict[tuple, float] = {}
        self.last_cls: tuple | None = None      # the shape class of the last planned matrix
        self._host_declines = 0                 # calls declined for host time alone since the last probe
        self._probe_gap = self.PROBE_EVERY      # declines before the next probe (doubles, capped)
        self.last_cold = False                  # the last plan() solved afresh (no cache hit)
        # the last matrix's router result and braid Plan: a repeated matrix (fixed shapes, the
        # bench) skips the router's reuse check and the plan build (~200 us of ~290 on 4 GPUs)
        self._memo: list | None = None
        self.agreed_host_us: float | None = None  # a value for every class (tests, reports without a class)
        self.pcie_scale = 1.0                   # agreed correction of the second lane's capacity
        self.samples: dict[tuple, dict[str, list[float]]] = {}   # class -> {"r"|"n": measured/predicted}
        self._explored: dict[tuple, int] = {}   # class -> calls routed to measure it
        self.last_pred: tuple | None = None     # ("r"|"n", class, raw predicted us) of the last decision
        self.obs_pred: tuple | None = None      # the same for the observed call (set by the caller)

    # Every decision below must come out the same on every rank: they read only agreed state
    # (`agree`, fed with the exchanged descriptors), never this rank's own measurements.
    def host_time_us(self, cls: tuple | None = None) -> float:
        """The agreed host time of a routed call of this shape class. Per class, because a
        measured host time also holds back-pressure: where the GPU is the bottleneck the host
        waits for it inside the call (4 x H200, 2026-11-22: 6.2 ms "host" time per call at 1 GiB,
        which then declined every 256 MiB call when one value served all sizes)."""
        if cls is None:
            cls = self.last_cls
        got = self.agreed_host.get(cls) if cls is not None else None
        if got is not None:
            return got
        if self.agreed_host_us is not None:
            return self.agreed_host_us
        return self.HOST_US_PER_PAIR * self.world_size ** 2

    def _probe_due(self) -> bool:
        """Count a decline for host time; True when this call should be routed anyway."""
        self._host_declines += 1
        if self._host_declines < self._probe_gap:
            return False
        self._host_declines = 0
        self._probe_gap = min(2 * self._probe_gap, self.PROBE_MAX_GAP)
        return True

    def observe_host(self, us: float, cold: bool = False, cls: tuple | None = None) -> None:
        """This rank's routed call's host time (route + post): the lower median of the last
        HOST_WINDOW calls, reported to the others in the next descriptor (`report`). A median, not
        a running mean: the first call of a plan also solves it and opens the peers' buffers
        (4 x H200, 2026-11-22: a mean still read 3.6 ms per call after calls that took 1.5 ms
        end to end, and routing was declined on it)."""
        if cold:          # this call solved its plan or opened peers' buffers: not the steady cost
            return
        seen = self._host_seen.setdefault(cls, [])
        seen.append(us)
        del seen[:-self.HOST_WINDOW]
        if len(self._host_seen) > 64:
            self._host_seen = {cls: seen}
        self.host_us = statistics.median_low(seen)
        self._host_cls = cls

    def report(self, lane_obs) -> dict:
        """This rank's part of the next descriptor: its host time, and (seq, lane times) of an
        observed routed call once that call has finished here (None before)."""
        rep = {"rhost": self.host_us, "robs": lane_obs}
        if self._host_cls is not None:
            rep["rcls"] = list(self._host_cls)
        return rep

    def agree(self, descs: list, names: dict[str, str]) -> bool:
        """Fold every rank's report into the agreed state. Returns True when a lane observation
        was learned (every rank reported the same observed call): the caller then drops it."""
        reps = [d for d in descs if d is not None and d.get("rhost") is not None]
        if reps:
            classes = {tuple(d["rcls"]) if d.get("rcls") is not None else None for d in reps}
            if len(classes) == 1:                # every rank's value is of the same class
                cls = classes.pop()
                if cls is None:
                    self.agreed_host_us = max(d["rhost"] for d in reps)
                else:
                    if len(self.agreed_host) > 64:
                        self.agreed_host.clear()
                    self.agreed_host[cls] = max(d["rhost"] for d in reps)
        obs = [d.get("robs") for d in descs if d is not None]
        if not obs or any(o is None for o in obs) or len({o[0] for o in obs}) != 1:
            return False
        slowest: dict[str, float] = {}
        for _, times in obs:
            for lane, t in times.items():
                slowest[lane] = max(slowest.get(lane, 0.0), float(t))
        pred, self.obs_pred = self.obs_pred, None
        cycle = slowest.pop("cycle", None)
        if (pred is None or pred[0] == "r") and slowest:
            self.learn_lanes(slowest, names)
        if pred is not None and cycle is not None:
            self.learn_time(pred[0], pred[1], cycle, pred[2])
        return True

    def learn_time(self, kind: str, cls: tuple, measured_us: float, predicted_us: float) -> None:
        """Keep one agreed observation (kind "r": a routed call's GPU time, "n": a native call's
        time) as the class's ratio measured / predicted."""
        if measured_us <= 0.0 or predicted_us <= 0.0:
            return
        lo, hi = self.FIX_RANGE
        seen = self.samples.setdefault(cls, {}).setdefault(kind, [])
        seen.append(min(max(measured_us / predicted_us, lo), hi))
        del seen[:-self.FIX_WINDOW]

    def fix(self, cls: tuple) -> dict[str, float]:
        """The class's corrections in use: the least ratio of the recent samples, per kind that
        has enough of them."""
        got = self.samples.get(cls, {})
        return {k: min(v) for k, v in got.items() if len(v) >= self.FIX_MIN}

    def learn_lanes(self, times: dict[str, float], names: dict[str, str]) -> None:
        """Move the second lane's capacity scale toward equal finish times of the two lanes
        (slowest rank's time per lane). A second lane that carried nothing is probed back up one
        quantum per observation while its scale is below 1, so it can return."""
        direct, second = times.get(names["direct"], 0.0), times.get(names["host"], 0.0)
        lo, hi = self.SCALE_RANGE
        if direct <= 0.0:
            return
        if second <= 0.0:
            if self.pcie_scale < 1.0:
                self.pcie_scale = _quantize(self.pcie_scale * 2 ** 0.125)
            return
        r = direct / second               # > 1: the second lane finished first, give it more
        if 1.0 / self.HYSTERESIS <= r <= self.HYSTERESIS:
            return
        step = min(max(r ** 0.5, 0.5), 2.0)
        self.pcie_scale = min(max(_quantize(self.pcie_scale * step), lo), hi)

    def router(self, device_type: str, costs: dict[str, LaneCost]) -> Router | None:
        names = PATH_LANE[device_type]
        direct, second = costs.get(names["direct"]), costs.get(names["host"])
        if direct is None or second is None:
            return None
        w = self.world_size
        port = lambda c: c.bw_gbps * (w - 1) / w                      # noqa: E731
        pcie = port(second) * self.pcie_scale
        key = (device_type, round(port(direct), 3), round(pcie, 3))
        r = self._routers.get(key)
        if r is None:
            if len(self._routers) > 32:
                self._routers.clear()
            topo = nvswitch(w, nvlink_gbps=port(direct), pcie_gbps=pcie, relays=False,
                            name=f"measured-{device_type}{w}",
                            source="calibrated all_to_all_single lane costs of this machine")
            r = self._routers[key] = Router(topo)
        return r

    def plan(self, matrix: list[list[int]], device_type: str, costs: dict[str, LaneCost],
             native_cost: LaneCost | None, force: bool) -> tuple[Plan | None, float, float]:
        """(plan or None, predicted us routed, predicted us for the native all_to_all). None when
        routing is not predicted to beat the native call by 3% (unless `force`)."""
        router = self.router(device_type, costs)
        self.last_pred = None
        if router is None:
            return None, 0.0, 0.0
        cls = self.last_cls = shape_class(matrix)
        fix = self.fix(cls)
        native_raw = native_time_us(matrix, native_cost) if native_cost is not None else float("inf")
        native_us = native_raw * fix.get("n", 1.0)
        if math.isfinite(native_raw):
            self.last_pred = ("n", cls, native_raw)
        # a decline for host time alone is re-checked now and then by routing anyway (otherwise an
        # estimate that is too high is never measured again): after PROBE_EVERY declines, then
        # twice as many after each probe that did not change the verdict, so a size where routing
        # does lose pays for ever fewer probes (4 x H200, MoE 64 MiB: a probe every 8 calls cost
        # 30%). The counts follow agreed decisions only, so every rank probes in the same call.
        probe = False
        if not force and self.host_time_us() >= 0.97 * native_us:
            if not self._probe_due():
                return None, self.host_time_us(), native_us     # no plan can win: skip the solve
            probe = True
        mt = tuple(map(tuple, matrix))
        memo = self._memo
        if memo is not None and memo[0] is router and memo[1] == mt:
            rp, built = memo[2], memo[3]          # the same matrix again: no router, no rebuild
            self.last_cold = False
        else:
            rp, hit = router.plan(matrix)
            self.last_cold = not hit
            built = None
            self._memo = memo = [router, mt, rp, None]
        names = PATH_LANE[device_type]
        lat = max(costs[names["direct"]].latency_us, costs[names["host"]].latency_us)
        # the host runs ahead of the GPU while a call's GPU time exceeds its host time; below
        # that, calls come no faster than the host posts them
        gpu_raw = rp.max_load_us + lat + MULTI_LANE_OVERHEAD_US
        gpu_us = gpu_raw * fix.get("r", 1.0)
        routed_us = max(gpu_us, self.host_time_us())
        if not force and routed_us >= 0.97 * native_us:
            host_bound = gpu_us < 0.97 * native_us and self.host_time_us() >= 0.97 * native_us
            # explored only where the model sees the GPU, not the host, as the routed call's bound
            explore = (not host_bound and "r" not in fix and self._explored.get(cls, 0) < self.EXPLORE_CALLS
                       and gpu_us < self.EXPLORE * native_us and self.host_time_us() < 0.97 * native_us
                       and self.host_time_us() <= gpu_us)
            if explore:
                self._explored[cls] = self._explored.get(cls, 0) + 1   # measure the routed side
            elif not (host_bound or gpu_us < self.CLOSE * native_us):
                return None, routed_us, native_us
            elif not probe and not self._probe_due():
                return None, routed_us, native_us
        elif not force:
            self._probe_gap = self.PROBE_EVERY          # routing pays again: probe soon if it stops
        if built is None:
            built = memo[3] = build_plan(matrix, rp.flows, names)
        self.last_pred = ("r", cls, gpu_raw)
        return built, routed_us, native_us


def shape_class(matrix: list[list[int]]) -> tuple[int, int]:
    """A coarse class of a traffic matrix for the learned corrections: the busiest port's bytes
    (log2, rounded) and its skew (the busiest port over the mean port, in half-octaves)."""
    w = len(matrix)
    outs = [sum(row[d] for d in range(w) if d != s) for s, row in enumerate(matrix)]
    ins = [sum(matrix[s][d] for s in range(w) if s != d) for d in range(w)]
    busiest = max(outs + ins + [1])
    mean = max(sum(outs) / max(w, 1), 1.0)
    return round(math.log2(busiest)), round(2 * math.log2(max(busiest / mean, 1.0)))


def _quantize(x: float) -> float:
    return 2.0 ** (round(math.log2(x) * 8) / 8)


def native_time_us(matrix: list[list[int]], cost: LaneCost) -> float:
    """The native all_to_all's time on a skewed matrix, from its balanced calibration: it is bound
    by the busiest port (bytes leaving or entering one rank), which a balanced all_to_all of
    S per rank loads with S (w-1)/w."""
    w = len(matrix)
    out = max(sum(row[d] for d in range(w) if d != s) for s, row in enumerate(matrix))
    inn = max(sum(matrix[s][d] for s in range(w) if s != d) for d in range(w))
    busiest = max(out, inn)
    return cost.time_us(busiest * w / max(w - 1, 1))


def build_plan(matrix: list[list[int]], flows: dict, names: dict[str, str], relay: bool = False) -> Plan:
    """The router's per-demand path bytes as lane transfers: each demand cut in path order.
    Relay paths go on the `relay` lane (Transfer.via = the intermediate rank) when `relay`, else
    they fold into the direct lane."""
    mv = all_to_all_movement(matrix)
    lanes: dict[str, list[Transfer]] = {}
    for t in mv.transfers:
        d = t.dsts[0][0]
        parts = flows.get((t.src, d)) or []
        lane_bytes: list[tuple[str, int, int]] = []        # (lane, via, bytes)
        for path, nb in parts:
            if path.kind == "relay" and relay:
                lane, via = "relay", path.via[0]
            else:
                lane, via = names.get(path.kind, names["direct"]), -1
            if lane_bytes and lane_bytes[-1][:2] == (lane, via):
                lane_bytes[-1] = (lane, via, lane_bytes[-1][2] + nb)
            else:
                lane_bytes.append((lane, via, nb))
        if not lane_bytes:
            lane_bytes = [(names["direct"], -1, t.nbytes)]
        # cut points on pages, the last piece takes the rest (every byte exactly once)
        start, acc = 0, 0
        for i, (lane, via, nb) in enumerate(lane_bytes):
            acc += nb
            stop = t.nbytes if i == len(lane_bytes) - 1 else min(t.nbytes, round(acc / ALIGN) * ALIGN)
            if stop > start:
                piece = t.piece(start, stop)
                if via >= 0:
                    piece = Transfer(piece.src, piece.src_off, piece.nbytes, piece.dsts, via)
                lanes.setdefault(lane, []).append(piece)
                start = stop
    total = sum(t.nbytes for ts in lanes.values() for t in ts) or 1
    order = {k.value: i for i, k in enumerate(LaneKind)}
    shares = {k: sum(t.nbytes for t in lanes[k]) / total for k in sorted(lanes, key=lambda k: order.get(k, 99))}
    size = max((sum(row) for row in matrix), default=0)
    return Plan("all_to_all_single", len(matrix), size, shares, {k: lanes[k] for k in shares}, list(mv.local))

