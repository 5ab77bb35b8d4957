"""The router: spread a traffic matrix over every path so the most loaded link is as light as
possible (NIMBLE's min-congestion planner). Pure python, no torch.

Model. A topology is a set of directed links with capacities (GB/s) and, for every ordered pair of
GPUs, candidate paths: direct NVLink, through one intermediate GPU (relay, never two), host-staged
(PCIe out, host memory, PCIe in), and across nodes rail-matched NICs (a GPU reaches the NIC of rail
k through the GPU that owns it, over NVLink). A link's load is the bytes routed over it times the
path's use of it; its time is load / capacity. The plan minimises the largest link time, which is
the collective's time when every link runs at capacity.

Solver: the path LP (min tau subject to every demand split over its paths and every link's time
<= tau) by a primal-dual interior point method (Mehrotra predictor-corrector). Candidates that
another candidate beats on every link (relays on a switch) are left out; every demand's block of
the Newton system is eliminated in closed form, leaving one links x links system per solve (34
links with a dummy for 8 GPUs on an NVSwitch); the topology's path/link tables are compiled once
and kept on the Topology, the rows for a set of split demands once per set. From a feasible,
centred start it takes 1.5-5.5 Newton rounds on the presets, stopping when the plan is within
`gap` (2%) of a lower bound from the dual link prices (weak duality), tried at each iterate and
predictor point, so every plan carries a certificate (`lower_bound_us`).
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

import copy
import math
import time
from dataclasses import dataclass, field

from . import checks
from .checks import MisuseError


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
    """n GPUs on an NVSwitch: every GPU has one NVLink port out and one in; PCIe to host memory.
    n >= 1 (one GPU: a topology with no pairs); rates in GB/s, finite and > 0; host_gbps None means
    pcie_gbps * n."""
    n = checks.whole(n, "nvswitch: n (GPUs on the switch)", 1)
    checks.rate(nvlink_gbps, "nvswitch: nvlink_gbps")
    checks.rate(pcie_gbps, "nvswitch: pcie_gbps")
    if host_gbps is not None:
        checks.rate(host_gbps, "nvswitch: host_gbps", "GB/s through host memory, or None for pcie_gbps * n")
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
    """n GPUs wired directly to each other (a link per ordered pair), plus PCIe to host memory.
    n >= 1; rates in GB/s, finite and > 0; host_gbps None means pcie_gbps * n."""
    n = checks.whole(n, "mesh: n (GPUs)", 1)
    checks.rate(pair_gbps, "mesh: pair_gbps")
    checks.rate(pcie_gbps, "mesh: pcie_gbps")
    if host_gbps is not None:
        checks.rate(host_gbps, "mesh: host_gbps", "GB/s through host memory, or None for pcie_gbps * n")
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
    to NIC k), reaching the rail's owner GPU over NVLink when the endpoint is another GPU.
    nodes, gpus_per_node and nics >= 1 (the NICs are the only way between nodes, and every NIC
    needs an owner GPU); rates in GB/s, finite and > 0."""
    nodes = checks.whole(nodes, "multi_node: nodes", 1)
    gpus_per_node = checks.whole(gpus_per_node, "multi_node: gpus_per_node", 1)
    nics = checks.whole(nics, "multi_node: nics (NICs per node)", 1, "the NICs are the only links between nodes")
    checks.rate(nic_gbps, "multi_node: nic_gbps")
    checks.rate(nvlink_gbps, "multi_node: nvlink_gbps")
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
    """Topologies by name: the machines measured here and synthetic ones. `nodes` and `nics` (per
    node) are used by "multinode" only, but must be >= 1 whatever the name."""
    if not isinstance(name, str):
        raise MisuseError(f"preset: name = {name!r} is not a topology name; pass one of h200x2, h200x4, "
                          f"mesh4, nvswitchN (N GPUs, e.g. nvswitch8), multinode")
    nodes = checks.whole(nodes, "preset: nodes", 1, "the number of 8-GPU nodes")
    nics = checks.whole(nics, "preset: nics", 1, "NICs (rails) per node")
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
    raise MisuseError(f"unknown topology {name!r}: h200x2, h200x4, mesh4, nvswitchN (N GPUs, e.g. nvswitch8), "
                      f"multinode")


# -------------------------------------------------------------------------------------------------
# the solver
# -------------------------------------------------------------------------------------------------

class _Compiled:
    """A topology's candidate paths as arrays, built once and kept on the Topology; a call only
    gathers rows. Pairs are flat (p = s * n + d). Links are numbered 0..L-1 in `topo.capacity`
    order, plus one dummy link L that no path loads (padding points at it; M = L + 1 columns).

    Only the candidates that some optimal plan may need are kept ("reduced" columns, R per pair):
    candidate j is dropped when another candidate i puts no more bytes than j on any link (a relay
    on an NVSwitch crosses the direct path's out and in ports plus two more): moving j's bytes to i
    never raises a link, so dropping j keeps the optimum, and any link prices price j at least as
    high as i, so the dual bound is unchanged too. Of exact duplicates the first stays. The fastest
    candidate (least total link time) always stays and is reduced column 0; a pair with fewer than R
    kept candidates repeats column 0 (a duplicate column changes nothing in the LP)."""

    def __init__(self, topo: Topology):
        import numpy as np
        checks.topology(topo)                  # once per compile: capacities divide below
        self.npaths, self.capacity = len(topo.paths), dict(topo.capacity)
        names = list(topo.capacity)
        index = {e: i for i, e in enumerate(names)}
        n, nl = topo.num_gpus, len(names)
        nm = nl + 1
        self.names, self.n, self.L, self.M = names, n, nl, nm
        self.inv_cap = np.array([1.0 / (topo.capacity[e] * 1e3) for e in names])      # us per byte
        self.inv_cap_m = np.append(self.inv_cap, 0.0)
        self.paths: list[tuple[Path, ...]] = [() for _ in range(n * n)]
        use: list[list[dict[int, float]]] = [[] for _ in range(n * n)]
        for (s, d), ps in topo.paths.items():
            self.paths[s * n + d] = tuple(ps)
            for p in ps:
                acc: dict[int, float] = {}
                for e, w in p.links:
                    acc[index[e]] = acc.get(index[e], 0.0) + w
                use[s * n + d].append(acc)
        # per pair: the kept candidates, fastest first
        kept: list[list[int]] = []
        for u in use:
            if not u:
                kept.append([])
                continue
            cost = [sum(w * self.inv_cap[e] for e, w in a.items()) for a in u]
            fastest = min(range(len(u)), key=lambda j: (cost[j], j))

            def beaten(j):
                return any(i != j and all(u[j].get(e, 0.0) >= w for e, w in u[i].items())
                           and (u[j] != u[i] or i < j) for i in range(len(u)))
            kept.append([fastest] + [j for j in range(len(u)) if j != fastest and not beaten(j)])
        width = max(1, max(len(k) for k in kept))
        depth = max(1, max((len(use[p][j]) for p, k in enumerate(kept) for j in k), default=1))
        self.R, self.K = width, depth
        self.nkeep = np.array([len(k) for k in kept])
        rcol = np.zeros((n * n, width), dtype=np.intp)
        rlk = np.full((n * n, width, depth), nl, dtype=np.intp)
        rcb = np.zeros((n * n, width, depth))
        links_of = []                                   # per pair: the links its kept paths use
        for p, k in enumerate(kept):
            seen: dict[int, None] = {}
            for r in range(width if k else 0):
                j = k[r] if r < len(k) else k[0]
                rcol[p, r] = j
                for i, (e, w) in enumerate(use[p][j].items()):
                    rlk[p, r, i], rcb[p, r, i] = e, w
                    seen[e] = None
            links_of.append(list(seen))
        self.rcol, self.rlk = rcol, rlk
        self.rcu = rcb * self.inv_cap_m[rlk]
        self.rpad = np.arange(width) >= self.nkeep[:, None]
        self.multi_ok = self.nkeep >= 2                 # pairs the solver may split
        offdiag = np.ones((n, n), dtype=bool)
        np.fill_diagonal(offdiag, False)
        self.missing = (self.nkeep == 0) & offdiag.ravel()
        self.has_missing = bool(self.missing.any())
        # dense per path x link: bytes per byte routed (exact loads) and us per byte (times)
        rows = np.repeat(np.arange(n * n * width), depth)
        cbd = np.zeros((n * n * width, nm))
        np.add.at(cbd, (rows, rlk.ravel()), rcb.ravel())
        cbd[:, nl] = 0.0
        self.cb_dense = cbd
        self.cu_dense = cbd * self.inv_cap_m
        self.cu_fast = np.ascontiguousarray(self.cu_dense.reshape(n * n, width, nm)[:, 0, :])
        # the Schur complement's index sets: per path its link pairs, per pair its own links' pairs
        self.rpair = (rlk[..., :, None] * nm + rlk[..., None, :]).reshape(n * n, width, depth * depth)
        self.rpcu = (self.rcu[..., :, None] * self.rcu[..., None, :]).reshape(n * n, width, depth * depth)
        kd = max(1, max(len(x) for x in links_of))
        plink = np.full((n * n, kd), nl, dtype=np.intp)
        for p, x in enumerate(links_of):
            plink[p, :len(x)] = x
        # the Schur complement's demand term: per demand over its own links (kd^2 entries each)
        # when those are very few against all links (16 GPUs on a switch: 5 of 66), else one
        # dense (links x demands x links) product, which measured faster up to 8 GPUs
        self.compact = 10 * kd < nm
        self.pouter = (plink[:, :, None] * nm + plink[:, None, :]).reshape(n * n, kd * kd)
        self.home = np.zeros((n * n, width))            # one-hot on the fastest path (reduced column 0)
        self.home[:, 0] = 1.0
        self.ones_r = np.ones(width)
        self.flat0 = np.arange(n * n) * width          # each pair's first column in (n*n, R) flat
        # per call the solver gathers these rows and adds each demand's offset (k * M) to the link
        # indices: its paths' links (for b_k) and then its own links (the compact b_k)
        self.kc = np.concatenate((rlk.reshape(n * n, -1), plink), 1)
        self.nkc = width * depth
        # the solver's start: each demand split in proportion to 1 / (path time), a fair first guess
        # for a switch (most on NVLink, a little over PCIe) that uniform fractions are not
        cost = self.rcu.sum(-1)
        inv = np.where(cost > 0, 1.0 / np.where(cost > 0, cost, 1.0), 0.0)
        tot = inv.sum(1, keepdims=True)
        self.f0 = np.where(tot > 0, inv / np.where(tot > 0, tot, 1.0), 0.0)
        self.diag = np.arange(nm) * (nm + 1)
        self.rows: dict[bytes, _Rows] = {}
        self.has_pad = bool(self.rpad.any())
        self.mix = np.array([0.75, 0.5, 0.25, 0.1])          # weights toward the fastest paths (_shorten)
        # per flat (pair, reduced column): the pair and the candidate, for building flows
        self.flat_keys = [divmod(i // width, n) for i in range(n * n * width)]
        self.flat_paths = [self.paths[i // width][rcol[i // width, i % width]] if self.paths[i // width] else None
                           for i in range(n * n * width)]

    def original(self, vals):
        """(n*n, R) values per reduced column -> (n*n, W) per original candidate (padding columns
        are copies of column 0 and add into its candidate)."""
        import numpy as np
        width = max(1, max(len(p) for p in self.paths))
        out = np.zeros((self.n * self.n, width), dtype=vals.dtype)
        np.add.at(out, (np.arange(self.n * self.n)[:, None], self.rcol), vals)
        return out


class _Rows:
    """The compiled tables gathered for one set of split demands (flat pair indices p), kept on
    the compiled topology: the same demands recur from call to call, and gathering every per-pair
    table costs more than the arithmetic done with it."""

    def __init__(self, c: _Compiled, p):
        import numpy as np
        nd = len(p)
        self.p = p
        # the constraint matrix (see _solve) as one bincount: each path's link entries, then the
        # slack columns (identity) and tau's (minus ones), their values fixed
        P = nd * c.R
        self.n_cols = P + c.M + 1                               # paths, slacks, tau
        self.gidx = np.concatenate(((np.arange(P)[:, None] * c.M + c.rlk[p].reshape(P, -1)).ravel(),
                                    (P + np.arange(c.M)) * c.M + np.arange(c.M),
                                    (P + c.M) * c.M + np.arange(c.M)))
        self.gtail = np.concatenate((np.ones(c.M), -np.ones(c.M)))
        self.rcu = c.rcu[p]                                     # (nd, R, K) us per byte of each path's links
        self.rpcu = c.rpcu[p]                                   # (nd, R, K*K) products of those
        self.compact = c.compact
        if c.compact:
            idx = c.kc[p] + (np.arange(nd) * c.M)[:, None]     # link indices, offset per demand
            self.kidx = idx[:, :c.nkc].ravel()
            self.cidx = idx[:, c.nkc:].ravel()
            self.sidx = np.concatenate((c.rpair[p].ravel(), c.pouter[p].ravel(), c.diag))
        else:
            self.kidx = (c.rlk[p].reshape(nd, -1) + (np.arange(nd) * c.M)[:, None]).ravel()
            self.cidx = None
            self.sidx = np.concatenate((c.rpair[p].ravel(), c.diag))
        self.f0 = c.f0[p]
        self.pad = c.rpad[p] if c.has_pad else None
        if self.pad is not None and not self.pad.any():
            self.pad = None
        self.mix = c.mix
        self.home = c.home[:nd]


def _rows(c: _Compiled, many) -> _Rows:
    key = many.tobytes()
    rows = c.rows.get(key)
    if rows is None:
        import numpy as np
        if len(c.rows) >= 16:
            c.rows.clear()
        rows = c.rows[key] = _Rows(c, np.flatnonzero(many))
    return rows


def _compiled(topo: Topology) -> _Compiled:
    """The topology's arrays, rebuilt when its links or capacities change (paths are compiled
    once: a caller that edits `topo.paths` in place after planning must `del topo._compiled`)."""
    c = topo.__dict__.get("_compiled")
    if c is None or c.npaths != len(topo.paths) or c.capacity != topo.capacity:
        c = _Compiled(topo)
        topo.__dict__["_compiled"] = c
    return c


def _rowmin(x, pick=None):
    """Each row's least entry (or largest, pick=numpy.maximum): pairwise picks of column halves,
    a few whole-array calls; numpy's own reduction over a short row axis costs more here."""
    import numpy as np
    pick = pick or np.minimum
    while x.shape[1] > 1:
        h = x.shape[1] // 2
        y = pick(x[:, :h], x[:, h:2 * h])
        x = y if x.shape[1] == 2 * h else np.concatenate((y, x[:, 2 * h:]), 1)
    return x[:, 0]


def _solve(Gx, A, pcu, rows: _Rows, fixed, gap: float, iters: int):
    """Mehrotra predictor-corrector interior point method on the path LP

        min tau  s.t.  sum_j f[k, j] = 1                          (every demand fully routed)
                       sum_kj f[k, j] G[kj, e] + fixed[e] + s[e] = tau   (link e's time <= tau)
                       f, s, tau >= 0

    G[kj, e] is the time (us) link e takes if all of demand k goes on path j (dense, paths x
    links), the first rows of Gx: the constraint matrix's columns as rows (path kj -> its link
    times, plus its demand's multiplier added apart; slack e -> link e; tau -> minus every link).
    A holds G's numbers per path entry (A[kj, i] for the path's i-th link), for the sums that
    only need each path's few links. Eliminating every demand's block leaves one
    links x links system per Newton solve:

        S = sum_k [ sum_j D_kj a_kj a_kj^T  -  b_k b_k^T / delta_k ] + diag(D_s) + D_tau
            (a_kj: path kj's link times; b_k = sum_j D_kj a_kj; delta_k = sum_j D_kj)

    The first sum is one bincount over each path's link pairs (pcu: their products); the second
    is a dense product, or where a demand's links are very few against all links (rows.compact)
    a bincount over each demand's own link pairs. The start is primal feasible (fractions summing
    to 1, slacks = tau - link time) and dual feasible, and Newton steps keep both, so the duality
    gap is z . s and each Newton system needs only its right-hand side, no residuals.

    The certificate: a plan's upper bound is the most loaded link of its fractions normalised to
    exact row sums (a feasible plan); a lower bound, for link prices w = max(-y, 0) (the dual), is
    (sum_k min_j price_kj + fixed.w) / sum(w): any plan's price-weighted mean link time, so at most
    its largest (weak duality). It stops when the best upper bound seen is within `gap` of the best
    lower bound seen. Both are tried at the iterate and at the predictor's point (the iterate plus
    the full affine step), which is often closer to the optimum: a hit there skips the corrector.
    Returns (fractions (nd, R), upper, lower, prices w / sum(w) over the M links, link times of
    the returned fractions)."""
    import numpy as np
    f0 = rows.f0
    kidx, cidx, sidx, compact = rows.kidx, rows.cidx, rows.sidx, rows.compact
    nd, width = f0.shape
    N, M = Gx.shape
    P = N - M - 1
    G = Gx[:P]
    ones_w = np.ones(width)
    add, minimum, maximum = np.add.reduce, np.minimum.reduce, np.maximum.reduce
    solve = np.linalg.solve
    inner = slice(P, P + M)
    t = f0.ravel() @ G + fixed
    tau = 1.6 * float(maximum(t))                  # 1.6 x the start's most loaded link
    slack = tau - t
    z = np.concatenate((f0.ravel(), slack, (tau,)))
    # a centred dual start: every link's slack times its price is the same mu (the prices sum to
    # 0.9), and each demand's multiplier is the largest that keeps every path's dual slack at
    # least mu / its fraction; measured one round fewer than uniform prices on the 8-GPU presets
    mu = 0.9 / float(add(1.0 / slack))
    w = mu / slack
    pr = (G @ w).reshape(nd, width)
    y1 = minimum((pr - mu / f0).T)
    y2 = -w
    sg = np.concatenate(((pr - y1[:, None]).ravel(), w, (1.0 - float(add(w)),)))
    best = [math.inf, 0.0, None, None, None]      # upper, lower, fractions, prices, link times

    def certify(zf, y):                            # update the best bounds; True when within gap
        # the predictor's point steps exactly to the boundary, where rounding can leave a fraction
        # at -1e-17, one byte below zero after the floors (a -1 byte flow on mesh8, found 2026-11-23)
        fr = np.maximum(zf.reshape(nd, width), 0.0)
        fn = fr / (fr @ ones_w)[:, None]
        tn = fn.ravel() @ G + fixed
        ub = float(maximum(tn))
        if ub < best[0]:
            best[0], best[2], best[4] = ub, fn, tn
        w = np.maximum(-y, 0.0)
        w[-1] = 0.0                                # the dummy link carries nothing
        for _ in range(2):
            ws = float(add(w))
            if ws > 0:
                lb = (float(add(_rowmin((G @ w).reshape(nd, width)))) + float(fixed @ w)) / ws
                if lb > best[1]:
                    best[1], best[3] = lb, w / ws
            if best[0] <= best[1] * (1 + gap):
                return True
            # the same prices on the plan's busy links only (>= 90% of its largest time): an
            # interior iterate still prices slack links a little, which an optimal dual does not
            w = w * (tn >= 0.9 * ub)
        return False

    def step(v, dv):                               # longest step in [0, 1] keeping v + a dv >= 0
        return 1.0 / max(1.0, -float(minimum(dv / v)))

    def dual_step(v, h):                           # the same for v - a h
        return 1.0 / max(1.0, float(maximum(h / v)))

    rhs1, nfixed = np.ones(nd), -fixed
    for it in range(iters):
        zs = z * sg
        gap_now = float(add(zs))                   # primal - dual objective (both feasible)
        if (gap_now <= 0.05 * z[-1] or it == iters - 1) and (certify(z[:P], y2) or it == iters - 1):
            break
        D = z / sg
        Df = D[:P]
        idelta = 1.0 / (Df.reshape(nd, width) @ ones_w)
        bkx = np.bincount(kidx, (A * Df[:, None]).ravel(), nd * M)      # b_k, dense (nd, M)
        bk = bkx.reshape(nd, M)
        bkt = bk.T * idelta
        if compact:
            bc = bkx[cidx].reshape(nd, -1)                              # b_k on the demand's own links
            kd = bc.shape[1]
            outer = (bc * -idelta[:, None]).reshape(nd, kd, 1) * bc.reshape(nd, 1, kd)
            S = np.bincount(sidx, np.concatenate(((pcu * Df[:, None]).ravel(), outer.ravel(), D[inner])),
                            M * M).reshape(M, M)
        else:
            S = np.bincount(sidx, np.concatenate(((pcu * Df[:, None]).ravel(), D[inner])), M * M).reshape(M, M)
            S -= bkt @ bk
        S += D[-1]

        def direction(r1, r2):                     # Newton direction: link multipliers, A^T u
            u2 = solve(S, r2 - bkt @ r1)
            h = Gx @ u2
            h[:P] += ((r1 - bk @ u2) * idelta).repeat(width)
            return u2, h

        # predictor (affine step): its right-hand side is the constraints' own (1, -fixed)
        u2, h = direction(rhs1, nfixed)
        dz = D * h - z
        ap, ad = step(z, dz), dual_step(sg, h)
        dzh = dz * h
        gap_aff = gap_now + ap * float(dz @ sg) - ad * float(z @ h) - ap * ad * float(add(dzh))
        if gap_aff <= 0.1 * (z[-1] + ap * dz[-1]) and certify(z[:P] + ap * dz[:P], y2 + ad * u2):
            break
        # corrector: centre toward sigma * mu, less the predictor's second-order term
        sigma = (gap_aff / gap_now) ** 3
        q = (sigma * gap_now / N + dzh) / sg
        u2, h = direction(rhs1 - q[:P].reshape(nd, width) @ ones_w, nfixed - q @ Gx)
        dz = q - z + D * h
        ap, ad = 0.99 * step(z, dz), 0.99 * dual_step(sg, h)
        z = z + ap * dz
        sg = sg - ad * h
        y2 = y2 + ad * u2
    return best[2], best[0], best[1], best[3], best[4]


class RoutePlan:
    """A plan: every demand's bytes split over its candidate paths.

    flows: (src, dst) -> [(Path, bytes)], bytes > 0 summing exactly to the demand. Built from the
    integer split on first access (a dict of Path objects costs more than the plan itself on a
    cache hit); `split` has the same numbers as arrays: (src, dst, bytes[n*n, W]) over every
    ordered pair, column j = the pair's j-th candidate.
    link_load: link -> bytes (weighted by the path's use of the link), also built on first access;
    max_load_us: the most loaded link's time; lower_bound_us: proven, no split over these paths
    beats it (0: none); reused: an earlier plan's path fractions rescaled to this matrix."""

    def __init__(self, topology: str, c: _Compiled, ints, loads, max_load_us: float, plan_time_us: float,
                 lower_bound_us: float = 0.0, reused: bool = False, fractions=None, prices=None):
        self.topology = topology
        self.max_load_us = max_load_us
        self.plan_time_us = plan_time_us
        self.lower_bound_us = lower_bound_us
        self.reused = reused
        self.fractions = fractions        # (n*n, R) fractions over the reduced columns, for reuse
        self.prices = prices              # (M,) the solve's link prices (dual), for reuse, or None
        self._c, self._ints, self._loads = c, ints, loads
        self._flows = self._link_load = None

    @property
    def flows(self) -> dict[tuple[int, int], list[tuple[Path, int]]]:
        if self._flows is None:
            import numpy as np
            c = self._c
            ints = self._ints
            if c.has_pad:                          # padding columns are copies of column 0
                ints = ints.copy()
                ints[:, 0] += (ints * c.rpad) @ c.ones_r
                ints[c.rpad] = 0.0
            nz = np.flatnonzero(ints)
            out: dict[tuple[int, int], list[tuple[Path, int]]] = {}
            keys, paths = c.flat_keys, c.flat_paths
            for i, v in zip(nz.tolist(), ints.ravel()[nz].astype(np.int64).tolist()):
                fl = out.get(keys[i])
                if fl is None:
                    out[keys[i]] = [(paths[i], v)]
                else:
                    fl.append((paths[i], v))
            self._flows = out
        return self._flows

    @property
    def split(self):
        import numpy as np
        c = self._c
        s, d = np.divmod(np.arange(c.n * c.n), c.n)
        return s, d, c.original(self._ints).astype(np.int64)

    @property
    def link_load(self) -> dict[str, float]:
        if self._link_load is None:
            self._link_load = dict(zip(self._c.names, self._loads[:self._c.L].tolist()))
        return self._link_load

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


def _matrix(topo: Topology, c: _Compiled, matrix):
    """The matrix as whole bytes, flat (n*n), diagonal zero; bad input raises (checks.demands)."""
    import numpy as np
    n = topo.num_gpus
    m = checks.demands(matrix, n, topo.name)
    m[::n + 1] = 0.0
    np.floor(m, out=m)
    if c.has_missing and (c.missing & (m > 0)).any():
        p = int(np.argmax(c.missing & (m > 0)))
        raise MisuseError(f"no candidate path from GPU {p // n} to GPU {p % n}: add one to the topology")
    return m


def _materialize(c: _Compiled, b, frac, col):
    """Integer bytes per reduced column from fractions frac (n*n, R): floors, the remainder to
    column col of each pair (its largest share); then the exact link loads and the largest time."""
    import numpy as np
    ints = np.floor(frac * b[:, None])
    ints.ravel()[c.flat0 + col] += b - ints @ c.ones_r
    loads = ints.ravel() @ c.cb_dense
    return ints, loads, float((loads * c.inv_cap_m).max())


def route(topo: Topology, matrix: list[list[int]], iters: int = 30, min_split_bytes: int = 1 << 20,
          gap: float = 0.02, min_share: float = 0.01) -> RoutePlan:
    """Min-congestion routing of matrix[s][d] bytes over the topology's candidate paths.

    An interior point method on the path LP (see `_solve`): a handful of Newton rounds, each
    reduced to one links x links system, stopping once the plan is provably within `gap` of the
    optimum (a dual lower bound certifies it; `lower_bound_us` keeps it). Demands at or below
    `min_split_bytes`, and pairs with one useful candidate, take their fastest path and are fixed
    load for the rest. Then the plan is made short where the bound allows (`_shorten`).
    Rejected: Frank-Wolfe on a soft maximum (first-order: 30-120 rounds and 9-100 ms here, still
    1.05x on some matrices, stalls where links tie) and slice-by-slice greedy (1.17x).

    The matrix: n rows of n byte counts, each an int or float, finite and >= 0 (floats are floored
    to whole bytes; the diagonal is ignored); anything else raises MisuseError (braid.planner.checks)."""
    import numpy as np
    t0 = time.perf_counter()
    checks.whole(iters, "route: iters", 1)
    checks.real(min_split_bytes, "route: min_split_bytes", strict=False)
    checks.real(gap, "route: gap", strict=False, hint="the relative gap to the optimum at which to stop")
    checks.real(min_share, "route: min_share", high=1.0, hint="the smallest share of a demand a path keeps")
    c = _compiled(topo)
    b = _matrix(topo, c, matrix)
    frac = c.home * (b > 0)[:, None]
    lower, prices = 0.0, None
    many = (b > min_split_bytes) & c.multi_ok
    if many.any():
        rows = _rows(c, many)
        p = rows.p
        bm = b[p]
        b3 = bm[:, None, None]
        one = b.copy()
        one[p] = 0.0
        fixed = one @ c.cu_fast                    # the one-path demands' link times
        A = rows.rcu * b3                          # (nd, R, K) us of each path's links
        Gx = np.bincount(rows.gidx, np.concatenate((A.ravel(), rows.gtail)), rows.n_cols * c.M).reshape(-1, c.M)
        G = Gx[:A.shape[0] * c.R]
        fm, upper, lower, prices, t = _solve(Gx, A.reshape(len(G), -1),
                                             (rows.rpcu * (b3 * b3)).reshape(len(G), -1), rows, fixed, gap, iters)
        frac[p] = _shorten(fm, G, fixed, t, rows, max(upper, lower * (1 + gap)), min_share)
    ints, loads, worst = _materialize(c, b, frac, frac.argmax(1))
    if prices is None and worst > 0:
        # nothing to solve (every demand on its one path): price the busiest link alone; the bound
        # is then every demand's least time on it, at least the load of the demands that have no
        # other useful path, which is the whole load when no demand could move
        e = int((loads * c.inv_cap_m).argmax())
        prices = np.zeros(c.M)
        prices[e] = 1.0
        lower = float(b @ c.cu_dense[:, e].reshape(-1, c.R).min(1))
    plan = RoutePlan(topo.name, c, ints, loads, worst, 0.0, float(lower), fractions=frac, prices=prices)
    plan.plan_time_us = (time.perf_counter() - t0) * 1e6
    return plan


def _shorten(fm, G, fixed, t, rows: _Rows, limit: float, min_share: float):
    """Prefer short plans within the certified bound. An interior point spreads every demand over
    all its equally good paths, which costs latency, relay memory and lane setup in the data plane.
    Each step is kept only if no link's time (t: the current ones) goes above `limit`, the bound
    the solve proved:
    1. demands whose fastest path (column 0) avoids every near-critical link (>= 97% of the limit)
       go back to it whole: that only takes load off the critical links;
    2. the plan is mixed toward "every demand on its fastest path" as far as the bound allows (all
       the way for balanced traffic): the mix's link times are linear in the mixing weight, so
       every weight is tried at once;
    3. shares under 5% (then 1%) of a demand's largest share are dropped, the demand renormalised."""
    import numpy as np
    nd, width = fm.shape
    pad = rows.pad
    if pad is not None:                            # padding columns are copies of column 0
        fm = fm.copy()
        fm[:, 0] += (fm * pad) @ np.ones(width)
        fm[pad] = 0.0
    home = rows.home                               # (nd, R): 1 on each demand's fastest path
    th = home.ravel() @ G + fixed                  # every demand on its fastest path
    if th.max() <= limit:
        return home
    free = (G @ (t >= 0.97 * limit)).reshape(nd, width)[:, 0] == 0
    if free.any():
        trial = fm * ~free[:, None]
        trial[:, 0] += free
        tt = trial.ravel() @ G + fixed
        if tt.max() <= limit:
            fm, t = trial, tt
    lams = rows.mix
    ok = (t[:, None] + (th - t)[:, None] * lams).max(0) <= limit
    if ok.any():
        lam = lams[int(ok.argmax())]
        fm = (1 - lam) * fm
        fm[:, 0] += lam
    for share in (min_share * 5, min_share) if min_share > 0 else ():
        kept = fm * (fm >= share * _rowmin(fm, np.maximum)[:, None])
        kept /= (kept @ np.ones(width))[:, None]
        if (kept.ravel() @ G + fixed).max() <= limit:
            return kept
    return fm


def direct_only(topo: Topology, matrix: list[list[int]]) -> float:
    """The most loaded link's time (us) when every demand takes its first (direct) path. The
    matrix is checked as route()'s is."""
    checks.topology(topo, paths=False)
    checks.demands(matrix, topo.num_gpus, topo.name)
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
        made = route(self.topo, m.reshape(c.n, c.n), min_split_bytes=split, **self.kwargs)
        if made.prices is not None:                # the reuse table, paid on the miss
            self._reuse_table(c, made)
            made.plan_time_us = (time.perf_counter() - t0) * 1e6
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
            import numpy as np
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
