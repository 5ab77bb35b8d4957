"""The simulator against braid's own recorded bench on our H200 host (2 and 4 GPUs).

Each recorded point gives the op, size, world and the shares braid ran with. The simulator splits
the op by those shares through the planner, runs the plan's lanes as flows on the h200x2 / h200x4
preset and predicts braid's time. The presets' link rates come from HARDWARE.md's probes, except the
host lane's (D2H / H2D per GPU, host memory), which come from braid's own calibration tables of the
same run (`bench_results/2026-11-22-run3/calibration/`, timed before the bench sweep at 1 / 64 /
512 MiB): what braid itself plans from. Nothing is taken from the bench points themselves.

What the bench times besides braid's op: its broadcast workload copies the message into the root's
buffer before every timed call (`workloads.make`: `buf.copy_(x)` on the root), so a broadcast that
braid's lanes run gets `bench_prelude_us` (nbytes at the preset's device_copy_gbps) ahead of it. The
NCCL broadcast baselines in the presets were timed with the same copy, so NCCL-alone points get
nothing added.

Which braid ran: run 3's reductions are the staged version (a point's `ce_reduce` field; default
"pipelined", braid's reductions since: `collectives.simulate_op`).

What is a prediction and what is an input: NCCL's own kernels are not modelled on our machines; the
preset carries NCCL's measured bus bandwidths (HARDWARE.md, or an earlier bench run), so a point
where braid chose NCCL alone only checks that braid adds little on top of NCCL. The points split over
the copy engines and the host lane are the predictions: nothing of them was fitted to the bench.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from .collectives import choose, simulate_op
from .topology import load


@dataclass
class Comparison:
    preset: str
    op: str
    world: int
    nbytes: int
    shares: dict
    measured_us: float
    simulated_us: float
    kind: str                     # "prediction" (a split braid's lanes ran) or "nccl input"
    lane_measured_us: dict
    lane_simulated_us: dict
    planner_shares: dict          # what the planner picks from simulated lane costs

    @property
    def error(self) -> float:
        return self.simulated_us / self.measured_us - 1

    def to_dict(self) -> dict:
        d = asdict(self)
        d["error"] = self.error
        return d


def bench_prelude_us(topo, op: str, nbytes: int, shares: dict) -> float:
    """Device time the bench's workload spends per timed call before braid's op starts (see the
    module docstring): the root's copy of the broadcast message. Zero where NCCL runs alone (its
    measured time already has it) and for every other op (their buffers are not reset)."""
    if op != "broadcast" or set(shares) == {"nccl"} or not topo.has("device_copy_gbps"):
        return 0.0
    return nbytes / (topo.c("device_copy_gbps") * 1e3)


def compare(points: list[dict], with_planner: bool = True) -> list[Comparison]:
    out = []
    topos = {}
    for p in points:
        topo = topos.setdefault(p["preset"], load(p["preset"]))
        res = simulate_op(topo, p["op"], p["world"], p["nbytes"], p["shares"], p.get("ce_reduce", "pipelined"))
        kind = "nccl input" if set(p["shares"]) == {"nccl"} else "prediction"
        planner = (choose(topo, p["op"], p["world"], ["nccl", "ce", "host"], p["nbytes"], native="nccl",
                          ce_reduce=p.get("ce_reduce", "pipelined"))
                   if with_planner else {})
        out.append(Comparison(p["preset"], p["op"], p["world"], p["nbytes"], p["shares"], p["braid_us"],
                              res.time_us + bench_prelude_us(topo, p["op"], p["nbytes"], p["shares"]), kind, p.get("lane_time_us", {}),
                              {k: v for k, v in res.lane_time_us.items() if k != "nccl"}, planner))
    return out


def load_points(path: str) -> list[dict]:
    with open(path) as f:
        return json.load(f)["points"]
