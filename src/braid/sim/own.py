"""The simulator against braid's own recorded bench on our H200 host (2 and 4 GPUs).

Each recorded point gives the op, size, world and the shares braid ran with. The simulator splits
the op by those shares through the planner, runs the plan's lanes as flows on the h200x2 / h200x4
preset (link rates from HARDWARE.md's probes, not from the bench) and predicts braid's time.

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


def compare(points: list[dict], with_planner: bool = True) -> list[Comparison]:
    out = []
    topos = {}
    for p in points:
        topo = topos.setdefault(p["preset"], load(p["preset"]))
        res = simulate_op(topo, p["op"], p["world"], p["nbytes"], p["shares"])
        kind = "nccl input" if set(p["shares"]) == {"nccl"} else "prediction"
        planner = (choose(topo, p["op"], p["world"], ["nccl", "ce", "host"], p["nbytes"], native="nccl")
                   if with_planner else {})
        out.append(Comparison(p["preset"], p["op"], p["world"], p["nbytes"], p["shares"], p["braid_us"],
                              res.time_us, kind, p.get("lane_time_us", {}),
                              {k: v for k, v in res.lane_time_us.items() if k != "nccl"}, planner))
    return out


def load_points(path: str) -> list[dict]:
    with open(path) as f:
        return json.load(f)["points"]
