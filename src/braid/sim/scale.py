"""Collectives on N nodes x G GPUs: braid's hierarchical steps against NCCL's own algorithms, and
skewed all-to-all routed by the hierarchical planner against one path per demand.

Sizes (nccl-tests' convention): M is the buffer each GPU holds: the all_reduce message, the
reduce_scatter input, the all_gather output (each rank contributes M / W), the bytes each GPU
sends in an all_to_all (M / W to every rank). W = N * G ranks; busbw = M / time x bus factor
(2(W-1)/W for all_reduce, (W-1)/W for the others).

Machine (`MACHINES`, every constant with its source): a node is the simulator's one-node model
(`collectives.simulate_op` on an NVSwitch `SimTopology` of G GPUs: NVLink ports, PCIe, host
memory, braid's ce / host lanes and NCCL's ring at `nccl_ring_efficiency` of NVLink); between nodes
K NICs per node of `nic_gbps` each, and every step that crosses nodes pays `net_step_us`.

braid (`comm/hier.py`): node steps on braid's lanes, rail steps on NCCL, one after the other:
    all_reduce       node reduce_scatter(M) -> rail all_reduce(M/G) -> node all_gather(M/G per rank)
    all_gather       rail all_gather(M/W per rank) -> node all_gather(M/G per rank)
    reduce_scatter   node reduce_scatter(M) -> rail reduce_scatter(M/G)
    all_to_all       node all_to_all(M) -> rail all_to_all(M)
  A node step's time is the simulator's: `collectives.choose` picks the lanes' shares from
  simulated lane costs (NCCL alone, or a split of ce + host, as braid on GPUs), `simulate_op` runs
  them. `nccl_node_us` is the same hierarchy with NCCL alone inside the node (what braid's lanes
  add); `overlap_us` is the slowest step alone (a bound for a braid that pipelined its steps).
  The G rail groups run at once and share the node's K NICs: each GPU gets B = K * nic / G.
  A rail step on NCCL over N ranks (one GPU per node), alpha = net_step_us:
    all_reduce of S  min(ring 2(N-1) alpha + 2(N-1)/N S / B,  tree 2 ceil(log2 N) alpha + 2 S / B)
    all_gather       (N-1) alpha + (N-1) c / B          (c: one rank's contribution)
    reduce_scatter   (N-1) alpha + (N-1)/N S / B
    all_to_all       alpha + (N-1)/N S / B              (every peer at once)

NCCL flat over W ranks (its own algorithms across nodes, pipelined, so one bottleneck):
  per-GPU bus bytes b (all_reduce 2(W-1)/W M; all_gather, reduce_scatter (W-1)/W M), at
  B_flat = min(eff * NVLink, K * nic): a ring's bytes cross each GPU's NVLink port once and, per
  node, its K NICs once in all (each channel's ring leaves the node once);
    ring             2(W-1) (all_reduce) or W-1 steps, each alpha (net_step_us across nodes, one
                     node: nccl_step_us), + b / B_flat
    tree (all_reduce) 2 (ceil(log2 N) alpha + (G-1) nccl_step_us) + 2 M / B_flat   (double binary
                     tree between nodes, a chain inside: every rank sends ~2M, as in the ring)
    all_reduce takes the faster of the two (NCCL's tuner picks per size); all_gather and
    reduce_scatter the ring;
    all_to_all       alpha + max((G-1)/W M / (eff * NVLink), G (N-1)/N M / (K * nic)).
  One node (N = 1): NCCL's node model above (the simulator's ring).

Skewed all_to_all (`skew`): every rank sends `hot` of its M to GPU 0 of the next node (one hot
expert per node, the MoE case) and the rest evenly to every other rank (hot = 0: balanced). The
matrix goes to the router on `multi_node(N, G, K, nic, NVLink)`; `route()` plans a cluster above
16 GPUs hierarchically (planner/hier.py); its `max_load_us` (busiest link) is the routed time. Direct
(one path per demand, NCCL with PXN): intra-node demands on NVLink, inter-node ones on the
destination's home rail (`direct_pxn_us`, the same link loads as `router.direct_only` where that
first candidate is the home rail; on a multi-node topology the router's first candidate is
rail 0, so `direct_only` would send every pair over NIC 0). Both add one `net_step_us`. braid
today runs uneven all_to_all across nodes on NCCL whole (comm/hier.py): the routed time is what
the router's plan would give, FuseLink's and NIMBLE's gain from idle NICs.

Not modelled: NVLink SHARP / IB SHARP (NVLS, CollNet) and PAT, which would speed NCCL up; NCCL's
tree running below its ring's bandwidth (here it has the ring's, which favours NCCL); congestion
beyond the NICs (a rail-optimised, non-blocking network); host-side costs of braid's steps; incast
above a NIC's line rate. Nothing here is calibrated on a multi-node machine.

The two-node link proxy (`run`, `sweep`, `braid sim scale --proxy`) is the earlier model: node 0's
links in the flow model with node 1 standing for every other node, latency-free. Folding: every
node does the same in these patterns, so one node's links carry what any node's carry; N enters
only through the demand sizes. Its variants: `single` = one path per demand (direct NVLink;
across nodes the destination's rail, as NCCL with PXN); `multi` = the router over direct, relay
and host-staged paths inside the node, only the destination's rail across; `borrow` = the router
with every rail, borrowed NICs reached through a relay GPU's buffer (FuseLink's policy as paths).
Its ops as demands (per GPU size M, hierarchical, pipelined):
    all_reduce  intra-node reduce-scatter + all-gather: M/8 twice to each of 7 local peers;
                across nodes each GPU's M/8 shard is all-reduced over its rail: 2(N-1)/N * M/8
    all_gather  across nodes a rail ring: each GPU forwards (N-1) * M; inside the node every GPU
                sends N * M (its node's share of the result) to each local peer
    alltoallv   each rank sends M: `hot` of it to GPU 0 of the next node, the rest evenly
"""
from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field

from ..planner import checks
from ..planner.checks import MisuseError
from ..planner.router import route
from .flow import BYTES_PER_US, Flow, simulate
from .topology import SimTopology, cluster, to_router

# -------------------------------------------------------------------------------------------------
# machines
# -------------------------------------------------------------------------------------------------

_NV4 = "probe on 2 and 4 x H200, 2026-11-22: copy-engine peer copy 387-396 GB/s; NVLink 4, the same on H100"
_BUSY = ("probe on 4 x H200, 2026-11-22: every GPU pushing to every other at once, 335 per GPU "
         "(assumed for 8 GPUs)")
_NIC = "FuseLink: one GPU on its own 400 Gb/s NIC, 49.3 GB/s"
_NET = ("assumption: one RDMA write and its completion through NCCL's network proxy, ~5 us per step "
        "that crosses nodes (a few us on InfiniBand)")
_RING = ("FlexLink's NCCL ring bus bandwidth 132-147 GB/s on 200 GB/s NVLink (preset h800x8-flexlink); "
         "assumed on every Hopper")
_STEP = "FlexLink (arXiv 2510.15882): NVLink latency 1-2 us (preset h800x8-flexlink)"
_LAT = ("measured on 2 x H200, 2026-11-22: a write/wait round trip through host counters 9.3 us, "
        "two per lane call")
_PCIE = "PCIe Gen5 x16, measured on 4 x H200, 2026-11-22: 55 one way, 102 both ways"
_HOST = ("assumption: two CPU sockets, each like the one-socket host of 4 x H200 (measured "
         "2026-11-22: 163)")
_HBM3 = ("assumption: the device copy measured on H200, 2100 GB/s (HBM3e 4.8 TB/s, 2026-11-22), scaled to HBM3 "
         "3.35 TB/s")


def _c(value, unit: str, source: str) -> dict:
    return {"value": value, "unit": unit, "source": source}


def _hopper(nv: float, nv_src: str, busy: float, busy_src: str, reduce: float, reduce_src: str,
            nic: float = 49.3, nic_src: str = _NIC, pcie: float = 55.0) -> dict[str, dict]:
    return {
        "nvlink_gbps": _c(nv, "GB/s per GPU per direction", nv_src),
        "nvlink_busy_gbps": _c(busy, "GB/s per GPU per direction", busy_src),
        "nccl_ring_efficiency": _c(0.7, "fraction of nvlink_gbps", _RING),
        "nccl_step_us": _c(1.5, "us per ring step inside a node", _STEP),
        "d2h_gbps": _c(pcie, "GB/s per GPU", _PCIE),
        "h2d_gbps": _c(pcie, "GB/s per GPU", _PCIE),
        "pcie_duplex_gbps": _c(102.0, "GB/s per GPU, both directions", _PCIE),
        "host_mem_gbps": _c(326.0, "GB/s, whole host", _HOST),
        "host_slot_bytes": _c(4 << 20, "bytes", "BRAID_HOST_CHUNK_KB default 4096 (envs.py)"),
        "ce_latency_us": _c(18.6, "us per call", _LAT),
        "host_latency_us": _c(18.6, "us per call", _LAT),
        "reduce_gbps": _c(reduce, "GB/s of device memory traffic", reduce_src),
        "nic_gbps": _c(nic, "GB/s per NIC per direction", nic_src),
        "net_step_us": _c(5.0, "us per step across nodes", _NET),
    }


@dataclass(frozen=True)
class Machine:
    """One node's GPUs (G, on an NVSwitch) and the constants of the multi-node model."""
    name: str
    gpus: int
    constants: dict
    summary: str

    def c(self, key: str) -> float:
        return self.constants[key]["value"]

    def node(self) -> SimTopology:
        """The simulator's one-node model of this machine (no NICs: only the node steps run on it)."""
        return SimTopology(f"{self.name}-node", 1, self.gpus, "nvswitch", 0, self.constants, self.summary)

    def sources(self) -> list[tuple[str, object, str, str]]:
        return [(k, v["value"], v["unit"], v["source"]) for k, v in self.constants.items()]


MACHINES: dict[str, Machine] = {
    "h100": Machine("h100", 8, _hopper(390.0, _NV4, 335.0, _BUSY, 1466.0, _HBM3),
                    "8 x H100 SXM on NVSwitch, 400 Gb/s NICs"),
    "h200": Machine("h200", 8, _hopper(390.0, _NV4, 335.0, _BUSY, 2100.0,
                                       "probe on 4 x H200, 2026-11-22: device-local copy 2100"),
                    "8 x H200 on NVSwitch, 400 Gb/s NICs"),
    "h800": Machine("h800", 8, _hopper(200.0, "H800 SXM spec: NVLink 400 GB/s both ways (FlexLink)", 172.0,
                                       "assumption: H200's all-at-once ratio 335/390 applied to 200", 1466.0, _HBM3,
                                       pcie=53.0),
                    "8 x H800 on NVSwitch (FlexLink's node), 400 Gb/s NICs (assumption: FlexLink measures one node)"),
    "nimble": Machine("nimble", 4, _hopper(360.0, "NIMBLE: 120 GB/s per directly wired GPU pair, 3 peers; "
                                                  "modelled as one 360 GB/s port per GPU on a switch", 360.0,
                                           "assumption: no all-at-once loss on direct links", 1466.0, _HBM3,
                                           nic=45.0, nic_src="NIMBLE (arXiv 2604.00317): one NDR400 NIC 45 GB/s"),
                      "4 x H100 per node, direct links (NIMBLE's node), NDR400 NICs"),
}
GPU_KINDS = tuple(MACHINES)
MODEL_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
LANES = ("nccl", "ce", "host")


def machine(name: str) -> Machine:
    if name not in MACHINES:
        raise MisuseError(f"scale: unknown machine {name!r}; known: {', '.join(MACHINES)}")
    return MACHINES[name]


def _check_nics(m: Machine, nics: int) -> int:
    nics = checks.whole(nics, "scale: nics (NICs per node)", 1)
    if m.gpus % nics:
        ok = ", ".join(str(k) for k in range(1, m.gpus + 1) if m.gpus % k == 0)
        raise MisuseError(f"scale: {nics} NICs per node on {m.name} ({m.gpus} GPUs per node): the NICs must divide "
                          f"the GPUs evenly; use {ok}")
    return nics


# -------------------------------------------------------------------------------------------------
# steps
# -------------------------------------------------------------------------------------------------

_SIM_OP = {"reduce_scatter": "reduce_scatter", "all_gather": "all_gather", "all_to_all": "all_to_all_single",
           "all_reduce": "all_reduce"}


@functools.lru_cache(maxsize=None)
def node_step(machine_name: str, op: str, nbytes: int, lanes: str = "braid") -> tuple[float, tuple]:
    """One node step on the simulator's node model: (time us, shares as sorted pairs). `nbytes` in
    the bench's convention (`collectives.py`: the reduce_scatter message, per rank for all_gather
    and all_to_all); lanes "braid" = the planner's choice over NCCL, ce and host, "nccl" = NCCL alone."""
    from .collectives import choose, simulate_op
    if nbytes <= 0:
        return 0.0, ()
    m = MACHINES[machine_name]
    topo = m.node()
    sim_op = _SIM_OP[op]
    shares = ({"nccl": 1.0} if lanes == "nccl" else
              choose(topo, sim_op, m.gpus, list(LANES), nbytes, native="nccl"))
    r = simulate_op(topo, sim_op, m.gpus, nbytes, shares)
    return r.time_us, tuple(sorted((k, round(v, 3)) for k, v in shares.items() if v > 0))


def rail_us(op: str, nodes: int, nbytes: float, rate_gbps: float, alpha_us: float) -> float:
    """NCCL over one rail group (one GPU per node, `nodes` ranks) at `rate_gbps` per GPU: the
    module docstring's formulas. `nbytes`: the all_reduce / reduce_scatter input, one rank's
    all_gather contribution, the bytes one rank holds for all_to_all."""
    n = nodes
    if n < 2 or nbytes <= 0:
        return 0.0
    B = rate_gbps * BYTES_PER_US
    if op == "all_reduce":
        ring = 2 * (n - 1) * alpha_us + 2 * (n - 1) / n * nbytes / B
        tree = 2 * math.ceil(math.log2(n)) * alpha_us + 2 * nbytes / B
        return min(ring, tree)
    if op == "all_gather":
        return (n - 1) * alpha_us + (n - 1) * nbytes / B
    if op == "reduce_scatter":
        return (n - 1) * alpha_us + (n - 1) / n * nbytes / B
    if op == "all_to_all":
        return alpha_us + (n - 1) / n * nbytes / B
    raise ValueError(f"unknown op {op!r}; known: {', '.join(MODEL_OPS)}")


def _node_bytes(m: Machine, op: str, M: int) -> int:
    """The bench's size of a one-node op whose buffer per GPU is M (nccl-tests' convention)."""
    return M // m.gpus if op == "all_gather" else M


def nccl_flat_us(m: Machine, op: str, nodes: int, nics: int, M: float) -> tuple[float, str]:
    """NCCL's own algorithm over all N * G ranks (module docstring): (time us, "ring" / "tree" /
    "p2p" / "node")."""
    G, W = m.gpus, nodes * m.gpus
    if nodes == 1:
        return node_step(m.name, op, _node_bytes(m, op, M), "nccl")[0], "node"
    nv = m.c("nccl_ring_efficiency") * m.c("nvlink_gbps")
    B = min(nv, nics * m.c("nic_gbps")) * BYTES_PER_US
    a, av = m.c("net_step_us"), m.c("nccl_step_us")
    if op == "all_reduce":
        ring = 2 * (W - 1) * a + 2 * (W - 1) / W * M / B
        tree = 2 * (math.ceil(math.log2(nodes)) * a + (G - 1) * av) + 2 * M / B
        return (ring, "ring") if ring <= tree else (tree, "tree")
    if op in ("all_gather", "reduce_scatter"):
        return (W - 1) * a + (W - 1) / W * M / B, "ring"
    if op == "all_to_all":
        return a + max((G - 1) / W * M / (nv * BYTES_PER_US),
                       G * (nodes - 1) / nodes * M / (nics * m.c("nic_gbps") * BYTES_PER_US)), "p2p"
    raise ValueError(f"unknown op {op!r}; known: {', '.join(MODEL_OPS)}")


@dataclass
class HierRow:
    """One collective on N nodes: braid's steps, the same hierarchy on NCCL alone, and NCCL flat."""
    gpu: str
    op: str
    nodes: int
    nics: int
    size: int
    braid_us: float
    nccl_node_us: float             # the same hierarchy with NCCL alone inside the node
    overlap_us: float               # braid's slowest step alone (pipelined steps, a bound)
    nccl_us: float
    nccl_algo: str
    steps: dict[str, float] = field(default_factory=dict)
    node_shares: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def speedup(self) -> float:
        """NCCL's time over braid's (> 1: braid faster)."""
        return self.nccl_us / self.braid_us

    @property
    def busbw_gbps(self) -> float:
        w = self.nodes * MACHINES[self.gpu].gpus
        f = 2 * (w - 1) / w if self.op == "all_reduce" else (w - 1) / w
        return self.size / (self.braid_us * BYTES_PER_US) * f

    def to_dict(self) -> dict:
        return dict(self.__dict__, speedup=self.speedup, busbw_gbps=self.busbw_gbps)


def _check_size(m: Machine, op: str, nodes: int, size: int) -> None:
    w = nodes * m.gpus
    if size < w * m.gpus:
        raise MisuseError(f"scale: {size} bytes per GPU is too small for {op} on {nodes} nodes x {m.gpus} GPUs: "
                          f"each rank's piece must be at least {m.gpus} bytes; use at least {w * m.gpus} bytes "
                          f"(e.g. --size 1M)")


def hier(gpu: str, op: str, nodes: int, nics: int, size: int = 256 << 20) -> HierRow:
    """braid's hierarchical `op` (module docstring) on `nodes` x G GPUs of machine `gpu` with
    `nics` NICs per node, `size` bytes per GPU (nccl-tests' convention), against NCCL flat."""
    m = machine(gpu)
    if op not in MODEL_OPS:
        raise MisuseError(f"scale: unknown op {op!r}; known: {', '.join(MODEL_OPS)}")
    nodes = checks.whole(nodes, "scale: nodes", 1)
    nics = _check_nics(m, nics)
    size = checks.whole(size, "scale: size (bytes per GPU)", 1)
    _check_size(m, op, nodes, size)
    G, W = m.gpus, nodes * m.gpus
    rate, a = nics * m.c("nic_gbps") / G, m.c("net_step_us")
    M = size

    def plan(lanes: str) -> tuple[dict[str, float], dict[str, dict]]:
        steps: dict[str, float] = {}
        shares: dict[str, dict] = {}

        def node(name: str, sim_op: str, nbytes: int) -> None:
            t, sh = node_step(m.name, sim_op, nbytes, lanes)
            steps[f"node {name}"] = t
            shares[f"node {name}"] = dict(sh)

        if nodes == 1:                   # one node: braid's own op, no hierarchy
            node(op, op, _node_bytes(m, op, M))
        elif op == "all_reduce":
            node("reduce_scatter", "reduce_scatter", M)
            steps["rail all_reduce"] = rail_us("all_reduce", nodes, M / G, rate, a)
            node("all_gather", "all_gather", M // G)
        elif op == "all_gather":
            steps["rail all_gather"] = rail_us("all_gather", nodes, M / W, rate, a)
            node("all_gather", "all_gather", M // G)
        elif op == "reduce_scatter":
            node("reduce_scatter", "reduce_scatter", M)
            steps["rail reduce_scatter"] = rail_us("reduce_scatter", nodes, M / G, rate, a)
        else:
            node("all_to_all", "all_to_all", M)
            steps["rail all_to_all"] = rail_us("all_to_all", nodes, M, rate, a)
        return steps, shares

    steps, shares = plan("braid")
    nccl_steps, _ = plan("nccl")
    flat, algo = nccl_flat_us(m, op, nodes, nics, M)
    return HierRow(gpu, op, nodes, nics, size, sum(steps.values()), sum(nccl_steps.values()),
                   max(steps.values()), flat, algo, steps, shares)


# -------------------------------------------------------------------------------------------------
# skewed all_to_all: the hierarchical router against one path per demand
# -------------------------------------------------------------------------------------------------

def hot_matrix(nodes: int, gpus: int, per_gpu_bytes: float, hot: float):
    """W x W bytes (numpy): every rank sends `hot` of per_gpu_bytes to GPU 0 of the next node and
    the rest evenly to every other rank, that one included (hot = 0: balanced)."""
    import numpy as np
    w = nodes * gpus
    if nodes < 2:
        raise MisuseError(f"scale: the skewed all_to_all needs >= 2 nodes (the hot expert is on the next node), "
                          f"got {nodes}")
    m = np.full((w, w), per_gpu_bytes * (1 - hot) / (w - 1))
    np.fill_diagonal(m, 0.0)
    src = np.arange(w)
    m[src, ((src // gpus + 1) % nodes) * gpus] += per_gpu_bytes * hot
    return np.floor(m)


def direct_pxn_us(nodes: int, gpus: int, nics: int, nic_gbps: float, nvlink_gbps: float, matrix) -> float:
    """The busiest link's time (us) with one path per demand: NVLink inside a node; across nodes
    the destination's home rail (NIC j * K // G), reached from the source and left at the far side
    over NVLink through the rail's owner GPU (NCCL's PXN) -- `multi_node()`'s links and owners."""
    import numpy as np
    N, G, K = nodes, gpus, nics
    m4 = np.asarray(matrix, dtype=float).reshape(N, G, N, G)
    idx = np.arange(N)
    intra = m4[idx, :, idx, :]                                   # (N, G, G)
    inter = m4.copy()
    inter[idx, :, idx, :] = 0.0
    S = inter.sum(axis=2)                                        # (N, Gi, Gj): out of (a, i) to local j elsewhere
    R = inter.sum(axis=0).transpose(1, 2, 0)                     # (N, Gj, Gi): into (b, j) from local i elsewhere
    nv_out = intra.sum(axis=2).copy()                            # (N, G)
    nv_in = intra.sum(axis=1).copy()
    tx = np.zeros((N, K))
    rx = np.zeros((N, K))
    home = [j * K // G for j in range(G)]
    owner = [k * G // K for k in range(K)]
    for j in range(G):
        k, o = home[j], owner[home[j]]
        tx[:, k] += S[:, :, j].sum(axis=1)
        for i in range(G):
            if o != i:                                           # to the rail's GPU on the sending node
                nv_out[:, i] += S[:, i, j]
                nv_in[:, o] += S[:, i, j]
        into = R[:, j, :].sum(axis=1)
        rx[:, k] += into
        if o != j:                                               # from the rail's GPU on the receiving node
            nv_out[:, o] += into
            nv_in[:, j] += into
    nv_t = max(nv_out.max(), nv_in.max()) / (nvlink_gbps * BYTES_PER_US)
    nic_t = max(tx.max(), rx.max()) / (nic_gbps * BYTES_PER_US)
    return float(max(nv_t, nic_t))


@dataclass
class SkewRow:
    gpu: str
    nodes: int
    nics: int
    hot: float
    size: int
    direct_us: float                # busiest link, one path per demand (PXN)
    routed_us: float                # busiest link, the hierarchical router's plan
    lower_bound_us: float           # the plan's certified lower bound
    plan_ms: float
    nccl_us: float                  # direct + one step across nodes
    braid_us: float                 # routed + one step across nodes

    @property
    def gain(self) -> float:
        return self.direct_us / self.routed_us

    def to_dict(self) -> dict:
        return dict(self.__dict__, gain=self.gain)


def skew(gpu: str, nodes: int, nics: int, hot: float = 0.7, size: int = 256 << 20) -> SkewRow:
    """Skewed all_to_all (module docstring): the router's plan on `multi_node` against one path
    per demand, `size` bytes sent per GPU."""
    from ..planner.router import multi_node
    m = machine(gpu)
    nodes = checks.whole(nodes, "scale: nodes", 1)
    nics = _check_nics(m, nics)
    checks.real(hot, "scale: hot", strict=False, high=1.0, hint="the share of each rank's bytes to the hot GPU")
    size = checks.whole(size, "scale: size (bytes per GPU)", 1)
    _check_size(m, "all_to_all", nodes, size)
    nic, nv = m.c("nic_gbps"), m.c("nvlink_gbps")
    mat = hot_matrix(nodes, m.gpus, size, hot)
    topo = multi_node(nodes, m.gpus, nics, nic_gbps=nic, nvlink_gbps=nv)
    t0 = time.perf_counter()
    plan = route(topo, mat)
    plan_ms = (time.perf_counter() - t0) * 1e3
    direct = direct_pxn_us(nodes, m.gpus, nics, nic, nv, mat)
    a = m.c("net_step_us")
    return SkewRow(gpu, nodes, nics, hot, size, direct, plan.max_load_us, plan.lower_bound_us, plan_ms,
                   direct + a, plan.max_load_us + a)


def _span(xs: list[float]) -> str:
    lo, hi = f"{min(xs):.2f}", f"{max(xs):.2f}"
    return f"{lo}x" if lo == hi else f"{lo}-{hi}x"


def verdict(rows: list[HierRow], skews: list[SkewRow]) -> list[str]:
    """Where multi-lane pays and where it does not, from the rows (the CLI's closing lines)."""
    out: list[str] = []
    multi = [r for r in rows if r.nodes > 1]
    if multi:
        lanes = [r.nccl_node_us / r.braid_us for r in multi]
        out.append(f"braid's lanes inside the node (ce + host beside NCCL) make the whole op {_span(lanes)} faster "
                   f"than the same steps with NCCL alone in the node")
        for op in MODEL_OPS:
            rs = [r for r in multi if r.op == op]
            if not rs:
                continue
            best, worst = max(rs, key=lambda r: r.speedup), min(rs, key=lambda r: r.speedup)
            wins = sum(r.speedup >= 1.05 for r in rs)
            losses = sum(r.speedup <= 0.95 for r in rs)
            where = lambda r: f"{r.gpu} {r.nodes} nodes {r.nics} NICs"        # noqa: E731
            out.append(f"{op}: braid faster by >= 5% in {wins} of {len(rs)} cases (best {best.speedup:.2f}x, "
                       f"{where(best)}), slower by >= 5% in {losses} (worst {worst.speedup:.2f}x, {where(worst)}); "
                       f"steps overlapped: up to {max(r.nccl_us / r.overlap_us for r in rs):.2f}x")
        out.append("pays: all_reduce on few nodes (each node sends 2(N-1)/N M across, NCCL's ring 2(W-1)/W M) and "
                   "all_gather / reduce_scatter on many (N-1 rail steps of latency, NCCL's ring W-1); does not pay "
                   "where the NICs are the bottleneck and NCCL's pipeline hides its NVLink time, which braid's "
                   "node steps add on top (all_to_all, all_reduce beyond a few nodes)")
    sk = [r for r in skews if r.hot > 0]
    if sk:
        for k in sorted({r.nics for r in sk}):
            g = [r.gain for r in sk if r.nics == k]
            out.append(f"skewed all_to_all, {k} NIC{'s' if k > 1 else ''} per node: one path per demand / the "
                       f"router's plan = {_span(g)} (busiest link)")
        bal = [r.gain for r in skews if r.hot == 0]
        if bal:
            out.append(f"balanced all_to_all: {_span(bal)} (every NIC already busy); the gain of "
                       f"spreading comes from idle NICs, so none with 1 NIC per node")
    return out


# -------------------------------------------------------------------------------------------------
# the two-node link proxy (the earlier model, `braid sim scale --proxy`)
# -------------------------------------------------------------------------------------------------

VARIANTS = ("single", "multi", "borrow")
SCALE_OPS = ("all_reduce", "all_gather", "alltoallv")
GPUS = 8


def proxy_matrix(op: str, nodes: int, per_gpu_bytes: int, hot: float = 0.7) -> list[list[int]]:
    """The two-node proxy's traffic matrix (16 x 16) for `op` on `nodes` nodes: nodes >= 1,
    per_gpu_bytes >= 1, hot (alltoallv's share to the hot GPU) in [0, 1]."""
    checks.whole(nodes, "scale: nodes", 1)
    checks.whole(per_gpu_bytes, "scale: per_gpu_bytes", 1)
    checks.real(hot, "scale: hot", strict=False, high=1.0, hint="the share of each rank's bytes to the hot GPU")
    n2 = 2 * GPUS
    m = [[0] * n2 for _ in range(n2)]
    M = per_gpu_bytes
    w = nodes * GPUS

    def both(a: int, b: int, nbytes: float) -> None:      # this node's demand and its mirror
        m[a][b] += int(nbytes)
        m[(a + GPUS) % n2][(b + GPUS) % n2] += int(nbytes)

    for g in range(GPUS):
        for p in range(GPUS):
            if p == g:
                continue
            if op == "all_reduce":
                both(g, p, 2 * M / GPUS)
            elif op == "all_gather":
                both(g, p, nodes * M)
            elif op == "alltoallv":
                both(g, p, M * (1 - hot) / (w - 2))
        if nodes > 1:
            if op == "all_reduce":
                both(g, g + GPUS, 2 * (nodes - 1) / nodes * M / GPUS)
            elif op == "all_gather":
                both(g, g + GPUS, (nodes - 1) * M)
            elif op == "alltoallv":
                for j in range(GPUS):
                    cold = M * (1 - hot) / (w - 2) * (nodes - 1)
                    both(g, GPUS + j, cold - (M * (1 - hot) / (w - 2) if j == 0 else 0) + (M * hot if j == 0 else 0))
    if op == "alltoallv" and nodes == 1:
        raise ValueError("alltoallv at scale needs >= 2 nodes (the hot expert is on the next node)")
    return m


def algbw_bytes(op: str, nodes: int, per_gpu_bytes: int) -> float:
    return per_gpu_bytes * nodes * GPUS if op == "all_gather" else per_gpu_bytes


def bus_factor(op: str, world: int) -> float:
    return 2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world


@dataclass
class ScaleRow:
    op: str
    nodes: int
    nics: int
    variant: str
    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    path_shares: dict[str, float] = field(default_factory=dict)
    plan_cold_us: float = 0.0
    plan_cached_us: float = 0.0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


_CACHE: dict[tuple, object] = {}


def run(op: str, nodes: int, nics: int = 8, variant: str = "borrow", hot: float = 0.7,
        per_gpu_bytes: int = 256 << 20) -> ScaleRow:
    if op not in SCALE_OPS:
        raise ValueError(f"unknown op {op!r}; known: {', '.join(SCALE_OPS)}")
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")
    topo: SimTopology = cluster(2, nics)
    m = proxy_matrix(op, nodes, per_gpu_bytes, hot)
    if not any(map(any, m)):                       # the bandwidths below divide by the time
        raise MisuseError(f"scale: {per_gpu_bytes} bytes per GPU is too small for {op} on {nodes} nodes: every "
                          f"demand rounds down to 0 bytes; use a larger size")
    rt = to_router(topo, relays=variant != "single", host=variant != "single",
                   max_rails=None if variant == "borrow" else 1)
    n = len(m)
    cold = cached = 0.0
    if variant == "single":
        routed = {(s, d): [(rt.candidates(s, d)[0], m[s][d])] for s in range(n) for d in range(n)
                  if s != d and m[s][d] > 0}
    else:
        key = (topo.name, variant, tuple(map(tuple, m)))
        plan = route(rt, m)
        cold = plan.plan_time_us
        _CACHE[key] = plan
        t0 = time.perf_counter()
        plan = _CACHE[(topo.name, variant, tuple(map(tuple, m)))]
        cached = (time.perf_counter() - t0) * 1e6
        routed = plan.flows
    flows, kinds = [], {}
    for (s, d), fl in routed.items():
        for p, b in fl:
            if b > 0:
                kind = "borrowed rail" if any(e.startswith("nicrelay") for e, _ in p.links) else p.kind
                flows.append(Flow(f"{s}>{d}", b, p.links, group=kind))
                kinds[kind] = kinds.get(kind, 0) + b
    res = simulate(rt.capacity, flows)
    t = res.makespan_us
    total = sum(kinds.values()) or 1
    alg = algbw_bytes(op, nodes, per_gpu_bytes) / (t * BYTES_PER_US)
    w = nodes * GPUS
    return ScaleRow(op, nodes, nics, variant, t, alg, alg * bus_factor(op, w),
                    {k: v / total for k, v in sorted(kinds.items())}, cold, cached)


def sweep(op: str, nodes_list: list[int], nics: int = 8, hot: float = 0.7,
          variants: tuple[str, ...] = VARIANTS, per_gpu_bytes: int = 256 << 20) -> list[ScaleRow]:
    return [run(op, n, nics, v, hot, per_gpu_bytes) for n in nodes_list for v in variants]
