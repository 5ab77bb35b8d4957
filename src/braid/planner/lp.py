"""The exact optimum of a routing problem, for checking the router (needs numpy and scipy).

min t  subject to: every demand's bytes are split over its candidate paths, and every link's time
(weighted bytes / capacity) is at most t. Same candidate paths as the router, so the ratio
router / LP measures the solver alone.
"""
from __future__ import annotations

from . import checks
from .router import Topology


def lp_optimum(topo: Topology, matrix: list[list[int]]) -> float:
    """The smallest possible most-loaded-link time in microseconds (raises ImportError without scipy).
    The matrix is checked as route()'s is (MisuseError on bad input)."""
    checks.topology(topo)
    checks.demands(matrix, topo.num_gpus, topo.name)
    import numpy as np
    from scipy.optimize import linprog
    demands = [(s, d, matrix[s][d]) for s in range(len(matrix)) for d in range(len(matrix))
               if s != d and matrix[s][d] > 0]
    if not demands:
        return 0.0
    var = [(i, p) for i, (s, d, _) in enumerate(demands) for p in topo.candidates(s, d)]
    links = list(topo.capacity)
    li = {e: j for j, e in enumerate(links)}
    nv = len(var) + 1
    c = np.zeros(nv)
    c[-1] = 1.0
    a_eq = np.zeros((len(demands), nv))
    b_eq = np.array([b for _, _, b in demands], float)
    a_ub = np.zeros((len(links), nv))
    for k, (i, p) in enumerate(var):
        a_eq[i, k] = 1.0
        for e, w in p.links:
            a_ub[li[e], k] += w / (topo.capacity[e] * 1e3)
    a_ub[:, -1] = -1.0
    res = linprog(c, A_ub=a_ub, b_ub=np.zeros(len(links)), A_eq=a_eq, b_eq=b_eq,
                  bounds=[(0, None)] * nv, method="highs")
    if res.status != 0:
        raise RuntimeError(f"LP failed: {res.message}")
    return float(res.fun)
