"""all_reduce, all_gather and skewed all-to-all-v on N nodes x 8 GPUs (cluster presets).

Folding. Every node does the same thing (the patterns below are invariant under shifting node
numbers), so one node's links carry the same load as any other's. The simulator therefore runs a
two-node proxy: node 0 is "this node", node 1 stands for every other node at once; a demand from
node 0 to node 1 carries the bytes this node sends to all other nodes together, and the mirror
demand (node 1 to node 0) the bytes it receives. NIC, NVLink and PCIe loads of node 0 are then
exactly those of an N-node run; N enters only through the demand sizes. Planning one node's
traffic matrix is what braid would do per node.

Ops as demands (per GPU size M; NCCL-style hierarchical algorithms, pipelined, so the time is the
most loaded link's, which the flow model gives):
    all_reduce  intra-node reduce-scatter + all-gather: M/8 twice to each of 7 local peers;
                across nodes each GPU's M/8 shard is all-reduced over its rail: 2(N-1)/N * M/8
    all_gather  across nodes a rail ring: each GPU forwards (N-1) * M; inside the node every GPU
                sends N * M (its node's share of the result) to each local peer
    alltoallv   each rank sends M: `hot` of it to GPU 0 of the next node (one hot expert per
                node, the MoE case), the rest evenly to every other rank

Variants: `single` = one path per demand (direct NVLink; across nodes the destination's rail, as
NCCL with PXN); `multi` = the router over direct, relay and host-staged paths inside the node but
only the destination's rail across (multi-lane, no borrowing); `borrow` = the router with every
rail, borrowed NICs reached through a relay GPU's buffer (FuseLink's policy as paths).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..planner import checks
from ..planner.checks import MisuseError
from ..planner.router import route
from .flow import BYTES_PER_US, Flow, simulate
from .topology import SimTopology, cluster, to_router

VARIANTS = ("single", "multi", "borrow")
SCALE_OPS = ("all_reduce", "all_gather", "alltoallv")
GPUS = 8


def proxy_matrix(op: str, nodes: int, per_gpu_bytes: int, hot: float = 0.7) -> list[list[int]]:
    """The two-node proxy's traffic matrix (16 x 16) for `op` on `nodes` nodes: nodes >= 1,
    per_gpu_bytes >= 1, hot (alltoallv's share to the hot GPU) in [0, 1]."""
    checks.whole(nodes, "scale: nodes", 1)
    checks.whole(per_gpu_bytes, "scale: per_gpu_bytes", 1)
    checks.real(hot, "scale: hot", strict=False, high=1.0, hint="the share of each rank's bytes to the hot GPU")
    n2 = 2 * GPUS
    m = [[0] * n2 for _ in range(n2)]
    M = per_gpu_bytes
    w = nodes * GPUS

    def both(a: int, b: int, nbytes: float) -> None:      # this node's demand and its mirror
        m[a][b] += int(nbytes)
        m[(a + GPUS) % n2][(b + GPUS) % n2] += int(nbytes)

    for g in range(GPUS):
        for p in range(GPUS):
            if p == g:
                continue
            if op == "all_reduce":
                both(g, p, 2 * M / GPUS)
            elif op == "all_gather":
                both(g, p, nodes * M)
            elif op == "alltoallv":
                both(g, p, M * (1 - hot) / (w - 2))
        if nodes > 1:
            if op == "all_reduce":
                both(g, g + GPUS, 2 * (nodes - 1) / nodes * M / GPUS)
            elif op == "all_gather":
                both(g, g + GPUS, (nodes - 1) * M)
            elif op == "alltoallv":
                for j in range(GPUS):
                    cold = M * (1 - hot) / (w - 2) * (nodes - 1)
                    both(g, GPUS + j, cold - (M * (1 - hot) / (w - 2) if j == 0 else 0) + (M * hot if j == 0 else 0))
    if op == "alltoallv" and nodes == 1:
        raise ValueError("alltoallv at scale needs >= 2 nodes (the hot expert is on the next node)")
    return m


def algbw_bytes(op: str, nodes: int, per_gpu_bytes: int) -> float:
    return per_gpu_bytes * nodes * GPUS if op == "all_gather" else per_gpu_bytes


def bus_factor(op: str, world: int) -> float:
    return 2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world


@dataclass
class ScaleRow:
    op: str
    nodes: int
    nics: int
    variant: str
    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    path_shares: dict[str, float] = field(default_factory=dict)
    plan_cold_us: float = 0.0
    plan_cached_us: float = 0.0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


_CACHE: dict[tuple, object] = {}


def run(op: str, nodes: int, nics: int = 8, variant: str = "borrow", hot: float = 0.7,
        per_gpu_bytes: int = 256 << 20) -> ScaleRow:
    if op not in SCALE_OPS:
        raise ValueError(f"unknown op {op!r}; known: {', '.join(SCALE_OPS)}")
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")
    topo: SimTopology = cluster(2, nics)
    m = proxy_matrix(op, nodes, per_gpu_bytes, hot)
    if not any(map(any, m)):                       # the bandwidths below divide by the time
        raise MisuseError(f"scale: {per_gpu_bytes} bytes per GPU is too small for {op} on {nodes} nodes: every "
                          f"demand rounds down to 0 bytes; use a larger size")
    rt = to_router(topo, relays=variant != "single", host=variant != "single",
                   max_rails=None if variant == "borrow" else 1)
    n = len(m)
    cold = cached = 0.0
    if variant == "single":
        routed = {(s, d): [(rt.candidates(s, d)[0], m[s][d])] for s in range(n) for d in range(n)
                  if s != d and m[s][d] > 0}
    else:
        key = (topo.name, variant, tuple(map(tuple, m)))
        plan = route(rt, m)
        cold = plan.plan_time_us
        _CACHE[key] = plan
        t0 = time.perf_counter()
        plan = _CACHE[(topo.name, variant, tuple(map(tuple, m)))]
        cached = (time.perf_counter() - t0) * 1e6
        routed = plan.flows
    flows, kinds = [], {}
    for (s, d), fl in routed.items():
        for p, b in fl:
            if b > 0:
                kind = "borrowed rail" if any(e.startswith("nicrelay") for e, _ in p.links) else p.kind
                flows.append(Flow(f"{s}>{d}", b, p.links, group=kind))
                kinds[kind] = kinds.get(kind, 0) + b
    res = simulate(rt.capacity, flows)
    t = res.makespan_us
    total = sum(kinds.values()) or 1
    alg = algbw_bytes(op, nodes, per_gpu_bytes) / (t * BYTES_PER_US)
    w = nodes * GPUS
    return ScaleRow(op, nodes, nics, variant, t, alg, alg * bus_factor(op, w),
                    {k: v / total for k, v in sorted(kinds.items())}, cold, cached)


def sweep(op: str, nodes_list: list[int], nics: int = 8, hot: float = 0.7,
          variants: tuple[str, ...] = VARIANTS, per_gpu_bytes: int = 256 << 20) -> list[ScaleRow]:
    return [run(op, n, nics, v, hot, per_gpu_bytes) for n in nodes_list for v in variants]
