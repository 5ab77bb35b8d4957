"""A multi-node machine as the hierarchical planner sees it: N identical nodes of G GPUs, joined
only by K NIC rails (NIC k of one node talks to NIC k of another: rail-matched, as NIMBLE and
NCCL's PXN do). Pure Python + numpy, no torch.

A `Cluster` is described by a few functions rather than by every pair's paths (128 nodes of 8 GPUs
have 1M ordered pairs and 8M rail paths; enumerating them took seconds and gigabytes):
    links(a)                 node a's links in a fixed order, name -> GB/s (the same capacities
                             in the same order on every node; NICs are links of their node)
    intra(a, i, j)           the candidate paths from local GPU i to local GPU j of node a
    rail(a, i, b, j, k)      the path from GPU i of node a to GPU j of node b over rail k: its
                             links on node a (the leg to the rail's NIC, NIC k's send side) and on
                             node b (NIC k's receive side, the leg to GPU j)
    offered(i, j)            the rails offered between local GPUs i and j, in candidate order
    home[i]                  local GPU i's own (or nearest) rail
Every node has the same shape, so the planner reads each path's use of its source and destination
node's links once, from node 0 to node 1, as templates over local link indices; node a's link l
is global link a * L + l. `candidates(s, d)` builds the real Path objects on demand (the same
functions), and `LazyPaths` offers them as a read-only mapping, so code written for enumerated
topologies (lp_optimum, the flat solver, tests) still works on small clusters.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

from . import checks
from .checks import MisuseError
from .paths import Path, Topology


class Cluster:
    def __init__(self, nodes: int, gpus: int, rails: int, links, intra, rail, offered, home):
        import numpy as np
        self.N = checks.whole(nodes, "cluster: nodes", 2, "one node is a flat topology")
        self.G = checks.whole(gpus, "cluster: gpus per node", 1)
        self.K = checks.whole(rails, "cluster: rails (NICs per node)", 1)
        self._links, self._intra, self._rail, self._offered = links, intra, rail, offered
        self.home = tuple(int(k) for k in home)
        if len(self.home) != self.G or not all(0 <= k < self.K for k in self.home):
            raise MisuseError(f"cluster: home = {home!r}: one rail in 0..{self.K - 1} per local GPU")
        first = list(links(0).items())
        self.L = len(first)
        self.cap = np.array([float(v) for _, v in first])
        self.names: list[list[str]] = []
        self.capacity: dict[str, float] = {}
        for a in range(self.N):
            items = first if a == 0 else list(links(a).items())
            if len(items) != self.L or any(float(v) != c for (_, v), c in zip(items, self.cap)):
                raise MisuseError(f"cluster: node {a} has other links than node 0; the nodes must be alike")
            for e, v in items:
                if e in self.capacity:
                    raise MisuseError(f"cluster: link {e!r} belongs to two nodes; name each node's links apart")
                self.capacity[e] = v
            self.names.append([e for e, _ in items])
        self._templates()

    # ---- templates ---------------------------------------------------------------------------
    def _use(self, path: Path, index: dict[str, int], other: dict[str, int] | None, where: str):
        import numpy as np
        mine, theirs = np.zeros(self.L), np.zeros(self.L)
        for e, w in path.links:
            if isinstance(w, bool) or not isinstance(w, numbers.Real) or not (math.isfinite(w) and w >= 0):
                raise MisuseError(f"cluster: the {path.name()} path {where} uses link {e!r} {w!r} times per byte; "
                                  f"a use must be finite and >= 0")
            if e in index:
                mine[index[e]] += w
            elif other is not None and e in other:
                theirs[other[e]] += w
            else:
                raise MisuseError(f"cluster: the {path.name()} path {where} crosses link {e!r}, which is not a link "
                                  f"of its nodes")
        return mine, theirs

    def _templates(self) -> None:
        """Per (local i, local j, rail k): the path's use of the source node's links (S) and of the
        destination node's links (D); the offered rails, the base rail H (the destination's home,
        else the first offered), the source's own rail O (its home where offered, else H); per
        intra-node pair its candidates' use of the node's links (PI) and the fastest one."""
        import numpy as np
        G, K, L = self.G, self.K, self.L
        i0 = {e: l for l, e in enumerate(self.names[0])}
        i1 = {e: l for l, e in enumerate(self.names[1])}
        self.S = np.zeros((G, G, K, L))
        self.D = np.zeros((G, G, K, L))
        self.off = np.zeros((G, G, K), dtype=bool)
        self.order = [[[] for _ in range(G)] for _ in range(G)]
        self.H = np.zeros((G, G), dtype=np.intp)
        self.O = np.zeros((G, G), dtype=np.intp)
        for i in range(G):
            for j in range(G):
                ks = [int(k) for k in self._offered(i, j)]
                if not ks or len(set(ks)) != len(ks) or not all(0 <= k < K for k in ks):
                    raise MisuseError(f"cluster: offered({i}, {j}) = {ks!r}: distinct rails in 0..{K - 1}, at least one")
                self.order[i][j] = ks
                for k in ks:
                    self.off[i, j, k] = True
                    self.S[i, j, k], self.D[i, j, k] = self._use(self._rail(0, i, 1, j, k), i0, i1,
                                                                 f"from GPU {i} of node 0 to GPU {j} of node 1")
                self.H[i, j] = self.home[j] if self.home[j] in ks else ks[0]
                self.O[i, j] = self.home[i] if self.home[i] in ks else self.H[i, j]
        self.Hk = np.eye(K)[self.H]                          # (G, G, K) one-hot
        self.Ok = np.eye(K)[self.O]
        self.E = self.off / self.off.sum(2, keepdims=True)
        self.pos = np.full((G, G, K), -1, dtype=np.intp)    # rail -> candidate position
        for i in range(G):
            for j in range(G):
                for p, k in enumerate(self.order[i][j]):
                    self.pos[i, j, k] = p

        def side(T, w):
            return np.einsum("ijk,ijkl->ijl", w, T)
        self.SH, self.SE, self.SO = side(self.S, self.Hk), side(self.S, self.E), side(self.S, self.Ok)
        self.DH, self.DE, self.DO = side(self.D, self.Hk), side(self.D, self.E), side(self.D, self.Ok)
        # one node's own paths, over node 0's links (in local order) as a flat topology
        cap0 = {e: self.capacity[e] for e in self.names[0]}
        node = Topology(f"node of {G} GPUs", G, cap0)
        for i in range(G):
            for j in range(G):
                if i != j:
                    ps = list(self._intra(0, i, j))
                    if not ps:
                        raise MisuseError(f"cluster: no path from GPU {i} to GPU {j} inside a node")
                    node.paths[(i, j)] = ps
        self.node = node
        C = max(1, max((len(p) for p in node.paths.values()), default=1))
        self.PI = np.zeros((G, G, C, L))
        self.PImask = np.zeros((G, G, C), dtype=bool)
        inv = 1.0 / self.cap
        self.P0 = np.zeros((G, G, L))
        self.fast = np.zeros((G, G), dtype=np.intp)
        for (i, j), ps in node.paths.items():
            for c, p in enumerate(ps):
                self.PI[i, j, c] = self._use(p, i0, None, f"from GPU {i} to GPU {j} inside node 0")[0]
                self.PImask[i, j, c] = True
            t = [float(self.PI[i, j, c] @ inv) for c in range(len(ps))]
            self.fast[i, j] = min(range(len(ps)), key=lambda c: (t[c], c))
            self.P0[i, j] = self.PI[i, j, self.fast[i, j]]

    # ---- GPUs and paths ----------------------------------------------------------------------
    @property
    def num_gpus(self) -> int:
        return self.N * self.G

    def link_names(self) -> list[str]:
        return [e for names in self.names for e in names]

    def candidates(self, s: int, d: int) -> list[Path]:
        a, i = divmod(s, self.G)
        b, j = divmod(d, self.G)
        if a == b:
            return list(self._intra(a, i, j))
        return [self._rail(a, i, b, j, k) for k in self.order[i][j]]

    def rail_path(self, s: int, d: int, k: int) -> Path:
        a, i = divmod(s, self.G)
        b, j = divmod(d, self.G)
        return self._rail(a, i, b, j, k)


class LazyPaths(Mapping):
    """(s, d) -> the candidate paths between GPUs s != d of a Cluster, built when asked for (a
    read-only mapping: nothing is stored)."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.n = cluster.num_gpus

    def __getitem__(self, key):
        s, d = key
        if not (isinstance(s, numbers.Integral) and isinstance(d, numbers.Integral)
                and 0 <= s < self.n and 0 <= d < self.n and s != d):
            raise KeyError(key)
        return self.cluster.candidates(int(s), int(d))

    def __iter__(self):
        return ((s, d) for s in range(self.n) for d in range(self.n) if s != d)

    def __len__(self) -> int:
        return self.n * (self.n - 1)


def topology(name: str, cluster: Cluster, source: str = "") -> Topology:
    """The router Topology of a cluster: its links, its paths on demand, and the cluster itself
    (which sends route() to the hierarchical planner)."""
    topo = Topology(name, cluster.num_gpus, dict(cluster.capacity), LazyPaths(cluster), source, cluster)
    checks.topology(topo, paths=False)
    return topo
