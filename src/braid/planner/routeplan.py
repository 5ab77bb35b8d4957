"""A flat plan: every demand's bytes split over its candidate paths (the flat solver's result and
what a Router reuse returns). Pure Python + numpy."""
from __future__ import annotations

from .paths import Path


class RoutePlan:
    """A plan: every demand's bytes split over its candidate paths.

    flows: (src, dst) -> [(Path, bytes)], bytes > 0 summing exactly to the demand. Built from the
    integer split on first access (a dict of Path objects costs more than the plan itself on a
    cache hit); `split` has the same numbers as arrays: (src, dst, bytes[n*n, W]) over every
    ordered pair, column j = the pair's j-th candidate.
    link_load: link -> bytes (weighted by the path's use of the link), also built on first access;
    max_load_us: the most loaded link's time; lower_bound_us: proven, no split over these paths
    beats it (0: none); reused: an earlier plan's path fractions rescaled to this matrix."""

    def __init__(self, topology: str, c, ints, loads, max_load_us: float, plan_time_us: float,
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

