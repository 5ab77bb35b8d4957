"""The two-stage balancer: shares that keep every lane finishing together (FlexLink's idea,
generalised to any set of lanes). Pure math on measured times; no torch.

Stage 1 (calibrate): run, time each lane, move shares, repeat until the lanes' times agree.
Two rules are offered:

    flexlink_step   FlexLink's NVLink-centred rule: the anchor lane (NVLink) always keeps a share;
                    if the anchor is not the slowest, move `step` from the slowest lane to the anchor,
                    else move `step` from the anchor to the fastest other lane; halve the step when
                    the slowest lane changes (damping).
    rate_step       braid's default: estimate each lane's rate from this round (bytes it carried
                    over its time minus its fixed latency) and re-solve equal finish; damped by
                    `gain` (1 = jump straight to the solution). Where FlexLink's rule moves a fixed
                    step and needs O(1/step) rounds to cross a large error, this one converges in a
                    few rounds whatever the starting error (tests/test_balancer.py compares them on
                    the same traces).

Stage 2 (adapt online): per (op, size bucket), a window of the last calls' per-lane times. When the
window's mean spread (slowest/fastest - 1) passes `adapt_threshold`, move shares by a damped rate
step; after a move, wait `cooldown` calls (the window refills with times under the new shares)
before the next. A lane that slows down loses share within a handful of calls and wins it back
when it recovers; a spread that stays inside the threshold leaves the shares alone (hysteresis,
no oscillation).

Each bucket also learns where multi-lane stops paying: `SizeThreshold` keeps, per bucket, whether
the split beat the single lane when both were measured.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


MIN_FLEXLINK_STEP = 0.005   # without a floor, halving can stall the rule short of equilibrium


def spread(times: dict[str, float]) -> float:
    """slowest / fastest - 1 over lanes with a time (0 for one lane)."""
    vals = [t for t in times.values() if t > 0]
    if len(vals) < 2:
        return 0.0
    return max(vals) / min(vals) - 1.0


def _normalise(shares: dict[str, float], floor: float = 0.0) -> dict[str, float]:
    clipped = {k: max(v, floor) for k, v in shares.items()}
    total = sum(clipped.values())
    return {k: v / total for k, v in clipped.items()}


def flexlink_step(shares: dict[str, float], times: dict[str, float], anchor: str, step: float,
                  last_slowest: str | None = None) -> tuple[dict[str, float], float, str]:
    """One round of FlexLink's rule. Returns (new shares, new step, slowest lane)."""
    slowest = max(times, key=times.get)
    if last_slowest is not None and slowest != last_slowest:
        step = max(step / 2, MIN_FLEXLINK_STEP)
    new = dict(shares)
    if slowest != anchor:
        moved = min(step, new[slowest])
        new[slowest] -= moved
        new[anchor] = new.get(anchor, 0.0) + moved
    else:
        others = {k: t for k, t in times.items() if k != anchor}
        if others:
            fastest = min(others, key=others.get)
            moved = min(step, new[anchor] - 1e-6)
            new[anchor] -= moved
            new[fastest] = new.get(fastest, 0.0) + moved
    return _normalise(new), step, slowest


def rate_step(shares: dict[str, float], times: dict[str, float], latency_us: dict[str, float] | None = None,
              gain: float = 1.0, min_share: float = 0.0) -> dict[str, float]:
    """Re-solve equal finish from this round's per-lane rates, moving `gain` of the way there."""
    latency_us = latency_us or {}
    rates = {}
    unmeasured = {}
    for k, f in shares.items():
        t = times.get(k, 0.0) - latency_us.get(k, 0.0)
        if f <= 0:
            rates[k] = 0.0
        elif t <= 0:            # no usable measurement (time within latency, or none): keep its share
            unmeasured[k] = f
        else:
            rates[k] = f / t
    if unmeasured:
        rest = {k: v for k, v in shares.items() if k not in unmeasured}
        if not rest or not any(rates.get(k, 0.0) for k in rest):
            return dict(shares)
        kept = sum(unmeasured.values())
        sub = rate_step(_normalise(rest), {k: times.get(k, 0.0) for k in rest}, latency_us, gain, 0.0)
        merged = {**{k: v * (1 - kept) for k, v in sub.items()}, **unmeasured}
        return _normalise(merged, min_share)
    if not any(rates.values()):
        return dict(shares)
    # equal finish with latencies a_k: f_k = r_k (T - a_k), sum f_k = 1
    lat = {k: latency_us.get(k, 0.0) for k in shares}
    active = {k for k in shares if rates[k] > 0}
    while True:
        rsum = sum(rates[k] for k in active)
        finish = (1.0 + sum(rates[k] * lat[k] for k in active)) / rsum
        drop = {k for k in active if finish <= lat[k]}
        if not drop or len(active) == len(drop):
            break
        active -= drop
    target = {k: (rates[k] * (finish - lat[k]) if k in active else 0.0) for k in shares}
    target = _normalise({k: max(v, 0.0) for k, v in target.items()})
    mixed = {k: (1 - gain) * shares[k] + gain * target[k] for k in shares}
    return _normalise(mixed, min_share)


@dataclass
class Calibration:
    """Stage 1 driver: feed it each round's lane times, it answers the next shares."""
    shares: dict[str, float]
    rule: str = "rate"            # "rate" or "flexlink"
    anchor: str | None = None     # flexlink: the lane that always keeps a share
    threshold: float = 0.05       # stop when the spread stays below this ...
    stable_rounds: int = 3        # ... for this many rounds
    step: float = 0.05            # flexlink's initial step
    latency_us: dict[str, float] = field(default_factory=dict)
    rounds: int = 0
    _stable: int = 0
    _last_slowest: str | None = None

    @property
    def converged(self) -> bool:
        return self._stable >= self.stable_rounds

    def observe(self, times: dict[str, float]) -> dict[str, float]:
        self.rounds += 1
        if spread(times) <= self.threshold:
            self._stable += 1
            return self.shares
        self._stable = 0
        if self.rule == "flexlink":
            anchor = self.anchor or max(self.shares, key=self.shares.get)
            self.shares, self.step, self._last_slowest = flexlink_step(
                self.shares, times, anchor, self.step, self._last_slowest)
        else:
            self.shares = rate_step(self.shares, times, self.latency_us, gain=0.8)
        return self.shares


@dataclass
class BucketState:
    shares: dict[str, float]
    window: deque
    cooldown_left: int = 0
    moves: int = 0
    parked: dict = field(default_factory=dict)    # lane -> calls until it is tried again


class OnlineBalancer:
    """Stage 2: per (op, world, size bucket) shares that follow the lanes' measured times.

    Every rank feeds the same inputs (the slowest rank's time per lane, gathered in the call
    descriptors), so every rank computes the same shares without another message."""

    def __init__(self, window: int = 8, adapt_threshold: float = 0.10, gain: float = 0.7,
                 cooldown: int | None = None, min_share: float = 0.01, min_samples: int = 3,
                 probe_after: int = 16, probe_share: float = 0.03):
        self.probe_after = probe_after
        self.probe_share = probe_share
        self.window = window
        self.adapt_threshold = adapt_threshold
        self.gain = gain
        self.cooldown = window // 2 if cooldown is None else cooldown
        self.min_share = min_share
        self.min_samples = min_samples
        self.buckets: dict[tuple, BucketState] = {}
        self.version = 0          # bumps on every move: ranks compare it to stay in step

    @staticmethod
    def bucket(op: str, nbytes: int) -> tuple:
        return (op, max(0, int(math.log2(max(nbytes, 1)))))

    def shares(self, key: tuple) -> dict[str, float] | None:
        st = self.buckets.get(key)
        return dict(st.shares) if st is not None else None

    def start(self, key: tuple, shares: dict[str, float]) -> None:
        """Seed a bucket (from the model or the stage-1 calibration) if it has no state yet."""
        if key not in self.buckets and len(shares) > 1:
            self.buckets[key] = BucketState(dict(shares), deque(maxlen=self.window))

    def parked(self, key: tuple) -> bool:
        st = self.buckets.get(key)
        return bool(st is not None and st.parked)

    def observe(self, key: tuple, shares_used: dict[str, float], times: dict[str, float]) -> bool:
        """One call's per-lane times under `shares_used`. Returns True when the shares moved.

        Parking: a lane already held at `min_share` that still finishes more than the threshold
        after every other lane makes each call wait for it (e.g. PCIe taken by other traffic: its
        fixed costs alone exceed the others' time). It leaves the split; after `probe_after` calls
        it comes back at `probe_share` and is measured again (back to normal, it regains its share
        through the usual steps; still slow, it is parked again)."""
        st = self.buckets.get(key)
        if st is None or set(times) != set(st.shares) or shares_used != st.shares:
            return False      # a call under other shares (fixed by the user, an older plan): ignore
        if st.parked:
            for k in list(st.parked):
                st.parked[k] -= 1
                if st.parked[k] <= 0:
                    del st.parked[k]
                    keep = 1.0 - self.probe_share
                    st.shares = {**{j: v * keep for j, v in st.shares.items()}, k: self.probe_share}
                    st.window.clear()
                    st.cooldown_left = self.cooldown
                    self.version += 1
                    return True
        st.window.append(dict(times))
        if st.cooldown_left > 0:
            st.cooldown_left -= 1
            return False
        if len(st.window) < self.min_samples:
            return False
        mean = {k: sum(w[k] for w in st.window) / len(st.window) for k in st.shares}
        if spread(mean) <= self.adapt_threshold:
            return False
        new = rate_step(st.shares, mean, gain=self.gain, min_share=self.min_share)
        for k in sorted(new, key=lambda j: -mean[j]):
            others = [mean[j] for j in new if j != k]
            if (others and st.shares[k] <= self.min_share * 1.5 and new[k] <= self.min_share * 1.5
                    and mean[k] > (1 + self.adapt_threshold) * max(others)):
                del new[k]
                st.parked[k] = self.probe_after
                break
        st.shares = _normalise(new)
        st.window.clear()
        st.cooldown_left = self.cooldown
        st.moves += 1
        self.version += 1
        return True


@dataclass
class SizeThreshold:
    """Per bucket: does splitting beat the single lane? Learned from timed pairs of calls."""
    wins: dict[tuple, int] = field(default_factory=dict)
    losses: dict[tuple, int] = field(default_factory=dict)

    def record(self, key: tuple, split_us: float, single_us: float) -> None:
        if split_us < single_us:
            self.wins[key] = self.wins.get(key, 0) + 1
        else:
            self.losses[key] = self.losses.get(key, 0) + 1

    def split_pays(self, key: tuple) -> bool | None:
        w, l = self.wins.get(key, 0), self.losses.get(key, 0)
        if w + l == 0:
            return None
        return w > l

    def smallest_paying_bucket(self, op: str) -> int | None:
        """The size bucket (log2 bytes) from which splitting pays for `op`, if learned."""
        paying = sorted(b for (o, b) in set(self.wins) | set(self.losses) if o == op and self.split_pays((o, b)))
        return paying[0] if paying else None
