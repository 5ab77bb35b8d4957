"""Small min-max LPs, many at once: for each problem b of a batch,

    minimize   tau
    subject to a[b, e] + C[b, e, :] . v <= tau      for every row e (a link's time)
               0 <= v <= 1                          (m variables, each a share between two plans)

by a primal-dual interior point method (Mehrotra predictor-corrector) on the inequality form
min c.x s.t. G x <= h, x = (v, tau). Each Newton step solves one (m+1) x (m+1) system per problem
(np.linalg.solve over the batch), so a batch of 16 problems of 17 variables costs about as much
as one. The hierarchical planner (hier.py) uses it for its per-node share LPs.

Returns v, tau and the row prices (the duals of the row constraints, >= 0, summing to 1 per
problem): weak duality makes any such prices a lower bound on every plan's largest link time,
which is how the planner certifies its plans. Pure numpy.
"""
from __future__ import annotations


def minmax(a, C, iters: int = 40, tol: float = 1e-9):
    """Solve the batch (a: (B, R), C: (B, R, m)); returns (v (B, m), tau (B,), prices (B, R)).

    The rows are scaled by their largest magnitude (times of 1e3-1e6 us become O(1)), the start is
    v = 1/2 with tau above every row (primal strictly feasible), z = 1 (dual infeasible: the
    method reduces the dual residual with the gap). A problem stops when its gap and residuals are
    under `tol` relative (the others go on without it), all after `iters` Newton steps. Kept whole: the predictor,
    corrector and step lengths share the same batch arrays."""
    import numpy as np
    a = np.asarray(a, dtype=np.float64)
    C = np.asarray(C, dtype=np.float64)
    nb, nr, m = C.shape
    scale = np.maximum(np.abs(a).max(1), np.abs(C).max((1, 2)))
    scale = np.where(scale > 0, scale, 1.0)
    a = a / scale[:, None]
    C = C / scale[:, None, None]
    # G: (B, R + 2m, m + 1); h: (B, R + 2m); c = (0, ..., 0, 1)
    eye = np.eye(m)
    G = np.zeros((nb, nr + 2 * m, m + 1))
    G[:, :nr, :m] = C
    G[:, :nr, m] = -1.0
    G[:, nr:nr + m, :m] = eye
    G[:, nr + m:, :m] = -eye
    h = np.concatenate((-a, np.ones((nb, m)), np.zeros((nb, m))), 1)
    c = np.zeros(m + 1)
    c[m] = 1.0
    x = np.full((nb, m + 1), 0.5)
    x[:, m] = (a + C.sum(2) * 0.5).max(1) + 1.0
    s = h - np.einsum("brk,bk->br", G, x)
    z = np.ones_like(s)
    nrow = s.shape[1]
    Gt = G.transpose(0, 2, 1)

    def newton(G, Gt, s, z, rd, rp, rc, w):
        # G^T W G dx = -rd - G^T (rc / s + w * rp), w = z / s; then ds, dz
        M = (Gt * w[:, None, :]) @ G
        rhs = -rd - (Gt @ (rc / s + w * rp)[..., None])[..., 0]
        try:
            dx = np.linalg.solve(M, rhs[..., None])[..., 0]
        except np.linalg.LinAlgError:           # a nearly converged problem's system: least squares
            dx = np.stack([np.linalg.lstsq(Mb, rb, rcond=None)[0] for Mb, rb in zip(M, rhs)])
        ds = -rp - (G @ dx[..., None])[..., 0]
        dz = (rc - z * ds) / s
        return dx, ds, dz

    def longest(v, dv):                         # largest step in [0, 1] keeping v + t dv >= 0, per problem
        ratio = np.where(dv < 0, -v / np.where(dv < 0, dv, -1.0), np.inf)
        return np.minimum(1.0, ratio.min(1))

    act = np.arange(nb)                         # the problems still iterating: a converged one stops
    for it in range(iters):
        Ga, Gta, xa, sa, za, ha = G[act], Gt[act], x[act], s[act], z[act], h[act]
        rd = (Gta @ za[..., None])[..., 0] + c
        rp = (Ga @ xa[..., None])[..., 0] + sa - ha
        gap = (sa * za).sum(1)
        mu = gap / nrow
        done = (gap <= tol * (1 + np.abs(xa[:, m]))) & (np.abs(rd).max(1) <= tol) & (np.abs(rp).max(1) <= tol)
        done |= ~(sa.min(1) > 0) | ~(za.min(1) > 0)
        if done.any():
            keep = ~done
            act = act[keep]
            if not len(act):
                break
            Ga, Gta, xa, sa, za, ha = Ga[keep], Gta[keep], xa[keep], sa[keep], za[keep], ha[keep]
            rd, rp, mu = rd[keep], rp[keep], mu[keep]
        w = za / sa
        dx, ds, dz = newton(Ga, Gta, sa, za, rd, rp, -sa * za, w)
        ap, ad = longest(sa, ds), longest(za, dz)
        mu_aff = ((sa + ap[:, None] * ds) * (za + ad[:, None] * dz)).sum(1) / nrow
        sigma = np.clip(mu_aff / np.maximum(mu, 1e-300), 0.0, 1.0) ** 3
        rc = -sa * za + (sigma * mu)[:, None] - ds * dz
        dx, ds, dz = newton(Ga, Gta, sa, za, rd, rp, rc, w)
        ap, ad = 0.99 * longest(sa, ds), 0.99 * longest(za, dz)
        x[act] = xa + ap[:, None] * dx
        s[act] = sa + ap[:, None] * ds
        z[act] = za + ad[:, None] * dz
    v = np.clip(x[:, :m], 0.0, 1.0)
    prices = np.maximum(z[:, :nr], 0.0)
    tot = prices.sum(1, keepdims=True)
    prices = np.where(tot > 0, prices / np.where(tot > 0, tot, 1.0), 1.0 / nr)
    tau = (a + np.einsum("brk,bk->br", C, v)).max(1) * scale
    return v, tau, prices
