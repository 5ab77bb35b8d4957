"""The flat solver: one topology's path LP (min tau subject to every demand split over its
candidate paths and every link's time <= tau) by a primal-dual interior point method (Mehrotra
predictor-corrector). docs/router.md describes the method, its clean-ups and its measurements.

This module stays longer than the others: the compiled tables (`_Compiled`, `_Rows`), the Newton
solve (`_solve`) and the clean-ups (`_shorten`) share their array layouts, and splitting them
would spread one data structure over several files. The interior point loop in `_solve` is kept
whole for the same reason: its predictor, corrector and certificate work on the same local arrays.
"""
from __future__ import annotations

import math
import time

from . import checks
from .checks import MisuseError
from .paths import Path, Topology
from .routeplan import RoutePlan


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
        # kept whole (100 lines): one pass over the topology's paths fills every table the
        # solver reads; each table's rows depend on the index maps built a few lines before
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
    the returned fractions).

    Kept whole (134 lines): one Newton iteration's predictor, certificate checks and corrector
    share a dozen arrays updated in place; split into functions they would pass them all around."""
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


def route_flat(topo: Topology, matrix: list[list[int]], iters: int = 30, min_split_bytes: int = 1 << 20,
               gap: float = 0.02, min_share: float = 0.01, background_us=None) -> RoutePlan:
    """Min-congestion routing of matrix[s][d] bytes over the topology's candidate paths.

    An interior point method on the path LP (see `_solve`): a handful of Newton rounds, each
    reduced to one links x links system, stopping once the plan is provably within `gap` of the
    optimum (a dual lower bound certifies it; `lower_bound_us` keeps it). Demands at or below
    `min_split_bytes`, and pairs with one useful candidate, take their fastest path and are fixed
    load for the rest. Then the plan is made short where the bound allows (`_shorten`).
    Rejected: Frank-Wolfe on a soft maximum (first-order: 30-120 rounds and 9-100 ms here, still
    1.05x on some matrices, stalls where links tie) and slice-by-slice greedy (1.17x).
    `background_us` (optional, one time per link in capacity order): what other traffic already
    takes on each link; the split demands are balanced around it, and the plan's loads leave it out
    (the hierarchical planner passes a node's rail traffic when it routes that node's own pairs).

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
        if background_us is not None:              # other traffic on these links (hier.py: a node's rails)
            fixed = fixed + np.append(background_us, 0.0)
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

