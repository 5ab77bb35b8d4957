"""The router: spread a traffic matrix over every path so the most loaded link is as light as
possible (NIMBLE's min-congestion planner). Pure python, no torch.

Model. A topology is a set of directed links with capacities (GB/s) and, for every ordered pair of
GPUs, candidate paths: direct NVLink, through one intermediate GPU (relay, never two), host-staged
(PCIe out, host memory, PCIe in), and across nodes rail-matched NICs (a GPU reaches the NIC of rail
k through the GPU that owns it, over NVLink). A link's load is the bytes routed over it times the
path's use of it; its time is load / capacity. The plan minimises the largest link time, which is
the collective's time when every link runs at capacity.

Solver: the path LP (min tau subject to every demand split over its paths and every link's time
<= tau) by a primal-dual interior point method (Mehrotra predictor-corrector). Every demand's
block of the Newton system is eliminated in closed form, leaving one links x links system per
round (33 links for 8 GPUs on an NVSwitch), and the topology's path/link incidence is compiled
once into arrays kept on the Topology, so a call gathers rows for its nonzero demands and runs
4-8 rounds of sparse array passes. It stops when the plan is within `gap` (2%) of a lower bound
from the dual link prices (weak duality), so every plan carries a certificate (`lower_bound_us`).
Rejected: Frank-Wolfe on a soft maximum of link times with exponential (multiplicative-weights)
link weights, the previous solver: first-order, 30-120 rounds, 9-100 ms here, up to 1.05x the
optimum, and its lower bound is too loose to stop on; slice-by-slice greedy with a max-link path
cost and rip-up-and-reroute (stuck at 1.17x on dense matrices). tests/test_router.py checks every
plan against the exact LP optimum (scipy, tests only) over the same candidate paths.

Policies. Demands at or below `min_split_bytes` take their fastest path (NIMBLE: multipath off at
or below 1 MB); `SplitThreshold` moves that size from measured single-path vs multipath times.
`Router.plan()` reuses an earlier plan's path fractions, rescaled to the new matrix's exact bytes,
when the result is provably within `tolerance` (5%) of the optimum for the new matrix (the cached
link prices give the bound); candidates are the plan cached under the matrix's coarse signature
(each demand rounded down to a power of two) and the last plan (hysteresis). docs/router.md has
the measurements.
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

class _Compiled:
    """A topology's candidate paths as arrays, built once and kept on the Topology (a call only
    gathers the rows of its nonzero demands). For pair (s, d) and candidate j: `lk[s, d, j, i]` is
    the index of the path's i-th link (L = no link), `cb` that link's bytes per byte routed, `cu`
    its microseconds per byte routed. A pair with fewer than W candidates repeats its first one:
    a duplicate column changes nothing in the LP and is merged back before output."""

    def __init__(self, topo: Topology, key: tuple):
        import numpy as np
        self.key = key
        names = list(topo.capacity)
        index = {e: i for i, e in enumerate(names)}
        n, nl = topo.num_gpus, len(names)
        width = max((len(v) for v in topo.paths.values()), default=1)
        depth = max((len({e for e, _ in p.links}) for v in topo.paths.values() for p in v), default=1)
        self.names, self.n, self.L, self.W, self.K = names, n, nl, width, depth
        self.inv_cap = np.array([1.0 / (topo.capacity[e] * 1e3) for e in names])      # us per byte
        lk = np.full((n, n, width, depth), nl, dtype=np.intp)
        cb = np.zeros((n, n, width, depth))
        num = np.zeros((n, n), dtype=np.intp)
        self.paths: list[list[tuple[Path, ...]]] = [[() for _ in range(n)] for _ in range(n)]
        for (s, d), ps in topo.paths.items():
            num[s, d] = len(ps)
            self.paths[s][d] = tuple(ps)
            for j in range(width if ps else 0):
                acc: dict[int, float] = {}
                for e, w in ps[j if j < len(ps) else 0].links:
                    acc[index[e]] = acc.get(index[e], 0.0) + w
                for i, (e, w) in enumerate(acc.items()):
                    lk[s, d, j, i], cb[s, d, j, i] = e, w
        self.lk, self.cb, self.num = lk, cb, num
        self.cu = cb * np.append(self.inv_cap, 0.0)[lk]
        self.pad = np.arange(width) >= num[..., None]
        # a demand on its own: the path with the least total link time (the one-path policy's choice)
        self.fastest = np.where(self.pad, np.inf, self.cu.sum(-1)).argmin(-1)
        # dom[s, d, j]: candidate j crosses every link of the fastest path at least as heavily
        # (e.g. a relay on an NVSwitch: the same out and in ports plus two more), so bytes moved
        # from j to the fastest path take load off every link and add it nowhere
        dom = np.zeros((n, n, width), dtype=bool)
        for (s, d), ps in topo.paths.items():
            if not ps:
                continue
            h = int(self.fastest[s, d])
            home = {int(e): w for e, w in zip(lk[s, d, h], cb[s, d, h]) if e < nl}
            for j in range(len(ps)):
                if j == h:
                    continue
                mine = {int(e): w for e, w in zip(lk[s, d, j], cb[s, d, j]) if e < nl}
                dom[s, d, j] = all(mine.get(e, 0.0) >= w for e, w in home.items())
        self.dominated = dom
        sq = depth * depth
        self.pair_idx = (lk[..., :, None] * (nl + 1) + lk[..., None, :]).reshape(n, n, width, sq)
        self.pair_cu = (self.cu[..., :, None] * self.cu[..., None, :]).reshape(n, n, width, sq)


def _compiled(topo: Topology) -> _Compiled:
    """The topology's arrays, rebuilt when its links or capacities change (paths are compiled
    once: a caller that edits `topo.paths` in place after planning must `del topo._compiled`)."""
    key = (len(topo.paths), tuple(topo.capacity.items()))
    c = topo.__dict__.get("_compiled")
    if c is None or c.key != key:
        c = _Compiled(topo, key)
        topo.__dict__["_compiled"] = c
    return c


START_MARGIN = 1.0      # dual start: each demand priced 1 (scaled units) below its cheapest path; 0.3 and 1 measured alike


def _solve(A, lk, pidx, pcu, fixed, L: int, gap: float, iters: int):
    """Mehrotra predictor-corrector interior point method on the path LP

        min tau  s.t.  sum_j f[k, j] = 1                          (every demand fully routed)
                       sum_kj f[k, j] A[k, j, e] + fixed[e] + s[e] = tau   (link e's time <= tau)
                       f, s, tau >= 0

    A[k, j, i] is the time (us, scaled) link lk[k, j, i] takes if all of demand k goes on path j.
    The Newton system is reduced to links (L x L): every demand's block is eliminated in closed
    form, so one round costs a few sparse passes over the paths and one L x L solve. Stops when
    the best plan seen is within `gap` of the best lower bound seen:
        upper: the most loaded link of f normalised to exact row sums (a feasible plan);
        lower: for link prices w = max(-y, 0) (the dual), sum_k min_j price_kj + fixed.w, over
               sum(w): any plan's price-weighted mean link time, so at most its largest (weak duality).
    Returns (fractions (nd, W), upper, lower, prices w / sum(w) or None)."""
    import numpy as np
    nd, width, depth = A.shape
    P = nd * width
    N = P + L + 1
    lkf = lk.ravel()
    kidx = (np.arange(nd)[:, None, None] * (L + 1) + lk).ravel()
    sq = (L + 1) * (L + 1)
    ones_w, ones_k = np.ones(width), np.ones(depth)      # short-axis sums as matrix-vector products
    yx = np.zeros(L + 1)                                 # prices with the "no link" slot at 0

    def load(f):                                   # link times of fractions f (nd, W)
        return np.bincount(lkf, (A * f[..., None]).ravel(), L + 1)[:L]

    def price(y):                                  # per path: sum of its links' y
        yx[:L] = y
        return (A * np.take(yx, lk)) @ ones_k

    scale = (load(np.full((nd, width), 1.0 / width)) + fixed).max()
    A = A / scale
    pcu = pcu / (scale * scale)
    fixed = fixed / scale
    z = np.empty(N)
    z[:P] = 1.0 / width
    t = load(z[:P].reshape(nd, width)) + fixed
    z[-1] = 1.5 * t.max() + 0.1
    z[P:P + L] = z[-1] - t
    g = np.empty(N)
    # a dual-feasible start: every link priced alike (half the budget), each demand's multiplier
    # one below its cheapest path, so every dual slack is positive
    y2 = np.full(L, -0.5 / L)
    pr = price(-y2)
    y1 = -pr.min(1) - START_MARGIN
    sg = np.empty(N)
    sg[:P] = (-y1[:, None] - pr).ravel()
    sg[P:P + L] = -y2
    sg[-1] = 0.5
    best_ub, best_lb, best_f, best_w = math.inf, 0.0, None, None

    def gt(u1, u2):                                # G^T u
        g[:P] = (u1[:, None] + price(u2)).ravel()
        g[P:P + L] = u2
        g[-1] = -u2.sum()
        return g.copy()

    for it in range(iters):
        f = z[:P].reshape(nd, width)
        rows = f @ ones_w
        t = load(f) + fixed
        rp1 = 1.0 - rows
        rp2 = z[-1] - t - z[P:P + L]
        rd = -gt(y1, y2) - sg
        rd[-1] += 1.0
        if z[-1] - (y1.sum() - fixed @ y2) <= 0.5 * gap * z[-1] or it == iters - 1 or it >= 4:
            fn = f / rows[:, None]
            ub = (load(fn) + fixed).max()
            if ub < best_ub:
                best_ub, best_f = ub, fn
            w = np.maximum(-y2, 0.0)
            ws = w.sum()
            if ws > 0:
                lb = (price(w).min(1).sum() + fixed @ w) / ws
                if lb > best_lb:
                    best_lb, best_w = lb, w / ws
            if best_ub <= best_lb * (1 + gap) or it == iters - 1:
                break
        mu = z @ sg / N
        D = z / sg
        Df = D[:P].reshape(nd, width)
        delta = Df @ ones_w
        bk = np.bincount(kidx, (A * Df[..., None]).ravel(), nd * (L + 1)).reshape(nd, L + 1)[:, :L]
        S = np.bincount(pidx, (pcu * Df[..., None]).ravel(), sq).reshape(L + 1, L + 1)[:L, :L]
        S[np.diag_indices(L)] += D[P:P + L]
        S += D[-1]
        bkt = bk.T / delta
        S -= bkt @ bk

        def newton(rc):
            q = (rc - z * rd) / sg
            qf = q[:P].reshape(nd, width)
            r1 = rp1 - qf @ ones_w
            r2 = rp2 - (load(qf) + q[P:P + L] - q[-1])
            u2 = np.linalg.solve(S, r2 - bkt @ r1)
            u1 = (r1 - bk @ u2) / delta
            h = gt(u1, u2)
            return u1, u2, q + D * h, rd - h

        def step(v, dv):
            return min(1.0, float((v / np.maximum(-dv, 1e-300)).min()))

        _, _, dz, ds = newton(-z * sg)
        ap, ad = step(z, dz), step(sg, ds)
        sigma = (((z + ap * dz) @ (sg + ad * ds)) / N / mu) ** 3
        u1, u2, dz, ds2 = newton(sigma * mu - z * sg - dz * ds)
        ap, ad = 0.99 * step(z, dz), 0.99 * step(sg, ds2)
        z = z + ap * dz
        sg = sg + ad * ds2
        y1 = y1 + ad * u1
        y2 = y2 + ad * u2
    return best_f, best_ub * scale, best_lb * scale, best_w


class RoutePlan:
    """A plan: every demand's bytes split over its candidate paths.

    flows: (src, dst) -> [(Path, bytes)], bytes > 0 summing exactly to the demand. Built from the
    integer split on first access (a dict of Path objects costs more than the plan itself on a
    cache hit); `split` has the same numbers as arrays: (src, dst, bytes[nd, W]) with column j
    = the pair's j-th candidate.
    link_load: link -> bytes (weighted by the path's use of the link); max_load_us: the most
    loaded link's time; lower_bound_us: proven, no split over these paths beats it (0: none);
    reused: an earlier plan's path fractions rescaled to this matrix."""

    def __init__(self, topology: str, flows, link_load: dict[str, float], max_load_us: float,
                 plan_time_us: float, lower_bound_us: float = 0.0, reused: bool = False,
                 fractions=None, prices=None, split=None, paths=None):
        self.topology = topology
        self._flows = flows
        self.link_load = link_load
        self.max_load_us = max_load_us
        self.plan_time_us = plan_time_us
        self.lower_bound_us = lower_bound_us
        self.reused = reused
        self.fractions = fractions        # (n, n, W) path fractions, for reuse (numpy) or None
        self.prices = prices              # (L,) the solve's link prices (dual), for reuse, or None
        self.split = split
        self._paths = paths

    @property
    def flows(self) -> dict[tuple[int, int], list[tuple[Path, int]]]:
        if self._flows is None:
            import numpy as np
            s, d, ints = self.split
            out: dict[tuple[int, int], list[tuple[Path, int]]] = {}
            kk, jj = np.nonzero(ints)
            sl, dl = s.tolist(), d.tolist()
            for k, j, v in zip(kk.tolist(), jj.tolist(), ints[kk, jj].tolist()):
                key = (sl[k], dl[k])
                item = (self._paths[key[0]][key[1]][j], v)
                fl = out.get(key)
                if fl is None:
                    out[key] = [item]
                else:
                    fl.append(item)
            self._flows = out
        return self._flows

    def __repr__(self) -> str:
        return (f"RoutePlan({self.topology!r}, demands={len(self.flows)}, max_load_us={self.max_load_us:.1f}, "
                f"lower_bound_us={self.lower_bound_us:.1f}, plan_time_us={self.plan_time_us:.0f}, reused={self.reused})")

    def link_time_us(self, capacity: dict[str, float]) -> dict[str, float]:
        return {e: b / (capacity[e] * 1e3) for e, b in self.link_load.items()}

    def to_dict(self) -> dict:
        return {
            "topology": self.topology, "max_load_us": self.max_load_us, "plan_time_us": self.plan_time_us,
            "lower_bound_us": self.lower_bound_us, "reused": self.reused,
            "flows": [{"src": s, "dst": d, "paths": [{"path": p.name(), "bytes": b} for p, b in fl]}
                      for (s, d), fl in sorted(self.flows.items())],
        }


def _matrix(topo: Topology, matrix):
    import numpy as np
    try:
        m = np.array(matrix, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the traffic matrix must be {topo.num_gpus} rows of {topo.num_gpus} byte counts: {exc}")
    if m.shape != (topo.num_gpus, topo.num_gpus):
        raise ValueError(f"the traffic matrix is {m.shape}, {topo.name} needs {topo.num_gpus} x {topo.num_gpus}")
    np.fill_diagonal(m, 0.0)
    if (m > 2.0 ** 52).any():
        raise ValueError("a demand above 2**52 bytes: split it before routing")
    return m


def _demands(c: _Compiled, m):
    import numpy as np
    s, d = np.nonzero(m > 0)
    b = np.floor(m[s, d])
    if (c.num[s, d] == 0).any():
        k = int(np.argmax(c.num[s, d] == 0))
        raise ValueError(f"no candidate path from GPU {s[k]} to GPU {d[k]}: add one to the topology")
    return s, d, b


def _materialize(topo: Topology, c: _Compiled, s, d, b, frac, t0: float) -> RoutePlan:
    """Integer bytes per path from per-demand fractions frac (nd, W), summing exactly to each demand
    (floors, the remainder to the demand's largest share), then the exact link loads."""
    import numpy as np
    nd = len(b)
    if nd == 0:
        return RoutePlan(topo.name, {}, {e: 0.0 for e in c.names}, 0.0, (time.perf_counter() - t0) * 1e6)
    ints = np.floor(frac * b[:, None])
    ints[np.arange(nd), frac.argmax(1)] += b - ints.sum(1)
    loads = np.bincount(c.lk[s, d].ravel(), (c.cb[s, d] * ints[..., None]).ravel(), c.L + 1)[:c.L]
    return RoutePlan(topo.name, None, dict(zip(c.names, loads.tolist())), float((loads * c.inv_cap).max()),
                     (time.perf_counter() - t0) * 1e6, split=(s, d, ints.astype(np.int64)), paths=c.paths)


def _merge_pads(c: _Compiled, s, d, frac):
    """Fold padding columns (duplicates of candidate 0) back into candidate 0."""
    pad = c.pad[s, d]
    if pad.any():
        frac = frac.copy()
        frac[:, 0] += (frac * pad).sum(1)
        frac[pad] = 0.0
    return frac


def route(topo: Topology, matrix: list[list[int]], iters: int = 30, min_split_bytes: int = 1 << 20,
          gap: float = 0.02, min_share: float = 0.01) -> RoutePlan:
    """Min-congestion routing of matrix[s][d] bytes over the topology's candidate paths.

    An interior point method on the path LP (see `_solve`): a handful of Newton rounds, each
    reduced to one links x links system, stopping once the plan is provably within `gap` of the
    optimum (a dual lower bound certifies it; `lower_bound_us` keeps it). Demands at or below
    `min_split_bytes` take their fastest path and are fixed load for the rest. Shares under
    `min_share` of a demand are dropped and the demand renormalised, if that keeps the plan within
    `gap` of the bound (an interior point leaves a little of every demand on every path).
    Rejected: Frank-Wolfe on a soft maximum (first-order: 30-120 rounds and 9-100 ms here, still
    1.05x on some matrices, stalls where links tie) and slice-by-slice greedy (1.17x)."""
    import numpy as np
    t0 = time.perf_counter()
    c = _compiled(topo)
    m = _matrix(topo, matrix)
    s, d, b = _demands(c, m)
    nd, width = len(b), c.W
    frac = np.zeros((nd, width))
    one = b <= min_split_bytes
    frac[one, c.fastest[s[one], d[one]]] = 1.0
    lower, prices = 0.0, None
    multi = np.nonzero(~one)[0]
    if len(multi):
        sm, dm = s[multi], d[multi]
        fixed = np.bincount(c.lk[s[one], d[one], c.fastest[s[one], d[one]]].ravel(),
                            (c.cu[s[one], d[one], c.fastest[s[one], d[one]]] * b[one, None]).ravel(),
                            c.L + 1)[:c.L] if one.any() else np.zeros(c.L)
        A = c.cu[sm, dm] * b[multi, None, None]
        fm, upper, lower, prices = _solve(A, c.lk[sm, dm], c.pair_idx[sm, dm].ravel(), c.pair_cu[sm, dm] * (b[multi] ** 2)[:, None, None],
                                          fixed, c.L, gap, iters)
        fm = _merge_pads(c, sm, dm, fm)
        # prefer short plans: an interior point spreads every demand over all its equally good
        # paths (relays included), which costs latency, relay memory and extra lane setup in the
        # data plane. Mix the plan toward "every demand on its fastest path" as far as the bound
        # allows (one bincount per trial; ties, e.g. balanced traffic, go all the way back).
        rows, hcol = np.arange(len(multi)), c.fastest[sm, dm]
        dom = c.dominated[sm, dm] & (fm > 0)
        if dom.any():     # dominated paths hand their bytes to the fastest path (loads only drop)
            fm = fm.copy()
            fm[rows, hcol] += np.where(dom, fm, 0.0).sum(1)
            fm[dom] = 0.0
        home = np.zeros_like(fm)
        home[rows, hcol] = 1.0
        limit = max(upper, lower * (1 + gap))
        lks = c.lk[sm, dm]
        # first, demands whose fastest path has slack on every link go home whole: that only
        # takes load off the near-critical links (checked below for the links it adds to)
        t = np.bincount(lks.ravel(), (A * fm[..., None]).ravel(), c.L + 1)[:c.L] + fixed
        tight = np.append(t >= 0.97 * limit, False)
        free = ~tight[lks[rows, hcol]].any(-1)
        if free.any():
            trial = np.where(free[:, None], home, fm)
            t = np.bincount(lks.ravel(), (A * trial[..., None]).ravel(), c.L + 1)[:c.L] + fixed
            if t.max() <= limit:
                fm = trial
        for lam in (1.0, 0.75, 0.5, 0.25, 0.1):
            mixed = (1 - lam) * fm + lam * home
            t = np.bincount(c.lk[sm, dm].ravel(), (A * mixed[..., None]).ravel(), c.L + 1)[:c.L] + fixed
            if t.max() <= limit:
                fm = mixed
                break
        for share in (min_share * 5, min_share) if min_share > 0 else ():
            kept = np.where(fm >= share * fm.max(1, keepdims=True), fm, 0.0)
            kept /= kept.sum(1, keepdims=True)
            t = np.bincount(c.lk[sm, dm].ravel(), (A * kept[..., None]).ravel(), c.L + 1)[:c.L] + fixed
            if t.max() <= max(upper, lower * (1 + gap)):
                fm = kept
                break
        frac[multi] = fm
    plan = _materialize(topo, c, s, d, b, frac, t0)
    plan.lower_bound_us = float(lower)
    full = np.zeros((c.n, c.n, width))
    full[s, d] = frac
    plan.fractions, plan.prices = full, prices
    plan.plan_time_us = (time.perf_counter() - t0) * 1e6
    return plan


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
    """Coarse signature: each demand rounded down to a power of two (the plan cache's key)."""
    return tuple(tuple(0 if b <= 0 else int(math.log2(b)) for b in row) for row in matrix)


def _signature_key(m) -> bytes:
    """signature() of a float matrix as bytes, in a few numpy calls (the Router's cache key)."""
    import numpy as np
    e = np.frexp(m)[1] - 1                       # floor(log2 b) for b > 0
    return np.where(m > 0, np.maximum(e, 0), 0).astype(np.int8).tobytes()


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

    Demands at or below the learned threshold (`self.threshold`, a SplitThreshold) take one path;
    `observe()` feeds it and a threshold move empties the cache."""

    def __init__(self, topo: Topology, tolerance: float = 0.05, max_cached: int = 256,
                 threshold: SplitThreshold | None = None, **kwargs):
        self.topo = topo
        self.tolerance = tolerance
        self.max_cached = max_cached
        if "min_split_bytes" in kwargs and threshold is None:
            threshold = SplitThreshold(kwargs.pop("min_split_bytes"), lowest_bytes=0)
        kwargs.pop("min_split_bytes", None)
        self.threshold = threshold or SplitThreshold()
        self.kwargs = kwargs
        self.cache: dict[bytes, RoutePlan] = {}
        self.last: RoutePlan | None = None
        self.hits = self.misses = 0

    def observe(self, nbytes: int, single_us: float, multipath_us: float) -> None:
        before = self.threshold.threshold_bytes
        if self.threshold.observe(nbytes, single_us, multipath_us) != before:
            self.cache.clear()
            self.last = None

    def plan(self, matrix: list[list[int]]) -> tuple[RoutePlan, bool]:
        t0 = time.perf_counter()
        c = _compiled(self.topo)
        m = _matrix(self.topo, matrix)
        key = _signature_key(m)
        split = self.threshold.threshold_bytes
        seen = self.cache.get(key)
        for old in (seen, self.last):
            if old is None or old.fractions is None or old.prices is None:
                continue
            plan = self.rescale(old, m, split, t0)
            if plan is not None:
                self.last = plan
                self.hits += 1
                return plan, True
            if old is self.last:
                break
        made = route(self.topo, m, min_split_bytes=split, **self.kwargs)
        if made.prices is not None:                # the reuse bound's table, paid on the miss
            self._cheapest(made)
            made.plan_time_us = (time.perf_counter() - t0) * 1e6
        if len(self.cache) >= self.max_cached:
            self.cache.clear()
        self.cache[key] = made
        self.last = made
        self.misses += 1
        return made, False

    def _cheapest(self, plan: RoutePlan):
        """Per pair under the plan's link prices: the cheapest candidate and its price (us/byte)."""
        import numpy as np
        cheap = plan.__dict__.get("_cheapest")
        if cheap is None:
            c = _compiled(self.topo)
            pr = (c.cu * np.take(np.append(plan.prices, 0.0), c.lk)).sum(-1)
            pr[c.pad] = np.inf
            j = pr.argmin(-1)
            cheap = (j, np.take_along_axis(pr, j[..., None], -1)[..., 0])
            plan.__dict__["_cheapest"] = cheap
        return cheap

    def rescale(self, old: RoutePlan, m, split: int, t0: float | None = None) -> RoutePlan | None:
        """`old`'s path fractions applied to matrix m (exact bytes), or None when the result is
        not provably within `tolerance` of the optimum for m."""
        import numpy as np
        t0 = time.perf_counter() if t0 is None else t0
        c = _compiled(self.topo)
        s, d, b = _demands(c, m)
        frac = old.fractions[s, d]
        cheap = self._cheapest(old)
        lower = float((b * cheap[1][s, d]).sum())
        one = b <= split
        fresh = frac.sum(1) < 0.5                  # zero in the old matrix: its cheapest path
        if one.any() or fresh.any():
            frac = frac.copy()
            frac[fresh] = 0.0
            frac[fresh, cheap[0][s[fresh], d[fresh]]] = 1.0
            frac[one] = 0.0
            frac[one, c.fastest[s[one], d[one]]] = 1.0
        plan = _materialize(self.topo, c, s, d, b, frac, t0)
        if plan.max_load_us > (1 + self.tolerance) * lower:
            return None
        plan.lower_bound_us, plan.reused = lower, True
        plan.fractions, plan.prices = old.fractions, old.prices
        plan.__dict__["_cheapest"] = cheap
        plan.plan_time_us = (time.perf_counter() - t0) * 1e6
        return plan
