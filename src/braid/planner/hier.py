"""The hierarchical planner: a multi-node topology (a Topology with a `cluster`, planner.cluster)
planned across the NIC rails, then within each node, without enumerating every pair's paths.
Pure Python + numpy, no torch. docs/router.md, "Clusters", has the measurements.

Rails. Every inter-node demand, GPU i of node a to GPU j of node b, is spread over the rails by a
mix of three distributions (cluster templates):
    E  even over every rail offered (FuseLink: bytes reach idle NICs through an NVLink hop; this
       alone balances every node's NICs exactly, the NIC bound)
    O  the source's own rail (no NVLink hop on the sending node)
    H  the destination's home rail (no hop on the receiving node: NCCL's PXN path)
as x = (1 - mu[a, i] - lam[b, j]) E + mu[a, i] O + lam[b, j] H, with one share per source GPU (mu)
and per destination GPU (lam), each in [0, 1] (where mu + lam > 1, O and H alone, rescaled to sum
1). The plan starts at E (every share 0). When that is not certified within `gap`, up to _ROUNDS
rounds each solve one small min-max LP per node (smalllp, all nodes in one batch: the node's link
times against its own GPUs' shares, linear there, the remote ends held) and take the step toward
its shares (_STEPS) that lowers the whole cluster's busiest link on exact loads; a round that
lowers nothing ends them, and the shares are kept only if the finished plan (with each node's own
demands) beats the even one, so a plan is never worse than E. Demands at or below
`min_split_bytes` take the H rail whole.

Inside a node. Each node's own demands are routed by the flat solver (solver.route_flat) over the
node's candidates with the rail traffic as background link time; a node whose own demands on their
fastest paths leave it below the rail plan's busiest link keeps those paths without a solve.

Certificate. Any nonnegative link prices w give a lower bound on every plan's largest link time
(weak duality: sum over demands of bytes x the cheapest candidate's priced time, over sum(w)), with
each demand's cheapest candidate taken over all its paths. The planner tries the plan's busy links
at several thresholds, powers of its link times and the share LP's prices, and keeps the best:
`lower_bound_us`, so each plan states how far from optimal it can be.

Small clusters (FLAT_MAX_GPUS GPUs or fewer) are routed by route() and Router with the flat solver
over their paths built on demand (cluster.LazyPaths), within `gap` of the optimum; `route_hier`
itself always plans hierarchically.
"""
from __future__ import annotations

import time

from . import checks
from .hierplan import HierPlan
from .paths import Topology

# route() and Router plan a cluster of at most this many GPUs with the flat solver (2 nodes of 8 GPUs
# compile in ~0.1 s, then plan within `gap` of the optimum); larger ones here
FLAT_MAX_GPUS = 16
# thresholds (share of the plan's largest link time) whose busy links price a lower bound
_BUSY = (0.999, 0.99, 0.97, 0.9, 0.8, 0.6)
_ROUNDS = 3                     # share LP rounds (each: one batched LP, a step search)
_STEPS = (1.0, 0.5, 0.25)       # steps toward a round's LP shares, tried on exact loads
_CHUNK = 1 << 21                # array entries per chunk of source nodes (rails, bounds)


def hierarchical(topo) -> bool:
    """Whether route() and Router plan `topo` here: a cluster of more than FLAT_MAX_GPUS GPUs."""
    return getattr(topo, "cluster", None) is not None and topo.num_gpus > FLAT_MAX_GPUS


def _cluster(topo: Topology):
    cl = getattr(topo, "cluster", None)
    if cl is None:
        from .checks import MisuseError
        raise MisuseError(f"route_hier: topology {getattr(topo, 'name', topo)!r} has no cluster; build it with "
                          f"multi_node(nodes >= 2, ...) or route it with route()")
    return cl


def _demands(topo: Topology, matrix):
    """The checked matrix (checks.demands) as whole bytes (N, G, N, G), diagonal zero."""
    import numpy as np
    cl = topo.cluster
    n = cl.num_gpus
    m = checks.demands(matrix, n, topo.name)
    m[::n + 1] = 0.0
    np.floor(m, out=m)
    return m.reshape(cl.N, cl.G, cl.N, cl.G)


class _Problem:
    """One matrix on one cluster: its inter-node demands split into those the planner spreads
    (big) and those that take the H rail whole (small), its intra-node demands, the share LP and
    the rails built from shares."""

    def __init__(self, cl, M, min_split_bytes: float):
        import numpy as np
        idx = np.arange(cl.N)
        self.cl, self.M = cl, M
        self.intra = M[idx, :, idx, :].copy()                       # (N, G, G)
        inter = M.copy()
        inter[idx, :, idx, :] = 0.0
        self.inter = inter
        big = inter > min_split_bytes
        self.big = big
        self.ib = inter * big                                       # spread over the rails
        self.isml = inter - self.ib                                 # on the H rail whole
        self.inv = 1.0 / (cl.cap * 1e3)                             # us per byte, per local link
        self.split_intra = min_split_bytes

    def intra_fast(self):
        """Bytes per link (N, L) of every node's own demands on their fastest paths."""
        import numpy as np
        return np.einsum("aij,ijl->al", self.intra, self.cl.P0)

    def share_lp(self, now_us, mu, lam):
        """Each node's next shares (mu, lam in [0, 1]) from its own min-max LP, all nodes in one
        batch (smalllp): rows = the node's links, their times now_us at the current shares less the
        node's own shares' part; columns = its GPUs' source and destination shares, the remote ends
        held where they are. Returns mu, lam (N, G) and the LP's link prices (N, L)."""
        import numpy as np
        from .smalllp import minmax
        cl = self.cl
        out_b = self.ib.sum(2)
        in_b = self.ib.sum(0).transpose(1, 0, 2)
        cmu = np.einsum("aij,ijl->ali", out_b, cl.SO - cl.SE)       # (N, L, G): d load / d mu[a, i]
        clam = np.einsum("bij,ijl->blj", in_b, cl.DH - cl.DE)       # (N, L, G): d load / d lam[b, j]
        C = np.concatenate((cmu, clam), 2) * self.inv[None, :, None]
        v_now = np.concatenate((mu, lam), 1)
        base = now_us - np.einsum("blm,bm->bl", C, v_now)
        v, _, prices = minmax(base, C)
        return v[:, :cl.G], v[:, cl.G:], prices

    def rails(self, mu, lam):
        """Whole bytes (N, G, N, G, K) per rail at shares mu, lam: floors, the remainder on each
        demand's largest share; demands at or below the split size whole on their H rail."""
        import numpy as np
        cl = self.cl
        N, G, K = cl.N, cl.G, cl.K
        out = np.empty((N, G, N, G, K))
        step = max(1, _CHUNK // (G * N * G * K))                    # source nodes per chunk: bounded memory
        E, Ok, Hk = cl.E[None, :, None], cl.Ok[None, :, None], cl.Hk[None, :, None]    # (1, G, 1, G, K)
        for a0 in range(0, N, step):
            a1 = min(N, a0 + step)
            m = mu[a0:a1, :, None, None, None]                      # (c, G, 1, 1, 1): a, i
            l = lam[None, None, :, :, None]                         # (1, 1, N, G, 1): b, j
            tot = m + l
            # mu + lam > 1: O and H only, rescaled to sum 1
            x = (np.maximum(1.0 - tot, 0.0) * E + m * Ok + l * Hk) / np.maximum(tot, 1.0)
            x = np.where(self.big[a0:a1, ..., None], x, Hk)         # (c, G, N, G, K)
            b = self.inter[a0:a1]
            ints = np.floor(x * b[..., None])
            rest = (b - ints.sum(-1)).ravel()
            flat = ints.reshape(-1, K)
            flat[np.arange(len(flat)), x.reshape(-1, K).argmax(1)] += rest
            out[a0:a1] = ints
        return out


def _rail_bytes(cl, rails):
    """Exact bytes per link (N, L) of whole-byte rails (N, G, N, G, K)."""
    N, G, K, L = cl.N, cl.G, cl.K, cl.L
    src = rails.sum(2).reshape(N, -1) @ cl.S.reshape(G * G * K, L)
    dst = rails.sum(0).transpose(1, 0, 2, 3).reshape(N, -1) @ cl.D.reshape(G * G * K, L)
    return src + dst


def _intra_bytes(cl, intra):
    """Exact bytes per link (N, L) of every node's own demands, intra (N, G, G, W) whole bytes."""
    N, G, L = cl.N, cl.G, cl.L
    W = intra.shape[-1]
    return intra.reshape(N, -1) @ cl.PI[:, :, :W, :].reshape(G * G * W, L)


def lower_bound(cl, M, w) -> float:
    """Weak duality: with link prices w (N, L) >= 0, sum over demands of bytes x the cheapest
    candidate's priced time (us), over sum(w), is at most any plan's largest link time. Every
    demand's candidates are all of its paths (rails and node paths), whatever the plan used."""
    import numpy as np
    ws = float(w.sum())
    if not ws > 0:
        return 0.0
    N, G = cl.N, cl.G
    wt = w / (cl.cap * 1e3)                                         # price x us per byte, (N, L)
    sw = np.einsum("ijkl,al->aijk", cl.S, wt)                       # (N, G, G, K)
    dw = np.einsum("ijkl,bl->bijk", cl.D, wt)
    big = 1e300
    sw = np.where(cl.off[None], sw, big)
    idx = np.arange(N)
    total = 0.0
    step = max(1, _CHUNK // (N * G * G * cl.K))                     # source nodes per chunk
    for a0 in range(0, N, step):
        a1 = min(N, a0 + step)
        cost = (sw[a0:a1, None] + dw[None]).min(-1)                 # (ca, N, G, G): a, b, i, j
        b = M[a0:a1].transpose(0, 2, 1, 3)                          # (ca, N, G, G)
        b = b.copy()
        b[idx[a0:a1] - a0, idx[a0:a1]] = 0.0                        # own node: the node paths below
        total += float((b * cost).sum())
    pw = np.einsum("ijcl,al->aijc", cl.PI, wt)
    pw = np.where(cl.PImask[None], pw, big).min(-1)                 # (N, G, G)
    own = M[idx, :, idx, :]
    total += float((np.where(own > 0, own, 0.0) * np.where(own > 0, pw, 0.0)).sum())
    return total / ws


def _certify(cl, M, times, gap: float, extra=()) -> tuple[float, object]:
    """The best lower bound over a few price vectors: the plan's busy links, powers of its link
    times, and any `extra` (N, L) prices, tried until one is within gap / 4 of the plan. Returns
    (bound, its prices normalised to sum 1)."""
    import numpy as np
    top = float(times.max())
    best, prices = 0.0, None
    if top <= 0:
        return 0.0, None
    cands = [(times >= f * top).astype(float) for f in _BUSY]
    cands += [(times / top) ** p for p in (4, 16)]
    cands += [np.asarray(x, dtype=float) for x in extra]
    seen = set()
    for w in cands:
        key = w.tobytes()
        if key in seen:
            continue
        seen.add(key)
        lb = lower_bound(cl, M, w)
        if lb > best:
            best, prices = lb, w / w.sum()
        if best * (1 + gap / 4) >= top:             # close enough: the rest can add little
            break
    return best, prices


def _intra(cl, prob: _Problem, bg_bytes, target_us: float, iters: int, gap: float, min_share: float):
    """Every node's own demands over the node's candidates (N, G, G, W) whole bytes: the fastest
    path where that leaves the node at or below target_us, else the flat solver with the node's
    rail traffic (bg_bytes) as background."""
    import numpy as np
    from .solver import route_flat
    N, G = cl.N, cl.G
    W = cl.PI.shape[2]
    out = np.zeros((N, G, G, W))
    ii, jj = np.nonzero(~np.eye(G, dtype=bool))
    fast = cl.fast[ii, jj]
    out[:, ii, jj, fast] = prob.intra[:, ii, jj]
    node_t = ((prob.intra_fast() + bg_bytes) * prob.inv).max(1)
    for a in np.flatnonzero(node_t > target_us * (1 + 0.5 * gap)).tolist():
        plan = route_flat(cl.node, prob.intra[a], iters=iters, min_split_bytes=prob.split_intra, gap=gap,
                          min_share=min_share, background_us=bg_bytes[a] * prob.inv)
        out[a] = plan.split[2].reshape(G, G, -1)[:, :, :W]
    return out


def _finish(cl, prob: _Problem, M, bg, iters: int, gap: float, min_share: float, extra):
    """Each node's own demands around the rail bytes bg, the link loads and times and the
    certificate: (intra, loads (N, L) bytes, times (N, L) us, lower bound, its prices)."""
    intra = _intra(cl, prob, bg, float((bg * prob.inv).max()), iters, gap, min_share)
    loads = bg + _intra_bytes(cl, intra)
    times = loads * prob.inv
    lower, prices = _certify(cl, M, times, gap, extra)
    return intra, loads, times, lower, prices


def route_hier(topo: Topology, matrix, iters: int = 30, min_split_bytes: int = 1 << 20, gap: float = 0.02,
               min_share: float = 0.01) -> HierPlan:
    """Min-congestion routing of matrix[s][d] bytes on a cluster topology, hierarchically (see the
    module docstring): rails first (shares per GPU, one small LP per node), then each node's own
    demands. The plan states its certified lower bound (`lower_bound_us`). The matrix: n rows of n
    byte counts, checked as route()'s is (MisuseError; floats floored). Deterministic."""
    import numpy as np
    t0 = time.perf_counter()
    checks.whole(iters, "route: iters", 1)
    checks.real(min_split_bytes, "route: min_split_bytes", strict=False)
    checks.real(gap, "route: gap", strict=False, hint="the relative gap to the optimum at which to stop")
    checks.real(min_share, "route: min_share", high=1.0, hint="the smallest share of a demand a path keeps")
    cl = _cluster(topo)
    M = _demands(topo, matrix)
    prob = _Problem(cl, M, float(min_split_bytes))
    N, G = cl.N, cl.G
    mu = lam = np.zeros((N, G))
    fast = prob.intra_fast()
    rails = prob.rails(mu, lam)
    bg = _rail_bytes(cl, rails)
    intra, loads, times, lower, prices = _finish(cl, prob, M, bg, iters, gap, min_share, ())
    if prob.big.any() and float(times.max()) > lower * (1 + gap):
        # the even spread is not certified within gap: share LP rounds, each node's best shares with
        # the others' held, then the step toward them (exact loads) that lowers the cluster's
        # busiest link most; none lowers it: done
        now = float(((bg + fast) * prob.inv).max())
        lp_prices, moved = [], False
        for _ in range(_ROUNDS):
            mu1, lam1, pr = prob.share_lp((bg + fast) * prob.inv, mu, lam)
            lp_prices.append(pr)
            found = None
            for t in _STEPS:
                mt, lt = mu + t * (mu1 - mu), lam + t * (lam1 - lam)
                r = prob.rails(mt, lt)
                b = _rail_bytes(cl, r)
                tt = float(((b + fast) * prob.inv).max())
                if tt < now * (1 - 1e-9) and (found is None or tt < found[0]):
                    found = (tt, mt, lt, r, b)
            if found is None:
                break
            now, mu, lam, rails, bg = found
            moved = True
        lower2, prices2 = _certify(cl, M, times, gap, lp_prices)
        if moved:                                   # kept only if better with each node's own demands too
            done = _finish(cl, prob, M, bg, iters, gap, min_share, lp_prices)
            if float(done[2].max()) < float(times.max()):
                intra, loads, times, lower2, prices2 = done
            else:
                mu = lam = np.zeros((N, G))
                rails = prob.rails(mu, lam)
        if lower2 > lower:
            lower, prices = lower2, prices2
    worst = float(times.max())
    # a bound above the plan only by rounding: the plan is optimal
    plan = HierPlan(topo.name, cl, rails, intra, loads.ravel(), worst, 0.0, min(float(lower), worst),
                    lam, mu, prices)
    plan.plan_time_us = (time.perf_counter() - t0) * 1e6
    return plan


def reapply(topo: Topology, old: HierPlan, M, split: float, tolerance: float, t0: float) -> HierPlan | None:
    """`old`'s plan applied to the checked matrix M (N, G, N, G whole bytes, hier._demands): its
    per-GPU rail shares, and per node pair its path fractions (a pair it did not carry, or one at
    or below `split` bytes, takes its fastest path). None when the result is not provably within
    `tolerance` of the optimum for M: its largest link time against the bound that old's link
    prices give for M (weak duality). Router.plan's reuse for clusters."""
    import numpy as np
    cl = _cluster(topo)
    prob = _Problem(cl, M, float(split))
    lower = lower_bound(cl, M, old.prices.reshape(cl.N, cl.L)) if old.prices is not None else 0.0
    if not lower > 0:
        return None
    rails = prob.rails(old.mu, old.lam)
    tot = old.intra.sum(-1, keepdims=True)
    W = old.intra.shape[-1]
    fastest = np.eye(W)[cl.fast][None]                              # (1, G, G, W)
    frac = np.where(tot > 0, old.intra / np.where(tot > 0, tot, 1.0), fastest)
    frac = np.where((prob.intra > split)[..., None], frac, fastest)
    ints = np.floor(frac * prob.intra[..., None])
    rest = (prob.intra - ints.sum(-1)).ravel()
    flat = ints.reshape(-1, W)
    flat[np.arange(len(flat)), frac.reshape(-1, W).argmax(1)] += rest
    loads = _rail_bytes(cl, rails) + _intra_bytes(cl, ints)
    worst = float((loads * prob.inv).max())
    if worst > (1 + tolerance) * lower:
        return None
    plan = HierPlan(topo.name, cl, rails, ints, loads.ravel(), worst, 0.0, min(float(lower), worst), old.lam, old.mu,
                    old.prices, reused=True)
    plan.plan_time_us = (time.perf_counter() - t0) * 1e6
    return plan
