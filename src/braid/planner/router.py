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

This module is the router's front: `route()` sends a topology of one node, and a cluster of at
most hier.FLAT_MAX_GPUS GPUs, to the flat solver (`braid.planner.solver`; a cluster's paths are
built on demand) and a larger multi-node one (a Topology with a `cluster`, from `multi_node()`) to
the hierarchical planner (`braid.planner.hier`), which plans across the NIC rails and then within
each node without enumerating every pair's paths. The pieces:
    paths.py       Path, Topology                       topologies.py  nvswitch, mesh, multi_node, preset
    cluster.py     the multi-node structure              solver.py      the flat interior point solver
    hier.py        the hierarchical planner             smalllp.py     batched small dense LPs (hier.py)
    routeplan.py   RoutePlan (flat plans)               reuse.py       Router, SplitThreshold, signature
"""
from __future__ import annotations

from . import checks
from .hier import hierarchical
from .paths import Path, Topology
from .reuse import Router, SplitThreshold, _signature_key, signature
from .routeplan import RoutePlan
from .solver import _compiled, _rowmin, route_flat
from .topologies import mesh, multi_node, nvswitch, preset

__all__ = ["Path", "Topology", "RoutePlan", "Router", "SplitThreshold", "direct_only", "mesh", "multi_node",
           "nvswitch", "preset", "route", "route_flat", "signature", "_compiled", "_rowmin", "_signature_key"]


def route(topo: Topology, matrix: list[list[int]], iters: int = 30, min_split_bytes: int = 1 << 20,
          gap: float = 0.02, min_share: float = 0.01):
    """Min-congestion routing of matrix[s][d] bytes over the topology's candidate paths: the flat
    solver for one node (`solver.route_flat`: every plan within `gap` of its proven lower bound)
    and for a cluster of at most hier.FLAT_MAX_GPUS GPUs (over its paths built on demand), the
    hierarchical planner for a larger multi-node topology (`hier.route_hier`). Demands at or below
    `min_split_bytes` take one path. The matrix: n rows of n byte counts (ints or floats, finite,
    >= 0; floats floored); anything else raises MisuseError (braid.planner.checks)."""
    if hierarchical(topo):
        from .hier import route_hier
        return route_hier(topo, matrix, iters=iters, min_split_bytes=min_split_bytes, gap=gap)
    return route_flat(topo, matrix, iters=iters, min_split_bytes=min_split_bytes, gap=gap, min_share=min_share)


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
