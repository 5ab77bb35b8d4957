"""The flow model: byte streams over links of fixed capacity, sharing them max-min fairly.

A `Flow` moves `nbytes` along a set of links, using `w` bytes of link capacity per byte moved
(a host-staged multicast crosses host memory once to stage and once per reader, so its weight on
that link is 1 + readers). It starts `start_us + latency_us` after time zero: the latency is the
fixed cost of the flow's chunk pipeline (per-step synchronisation, filling the first slot), paid
once before bytes move at the flow's rate. A flow may also carry an engine cap (`cap_gbps`): the
most a single pipeline can move alone, whatever the links allow (a store-and-forward relay with
one chunk in flight, NCCL's kernels reaching 70 % of a link).

A flow may wait for others (`after`, names of flows): it becomes ready `latency_us` after the
last of them finishes (and not before `start_us`). That is a CUDA stream's order (a copy queued
behind the previous one on its stream) and a counter wait (a peer's pull of piece k waits for that
peer's reduction of piece k), so a pipeline of pieces runs as the flows it is made of.

Rates are max-min fair (progressive filling): every active flow's rate rises together until a link
is full or a flow reaches its cap; flows through that link freeze; repeat. When a flow finishes or
a new one starts, the rates are solved again (event-driven, so a flow that finishes early gives
its share to the others). So a chunk pipeline of S steps costs S * per-step latency plus its bytes
over its share of the bottleneck link, which is the model the simulator needs and nothing finer.

Rejected: packet- or chunk-level simulation (slow in Python at 1024 GPUs, and the published
figures we reproduce are bandwidths of long transfers, which a fluid model gets right); a fixed
share per lane independent of the others (misses lanes that meet on one link, such as PCIe shared
by the host lane and a NIC).

Units: bytes, microseconds, GB/s with 1 GB/s = 1e3 bytes per microsecond. Pure Python.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Callable

BYTES_PER_US = 1e3   # 1 GB/s in bytes per microsecond


@dataclass(frozen=True)
class Flow:
    name: str
    nbytes: float
    links: tuple[tuple[str, float], ...]          # (link, bytes of that link per byte of the flow)
    latency_us: float = 0.0
    cap_gbps: float = math.inf
    start_us: float = 0.0
    group: str = ""                               # the lane (or op phase) it belongs to
    after: tuple[str, ...] = ()                   # names of flows that must finish before it starts

    @property
    def ready_us(self) -> float:
        return self.start_us + self.latency_us


@dataclass
class FlowResult:
    finish_us: list[float]
    flows: list[Flow]
    link_bytes: dict[str, float] = field(default_factory=dict)

    @property
    def makespan_us(self) -> float:
        return max(self.finish_us, default=0.0)

    def group_finish_us(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for f, t in zip(self.flows, self.finish_us):
            out[f.group] = max(out.get(f.group, 0.0), t)
        return out


def max_min_rates(capacity: dict[str, float], flows: list[Flow]) -> list[float]:
    """Max-min fair rates (GB/s) of flows that all want to send now (weighted progressive filling).

    Every unfrozen flow gets the same rate x; x rises until a link saturates or a flow hits its
    cap; the flows through a saturated link (or the capped flow) freeze at x."""
    n = len(flows)
    rates = [0.0] * n
    frozen = [False] * n
    touched = {e for f in flows for e, _ in f.links}
    used = {e: 0.0 for e in touched}
    remaining = n
    while remaining:
        weight = {e: 0.0 for e in touched}
        for i, f in enumerate(flows):
            if not frozen[i]:
                for e, w in f.links:
                    weight[e] += w
        x = math.inf
        for e, w in weight.items():
            if w > 0:
                x = min(x, max(0.0, capacity[e] - used[e]) / w)
        for i, f in enumerate(flows):
            if not frozen[i]:
                x = min(x, f.cap_gbps)
        eps = 1e-9 * max(1.0, x) if x != math.inf else 0.0
        tight = {e for e, w in weight.items() if w > 0 and max(0.0, capacity[e] - used[e]) / w <= x + eps}
        capped = {i for i, f in enumerate(flows) if not frozen[i] and f.cap_gbps <= x + eps}
        if x == math.inf:          # flows on no link with no cap: infinitely fast (local)
            for i in range(n):
                if not frozen[i]:
                    rates[i], frozen[i] = math.inf, True
            break
        for i, f in enumerate(flows):
            if frozen[i]:
                continue
            if i in capped or any(e in tight for e, _ in f.links):
                rates[i] = x
                frozen[i] = True
                remaining -= 1
                for e, w in f.links:
                    used[e] += w * x
    return rates


def simulate(capacity: dict[str, float], flows: list[Flow],
             capacity_of: Callable[[list[Flow]], dict[str, float]] | None = None) -> FlowResult:
    """Run the flows to completion; finish time of each (us). Links missing from `capacity` are
    an error: a flow over an unknown link is a bug in the caller's topology. A flow with `after`
    starts `latency_us` after the last of those flows finishes (never before its `start_us`);
    the names it waits on must be unique among the flows. `capacity_of`, where given, gives the
    capacities while a set of flows is active (a link whose rate depends on what else runs: a GPU's
    NVLink port that both sends and receives); `capacity` is then the set of known links.
    Kept whole (83 lines): the event loop's rate assignment, next event and progress share the
    active set and its per-link counts."""
    for f in flows:
        for e, _ in f.links:
            if e not in capacity:
                raise KeyError(f"flow {f.name!r} uses link {e!r}, not in the topology")
    index: dict[str, int] = {}
    dupes: set[str] = set()
    for i, f in enumerate(flows):
        if f.name in index:
            dupes.add(f.name)
        index[f.name] = i
    waits = [0] * len(flows)                      # unfinished flows each one waits for
    dependents: list[list[int]] = [[] for _ in flows]
    for i, f in enumerate(flows):
        for name in f.after:
            if name not in index or name in dupes:
                raise KeyError(f"flow {f.name!r} waits for {name!r}, "
                               f"{'not a flow' if name not in index else 'a name used twice'}")
            dependents[index[name]].append(i)
            waits[i] += 1
    left = [float(f.nbytes) for f in flows]
    finish = [math.nan] * len(flows)
    link_bytes = {e: 0.0 for e in capacity}
    for f in flows:
        for e, w in f.links:
            link_bytes[e] += w * f.nbytes
    ready = [f.ready_us if not f.after else math.nan for f in flows]
    pending = sorted((i for i in range(len(flows)) if waits[i] == 0), key=lambda i: ready[i])

    def done(i: int, at: float) -> None:
        finish[i] = at
        for j in dependents[i]:
            waits[j] -= 1
            if waits[j] == 0:
                ready[j] = max(flows[j].start_us, at) + flows[j].latency_us
                bisect.insort(pending, j, key=lambda k: ready[k])

    t = 0.0
    active: list[int] = []
    while pending or active:
        while pending and ready[pending[0]] <= t + 1e-9:
            i = pending.pop(0)
            if left[i] <= 0:
                done(i, max(t, ready[i]))
            else:
                active.append(i)
        if not active:
            if not pending:
                break
            t = ready[pending[0]]
            continue
        now = [flows[i] for i in active]
        rates = max_min_rates(capacity_of(now) if capacity_of else capacity, now)
        # time to the next event: a finish, or the next start
        dt = math.inf
        for i, r in zip(active, rates):
            dt = min(dt, 0.0 if r == math.inf else left[i] / (r * BYTES_PER_US) if r > 0 else math.inf)
        if pending:
            dt = min(dt, ready[pending[0]] - t)
        if dt == math.inf:
            raise RuntimeError("flows cannot progress: a link of zero capacity?")
        still, ended = [], []
        for i, r in zip(active, rates):
            left[i] -= (math.inf if r == math.inf else r * BYTES_PER_US * dt)
            if left[i] <= 1e-6 * max(1.0, flows[i].nbytes):
                ended.append(i)
            else:
                still.append(i)
        active = still
        t += dt
        for i in ended:
            done(i, t)
    if any(math.isnan(x) for x in finish):
        stuck = [flows[i].name for i in range(len(flows)) if math.isnan(finish[i])][:3]
        raise RuntimeError(f"flows wait for each other in a cycle: {stuck}")
    return FlowResult(finish, list(flows), link_bytes)


# -------------------------------------------------------------------------------------------------
# chunk pipelines
# -------------------------------------------------------------------------------------------------

def pipeline_rate_gbps(stage_gbps: list[float], window: int, chunk_bytes: float,
                       per_op_us: float = 0.0) -> float:
    """Steady rate of a store-and-forward chunk pipeline (a relay: write into a bounded buffer on
    another GPU, then forward) with `window` chunks in flight.

    Each chunk passes every stage in turn (stage i takes chunk / rate_i) and pays `per_op_us` of
    control (handshakes) once; with W chunks in flight the pipeline moves W chunks per chunk
    round trip (Little's law), and never more than its slowest stage:
        rate = min(min_i rate_i, W * chunk / (sum_i chunk / rate_i + per_op_us)).
    With W >= number of stages and no control cost this is the slowest stage; with W = 1 the
    stages never overlap and the rate is the harmonic sum."""
    if window < 1 or chunk_bytes <= 0 or not stage_gbps:
        raise ValueError(f"pipeline needs window >= 1, chunk > 0 and a stage, got {window}, {chunk_bytes}, {stage_gbps}")
    round_trip_us = sum(chunk_bytes / (r * BYTES_PER_US) for r in stage_gbps) + per_op_us
    return min(min(stage_gbps), window * chunk_bytes / round_trip_us / BYTES_PER_US)


def step_pipeline_us(num_steps: int, step_bytes: float, rate_gbps: float, latency_us: float,
                     num_stages: int = 1, slot_bytes: float = math.inf) -> float:
    """A step-synchronous ring lane alone: each of `num_steps` steps pays its latency, fills a
    `num_stages`-stage slot pipeline (one slot crosses the extra stages before the last one
    drains) and then moves its bytes at `rate_gbps`:
        step = latency + (stages - 1) * min(bytes, slot) / rate + bytes / rate."""
    if step_bytes <= 0:
        return 0.0
    fill = (num_stages - 1) * min(step_bytes, slot_bytes)
    return num_steps * (latency_us + (fill + step_bytes) / (rate_gbps * BYTES_PER_US))
