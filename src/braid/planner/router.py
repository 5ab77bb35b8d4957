"""The router: spread a traffic matrix over every path so the most loaded link is as light as
possible (NIMBLE's min-congestion planner). Pure python, no torch.

Model. A topology is a set of directed links with capacities (GB/s) and, for every ordered pair of
GPUs, candidate paths: direct NVLink, through one intermediate GPU (relay, never two), host-staged
(PCIe out, host memory, PCIe in), and across nodes rail-matched NICs (a GPU reaches the NIC of rail
k through the GPU that owns it, over NVLink). A link's load is the bytes routed over it times the
path's use of it; its time is load / capacity. The plan minimises the largest link time, which is
the collective's time when every link runs at capacity.

Solver: Frank-Wolfe on a soft maximum of the link times, i.e. exponential link weights
exp(alpha * time / max time) as in multiplicative-weights (Garg-Koenemann) methods. Each round
sends every demand to its cheapest path under those weights (all-or-nothing) and moves the plan
toward that by a line search; alpha grows each round. Rejected: slice-by-slice greedy with a
max-link path cost plus rip-up-and-reroute (stuck at 1.17x the optimum on dense matrices). tests/test_router.py checks the
result against the exact linear-program optimum over the same candidate paths.

Policies. Demands below `min_split_bytes` take their single best path (NIMBLE: multipath off at or
below 1 MB). `Router.plan()` keeps the previous plan when a new matrix has the same coarse
signature (each demand rounded to a power of two), so a slightly different matrix reuses it, and
caches plans by that signature.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Path:
    kind: str                                  # "direct", "relay", "host", "rail"
    links: tuple[tuple[str, float], ...]       # (link id, bytes of this link per byte routed)
    via: tuple[int, ...] = ()                  # relay GPUs / rail index

    def name(self) -> str:
        return self.kind + ("" if not self.via else ":" + ",".join(map(str, self.via)))


@dataclass
class Topology:
    name: str
    num_gpus: int
    capacity: dict[str, float]                 # link id -> GB/s
    paths: dict[tuple[int, int], list[Path]] = field(default_factory=dict)
    source: str = ""                           # where the constants come from

    def candidates(self, s: int, d: int) -> list[Path]:
        return self.paths[(s, d)]


# -------------------------------------------------------------------------------------------------
# topologies
# -------------------------------------------------------------------------------------------------

def nvswitch(n: int, nvlink_gbps: float = 390.0, pcie_gbps: float = 53.0, host_gbps: float | None = None,
             relays: bool = True, name: str | None = None, source: str = "") -> Topology:
    """n GPUs on an NVSwitch: every GPU has one NVLink port out and one in; PCIe to host memory."""
    cap: dict[str, float] = {}
    for g in range(n):
        cap[f"nv_out{g}"] = nvlink_gbps
        cap[f"nv_in{g}"] = nvlink_gbps
        cap[f"d2h{g}"] = pcie_gbps
        cap[f"h2d{g}"] = pcie_gbps
    host_gbps = host_gbps or pcie_gbps * n
    cap["host_mem"] = host_gbps                  # staged bytes cross host memory twice: weight 2
    topo = Topology(name or f"nvswitch{n}", n, cap, source=source)
    for s in range(n):
        for d in range(n):
            if s == d:
                continue
            ps = [Path("direct", ((f"nv_out{s}", 1.0), (f"nv_in{d}", 1.0)))]
            if relays:
                ps += [Path("relay", ((f"nv_out{s}", 1.0), (f"nv_in{m}", 1.0), (f"nv_out{m}", 1.0), (f"nv_in{d}", 1.0)), (m,))
                       for m in range(n) if m not in (s, d)]
            ps.append(Path("host", ((f"d2h{s}", 1.0), ("host_mem", 2.0), (f"h2d{d}", 1.0))))
            topo.paths[(s, d)] = ps
    return topo


def mesh(n: int, pair_gbps: float = 120.0, pcie_gbps: float = 50.0, host_gbps: float | None = None,
         name: str | None = None, source: str = "") -> Topology:
    """n GPUs wired directly to each other (a link per ordered pair), plus PCIe to host memory."""
    cap: dict[str, float] = {}
    for a in range(n):
        cap[f"d2h{a}"] = pcie_gbps
        cap[f"h2d{a}"] = pcie_gbps
        for b in range(n):
            if a != b:
                cap[f"nv{a}-{b}"] = pair_gbps
    cap["host_mem"] = host_gbps or pcie_gbps * n
    topo = Topology(name or f"mesh{n}", n, cap, source=source)
    for s in range(n):
        for d in range(n):
            if s == d:
                continue
            ps = [Path("direct", ((f"nv{s}-{d}", 1.0),))]
            ps += [Path("relay", ((f"nv{s}-{m}", 1.0), (f"nv{m}-{d}", 1.0)), (m,)) for m in range(n) if m not in (s, d)]
            ps.append(Path("host", ((f"d2h{s}", 1.0), ("host_mem", 2.0), (f"h2d{d}", 1.0))))
            topo.paths[(s, d)] = ps
    return topo


def multi_node(nodes: int, gpus_per_node: int = 8, nics: int = 8, nic_gbps: float = 50.0,
               nvlink_gbps: float = 390.0, name: str | None = None, source: str = "") -> Topology:
    """`nodes` NVSwitch nodes; NIC k of a node belongs to GPU k * gpus_per_node // nics. Inside a
    node: direct and one-relay NVLink paths. Across nodes: one path per rail k (rail-matched: NIC k
    to NIC k), reaching the rail's owner GPU over NVLink when the endpoint is another GPU."""
    n = nodes * gpus_per_node
    cap: dict[str, float] = {}
    for g in range(n):
        cap[f"nv_out{g}"] = nvlink_gbps
        cap[f"nv_in{g}"] = nvlink_gbps
    for a in range(nodes):
        for k in range(nics):
            cap[f"nic_tx{a}.{k}"] = nic_gbps
            cap[f"nic_rx{a}.{k}"] = nic_gbps
    topo = Topology(name or f"{nodes}x{gpus_per_node}gpu-{nics}nic", n, cap, source=source)

    def owner(node: int, k: int) -> int:
        return node * gpus_per_node + k * gpus_per_node // nics

    for s in range(n):
        for d in range(n):
            if s == d:
                continue
            sa, da = s // gpus_per_node, d // gpus_per_node
            if sa == da:
                ps = [Path("direct", ((f"nv_out{s}", 1.0), (f"nv_in{d}", 1.0)))]
                ps += [Path("relay", ((f"nv_out{s}", 1.0), (f"nv_in{m}", 1.0), (f"nv_out{m}", 1.0), (f"nv_in{d}", 1.0)), (m,))
                       for m in range(sa * gpus_per_node, (sa + 1) * gpus_per_node) if m not in (s, d)]
            else:
                ps = []
                for k in range(nics):
                    links: list[tuple[str, float]] = []
                    o_s, o_d = owner(sa, k), owner(da, k)
                    if o_s != s:
                        links += [(f"nv_out{s}", 1.0), (f"nv_in{o_s}", 1.0)]
                    links += [(f"nic_tx{sa}.{k}", 1.0), (f"nic_rx{da}.{k}", 1.0)]
                    if o_d != d:
                        links += [(f"nv_out{o_d}", 1.0), (f"nv_in{d}", 1.0)]
                    ps.append(Path("rail", tuple(links), (k,)))
            topo.paths[(s, d)] = ps
    return topo


def preset(name: str, nodes: int = 1, nics: int = 8) -> Topology:
    """Topologies by name: the machines measured here and synthetic ones."""
    if name == "h200x2":
        return nvswitch(2, 390.0, 53.0, 136.0, name=name,
                        source="HARDWARE.md 2026-11-22: copy engine 387-396 GB/s, PCIe pair 53, host total 136 (2 GPUs)")
    if name == "h200x4":
        return nvswitch(4, 390.0, 53.0, 163.0, name=name,
                        source="HARDWARE.md 2026-11-22: copy engine 389-396 GB/s, PCIe 53-55, host total 163 (4 GPUs)")
    if name == "mesh4":
        return mesh(4, 120.0, 50.0, name=name, source="NIMBLE testbed: 120 GB/s direct per pair (REFERENCE.md)")
    if name.startswith("nvswitch") and name[8:].isdigit():
        return nvswitch(int(name[8:]), name=name, source="H200-class NVLink 390 GB/s, PCIe 53 GB/s")
    if name == "multinode":
        return multi_node(nodes, 8, nics, source="8 GPUs per node, 400 Gb/s (50 GB/s) NICs")
    raise ValueError(f"unknown topology {name!r}: h200x2, h200x4, mesh4, nvswitch8, nvswitch16, multinode")


# -------------------------------------------------------------------------------------------------
# the solver
# -------------------------------------------------------------------------------------------------

@dataclass
class RoutePlan:
    topology: str
    flows: dict[tuple[int, int], list[tuple[Path, int]]]   # demand -> (path, bytes)
    link_load: dict[str, float]                            # link -> bytes (weighted)
    max_load_us: float                                     # the most loaded link's time
    plan_time_us: float

    def link_time_us(self, capacity: dict[str, float]) -> dict[str, float]:
        return {e: b / (capacity[e] * 1e3) for e, b in self.link_load.items()}

    def to_dict(self) -> dict:
        return {
            "topology": self.topology, "max_load_us": self.max_load_us, "plan_time_us": self.plan_time_us,
            "flows": [{"src": s, "dst": d, "paths": [{"path": p.name(), "bytes": b} for p, b in fl]}
                      for (s, d), fl in sorted(self.flows.items())],
        }


def route(topo: Topology, matrix: list[list[int]], iters: int = 120, alpha: float = 10.0,
          min_split_bytes: int = 1 << 20, patience: int = 12, min_iters: int = 30) -> RoutePlan:
    """Min-congestion routing of matrix[s][d] bytes over the topology's candidate paths.

    Frank-Wolfe on a soft maximum of the link times (the multiplicative-weights view: a link's
    weight is exp(alpha * time / max time)): each round, every demand's cheapest path under those
    weights gets the demand (all-or-nothing), and the plan moves toward that by the step that
    minimises the soft maximum at the current sharpness (a line search on the true maximum stalls
    where two links tie). The sharpness grows each round, so the plan approaches the true min-max.
    Vectorised with numpy: one round is a few matrix products."""
    import numpy as np
    t0 = time.perf_counter()
    names = list(topo.capacity)
    index = {e: i for i, e in enumerate(names)}
    inv_cap = np.array([1.0 / (topo.capacity[e] * 1e3) for e in names])       # us per byte
    demands = [(s, d, int(matrix[s][d])) for s in range(len(matrix)) for d in range(len(matrix))
               if s != d and matrix[s][d] > 0]
    out: dict[tuple[int, int], list[tuple[Path, int]]] = {}
    if not demands:
        return RoutePlan(topo.name, out, {e: 0.0 for e in names}, 0.0, (time.perf_counter() - t0) * 1e6)
    paths: list[Path] = []
    owner: list[int] = []
    for k, (s, d, _) in enumerate(demands):
        for p in topo.candidates(s, d):
            paths.append(p)
            owner.append(k)
    owner_a = np.array(owner)
    inc = np.zeros((len(paths), len(names)))          # us of each link per byte on each path
    for r, p in enumerate(paths):
        for e, w in p.links:
            inc[r, index[e]] += w * inv_cap[index[e]]
    nd = len(demands)
    width = max(np.bincount(owner_a, minlength=nd))
    slot = np.full((nd, width), -1)
    fill = np.zeros(nd, dtype=int)
    for r, k in enumerate(owner):
        slot[k, fill[k]] = r
        fill[k] += 1
    valid = slot >= 0
    slot_safe = np.where(valid, slot, 0)
    bytes_ = np.array([float(b) for _, _, b in demands])
    small = bytes_ <= min_split_bytes

    def all_or_nothing(costs: np.ndarray) -> np.ndarray:
        per = np.where(valid, costs[slot_safe], np.inf)
        best = slot[np.arange(nd), per.argmin(axis=1)]
        y = np.zeros(len(paths))
        y[best] = bytes_
        return y

    x = all_or_nothing(inc.sum(axis=1))               # start: each demand on its fastest path alone
    fixed_small = small.any()
    gammas = np.linspace(0.0, 1.0, 65)
    best_top, stale = math.inf, 0
    for it in range(iters):
        t = x @ inc
        top = t.max()
        if top <= 0:
            break
        if top < best_top * (1 - 1e-4):
            best_top, stale = top, 0
        else:
            stale += 1
            if stale >= patience and it >= min_iters:
                break                               # converged at this sharpness: stop early
        a = min(alpha * (1.0 + it / 10.0), 400.0)      # smooth first, sharper toward the true max
        g = np.exp(a * (t / top - 1.0))
        y = all_or_nothing(inc @ g)
        if fixed_small:                               # small demands keep one path (no multipath <= 1 MB)
            y = np.where(small[owner_a], x, y)
        ty = y @ inc

        def soft(gs: np.ndarray) -> np.ndarray:
            # line search on the soft maximum (log-sum-exp at the current sharpness): the true max
            # is flat where two links tie, which stalls the method; the soft one is not
            z = a * (((1 - gs)[:, None] * t[None, :] + gs[:, None] * ty[None, :]) / top - 1.0)
            zmax = z.max(axis=1)
            return zmax + np.log(np.exp(z - zmax[:, None]).sum(axis=1))

        scores = soft(gammas)
        k = int(scores.argmin())
        if k == 0:
            gammas_fine = np.linspace(0.0, gammas[1], 33)
            k2 = int(soft(gammas_fine).argmin())
            if k2 == 0:
                continue
            gamma = gammas_fine[k2]
        else:
            gamma = gammas[k]
        x = (1 - gamma) * x + gamma * y
    # integer bytes per path, summing exactly to each demand
    for k, (s, d, b) in enumerate(demands):
        rows = [r for r in slot[k] if r >= 0]
        items = sorted(((paths[r], x[r]) for r in rows if x[r] > 0.5), key=lambda kv: -kv[1])
        ints, acc = [], 0
        for j, (p, v) in enumerate(items):
            n = b - acc if j == len(items) - 1 else int(round(v))
            n = max(0, min(n, b - acc))
            acc += n
            if n:
                ints.append((p, n))
        out[(s, d)] = ints
    exact = {e: 0.0 for e in names}
    for fl in out.values():
        for p, n in fl:
            for e, w in p.links:
                exact[e] += n * w
    max_us = max((exact[e] / (topo.capacity[e] * 1e3) for e in names), default=0.0)
    return RoutePlan(topo.name, out, exact, max_us, (time.perf_counter() - t0) * 1e6)


def direct_only(topo: Topology, matrix: list[list[int]]) -> float:
    """The most loaded link's time (us) when every demand takes its first (direct) path."""
    load = {e: 0.0 for e in topo.capacity}
    for s in range(len(matrix)):
        for d in range(len(matrix)):
            if s != d and matrix[s][d]:
                for e, w in topo.candidates(s, d)[0].links:
                    load[e] += matrix[s][d] * w
    return max(load[e] / (topo.capacity[e] * 1e3) for e in load)


def signature(matrix: list[list[int]]) -> tuple:
    """Coarse signature: each demand rounded to a power of two (plans are reused within it)."""
    return tuple(tuple(0 if b <= 0 else int(math.log2(b)) for b in row) for row in matrix)


class Router:
    """Plans with a cache keyed by (topology, coarse signature of the matrix)."""

    def __init__(self, topo: Topology, **kwargs):
        self.topo = topo
        self.kwargs = kwargs
        self.cache: dict[tuple, RoutePlan] = {}

    def plan(self, matrix: list[list[int]]) -> tuple[RoutePlan, bool]:
        """(plan, cache hit). A hit returns the plan made for a matrix of the same signature."""
        key = signature(matrix)
        hit = self.cache.get(key)
        if hit is not None:
            return hit, True
        made = route(self.topo, matrix, **self.kwargs)
        if len(self.cache) > 256:
            self.cache.clear()
        self.cache[key] = made
        return made, False
