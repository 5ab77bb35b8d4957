"""Lane cost model and the first split: latency + bytes / bandwidth per lane, solved for equal finish.

Each lane, timed alone at an op, is summarised by `LaneCost(latency_us, bw_gbps)`: moving n bytes
of that op takes latency_us + n / bw. For a set of lanes running at once, the split that makes
them finish together at time T gives lane i the bytes (T - a_i) * b_i; T is found from
sum_i max(0, (T - a_i) b_i) = n (lanes whose latency exceeds T get nothing).

Two refinements keep it honest:
- lanes of the same link group (NCCL and the copy engines both drive NVLink) do not add up: the
  best lane of each group for the size is kept, the others get no share;
- a multi-lane split pays a fixed overhead (more launches, a host exchange); if the best single
  lane is predicted no slower, it alone is used. That is how small messages end on one lane.

Rejected: a size threshold constant for multi-lane (it differs per op, machine and lane set; the
model gives it per case, and the balancer of the next issue learns it from measurements).
"""
from __future__ import annotations

from dataclasses import dataclass

from .plan import LINK_GROUP, LaneKind

# Fixed cost of going multi-lane, in microseconds: a host-memory exchange between ranks and one
# extra stream join. Measured order on H200 (2 x H200, 2026-11-22: a write/wait round trip between two GPUs through
# host counters, ~9 us).
MULTI_LANE_OVERHEAD_US = 15.0
# Shares below this fraction are not worth a lane (its fixed costs exceed what it brings).
MIN_SHARE = 0.02


@dataclass(frozen=True)
class LaneCost:
    """latency + bytes / bandwidth on the device, never below `floor_us`: the smallest time a call
    on this lane takes end to end (host-side work such as the descriptor exchange), which hides
    behind the transfer for large messages but bounds small ones."""
    latency_us: float
    bw_gbps: float   # 1 GB/s = 1e3 bytes per microsecond
    floor_us: float = 0.0

    def time_us(self, nbytes: float) -> float:
        return max(self.floor_us, self.latency_us + nbytes / (self.bw_gbps * 1e3))

    def to_dict(self) -> dict:
        return {"latency_us": self.latency_us, "bw_gbps": self.bw_gbps, "floor_us": self.floor_us}


def fit(size_a: int, time_a_us: float, size_b: int, time_b_us: float) -> LaneCost:
    """Latency and bandwidth through two timed sizes (size_b > size_a). Clamped to sane values:
    latency >= 0.5 us, bandwidth from the larger point when the line is ill-posed."""
    if size_b <= size_a:
        raise ValueError("fit needs size_b > size_a")
    slope = (time_b_us - time_a_us) / (size_b - size_a)     # us per byte
    if slope <= 0:
        slope = time_b_us / size_b
    latency = max(0.5, time_b_us - slope * size_b)
    return LaneCost(latency, 1.0 / slope / 1e3)


# A timed size whose line to the largest size puts more than this fraction of its time in the
# fixed part was bound by the host (or a fixed cost), not by bytes: it says little about the
# bandwidth. On 2 x H200 the copy engines' all_reduce took ~480 us at 64 MiB (device time ~190
# us); the line through 64 and 512 MiB had a 317 us latency and predicted 985 us at 256 MiB
# (measured: 811), so NCCL (890) kept that size.
FIXED_FRACTION = 0.5


def fixed_bound(n: int, t_us: float, big_n: int, big_t_us: float) -> bool:
    """Is the point (n, t) dominated by fixed costs, judged by its line to (big_n, big_t)?"""
    return fit(n, t_us, big_n, big_t_us).latency_us > FIXED_FRACTION * t_us


def fit_points(floor_us: float, points: list[tuple[int, float]]) -> LaneCost:
    """The lane's line from timed (bytes, us) points, sizes ascending, the largest last: through
    the largest point and the smallest one that is not `fixed_bound`, else the largest other
    point. The floor is kept."""
    if len(points) < 2:
        raise ValueError("fit_points needs at least two timed sizes")
    big_n, big_t = points[-1]
    others = [(n, t) for n, t in points[:-1] if n < big_n]
    if not others:
        raise ValueError("fit_points needs a size below the largest")
    use = next(((n, t) for n, t in others if not fixed_bound(n, t, big_n, big_t)), others[-1])
    line = fit(use[0], use[1], big_n, big_t)
    return LaneCost(line.latency_us, line.bw_gbps, floor_us)


def equal_finish(costs: dict[str, LaneCost], nbytes: int) -> dict[str, float]:
    """Shares (fractions summing to 1) that make every lane finish at the same time."""
    if nbytes <= 0 or len(costs) == 1:
        best = min(costs, key=lambda k: costs[k].time_us(max(nbytes, 1)))
        return {best: 1.0}
    items = sorted(costs.items(), key=lambda kv: kv[1].latency_us)
    # add lanes in order of latency; T solves sum (T - a_i) b_i = n over the active ones
    active: list[tuple[str, LaneCost]] = []
    finish = 0.0
    for i, (name, cost) in enumerate(items):
        active.append((name, cost))
        rate = sum(c.bw_gbps * 1e3 for _, c in active)
        weighted = sum(c.latency_us * c.bw_gbps * 1e3 for _, c in active)
        finish = (nbytes + weighted) / rate
        nxt = items[i + 1][1].latency_us if i + 1 < len(items) else float("inf")
        if finish <= nxt:
            break
    raw = {name: max(0.0, (finish - c.latency_us) * c.bw_gbps * 1e3) for name, c in active}
    total = sum(raw.values())
    return {k: v / total for k, v in raw.items() if v > 0}


def predicted_time_us(costs: dict[str, LaneCost], shares: dict[str, float], nbytes: int) -> float:
    """The slowest lane's time for this split (each lane at least its floor), plus the
    multi-lane overhead when split."""
    slowest = max(costs[k].time_us(f * nbytes) for k, f in shares.items())
    return slowest + (MULTI_LANE_OVERHEAD_US if len(shares) > 1 else 0.0)


def choose_shares(costs: dict[str, LaneCost], nbytes: int,
                  groups: dict[str, str] | None = None) -> dict[str, float]:
    """The split braid uses for an op of `nbytes` given each lane's cost alone.

    One lane per link group (the fastest for this size), equal finish among those, tiny shares
    dropped, and the single best lane when splitting is predicted not to pay.
    """
    if not costs:
        raise ValueError("choose_shares needs at least one lane")
    groups = groups or {str(k): LINK_GROUP.get(LaneKind(k), str(k)) if k in LaneKind._value2member_map_
                        else str(k) for k in costs}
    size = max(nbytes, 1)
    best_of_group: dict[str, str] = {}
    for name, cost in costs.items():
        g = groups.get(name, name)
        if g not in best_of_group or cost.time_us(size) < costs[best_of_group[g]].time_us(size):
            best_of_group[g] = name
    pool = {name: costs[name] for name in best_of_group.values()}
    single = min(costs, key=lambda k: costs[k].time_us(size))
    shares = equal_finish(pool, size)
    while len(shares) > 1 and min(shares.values()) < MIN_SHARE:
        weakest = min(shares, key=shares.get)
        pool.pop(weakest)
        shares = equal_finish(pool, size)
    if len(shares) == 1 or predicted_time_us(costs, shares, size) >= costs[single].time_us(size):
        return {single: 1.0}
    return shares


def choose_with_native(costs: dict[str, LaneCost], nbytes: int, native: str = "nccl",
                       exclude: tuple[str, ...] = (), single_ok: bool = False,
                       margin: float = 0.03, native_share: bool = False) -> dict[str, float]:
    """The split rule on GPUs: NCCL's own call when one lane is best, else a split over the other
    lanes (copy engines + host). Measured on H200
    (bench_results/2026-11-22-h200x4-sweep-before-split-rule): NCCL's kernels inside a split run as
    batched point-to-point, slower than NCCL's own collective and than the copy engines, so NCCL is
    the single-lane choice and the copy engines the NVLink lane of a split.
    `exclude` drops lanes that cannot help this op (e.g. star-shaped broadcast beyond 2 ranks).
    `single_ok`: another lane alone may replace NCCL when it is predicted faster by `margin` (the
    reductions, where the copy engines run an algorithm of their own).
    `native_share`: the op can give NCCL's own collective a share beside the other lanes (all_reduce
    on GPUs: NCCL reduces a prefix of the tensor); such a split is taken when predicted faster than
    both NCCL alone and the other lanes' split by `margin` (the model does not see NVLink shared
    between NCCL's kernels and the copy engines: calibration corrects the shares)."""
    if native not in costs:
        return choose_shares({k: c for k, c in costs.items() if k not in exclude} or costs, nbytes)
    pool = {k: c for k, c in costs.items() if k != native and k not in exclude}
    size = max(nbytes, 1)
    if native_share and pool:
        full = choose_shares(dict(pool, **{native: costs[native]}), size)
        if len(full) > 1 and native in full:
            t_full = predicted_time_us(costs, full, size)
            rivals = [costs[native].time_us(size)]
            multi = choose_shares(pool, size)
            if len(multi) > 1 or single_ok:
                rivals.append(predicted_time_us(pool, multi, size))
            if t_full < min(rivals) * (1.0 - margin):
                return full
    if pool:
        multi = choose_shares(pool, size)
        t = predicted_time_us(pool, multi, size)
        if len(multi) > 1 and t < costs[native].time_us(size):
            return multi
        if len(multi) == 1 and single_ok and t < costs[native].time_us(size) * (1.0 - margin):
            return multi
    return {native: 1.0}
