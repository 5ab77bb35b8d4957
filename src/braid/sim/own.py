"""The simulator against braid's own bench recorded on 2 and 4 x H200 (2026-11-22).

Each recorded point gives the op, size, world and the shares braid ran with. The simulator splits
the op by those shares through the planner, runs the plan's lanes as flows on the h200x2 / h200x4
preset and predicts braid's time. The presets' link rates come from device probes on those machines
(2026-11-22: copy-engine peer copies, PCIe D2H/H2D, device copies), except the
host lane's (D2H / H2D per GPU, host memory), which come from braid's own calibration tables of the
same run (`bench_results/2026-11-22-h200x4-every-op-sweep/calibration/`, timed before the bench
sweep at 1 / 64 / 512 MiB): what braid itself plans from. Nothing is taken from the bench points themselves.

What the bench times besides braid's op: its broadcast workload copies the message into the root's
buffer before every timed call (`workloads.make`: `buf.copy_(x)` on the root), so a broadcast that
braid's lanes run gets `bench_prelude_us` (nbytes at the preset's device_copy_gbps) ahead of it. The
NCCL broadcast baselines in the presets were timed with the same copy, so NCCL-alone points get
nothing added.

Which braid ran: the first recorded bench's reductions are the staged version, the later ones the
pipelined one with NCCL's own share (`collectives.simulate_op`'s `ce_reduce`; a point's `ce_reduce` field,
default "pipelined"). A skewed all_to_all_single (`hot_fraction` h: every rank sends h of its bytes
to the last rank, the rest evenly, `workloads.hot_matrix`) ran as the router's plan
(`collectives/routed.py`): on that matrix braid's router sends host bytes only on the demands into
the hot rank, the same on each (whatever the lane costs; tests/test_sim_repro.py checks it with
braid's Router), so the plan is rebuilt from the recorded host share by that rule and simulated
transfer by transfer. 2-GPU points recorded on GPUs 0-1 of the 4-GPU machine use the h200x4
constants (that machine's links and calibration) with world 2, except where NCCL took a share of a
2-GPU split (the tapered-cut benches): h200x4 has NCCL measured on 4 GPUs only, so those take h200x2's.

The tapered-cut benches' points (`ce_taper`) ran the copy engines' tapered cut (planner/pieces.py); earlier
points ran even pieces, and each is simulated with the cut it ran.

What is a prediction and what is an input: NCCL's own kernels are not modelled on the H200 machines;
the preset carries NCCL's bus bandwidths measured there (NCCL 2.28.9 through torch 2.11, bf16,
2026-11-22, or an earlier bench run), so a point
where braid chose NCCL alone only checks that braid adds little on top of NCCL. The points split over
the copy engines and the host lane are the predictions: nothing of them was fitted to the bench. A
split that gives NCCL a share (the pipelined all_reduce) takes NCCL's cost of its bytes from that
table; how it runs beside the other lanes (NVLink shared with the copy engines) is predicted.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from importlib import resources

from .. import envs
from ..planner.checks import MisuseError
from ..planner.plan import Plan, all_to_all_movement
from ..planner.traffic import hot_matrix as traffic_hot_matrix
from .collectives import PAGE, choose, simulate_op, simulate_plan
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
    variant: str = ""             # what tells apart points of one op and size (forced shares, hot fraction)
    source: str = ""              # the recorded file

    @property
    def name(self) -> str:
        """A stable id: preset, world where it is not the preset's, op, size, variant."""
        w = "" if self.preset.endswith(f"x{self.world}") else f"-w{self.world}"
        v = f"-{self.variant}" if self.variant else ""
        return f"{self.preset}{w}-{self.op}-{self.nbytes >> 20}M{v}"

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


def hot_matrix(world: int, nbytes: int, h: float, esz: int = 2) -> list[list[int]]:
    """Bytes each rank sends each rank in the bench's hot-fraction all_to_all (the bench's own
    element matrix, `planner.traffic.hot_matrix`, on nbytes / esz elements per rank)."""
    return [[x * esz for x in row] for row in traffic_hot_matrix(world, nbytes // esz, h)]


def routed_hot_plan(matrix: list[list[int]], host_share: float) -> Plan:
    """The router's plan for a hot-column matrix with the recorded host share: the host bytes
    spread evenly over the demands into the hot rank (the only ones whose offload lowers the
    busiest link; braid's router splits them so), each demand cut direct (ce) first, host after,
    on a page, as `collectives.routed.build_plan` cuts it (not imported: braid.collectives needs
    torch; a test checks the two plans are equal)."""
    w = len(matrix)
    hot = max(range(w), key=lambda d: sum(matrix[s][d] for s in range(w) if s != d))
    off = sum(matrix[s][d] for s in range(w) for d in range(w) if s != d)
    into = [s for s in range(w) if s != hot and matrix[s][hot]]
    per = host_share * off / len(into)
    mv = all_to_all_movement(matrix)
    lanes: dict[str, list] = {"ce": [], "host": []}
    for t in mv.transfers:
        if t.dsts[0][0] != hot or t.src not in into:
            lanes["ce"].append(t)
            continue
        stop = min(t.nbytes, round((t.nbytes - per) / PAGE) * PAGE)
        if stop > 0:
            lanes["ce"].append(t.piece(0, stop))
        if stop < t.nbytes:
            lanes["host"].append(t.piece(stop, t.nbytes))
    lanes = {k: v for k, v in lanes.items() if v}
    total = sum(t.nbytes for ts in lanes.values() for t in ts) or 1
    shares = {k: sum(t.nbytes for t in ts) / total for k, ts in lanes.items()}
    return Plan("all_to_all_single", w, max(sum(row) for row in matrix), shares, lanes, list(mv.local))


def simulate_point(topo, p: dict):
    """The simulator's result for one recorded point, as braid ran it (points recorded before
    the copy engines' tapered tail carry no "ce_taper": their pieces were even)."""
    with envs.override(BRAID_CE_TAPER=int(bool(p.get("ce_taper", False)))):
        return _simulate_point(topo, p)


def _simulate_point(topo, p: dict):
    if p.get("hot_fraction") is not None:
        matrix = hot_matrix(p["world"], p["nbytes"], p["hot_fraction"])
        return simulate_plan(topo, routed_hot_plan(matrix, p["shares"].get("host", 0.0)))
    return simulate_op(topo, p["op"], p["world"], p["nbytes"], p["shares"], p.get("ce_reduce", "pipelined"))


def compare(points: list[dict], with_planner: bool = True) -> list[Comparison]:
    out = []
    topos = {}
    for p in points:
        topo = topos.setdefault(p["preset"], load(p["preset"]))
        res = simulate_point(topo, p)
        kind = "nccl input" if set(p["shares"]) == {"nccl"} else "prediction"
        # the planner's own pick, where it has what it needs: NCCL measured at this world, a
        # balanced op (a skewed all_to_all is the router's, not the share planner's)
        planner = (choose(topo, p["op"], p["world"], ["nccl", "ce", "host"], p["nbytes"], native="nccl",
                          ce_reduce=p.get("ce_reduce", "pipelined"))
                   if with_planner and p["world"] == topo.num_gpus and p.get("hot_fraction") is None else {})
        lanes = {k: v for k, v in res.lane_time_us.items() if k != "nccl" or len(p["shares"]) > 1}
        out.append(Comparison(p["preset"], p["op"], p["world"], p["nbytes"], p["shares"], p["braid_us"],
                              res.time_us + bench_prelude_us(topo, p["op"], p["nbytes"], p["shares"]), kind,
                              p.get("lane_time_us", {}), lanes, planner, p.get("variant", ""), p.get("source", "")))
    return out


def recorded_bench() -> str:
    """The path of braid's recorded bench on the H200 host, shipped in the package (`braid sim own`'s
    default data)."""
    return str(resources.files("braid.sim").joinpath("data", "sim_bench_h200.json"))


def load_points(path: str) -> list[dict]:
    """The recorded points of a bench file: JSON {"points": [{...}, ...]}."""
    with open(path) as f:
        try:
            obj = json.load(f)
        except json.JSONDecodeError as exc:
            raise MisuseError(f"{path} is not JSON ({exc}); pass a recorded bench file like "
                              f"braid/sim/data/sim_bench_h200.json") from None
    points = obj.get("points") if isinstance(obj, dict) else None
    if not isinstance(points, list) or not all(isinstance(p, dict) for p in points):
        raise MisuseError(f"{path}: expected an object whose \"points\" is a list of recorded points "
                          f"(like braid/sim/data/sim_bench_h200.json)")
    return points
