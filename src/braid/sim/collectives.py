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
                preset efficiency). On our own machines NCCL is not modelled but measured: its
                time comes from the preset's table of NCCL bus bandwidths
    host_ring   FlexLink's host-staged ring: step-synchronous, each of the ring's steps pays a
    nic_ring    step latency and a slot fill, then bytes at the lane's rate (the two rings share
                each GPU's PCIe link)

Reductions done by braid's own lanes (ce, host) run as their plans do: reduce-scatter into slots,
a reduction kernel on the device, then the all-gather of the reduced chunks, in sequence.

Shares come from the planner (`braid.planner.model`): each lane is simulated alone at two sizes,
`fit()` turns that into a LaneCost (what `braid calibrate` does on hardware), and `choose_shares` /
`choose_with_native` picks the split, with `MULTI_LANE_OVERHEAD_US` added to a split's time.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..planner.model import MULTI_LANE_OVERHEAD_US, LaneCost, choose_shares, choose_with_native, fit
from ..planner.plan import (Movement, Plan, all_gather_movement, all_to_all_movement, broadcast_movement,
                            chunk_bounds, gather_chunks_movement, p2p_movement, reduce_scatter_movement, split)
from .flow import BYTES_PER_US, Flow, simulate
from .topology import SimTopology

RING_LANES = ("nccl", "host_ring", "nic_ring")
REDUCTIONS = ("all_reduce", "reduce_scatter", "reduce")
OPS = ("all_gather", "all_reduce", "reduce_scatter", "broadcast", "send_recv", "all_to_all_single", "reduce")

# nccl-tests bus-bandwidth factors (REFERENCE.md)


def bus_factor(op: str, world: int) -> float:
    if op == "all_reduce":
        return 2 * (world - 1) / world
    if op in ("all_gather", "reduce_scatter", "all_to_all_single"):
        return (world - 1) / world
    return 1.0


def algbytes(op: str, world: int, nbytes: int) -> int:
    """What bandwidth is computed over (braid bench's algbytes): all_gather's output is W x input."""
    return nbytes * world if op == "all_gather" else nbytes


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


def nccl_flows(topo: SimTopology, op: str, world: int, nbytes: float) -> list[Flow]:
    """NCCL's own op on `nbytes`. Measured presets: our calibration of NCCL alone (LaneCost per
    op) spread over ring flows. Modelled presets: ring at nccl_ring_efficiency of NVLink, or NVLink
    SHARP for all_reduce when the preset has nccl_nvls_efficiency, whichever NCCL's own estimate
    finds faster (NCCL's tuner picks per size; here by the same two formulas)."""
    if nbytes <= 0:
        return []
    pairs = [(0, 1)] if op == "send_recv" else [(g, (g + 1) % world) for g in range(world)]
    steps, bus, _ = _ring(op, world)
    if op == "broadcast":
        pairs = [(g, g + 1) for g in range(world - 1)]
    measured = topo.nccl_measured_us(op, world, nbytes)
    if measured is not None:      # an input on our machines: a delay, not flows
        return [Flow("nccl", 0, (), measured, group="nccl")]
    nv = topo.c("nvlink_gbps")
    step_us = topo.c("nccl_step_us")
    ring_rate = topo.c("nccl_ring_efficiency") * nv
    ring_us = steps * step_us + bus * nbytes / (ring_rate * BYTES_PER_US)
    if op == "all_reduce" and topo.has("nccl_nvls_efficiency") and world > 2:
        nvls_rate = topo.c("nccl_nvls_efficiency") * nv
        per_gpu = nbytes * (1 + 1 / world)
        if 2 * step_us + per_gpu / (nvls_rate * BYTES_PER_US) < ring_us:
            return [Flow(f"nvls{g}", per_gpu, ((f"nv_out{g}", 1.0), (f"nv_in{g}", 1.0)), 2 * step_us,
                         nvls_rate, group="nccl") for g in range(world)]
    return [Flow(f"nccl{a}>{b}", bus * nbytes, topo.nv_links(a, b), steps * step_us, ring_rate, group="nccl")
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


def transfer_flows(topo: SimTopology, lane: str, plan: Plan, start_us: float = 0.0) -> list[Flow]:
    """braid's point-to-point lanes (ce, host) from the plan's transfers."""
    out: list[Flow] = []
    transfers = plan.lanes.get(lane, [])
    if not transfers:
        return out
    if lane == "ce":
        lat = topo.c("ce_latency_us") if topo.has("ce_latency_us") else 0.0
        for i, t in enumerate(transfers):
            for d, _, _ in t.dsts:
                out.append(Flow(f"ce{i}:{t.src}>{d}", t.nbytes, topo.nv_links(t.src, d), lat, start_us=start_us, group="ce"))
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


def _capacity_for(topo: SimTopology, flows: list[Flow]) -> dict[str, float]:
    """Link capacities for this set of flows: a GPU whose NVLink port both sends and receives
    gets the measured all-at-once rate where the preset has one (nvlink_busy_gbps)."""
    cap = topo.capacity()
    if topo.has("nvlink_busy_gbps"):
        outs = {e for f in flows for e, _ in f.links if e.startswith("nv_out")}
        ins = {e for f in flows for e, _ in f.links if e.startswith("nv_in")}
        busy = topo.c("nvlink_busy_gbps")
        for g in range(topo.num_gpus):
            if f"nv_out{g}" in outs and f"nv_in{g}" in ins:
                cap[f"nv_out{g}"] = cap[f"nv_in{g}"] = busy
    return cap


def simulate_op(topo: SimTopology, op: str, world: int, nbytes: int, shares: dict[str, float]) -> OpResult:
    """Time of one op split by `shares` on the modelled machine (all lanes at once)."""
    if world > topo.num_gpus:
        raise ValueError(f"{topo.name} has {topo.num_gpus} GPUs, asked for {world}")
    shares = {k: v for k, v in shares.items() if v > 0}
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
    starts = {k: 0.0 for k in p2p_lanes}
    for i, p in enumerate(phase_plans):
        phase = [f for k in p2p_lanes for f in transfer_flows(topo, k, p, starts[k])]
        if not phase:
            continue
        res = simulate(_capacity_for(topo, flows + phase), flows + phase)
        done = res.group_finish_us()
        flows += phase
        if i + 1 < len(phase_plans) or op in REDUCTIONS:
            for k in p2p_lanes:
                if k in done:
                    starts[k] = done[k] + (reduce_us(topo, op, world, nbytes * total[k] / all_bytes)
                                           if i == 0 and op in REDUCTIONS else 0.0)
    res = simulate(_capacity_for(topo, flows), flows)
    lanes = res.group_finish_us()
    for k in p2p_lanes:                       # reduce_scatter ends with the reduction kernel
        if op == "reduce_scatter" and k in lanes:
            lanes[k] = starts[k]
    for k in shares:
        lanes.setdefault(k, 0.0)
    t = max(lanes.values(), default=0.0) + (MULTI_LANE_OVERHEAD_US if len(shares) > 1 else 0.0)
    return OpResult(op, world, nbytes, dict(shares), t, lanes)


def reduce_us(topo: SimTopology, op: str, world: int, lane_bytes: float) -> float:
    """braid's reduction kernel on one lane's chunk: read every rank's slot, write the result,
    at device-memory rate (W + 1) * chunk bytes."""
    if not topo.has("reduce_gbps") or lane_bytes <= 0:
        return 0.0
    return (world + 1) * (lane_bytes / world) / (topo.c("reduce_gbps") * BYTES_PER_US)


# -------------------------------------------------------------------------------------------------
# shares as braid picks them
# -------------------------------------------------------------------------------------------------

def lane_costs(topo: SimTopology, op: str, world: int, lanes: list[str], nbytes: int) -> dict[str, LaneCost]:
    """Each lane alone, simulated at nbytes/8 and nbytes and fitted to latency + bytes/bandwidth:
    the simulator's stand-in for `braid calibrate`."""
    small = max(1 << 20, nbytes // 8)
    out = {}
    for k in lanes:
        ta = simulate_op(topo, op, world, small, {k: 1.0}).time_us
        tb = simulate_op(topo, op, world, nbytes, {k: 1.0}).time_us
        out[k] = fit(small, ta, nbytes, tb) if nbytes > small else LaneCost(ta, small / ta / 1e3)
    return out


def choose(topo: SimTopology, op: str, world: int, lanes: list[str], nbytes: int,
           native: str | None = None) -> dict[str, float]:
    """The planner's split for this op from simulated lane costs: `choose_with_native` when a
    native lane is named (braid on GPUs: NCCL alone or a split of the others), else
    `choose_shares` (FlexLink: every lane, equal finish)."""
    costs = lane_costs(topo, op, world, lanes, nbytes)
    if native:
        return choose_with_native(costs, nbytes, native)
    groups = {k: k for k in costs}          # FlexLink's rings drive different links
    return choose_shares(costs, nbytes, groups)
