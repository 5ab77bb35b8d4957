"""Plans with reuse (`Router`), the coarse matrix signature it caches under, and the learned size
threshold below which a demand takes one path (`SplitThreshold`). docs/router.md, "Reuse and
hysteresis". Pure Python + numpy."""
from __future__ import annotations

import copy
import math
import time

from . import checks
from .checks import MisuseError
from .hier import hierarchical
from .paths import Topology
from .routeplan import RoutePlan
from .solver import _compiled, _Compiled, _matrix, route_flat


def signature(matrix: list[list[int]]) -> tuple:
    """Coarse signature: each demand rounded down to a power of two (the plan cache's key)."""
    return tuple(tuple(0 if b <= 0 else int(math.log2(b)) for b in row) for row in matrix)


def _signature_key(b) -> bytes:
    """signature() of whole nonnegative byte counts (flat numpy) as bytes, in two numpy calls (the
    Router's cache key): frexp's exponent of max(b, 1) is floor(log2 b) + 1, and 0 shares 1's."""
    import numpy as np
    return np.frexp(np.maximum(b, 1.0))[1].tobytes()


class SplitThreshold:
    """The size at or below which a demand takes one path (NIMBLE: multipath off at or below
    1 MB), learned from measurements.

    observe(nbytes, single_us, multipath_us) records one measured pair of times for a demand of
    nbytes. Sizes fall in power-of-two buckets (bucket k: 2**(k-1) < nbytes <= 2**k). The
    threshold is the bucket edge T = 2**k that loses the least time over the measured buckets:
        regret(T) = sum over buckets <= T of max(0, single - multi)    (multipath gain forgone)
                  + sum over buckets >  T of max(0, multi - single)    (multipath loss paid)
    with each bucket's mean times; ties keep the edge nearest the current threshold (hysteresis),
    and buckets with fewer than `min_samples` measurements do not count. With no measurements the
    threshold stays where it started."""

    def __init__(self, initial_bytes: int = 1 << 20, min_samples: int = 3,
                 lowest_bytes: int = 4 << 10, highest_bytes: int = 1 << 30):
        if not lowest_bytes <= initial_bytes <= highest_bytes:
            raise ValueError(f"initial threshold {initial_bytes} B outside [{lowest_bytes}, {highest_bytes}]")
        self.threshold_bytes = initial_bytes
        self.min_samples = min_samples
        self.lowest_bytes, self.highest_bytes = lowest_bytes, highest_bytes
        self.buckets: dict[int, list[float]] = {}    # k -> [count, sum single_us, sum multipath_us]

    @staticmethod
    def bucket(nbytes: int) -> int:
        return max(0, (int(nbytes) - 1).bit_length())

    def observe(self, nbytes: int, single_us: float, multipath_us: float) -> int:
        """Record one measurement; returns the (possibly moved) threshold in bytes."""
        if nbytes <= 0 or single_us <= 0 or multipath_us <= 0:
            raise ValueError(f"need positive bytes and times, got {nbytes} B, {single_us} us, {multipath_us} us")
        acc = self.buckets.setdefault(self.bucket(nbytes), [0, 0.0, 0.0])
        acc[0] += 1
        acc[1] += single_us
        acc[2] += multipath_us
        self.threshold_bytes = self._best()
        return self.threshold_bytes

    def _best(self) -> int:
        seen = {k: (v[1] / v[0], v[2] / v[0]) for k, v in self.buckets.items() if v[0] >= self.min_samples}
        if not seen:
            return self.threshold_bytes
        lo, hi = self.bucket(self.lowest_bytes), self.bucket(self.highest_bytes)
        here = self.bucket(self.threshold_bytes)
        best = None
        for k in range(lo, hi + 1):
            regret = sum(max(0.0, one - many) if b <= k else max(0.0, many - one) for b, (one, many) in seen.items())
            rank = (round(regret, 9), abs(k - here))
            if best is None or rank < best[0]:
                best = (rank, k)
        return 1 << best[1]


class Router:
    """Plans with reuse. `plan(matrix)` returns (plan for this matrix, hit):

    hit: an earlier plan's per-demand path fractions, rescaled to this matrix's bytes (exact
    integer bytes per path, link loads recomputed), used when its most loaded link is within
    `tolerance` of a lower bound on the optimum for this matrix. The bound is the earlier solve's
    link prices applied to the new matrix (weak duality: sum_k b_k * cheapest path price, over the
    prices' sum; no plan can do better), so a reused plan is never worse than (1 + tolerance) x
    the optimum. Candidates, in order: the plan cached under this matrix's coarse signature (each
    demand rounded down to a power of two), then the last plan returned (hysteresis: a drifting
    matrix keeps its plan until a new one would be more than `tolerance` better).
    miss: a fresh route(), cached under the signature.
    A matrix equal to the last one returns the last plan again (a copy marked reused): ~5 us.
    Every matrix is checked as route()'s is (MisuseError), on hits too: one equal to the last
    checked matrix holds the same numbers, and its cells that held 0 or 1 are looked at again for
    bools (True == 1).

    Demands at or below the learned threshold (`self.threshold`, a SplitThreshold) take one path;
    `observe()` feeds it and a threshold move empties the cache."""

    def __init__(self, topo: Topology, tolerance: float = 0.05, max_cached: int = 256,
                 threshold: SplitThreshold | None = None, **kwargs):
        if not isinstance(topo, Topology):
            raise MisuseError(f"Router: topo = {topo!r:.60} is not a Topology; build one with nvswitch(), "
                              f"mesh(), multi_node() or preset()")
        self.topo = topo
        self.tolerance = checks.real(tolerance, "Router: tolerance", strict=False,
                                     hint="how far above the optimum a reused plan may be, e.g. 0.05")
        self.max_cached = checks.whole(max_cached, "Router: max_cached", 1)
        if "min_split_bytes" in kwargs and threshold is None:
            threshold = SplitThreshold(kwargs.pop("min_split_bytes"), lowest_bytes=0)
        kwargs.pop("min_split_bytes", None)
        self.threshold = threshold or SplitThreshold()
        self.kwargs = kwargs
        self.cache: dict[bytes, RoutePlan] = {}
        self.last: RoutePlan | None = None
        # (matrix as tuples, threshold, the plan returned for it, its checked bytes, its 0/1 cells)
        self._exact: tuple | None = None
        self.hits = self.misses = 0

    def observe(self, nbytes: int, single_us: float, multipath_us: float) -> None:
        before = self.threshold.threshold_bytes
        if self.threshold.observe(nbytes, single_us, multipath_us) != before:
            self.cache.clear()
            self.last = None

    def plan(self, matrix: list[list[int]]) -> tuple[RoutePlan, bool]:
        t0 = time.perf_counter()
        # the very matrix of the last plan (fixed shapes): that plan again, a hit in microseconds
        try:
            mt = tuple(map(tuple, matrix))
        except TypeError:                          # not rows at all: the check below says so
            mt = None
        ex = self._exact
        if ex is not None and ex[2] is self.last and ex[0] == mt and ex[1] == self.threshold.threshold_bytes:
            # equal to the last checked matrix, so the same numbers, but a bool compares equal to 1 or
            # 0: its cells that hold 0 or 1 (found on the first repeat, then kept) are looked at again
            cells = ex[4]
            if cells is None:
                cells = checks.bool_cells(ex[3], self.topo.num_gpus)
            if not (cells and checks.has_bool(mt, cells)):
                again = copy.copy(ex[2])
                again.reused = True
                again.plan_time_us = (time.perf_counter() - t0) * 1e6
                self.last = again
                self._exact = (mt, ex[1], again, ex[3], cells)
                self.hits += 1
                return again, True
        plan, hit, m = self._plan(matrix, t0)
        self._exact = (mt, self.threshold.threshold_bytes, plan, m, None)
        return plan, hit

    def _plan(self, matrix, t0: float):
        if hierarchical(self.topo):
            return self._plan_hier(matrix, t0)
        c = _compiled(self.topo)
        m = _matrix(self.topo, c, matrix)
        key = _signature_key(m)
        split = self.threshold.threshold_bytes
        seen = self.cache.get(key)
        for old in (seen, self.last):
            if old is None or old.prices is None:
                continue
            plan = self._rescale(c, old, m, split, t0)
            if plan is not None:
                self.last = plan
                self.hits += 1
                return plan, True, m
            if old is self.last:
                break
        made = route_flat(self.topo, m.reshape(c.n, c.n), min_split_bytes=split, **self.kwargs)
        if made.prices is not None:                # the reuse table, paid on the miss
            self._reuse_table(c, made)
            made.plan_time_us = (time.perf_counter() - t0) * 1e6
        if len(self.cache) >= self.max_cached:
            self.cache.clear()
        self.cache[key] = made
        self.last = made
        self.misses += 1
        return made, False, m

    def _plan_hier(self, matrix, t0: float):
        """_plan for a cluster that the hierarchical planner routes: the same candidates (the plan
        under the signature, then the last), each reapplied to the new matrix (its per-GPU rail
        shares and per-node path fractions, hier.reapply) and kept when provably within
        `tolerance` of the optimum (its link prices bound the new matrix); else route_hier()."""
        from .hier import _demands, reapply, route_hier
        M = _demands(self.topo, matrix)
        m = M.ravel()
        key = _signature_key(m)
        split = self.threshold.threshold_bytes
        seen = self.cache.get(key)
        for old in (seen, self.last):
            if old is None or old.prices is None or getattr(old, "cluster", None) is None:
                continue
            plan = reapply(self.topo, old, M, split, self.tolerance, t0)
            if plan is not None:
                self.last = plan
                self.hits += 1
                return plan, True, m
            if old is self.last:
                break
        n = self.topo.num_gpus
        made = route_hier(self.topo, m.reshape(n, n), min_split_bytes=split, **self.kwargs)
        if len(self.cache) >= self.max_cached:
            self.cache.clear()
        self.cache[key] = made
        self.last = made
        self.misses += 1
        return made, False, m

    @staticmethod
    def _reuse_table(c: _Compiled, plan: RoutePlan):
        """What a reuse of `plan` needs, computed once per solve: per pair the cheapest candidate's
        price under the plan's link prices (us per byte; the bound is one product with the new
        matrix), and the fractions to apply: the plan's own, with pairs that had no demand moved
        whole to their cheapest candidate, and each pair's largest share (it takes the rounding
        remainder)."""
        import numpy as np
        table = plan.__dict__.get("_reuse")
        if table is None:
            pr = (c.cu_dense @ plan.prices).reshape(-1, c.R)
            j = pr.argmin(1)
            cheap = pr[np.arange(len(j)), j]
            frac = plan.fractions
            fresh = (frac @ np.ones(c.R)) < 0.5
            base = np.where(fresh[:, None], np.arange(c.R) == j[:, None], frac)
            table = (cheap, base, c.flat0 + base.argmax(1))
            plan.__dict__["_reuse"] = table
        return table

    def rescale(self, old: RoutePlan, m, split: int, t0: float | None = None) -> RoutePlan | None:
        """`old`'s path fractions applied to matrix m (exact bytes), or None when the result is
        not provably within `tolerance` of the optimum for m."""
        c = _compiled(self.topo)
        return self._rescale(c, old, _matrix(self.topo, c, m), split, time.perf_counter() if t0 is None else t0)

    def _rescale(self, c: _Compiled, old: RoutePlan, b, split: int, t0: float) -> RoutePlan | None:
        import numpy as np
        cheap, base, col = self._reuse_table(c, old)
        lower = float(b @ cheap)
        split_b = b * (b > split)                  # demands at or below the threshold: one path
        ints = np.floor(base * split_b[:, None])
        ints.ravel()[col] += split_b - ints @ c.ones_r
        ints[:, 0] += b - split_b
        loads = ints.ravel() @ c.cb_dense
        worst = float((loads * c.inv_cap_m).max())
        if worst > (1 + self.tolerance) * lower:
            return None
        plan = RoutePlan(self.topo.name, c, ints, loads, worst, 0.0, lower, True, old.fractions, old.prices)
        plan.__dict__["_reuse"] = old.__dict__["_reuse"]
        plan.plan_time_us = (time.perf_counter() - t0) * 1e6
        return plan
