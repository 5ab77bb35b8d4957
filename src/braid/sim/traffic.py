"""Traffic matrices on a modelled machine: the router's plan run as flows, and one GPU's
inter-node stream spread over borrowed NICs by the planner's NIC policy.

simulate_matrix: the router (`braid.planner.router.route`) splits every demand over candidate
paths of the preset (`topology.to_router`); each (demand, path, bytes) becomes a flow over that
path's links, and the flow model runs them all at once. The single-path baseline gives every
demand its first candidate (direct NVLink inside a node, the destination's rail across nodes: what
NCCL with PXN does). The time is the last flow's finish.

borrowed_nic_stream: FuseLink's experiment. One GPU sends a long stream in operations of
`relay_chunk_bytes`; before each operation `braid.planner.nic.choose_nic` picks its NIC from the
live state (operations in flight per NIC, relay bytes buffered). A direct operation is one flow
over the GPU's own NIC; a borrowed one is three flows in sequence: NVLink into the relay GPU's
buffer, that GPU's NIC, NVLink out of the relay buffer on the far side, after the policy's control
cost. Rates come from the same max-min sharing as every other flow (flow.max_min_rates); the relay
copies of the sending (and the receiving) GPU run one at a time, in arrival order, as copies
queued on one stream do.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..planner.nic import NicPolicy, NicState, choose_nic
from ..planner.router import route
from .flow import BYTES_PER_US, Flow, max_min_rates, simulate
from .topology import SimTopology, to_router


@dataclass
class MatrixResult:
    time_us: float
    plan_time_us: float
    path_bytes: dict[str, int]        # path kind -> bytes routed on it
    total_bytes: int

    @property
    def bw_gbps(self) -> float:
        return self.total_bytes / (self.time_us * BYTES_PER_US) if self.time_us else math.inf


def simulate_matrix(topo: SimTopology, matrix: list[list[int]], multipath: bool = True, **router_kw) -> MatrixResult:
    """Time of a traffic matrix: routed over every candidate path (multipath) or each demand on
    its first path. router_kw go to topology.to_router (max_relays, max_rails, relays, host)."""
    rt = to_router(topo, **router_kw)
    n = len(matrix)
    flows: list[Flow] = []
    kinds: dict[str, int] = {}
    plan_us = 0.0
    if multipath:
        rp = route(rt, matrix)
        plan_us = rp.plan_time_us
        routed = rp.flows
    else:
        routed = {(s, d): [(rt.candidates(s, d)[0], matrix[s][d])]
                  for s in range(n) for d in range(n) if s != d and matrix[s][d] > 0}
    for (s, d), fl in routed.items():
        for p, b in fl:
            if b > 0:
                flows.append(Flow(f"{s}>{d}:{p.name()}", b, p.links, group=p.kind))
                kinds[p.kind] = kinds.get(p.kind, 0) + b
    res = simulate(rt.capacity, flows)
    total = sum(matrix[s][d] for s in range(n) for d in range(n) if s != d)
    return MatrixResult(res.makespan_us, plan_us, kinds, total)


def skewed_matrix(num_gpus: int, per_rank_bytes: int, hot: float | None, hot_dst: int = 0) -> list[list[int]]:
    """Every rank sends `per_rank_bytes`: a fraction `hot` to one hot destination (rank `hot_dst`;
    that rank's own hot destination is the next rank), the rest evenly to the others. hot=None:
    balanced (every other rank gets the same)."""
    m = [[0] * num_gpus for _ in range(num_gpus)]
    for s in range(num_gpus):
        others = [d for d in range(num_gpus) if d != s]
        if hot is None:
            for d in others:
                m[s][d] = per_rank_bytes // len(others)
            continue
        h = hot_dst if s != hot_dst else (hot_dst + 1) % num_gpus
        m[s][h] = int(per_rank_bytes * hot)
        rest = [d for d in others if d != h]
        for d in rest:
            m[s][d] = int(per_rank_bytes * (1 - hot)) // len(rest)
    return m


# -------------------------------------------------------------------------------------------------
# FuseLink: one GPU's stream over borrowed NICs
# -------------------------------------------------------------------------------------------------

@dataclass
class _Op:
    nic: int
    borrowed: bool
    nbytes: int
    stages: list[str]          # links still to cross, in order
    left: float                # bytes left in the current stage
    ready_us: float            # when the current stage may start moving


def borrowed_nic_stream(topo: SimTopology, num_nics: int, total_bytes: int = 256 << 20,
                        policy: NicPolicy | None = None) -> float:
    """GB/s of GPU 0's stream to GPU 0 of the next node using its own NIC and the NICs of GPUs
    1 .. num_nics-1 (idle owners), operation by operation through the NIC policy."""
    if not 1 <= num_nics <= topo.nics_per_node:
        raise ValueError(f"num_nics must be in 1..{topo.nics_per_node}, got {num_nics}")
    chunk = int(topo.c("relay_chunk_bytes"))
    policy = policy or NicPolicy(max_borrowed_inflight=int(topo.c("borrowed_inflight_cap")),
                                 relay_mem_bytes=int(topo.c("relay_mem_bytes")))
    ctrl_us = topo.c("control_us")
    relay_nv = topo.c("nvlink_relay_gbps")
    # the sender's NVLink relay bandwidth, the receiver's, and NIC k (both ends at one rate)
    cap = {"relay_out": relay_nv, "relay_in": relay_nv}
    cap.update({f"nic{k}": topo.c("nic_gbps") for k in range(num_nics)})
    owners = [topo.nic_owner(0, k) for k in range(num_nics)]
    own = [0] * num_nics            # the sender's own operations in flight per NIC
    borrowed = [0] * num_nics       # borrowed operations in flight per NIC
    buffered = [0] * num_nics       # relay bytes held on the NIC's owner GPU
    ops: list[_Op] = []
    sent = done = 0
    t = 0.0
    while done < total_bytes:
        while sent < total_bytes:                      # launch what the policy allows now
            n = min(chunk, total_bytes - sent)
            states = [NicState(k, owners[k], own[k] if owners[k] == 0 else 0, borrowed[k], buffered[k])
                      for k in range(num_nics)]
            choice = choose_nic(0, n, states, policy)
            if choice.reason != "direct" and choice.relay is None:
                break                                  # "queued": wait for a completion
            k = choice.nic
            if choice.relay is None:
                own[k] += 1
                ops.append(_Op(k, False, n, [f"nic{k}"], n, t))
            else:
                borrowed[k] += 1
                buffered[k] += n
                ops.append(_Op(k, True, n, ["relay_out", f"nic{k}", "relay_in"], n, t + ctrl_us))
            sent += n
        moving = [o for o in ops if o.ready_us <= t + 1e-9]
        # the relay copies of one GPU run one after another (one copy stream each way), in the
        # order they reached that stage
        for stage in ("relay_out", "relay_in"):
            queue = [o for o in moving if o.stages[0] == stage]
            if len(queue) > 1:
                first = min(queue, key=lambda o: o.ready_us)
                moving = [o for o in moving if o.stages[0] != stage or o is first]
        rates = max_min_rates(cap, [Flow("op", o.left, ((o.stages[0], 1.0),)) for o in moving])
        waits = [o.ready_us - t for o in ops if o.ready_us > t + 1e-9]
        dt = min([o.left / (r * BYTES_PER_US) for o, r in zip(moving, rates)] + waits)
        t += dt
        for o, r in zip(moving, rates):
            o.left -= r * BYTES_PER_US * dt
            if o.left > 1e-6 * o.nbytes:
                continue
            o.stages.pop(0)
            o.left = o.nbytes
            if o.stages:
                o.ready_us = t          # queued for its next stage from now
                continue
            ops.remove(o)
            done += o.nbytes
            if o.borrowed:
                borrowed[o.nic] -= 1
                buffered[o.nic] -= o.nbytes
            else:
                own[o.nic] -= 1
    return total_bytes / (t * BYTES_PER_US)
