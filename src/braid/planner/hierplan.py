"""A hierarchical plan (hier.py's result): the same face as a flat RoutePlan (flows, split,
link_load, max_load_us, lower_bound_us, to_dict), kept as arrays, since a cluster of 128 nodes has
1M demands. Pure Python + numpy."""
from __future__ import annotations

from .paths import Path
from .routeplan import RoutePlan


class HierPlan(RoutePlan):
    """Every demand's bytes over its candidates, as arrays:
        rails  (N, G, N, G, K) whole bytes from GPU i of node a to GPU j of node b on rail k
               (zero on a node's own block)
        intra  (N, G, G, W) whole bytes between GPUs of one node per candidate (cluster.node order)
        loads  (N * L,) bytes per link, node-major in cluster.link_names() order
    lam, mu (N, G): the shares the plan was built from (hier.py: mu[a, i] of GPU i of node a's
    bytes out on its own rail, lam[b, j] of the bytes into GPU j of node b on that GPU's home rail,
    the rest spread over every rail); prices (N, L): the link prices of its lower bound, which a
    Router applies to a new matrix to check a reuse. `flows`, `split` and
    `link_load` are built on first access, as the flat plan's are."""

    def __init__(self, topology: str, cluster, rails, intra, loads, max_load_us: float, plan_time_us: float,
                 lower_bound_us: float, lam, mu, prices, reused: bool = False):
        self.topology = topology
        self.cluster = cluster
        self.rails, self.intra, self.loads = rails, intra, loads
        self.max_load_us = max_load_us
        self.plan_time_us = plan_time_us
        self.lower_bound_us = lower_bound_us
        self.lam, self.mu, self.prices = lam, mu, prices
        self.reused = reused
        self.fractions = None             # the flat plan's reuse table: not used for cluster plans
        self._flows = self._link_load = None

    @property
    def flows(self) -> dict[tuple[int, int], list[tuple[Path, int]]]:
        if self._flows is None:
            import numpy as np
            cl = self.cluster
            G = cl.G
            out: dict[tuple[int, int], list[tuple[Path, int]]] = {}
            a, i, b, j, k = np.nonzero(self.rails)
            vals = self.rails[a, i, b, j, k].astype(np.int64).tolist()
            pos = cl.pos[i, j, k].tolist()
            rows = sorted(zip((a * G + i).tolist(), (b * G + j).tolist(), pos, k.tolist(), vals))
            for s, d, _, kk, v in rows:                # candidate order within each demand
                out.setdefault((s, d), []).append((cl.rail_path(s, d, kk), v))
            a, i, j, c = np.nonzero(self.intra)
            vals = self.intra[a, i, j, c].astype(np.int64).tolist()
            cache: dict[tuple[int, int, int], list[Path]] = {}
            for aa, ii, jj, cc, v in zip(a.tolist(), i.tolist(), j.tolist(), c.tolist(), vals):
                ps = cache.get((aa, ii, jj))
                if ps is None:
                    ps = cache[(aa, ii, jj)] = cl._intra(aa, ii, jj)
                out.setdefault((aa * G + ii, aa * G + jj), []).append((ps[cc], v))
            self._flows = out
        return self._flows

    @property
    def split(self):
        """(src, dst, bytes[n*n, W]) over every ordered pair, column = the pair's candidate index."""
        import numpy as np
        cl = self.cluster
        N, G, K = cl.N, cl.G, cl.K
        n = N * G
        W = max(K, self.intra.shape[-1])
        out = np.zeros((n, n, W), dtype=np.int64)
        a, i, b, j, k = np.nonzero(self.rails)
        out[a * G + i, b * G + j, cl.pos[i, j, k]] = self.rails[a, i, b, j, k].astype(np.int64)
        a, i, j, c = np.nonzero(self.intra)
        out[a * G + i, a * G + j, c] = self.intra[a, i, j, c].astype(np.int64)
        s, d = np.divmod(np.arange(n * n), n)
        return s, d, out.reshape(n * n, W)

    @property
    def link_load(self) -> dict[str, float]:
        if self._link_load is None:
            self._link_load = dict(zip(self.cluster.link_names(), self.loads.tolist()))
        return self._link_load
