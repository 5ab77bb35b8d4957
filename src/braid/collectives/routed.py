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

    # Online correction of the second lane's port capacity from routed calls' lane times: a
    # ratio of finish times beyond HYSTERESIS moves the scale by its square root (at most 2x per
    # step), in quanta of 2^(1/8), within [1/4, 1]: the calibrated capacity is the ceiling. Lane
    # times alone pushed more onto the host lane than it could take (4 x H200, 256 MiB h = 0.7:
    # the host share rose from 0.08 to 0.12 while calls slowed from ~1530 to ~2040 us, cycles
    # that then declined routing); below the calibration they follow a busy PCIe down and back.
    HYSTERESIS = 1.15
    SCALE_RANGE = (0.25, 1.0)

    # Learned corrections of the two predictions the decision compares, per shape class of the
    # matrix (size of the busiest port, skew): a call's measured cycle (start to the next call's
    # start on the caller's stream, the slowest rank's; see comm._Cycle) over its prediction, for
    # routed calls and for native ones. 4 x H200, 2026-11-22, h = 0.7 at 256 MiB: predicted routed
    # 1967 us / NCCL 1772, measured 1557 / 2471, so the raw model declined a call that routing ran
    # 1.57x faster. A cycle can only be too long (work between calls, a late peer), so a class's
    # correction is the least ratio of its last FIX_WINDOW samples, used once it has FIX_MIN.
    #
    # Only steady calls are samples: the previous skewed call took the same side in the same
    # class, and this one did not solve its plan. A routed call between native ones read 2692 us
    # where routed calls in a row came every ~1550 (4 x H200, 256 MiB, h = 0.7), and native calls
    # right after routed ones read up to 2.9x their prediction: one side draining into the other.
    # So the side not in use is measured in TRIAL-call blocks (its first call is the change-over,
    # the rest are samples): first once the side in use has its samples, where the class has none
    # of the other (of routing only when the model puts it within EXPLORE of native), then again
    # after RECHECK calls of the class, the gap doubling while the verdict holds (a clear loss,
    # beyond CLOSE, waits at least RECHECK_FAR).
    EXPLORE = 1.5
    CLOSE = 1.3
    TRIAL = 4
    TRIES = 2
    RECHECK = (64, 1024)
    RECHECK_FAR = 256
    IN_FLIGHT = 8
    MEMO = 8
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
        self.last_cold = False                  # the last plan() solved afresh (no cache hit)
        # the last few matrices' router results and braid Plans: a repeated matrix (fixed shapes,
        # the bench, an MoE layer's dispatch and combine in turn) skips the router's reuse check and
        # the plan build (~200 us of ~290 on 4 GPUs; 155 us per call of an MoE layer that kept one)
        self._memo: dict[tuple, list] = {}
        self.agreed_host_us: float | None = None  # a value for every class (tests, reports without a class)
        self.pcie_scale = 1.0                   # agreed correction of the second lane's capacity
        self.samples: dict[tuple, dict[str, list[float]]] = {}   # class -> {"r"|"n": measured/predicted}
        self._classes: dict[tuple, dict] = {}   # class -> trial state (see _state)
        self.last_pred: tuple | None = None     # ("r"|"n", class, raw predicted us) of the last decision
        self.steady = False                     # the last decision's call is a sample (see above)
        self.sample_limit = 1                   # observations in flight wanted for it (see plan)
        self._sampling = False
        self._prev: tuple | None = None         # (side, class) of the previous skewed call
        self._before: tuple | None = None
        self.in_flight: dict[int, tuple] = {}   # seq -> ("r"|"n", class, raw prediction) being timed

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

    def report(self, lane_obs: list | None) -> dict:
        """This rank's part of the next descriptor: its host time, and [seq, lane times] of each
        observed call that has finished here (oldest first; None or [] before)."""
        rep = {"rhost": self.host_us, "robs": lane_obs or None}
        if self._host_cls is not None:
            rep["rcls"] = list(self._host_cls)
        return rep

    def wants_sample(self, in_flight: int) -> bool:
        """Time the call just decided? A steady call, while fewer than sample_limit are timed."""
        return self.last_pred is not None and self.steady and in_flight < self.sample_limit

    def expect(self, seq: int) -> None:
        """The caller times the call just decided (a steady one) as observation `seq`."""
        self.in_flight[seq] = self.last_pred

    def agree(self, descs: list, names: dict[str, str]) -> list[int]:
        """Fold every rank's report into the agreed state. Returns the observations learned (their
        seqs: every rank reported them in this call), which the caller then drops."""
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
        if not obs or any(not o for o in obs):
            return []
        per_rank = [{int(seq): times for seq, times in o} for o in obs]
        common = sorted(set.intersection(*(set(p) for p in per_rank)))
        for seq in common:
            slowest: dict[str, float] = {}
            for p in per_rank:
                for lane, t in p[seq].items():
                    slowest[lane] = max(slowest.get(lane, 0.0), float(t))
            pred = self.in_flight.pop(seq, None)
            cycle = slowest.pop("cycle", None)
            if (pred is None or pred[0] == "r") and slowest:
                self.learn_lanes(slowest, names)
            if pred is not None and cycle is not None:
                self.learn_time(pred[0], pred[1], cycle, pred[2])
        return common

    def learn_time(self, kind: str, cls: tuple, measured_us: float, predicted_us: float) -> None:
        """Keep one agreed observation (kind "r": a routed call's cycle, "n": a native call's)
        as the class's ratio measured / predicted."""
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

    # the decision ------------------------------------------------------------------------------
    def begin(self) -> None:
        """A skewed call starts its routing decision (plan() may not follow: then the call is
        neither side, and the next one is not steady)."""
        self._before, self._prev = self._prev, None
        self.last_pred = None
        self.steady = False

    def _state(self, cls: tuple) -> dict:
        st = self._classes.get(cls)
        if st is None:
            if len(self._classes) > 256:
                self._classes.clear()
            st = self._classes[cls] = {"trial": None, "tries": {"r": 0, "n": 0}, "since": 0,
                                       "gap": self.RECHECK[0], "verdict": None}
        return st

    def _busy(self, kind: str, cls: tuple) -> bool:
        """Observations of this side and class still being timed (a trial waits for them)."""
        return any(p is not None and p[0] == kind and p[1] == cls for p in self.in_flight.values())

    def _choose(self, st: dict, cls: tuple, fix: dict, routed_us: float, native_us: float) -> str:
        """The side for this call: a trial in progress, else the faster prediction, or a trial of
        the other side when one is due."""
        trial = st["trial"]
        self._sampling = trial is not None
        if trial is not None:
            trial[1] -= 1
            if trial[1] <= 0:
                st["trial"] = None
            return trial[0]
        verdict = "r" if routed_us < 0.97 * native_us else "n"
        if st["verdict"] is not None and verdict != st["verdict"]:
            st["gap"], st["since"] = self.RECHECK[0], 0          # it changed: look again soon
        st["verdict"] = verdict
        other = "n" if verdict == "r" else "r"
        if other not in fix and st["tries"][other] < self.TRIES and verdict in fix and (
                other == "n" or routed_us < self.EXPLORE * native_us):
            due, first = True, True           # the side in use is measured, this one never, and may win
        else:
            if other == "r" and routed_us >= self.CLOSE * native_us:
                st["gap"] = max(st["gap"], self.RECHECK_FAR)      # far from winning: look less often
            st["since"] += 1
            due, first = st["since"] >= st["gap"], False
        if due and not self._busy(other, cls):
            if first:
                st["tries"][other] += 1
            else:
                st["gap"] = min(2 * st["gap"], self.RECHECK[1])
            st["since"] = 0
            st["trial"] = [other, self.TRIAL - 1]
            self._sampling = True
            return other
        return verdict

    def plan(self, matrix: list[list[int]], device_type: str, costs: dict[str, LaneCost],
             native_cost: LaneCost | None, force: bool) -> tuple[Plan | None, float, float]:
        """(plan or None, predicted us routed, predicted us for the native all_to_all). None when
        routing is not predicted to beat the native call by 3% and no trial of it is due (unless
        `force`)."""
        if self._before is None and self._prev is not None:
            self.begin()                      # the caller did not call begin() first
        before, self._before = self._before, None
        router = self.router(device_type, costs)
        self.last_pred = None
        if router is None:
            return None, 0.0, 0.0
        cls = self.last_cls = shape_class(matrix)
        fix = self.fix(cls)
        native_raw = native_time_us(matrix, native_cost) if native_cost is not None else float("inf")
        native_us = native_raw * fix.get("n", 1.0)
        host = self.host_time_us(cls)
        st = self._state(cls)

        self._sampling = False

        def native(routed_us: float):
            self.last_pred = ("n", cls, native_raw)
            self.steady = before == ("n", cls)
            self._prev = ("n", cls)
            self._limit("n", fix)
            return None, routed_us, native_us

        if not force and math.isfinite(native_raw) and "r" not in fix and st["trial"] is None \
                and host >= 0.97 * native_us:
            # the host alone is predicted to lose and no routed call of this class was measured:
            # no solve, unless a trial of routing is due now
            if self._choose(st, cls, fix, host, native_us) == "n":
                return native(host)
            st["trial"][1] += 1                # _choose counted this call; it continues below
        mt = tuple(map(tuple, matrix))
        memo = self._memo.get(mt)
        if memo is not None and memo[0] is router:
            rp, built = memo[1], memo[2]          # a recent matrix again: no router, no rebuild
            self.last_cold = False
        else:
            rp, hit = router.plan(matrix)
            self.last_cold = not hit
            built = None
            if len(self._memo) >= self.MEMO:
                self._memo.pop(next(iter(self._memo)))
            self._memo[mt] = memo = [router, rp, None]
        names = PATH_LANE[device_type]
        lat = max(costs[names["direct"]].latency_us, costs[names["host"]].latency_us)
        gpu_raw = rp.max_load_us + lat + MULTI_LANE_OVERHEAD_US
        # measured cycles hold whatever bounds a routed call (GPU, host, peers); before there are
        # any, the host runs ahead of the GPU while a call's GPU time exceeds its host time, and
        # below that calls come no faster than the host posts them
        routed_us = gpu_raw * fix["r"] if "r" in fix else max(gpu_raw, host)
        if not force and math.isfinite(native_raw):
            if self._choose(st, cls, fix, routed_us, native_us) == "n":
                return native(routed_us)
        if built is None:
            built = memo[2] = build_plan(matrix, rp.flows, names)
        self.last_pred = ("r", cls, gpu_raw)
        self.steady = before == ("r", cls) and not self.last_cold
        self._prev = ("r", cls)
        self._limit("r", fix)
        return built, routed_us, native_us

    def _limit(self, kind: str, fix: dict) -> None:
        """How many observations may be in flight when this call is timed: every steady call of a
        trial or of a side without its samples; one at a time otherwise (each costs two timing
        events and a query per call, ~60 us of host time on 4 x H200)."""
        self.sample_limit = self.IN_FLIGHT if self._sampling or kind not in fix else 1


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

