"""Collectives on a modelled machine: braid's plans turned into flows, run by the flow model.

An op of `nbytes` (the size `braid bench` reports: per rank for all_gather and all_to_all, the
message for the others) is split by the planner exactly as braid splits it:
`braid.planner.plan` writes the op as a Movement, `split()` cuts it by the shares, and each lane
of the resulting Plan becomes flows:

    ce          every (transfer, destination) is a flow over NVLink (src out, dst in)
    host        every transfer is one flow: D2H once at the source, H2D at each destination,
                host memory crossed 1 + destinations times (multicast staged once); its latency
                includes filling the first slot of the D2H -> H2D pipeline
    nccl        NCCL's own algorithm on its share: a ring (flow g -> g+1 carrying the ring's bus
                bytes) or, for all_reduce where the preset models it, NVLink SHARP (every GPU
                sends and receives its share once); its rate is NCCL's reach on the link (a
                preset efficiency). On our own machines NCCL is not modelled but measured: the
                same ring flows, with the latency and rate of the preset's measured table
                (NCCL alone takes exactly its measured time; beside copy-engine flows it shares
                the NVLink ports with them)
    host_ring   FlexLink's host-staged ring: step-synchronous, each of the ring's steps pays a
    nic_ring    step latency and a slot fill, then bytes at the lane's rate (the two rings share
                each GPU's PCIe link)

Reductions run as braid runs them (`Reductions.reduction` -> `multi`), in one of two versions:
    staged      (braid before the pipelined copy-engine reduction, bench run 3): every lane's part
                reduce-scatters into slots, a reduction kernel runs, the reduced chunks gather back
    pipelined   (braid since the pipelined copy-engine reduction): all_reduce hands NCCL's share to NCCL's own
                all_reduce of a prefix of the tensor, on its own stream beside the others; the
                copy engines' part of every chunk runs `collectives/ce_reduce.py`'s pipeline (pull
                piece k from every peer on one stream, reduce it on another, gather the peers'
                reduced piece k on a third, each step waiting for exactly what it needs: flows with
                `after`); the other lanes' part takes the staged path above
    pushed      (braid now): as pipelined, but the all_reduce's peers push their reduced pieces and
                the call ends when every peer's last piece has come: the lane pays its start
                handshake and no done handshake (half of ce_latency_us, which counts both); a
                reduce runs the same pipeline and pushes to the root alone (before, and in the
                other two versions, its copy engines' share took the staged path)

Shares come from the planner (`braid.planner.model`): each lane is simulated alone at two sizes,
`fit()` turns that into a LaneCost (what `braid calibrate` does on hardware), and `choose_shares` /
`choose_with_native` picks the split, with `MULTI_LANE_OVERHEAD_US` added to a split's time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .. import envs
from ..planner.model import MULTI_LANE_OVERHEAD_US, LaneCost, choose_shares, choose_with_native, fit
from ..planner.plan import (Movement, Plan, all_gather_movement, all_to_all_movement, broadcast_movement,
                            ce_cut, chunk_bounds, cut_points, gather_chunks, gather_chunks_movement, p2p_movement,
                            reduce_scatter_chunks, reduce_scatter_movement, split)
from ..planner.pieces import piece_elems, pieces, tail_elems
from .busbw import algbytes, bus_factor
from .flow import BYTES_PER_US, Flow, FlowResult, simulate
from .topology import SimTopology

RING_LANES = ("nccl", "host_ring", "nic_ring")
REDUCTIONS = ("all_reduce", "reduce_scatter", "reduce")
OPS = ("all_gather", "all_reduce", "reduce_scatter", "broadcast", "send_recv", "all_to_all_single", "reduce")
CE_REDUCE = ("pushed", "pipelined", "staged")   # braid's copy-engine reduction: now / before the push / staged

PAGE = 4096                              # braid's cut points on GPUs (Exchange.plan, Reductions.reduction)


@dataclass
class OpResult:
    op: str
    world: int
    nbytes: int
    shares: dict[str, float]
    time_us: float
    lane_time_us: dict[str, float] = field(default_factory=dict)

    @property
    def algbw_gbps(self) -> float:
        return algbytes(self.op, self.world, self.nbytes) / (self.time_us * BYTES_PER_US)

    @property
    def busbw_gbps(self) -> float:
        return self.algbw_gbps * bus_factor(self.op, self.world)

    def to_dict(self) -> dict:
        return {"op": self.op, "world": self.world, "nbytes": self.nbytes, "shares": self.shares,
                "time_us": self.time_us, "algbw_gbps": self.algbw_gbps, "busbw_gbps": self.busbw_gbps,
                "lane_time_us": self.lane_time_us}


# -------------------------------------------------------------------------------------------------
# movements and plans
# -------------------------------------------------------------------------------------------------

def movements(op: str, world: int, nbytes: int, elem_bytes: int = 2) -> list[Movement]:
    """The op as braid's planner writes it, phase by phase."""
    if op == "all_gather":
        return [all_gather_movement(world, nbytes, False)]
    if op == "broadcast":
        return [broadcast_movement(world, nbytes, 0)]
    if op == "send_recv":
        return [p2p_movement(world, 0, 1, nbytes)]
    if op == "all_to_all_single":
        per = nbytes // world
        return [all_to_all_movement([[per] * world for _ in range(world)])]
    if op in REDUCTIONS:
        bounds = chunk_bounds(nbytes // elem_bytes, world, elem_bytes)
        rs = reduce_scatter_movement(world, bounds)
        if op == "reduce_scatter":
            return [rs]
        return [rs, gather_chunks_movement(world, bounds, None if op == "all_reduce" else 0)]
    raise ValueError(f"unknown op {op!r}; known: {', '.join(OPS)}")


def plans(op: str, world: int, nbytes: int, shares: dict[str, float]) -> list[Plan]:
    return [split(m, shares, nbytes) for m in movements(op, world, nbytes)]


# -------------------------------------------------------------------------------------------------
# lanes to flows
# -------------------------------------------------------------------------------------------------

def _ring(op: str, world: int) -> tuple[int, float, float]:
    """(steps, bus bytes per GPU per op byte, bytes per step per op byte) of a ring."""
    if op == "all_reduce":
        return 2 * (world - 1), 2 * (world - 1) / world, 1 / world
    if op == "all_gather":
        return world - 1, world - 1, 1.0
    if op in ("reduce_scatter", "reduce"):
        return world - 1, (world - 1) / world, 1 / world
    if op == "all_to_all_single":
        return 1, (world - 1) / world, (world - 1) / world
    return max(1, world - 1), 1.0, 1.0           # broadcast (pipelined ring), send_recv


def nccl_flows(topo: SimTopology, op: str, world: int, nbytes: float, start_us: float = 0.0) -> list[Flow]:
    """NCCL's own op on `nbytes`. Measured presets (h200x2, h200x4): the measured table's time as
    ring flows (its fixed part as their latency, the rest at the rate it implies). Modelled presets: ring at nccl_ring_efficiency of NVLink, or NVLink
    SHARP for all_reduce when the preset has nccl_nvls_efficiency, whichever NCCL's own estimate
    finds faster (NCCL's tuner picks per size; here by the same two formulas)."""
    if nbytes <= 0:
        return []
    pairs = [(0, 1)] if op == "send_recv" else [(g, (g + 1) % world) for g in range(world)]
    steps, bus, _ = _ring(op, world)
    if op == "broadcast":
        pairs = [(g, g + 1) for g in range(world - 1)]
    seg = topo.nccl_measured_segment(op, world, nbytes)
    if seg is not None:
        # an input on the measured presets: the ring's flows at the measured table's latency and rate, so
        # that NCCL alone takes exactly its measured time and beside other lanes shares NVLink
        # (where the table's slope is beyond what a link carries, the link's rate and a longer
        # fixed part: still the measured time alone)
        measured = topo.nccl_measured_us(op, world, nbytes)
        per_flow = (bus if op not in ("broadcast", "send_recv") else 1.0) * nbytes
        link = min(topo.capacity()[e] for e, _ in topo.nv_links(*pairs[0]))
        cap = min(per_flow / nbytes * seg[1], link)
        latency = min(max(0.0, measured - per_flow / (cap * BYTES_PER_US)), measured)
        cap = per_flow / ((measured - latency) * BYTES_PER_US) if measured > latency else math.inf
        return [Flow(f"nccl{a}>{b}", per_flow, topo.nv_links(a, b), latency, cap, start_us, group="nccl")
                for a, b in pairs]
    if topo.nccl_busbw:
        raise ValueError(f"{topo.name}: NCCL's {op} is measured on its {topo.num_gpus} GPUs only, not on {world} "
                         f"(the preset does not model NCCL)")
    nv = topo.c("nvlink_gbps")
    step_us = topo.c("nccl_step_us")
    ring_rate = topo.c("nccl_ring_efficiency") * nv
    ring_us = steps * step_us + bus * nbytes / (ring_rate * BYTES_PER_US)
    if op == "all_reduce" and topo.has("nccl_nvls_efficiency") and world > 2:
        nvls_rate = topo.c("nccl_nvls_efficiency") * nv
        per_gpu = nbytes * (1 + 1 / world)
        if 2 * step_us + per_gpu / (nvls_rate * BYTES_PER_US) < ring_us:
            return [Flow(f"nvls{g}", per_gpu, ((f"nv_out{g}", 1.0), (f"nv_in{g}", 1.0)), 2 * step_us,
                         nvls_rate, start_us, group="nccl") for g in range(world)]
    return [Flow(f"nccl{a}>{b}", bus * nbytes, topo.nv_links(a, b), steps * step_us, ring_rate, start_us, group="nccl")
            for a, b in pairs]


def ring_lane_flows(topo: SimTopology, lane: str, op: str, world: int, nbytes: float) -> list[Flow]:
    """FlexLink's auxiliary rings (host-staged, NIC loopback): step-synchronous, so every step pays
    the lane's step latency and (host) a slot fill before its bytes stream."""
    if lane == "nccl":
        return nccl_flows(topo, op, world, nbytes)
    if nbytes <= 0:
        return []
    steps, bus, per_step = _ring(op, world)
    step_bytes = per_step * nbytes
    if lane == "host_ring":
        rate = topo.c("host_ring_gbps")
        fill = min(step_bytes, topo.c("host_slot_bytes")) / (rate * BYTES_PER_US)
        latency = steps * (topo.c("host_ring_step_us") + fill)
    elif lane == "nic_ring":
        rate = topo.c("nic_ring_gbps")
        latency = steps * topo.c("nic_ring_step_us")
    else:
        raise ValueError(f"unknown ring lane {lane!r}")
    out = []
    for g in range(world):
        h = (g + 1) % world
        links = ((f"pcie_up{g}", 1.0), (f"pcie_dn{h}", 1.0))
        out.append(Flow(f"{lane}{g}>{h}", bus * nbytes, links, latency, rate, group=lane))
    return out


def transfer_flows(topo: SimTopology, lane: str, plan: Plan, start_us: float = 0.0, tag: str = "") -> list[Flow]:
    """braid's point-to-point lanes (ce, host) from the plan's transfers. The ce lane pulls
    (lanes/ce.py): every destination copies what it receives one piece after the other on its
    lane stream, sources in rotated order (rank r starts at r+1), so each destination's pulls are
    a chain of flows. `tag` keeps flow names apart between phases."""
    out: list[Flow] = []
    transfers = plan.lanes.get(lane, [])
    if not transfers:
        return out
    if lane == "ce":
        lat = topo.c("ce_latency_us") if topo.has("ce_latency_us") else 0.0
        w = plan.world_size
        for d in sorted({d for t in transfers for d, _, _ in t.dsts}):
            prev = None
            mine = sorted((t for t in transfers if any(q == d for q, _, _ in t.dsts)),
                          key=lambda t: ((t.src - d) % w, t.src_off))
            for i, t in enumerate(mine):
                name = f"ce{tag}:{t.src}>{d}.{i}"
                out.append(Flow(name, t.nbytes, topo.nv_links(t.src, d), lat if prev is None else 0.0,
                                start_us=start_us, group="ce", after=(prev,) if prev else ()))
                prev = name
    elif lane == "host":
        lat = topo.c("host_latency_us") if topo.has("host_latency_us") else 0.0
        slot = topo.c("host_slot_bytes") if topo.has("host_slot_bytes") else 0.0
        for i, t in enumerate(transfers):
            fill = min(t.nbytes, slot) / (topo.c("d2h_gbps") * BYTES_PER_US)
            links = [(f"d2h{t.src}", 1.0), (f"pcie{t.src}", 1.0), ("host_mem", 1.0 + len(t.dsts))]
            for d, _, _ in t.dsts:
                links += [(f"h2d{d}", 1.0), (f"pcie{d}", 1.0)]
            out.append(Flow(f"host{i}:{t.src}", t.nbytes, tuple(links), lat + fill, start_us=start_us, group="host"))
    else:
        raise ValueError(f"lane {lane!r} is not a point-to-point lane of the simulator")
    return out


def ce_piece_bytes(chunk_bytes: list[int], esz: int = 2) -> int:
    """Bytes per piece of the copy engines' pipelined reduction (`planner.pieces`, braid's rule)."""
    return piece_elems(max(chunk_bytes, default=0), esz) * esz


def _pieces(n: int, per: int, tail: int) -> list[int]:
    return [b - a for a, b in pieces(n, per, tail)]


def ce_reduction_flows(topo: SimTopology, op: str, world: int, chunk_bytes: list[int], esz: int = 2,
                       pushed: bool = True) -> list[Flow]:
    """The copy engines' pipelined reduction (collectives/ce_reduce.py) of `chunk_bytes[r]` bytes
    reduced by rank r, as flows that wait for what the GPU streams wait for:

        pull stream    piece k from every peer p in rotated order (me+1, me+2, ...), one copy after
                       the other: nv_out{p} -> nv_in{me}
        reduce stream  piece k once its pulls are done and piece k-1 is reduced: a kernel reading
                       the W rows and writing one (W + 1 piece bytes of device memory, + 1 for the
                       copy of the rank's own row when W > 2), on hbm{me} at reduce_gbps
        gather stream  (all_reduce) peer p's reduced piece k once p has reduced it, one copy after
                       the other: nv_out{p} -> nv_in{me}

    The lane's start and done handshakes (ce_latency_us) are paid before the first pull. The pull
    and gather streams share nv_in{me}; nothing is assumed about overlap beyond what the waits allow.
    `pushed` (all_reduce): the peers push their reduced pieces (the same flows) and no done
    handshake closes the call: only the start handshake is paid. A reduce (to rank 0) always
    pushes, to rank 0 alone."""
    lat = topo.c("ce_latency_us") if topo.has("ce_latency_us") else 0.0
    if (pushed and op == "all_reduce") or op == "reduce":
        lat /= 2
    per = ce_piece_bytes(chunk_bytes, esz)
    # the executor's cut (collectives/ce_reduce.py), under the same settings
    tail = tail_elems(per // esz, esz, envs.get("BRAID_CE_TAPER_FROM_KB") << 10) * esz if envs.get("BRAID_CE_TAPER") else 0
    pcs = [_pieces(n, per, tail) for n in chunk_bytes]
    red_w = 3.0 if world == 2 else world + 2.0
    out: list[Flow] = []
    for r in range(world):
        peers = [(r + i) % world for i in range(1, world)]
        prev = None
        for k, nb in enumerate(pcs[r]):
            for p in peers:
                name = f"ce.pull{r}.{k}<{p}"
                out.append(Flow(name, nb, topo.nv_links(p, r), lat if prev is None else 0.0,
                                after=(prev,) if prev else (), group="ce"))
                prev = name
            out.append(Flow(f"ce.red{r}.{k}", nb, ((f"hbm{r}", red_w),),
                            after=(prev,) + ((f"ce.red{r}.{k - 1}",) if k else ()), group="ce"))
    if op in ("all_reduce", "reduce"):
        for r in range(world) if op == "all_reduce" else (0,):
            peers = [(r + i) % world for i in range(1, world)]
            prev = None
            for k in range(max((len(pcs[p]) for p in peers), default=0)):
                for p in peers:
                    if k >= len(pcs[p]):
                        continue
                    name = f"ce.gather{r}.{k}<{p}"
                    out.append(Flow(name, pcs[p][k], topo.nv_links(p, r),
                                    after=(f"ce.red{p}.{k}",) + ((prev,) if prev else ()), group="ce"))
                    prev = name
    return out


def _capacity_for(topo: SimTopology, flows: list[Flow]) -> dict[str, float]:
    """Link capacities while this set of flows is active: a GPU whose NVLink port both sends and
    receives copy-engine traffic gets the measured all-at-once rate where the preset has one
    (nvlink_busy_gbps, a copy-engine probe; NCCL's flows carry their own measured rate and do not
    count); each GPU's device memory (`hbm{g}`, braid's reduction kernels) runs at reduce_gbps."""
    cap = topo.capacity()
    if topo.has("reduce_gbps"):
        for g in range(topo.num_gpus):
            cap[f"hbm{g}"] = topo.c("reduce_gbps")
    if topo.has("nvlink_busy_gbps"):
        ce = [f for f in flows if f.group != "nccl"]
        outs = {e for f in ce for e, _ in f.links if e.startswith("nv_out")}
        ins = {e for f in ce for e, _ in f.links if e.startswith("nv_in")}
        busy = topo.c("nvlink_busy_gbps")
        for g in range(topo.num_gpus):
            if f"nv_out{g}" in outs and f"nv_in{g}" in ins:
                cap[f"nv_out{g}"] = cap[f"nv_in{g}"] = busy
    return cap


def run_flows(topo: SimTopology, flows: list[Flow]) -> FlowResult:
    """The flow model on this machine, the all-at-once NVLink rate applied while a GPU's port
    both sends and receives (the rule of `_capacity_for`, event by event)."""
    if not topo.has("nvlink_busy_gbps"):
        return simulate(_capacity_for(topo, flows), flows)
    return simulate(_capacity_for(topo, []), flows, capacity_of=lambda active: _capacity_for(topo, active))


def simulate_op(topo: SimTopology, op: str, world: int, nbytes: int, shares: dict[str, float],
                ce_reduce: str = "pushed") -> OpResult:
    """Time of one op split by `shares` on the modelled machine (all lanes at once). `ce_reduce`
    names the version of braid's reductions that ran (module docstring): "staged" is every lane
    staged (and NCCL, if split with others, as a ring lane on its fraction of the bytes); with
    "pipelined" an all_reduce gives NCCL a prefix and a reduction splits the rest as braid does now."""
    if world > topo.num_gpus:
        raise ValueError(f"{topo.name} has {topo.num_gpus} GPUs, asked for {world}")
    if ce_reduce not in CE_REDUCE:
        raise ValueError(f"ce_reduce must be one of {CE_REDUCE}, got {ce_reduce!r}")
    shares = {k: v for k, v in shares.items() if v > 0}
    if (ce_reduce in ("pipelined", "pushed") and op in REDUCTIONS and set(shares) <= {"ce", "host", "nccl"}
            and ("nccl" not in shares or (op == "all_reduce" and len(shares) > 1))):
        return _simulate_reduction(topo, op, world, nbytes, shares, pushed=ce_reduce == "pushed")
    phase_plans = plans(op, world, nbytes, shares)
    total = {k: 0 for k in shares}
    for p in phase_plans:
        for k, b in p.lane_bytes().items():
            total[k] += b
    all_bytes = sum(total.values()) or 1
    flows: list[Flow] = []
    p2p_lanes = [k for k in shares if k not in RING_LANES]
    for k in shares:
        if k in RING_LANES:
            # a ring lane runs the whole op on its fraction of the plan's bytes
            flows += ring_lane_flows(topo, k, op, world, nbytes * total[k] / all_bytes)
    # point-to-point lanes, phase by phase: a lane's next phase starts when its previous one ends
    flows, starts = _staged_phases(topo, op, world, phase_plans, p2p_lanes,
                                   {k: nbytes * total[k] / all_bytes for k in p2p_lanes}, flows)
    return _result(topo, op, world, nbytes, shares, flows, p2p_lanes, starts)


def _result(topo, op: str, world: int, nbytes: int, shares: dict, flows: list, staged, starts: dict) -> OpResult:
    """Run the flows; each lane's finish (a staged reduce_scatter lane ends with its reduction
    kernel, recorded in `starts`), the op's time = the slowest lane + the multi-lane overhead."""
    res = run_flows(topo, flows)
    lanes = res.group_finish_us()
    for k in staged:
        if op == "reduce_scatter" and k in lanes:
            lanes[k] = starts[k]
    for k in shares:
        lanes.setdefault(k, 0.0)
    t = max(lanes.values(), default=0.0) + (MULTI_LANE_OVERHEAD_US if len(shares) > 1 else 0.0)
    return OpResult(op, world, nbytes, dict(shares), t, lanes)


def _staged_phases(topo: SimTopology, op: str, world: int, phase_plans: list[Plan], lanes: list[str],
                   lane_bytes: dict[str, float], flows: list[Flow]) -> tuple[list[Flow], dict[str, float]]:
    """braid's staged lanes phase by phase beside `flows` (which run from time zero): a lane's
    next phase starts when its previous one ends, after the reduction kernel on its part
    (`lane_bytes`: op bytes of each lane). Exact in the flow model: a later phase starts after
    the one that sets its start, so it cannot change that one's end. Returns all flows and each
    lane's start of its last step (for reduce_scatter: the end of its reduction)."""
    starts = {k: 0.0 for k in lanes}
    flows = list(flows)
    for i, p in enumerate(phase_plans):
        phase = [f for k in lanes for f in transfer_flows(topo, k, p, starts[k], tag=f"p{i}")]
        if not phase:
            continue
        res = run_flows(topo, flows + phase)
        done = res.group_finish_us()
        flows += phase
        if i + 1 < len(phase_plans) or op in REDUCTIONS:
            for k in lanes:
                if k in done:
                    starts[k] = done[k] + (reduce_us(topo, op, world, lane_bytes[k])
                                           if i == 0 and op in REDUCTIONS else 0.0)
    return flows, starts


def _simulate_reduction(topo: SimTopology, op: str, world: int, nbytes: int, shares: dict[str, float],
                        esz: int = 2, pushed: bool = True) -> OpResult:
    """A split reduction as `Reductions.reduction`'s `multi` runs it (bf16: esz 2):
      - all_reduce: NCCL's share is a prefix of the tensor (cut on a page) that NCCL's own
        all_reduce reduces on its stream, at the cost of NCCL's all_reduce of that many bytes
        (the measured table of h200x2 / h200x4), beside the other lanes and sharing NVLink with them;
      - the rest is cut into W chunks; the copy engines take the front of every chunk (their
        share, renormalised without NCCL) and run the pipelined reduction on it;
      - the other lanes (host) take the back of every chunk through the staged path.
    Every part starts at once; the op ends when the last lane does, plus the multi-lane overhead."""
    numel = nbytes // esz
    nat_f = shares.get("nccl", 0.0) if op == "all_reduce" else 0.0
    base, rest_shares = 0, dict(shares)
    if 0.0 < nat_f < 1.0:
        base = cut_points(numel * esz, [nat_f, 1.0 - nat_f], PAGE)[1] // esz
        rest_shares = {k: v / (1.0 - nat_f) for k, v in shares.items() if k != "nccl"}
    bounds = [base * esz + b for b in chunk_bounds(numel - base, world, esz)]
    elem = [(bounds[d] // esz, (bounds[d + 1] - bounds[d]) // esz) for d in range(world)]
    ce_f = rest_shares.get("ce", 0.0) if base < numel else 0.0
    cut = ce_cut(elem, ce_f, any(k != "ce" for k in rest_shares), esz, PAGE, every=op == "reduce")
    if op == "reduce" and (not any(cut) or not pushed):     # (Reductions.reduce_cuts: staged)
        ce_f, cut = 0.0, [0] * world
    rest = {k: v for k, v in rest_shares.items() if not (k == "ce" and ce_f > 0)} if base < numel else {}
    flows: list[Flow] = []
    if base:
        flows += nccl_flows(topo, "all_reduce", world, base * esz)
    if ce_f > 0:
        flows += ce_reduction_flows(topo, op, world, [c * esz for c in cut], esz, pushed)
    rest_chunks = [((o + c) * esz, (n - c) * esz) for (o, n), c in zip(elem, cut)]
    rest_bytes = sum(n for _, n in rest_chunks)
    staged = [k for k in rest if rest_bytes]
    starts: dict[str, float] = {}
    if staged:
        mvs = [reduce_scatter_chunks(world, rest_chunks)]
        if op != "reduce_scatter":
            mvs.append(gather_chunks(world, rest_chunks, None if op == "all_reduce" else 0))
        phase_plans = [split(m, rest, nbytes, align=PAGE) for m in mvs]
        tot = {k: 0 for k in staged}
        for k, b in phase_plans[0].lane_bytes().items():
            tot[k] = tot.get(k, 0) + b
        all_b = sum(tot.values()) or 1
        lane_bytes = {k: rest_bytes * tot.get(k, 0) / all_b for k in staged}
        flows, starts = _staged_phases(topo, op, world, phase_plans, staged, lane_bytes, flows)
    return _result(topo, op, world, nbytes, shares, flows, staged, starts)


def simulate_plan(topo: SimTopology, plan: Plan) -> OpResult:
    """One phase of point-to-point lanes (ce, host) as a given plan has them, all at once: a
    routed all_to_all (collectives/routed.py's plan, each demand cut over its paths)."""
    flows = [f for k in plan.lanes for f in transfer_flows(topo, k, plan)]
    res = run_flows(topo, flows)
    lanes = res.group_finish_us()
    used = [k for k, ts in plan.lanes.items() if ts]
    t = max(lanes.values(), default=0.0) + (MULTI_LANE_OVERHEAD_US if len(used) > 1 else 0.0)
    return OpResult(plan.op, plan.world_size, plan.nbytes, dict(plan.shares), t, lanes)


def reduce_us(topo: SimTopology, op: str, world: int, lane_bytes: float) -> float:
    """braid's reduction kernel on one lane's chunk: read every rank's slot, write the result,
    at device-memory rate (W + 1) * chunk bytes."""
    if not topo.has("reduce_gbps") or lane_bytes <= 0:
        return 0.0
    return (world + 1) * (lane_bytes / world) / (topo.c("reduce_gbps") * BYTES_PER_US)


# -------------------------------------------------------------------------------------------------
# shares as braid picks them
# -------------------------------------------------------------------------------------------------

def lane_costs(topo: SimTopology, op: str, world: int, lanes: list[str], nbytes: int,
               ce_reduce: str = "pushed") -> dict[str, LaneCost]:
    """Each lane alone, simulated at nbytes/8 and nbytes and fitted to latency + bytes/bandwidth:
    the simulator's stand-in for `braid calibrate`."""
    small = max(1 << 20, nbytes // 8)
    out = {}
    for k in lanes:
        ta = simulate_op(topo, op, world, small, {k: 1.0}, ce_reduce).time_us
        tb = simulate_op(topo, op, world, nbytes, {k: 1.0}, ce_reduce).time_us
        out[k] = fit(small, ta, nbytes, tb) if nbytes > small else LaneCost(ta, small / ta / 1e3)
    return out


def choose(topo: SimTopology, op: str, world: int, lanes: list[str], nbytes: int,
           native: str | None = None, ce_reduce: str = "pushed") -> dict[str, float]:
    """The planner's split for this op from simulated lane costs: `choose_with_native` when a
    native lane is named (braid on GPUs: NCCL alone or a split of the others), else
    `choose_shares` (FlexLink: every lane, equal finish)."""
    costs = lane_costs(topo, op, world, lanes, nbytes, ce_reduce)
    if native:
        return choose_with_native(costs, nbytes, native)
    groups = {k: k for k in costs}          # FlexLink's rings drive different links
    return choose_shares(costs, nbytes, groups)
