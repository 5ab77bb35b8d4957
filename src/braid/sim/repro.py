"""Published figures of FlexLink, FuseLink and NIMBLE beside the simulator's, one constant set
per testbed (the preset), nothing tuned per row.

FlexLink (h800x8-flexlink): NCCL alone, then NCCL + host-staged ring + NIC-loopback ring split by
the planner (each lane simulated alone at two sizes, fitted to a LaneCost, `choose_shares`), at
256 MB. Bandwidth = message / time (FlexLink's definition; all_gather's message is per rank).

FuseLink (hopper8-8nic-fuselink): one GPU's stream to the next node through its own NIC plus
1..5 borrowed NICs, operation by operation through `braid.planner.nic.choose_nic`.

NIMBLE (h100x4-mesh-4rail-nimble): the router's plan over the preset's paths, run as flows: one
intra-node pair with 0, 1, 2 relays; one inter-node pair with 1..4 rails; skewed all-to-all-v
(each rank sends `hot` of its bytes to one destination) against each demand on its single path.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from .collectives import choose, simulate_op
from .topology import load
from .traffic import borrowed_nic_stream, simulate_matrix, skewed_matrix

TOLERANCE = 0.10


@dataclass
class Row:
    name: str
    published: float | None
    simulated: float
    unit: str
    tolerance: float | None = TOLERANCE      # relative; None: shown, not checked
    rule: str = "within"                     # "within" or "at_least" (published is a floor)
    note: str = ""

    @property
    def ok(self) -> bool | None:
        if self.published is None or self.tolerance is None:
            return None
        if self.rule == "at_least":
            return self.simulated >= self.published * (1 - self.tolerance)
        return abs(self.simulated / self.published - 1) <= self.tolerance

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        return d


# -------------------------------------------------------------------------------------------------

FLEXLINK_TABLE = [  # op, GPUs, NCCL GB/s, FlexLink GB/s, PCIe share %, NIC share % (256 MB)
    ("all_reduce", 2, 139, 175, 12, 9),
    ("all_reduce", 4, 98, 118, 12, 2),
    ("all_reduce", 8, 107, 109, 1, 1),
    ("all_gather", 2, 132, 163, 14, 5),
    ("all_gather", 4, 49, 62, 12, 10),
    ("all_gather", 8, 21, 26, 12, 7),
]
FLEXLINK_BYTES = 256 * 10 ** 6
FLEXLINK_LANES = ["nccl", "host_ring", "nic_ring"]


def flexlink() -> list[Row]:
    topo = load("h800x8-flexlink")
    rows = []
    for op, w, nccl_pub, flex_pub, pcie_pub, nic_pub in FLEXLINK_TABLE:
        label = f"{'AllReduce' if op == 'all_reduce' else 'AllGather'} {w} GPUs"
        base = simulate_op(topo, op, w, FLEXLINK_BYTES, {"nccl": 1.0})
        shares = choose(topo, op, w, FLEXLINK_LANES, FLEXLINK_BYTES)
        both = simulate_op(topo, op, w, FLEXLINK_BYTES, shares)
        bw = lambda r: FLEXLINK_BYTES / r.time_us / 1e3  # noqa: E731  (FlexLink: message / time)
        rows += [
            Row(f"{label}: NCCL", nccl_pub, bw(base), "GB/s"),
            Row(f"{label}: FlexLink", flex_pub, bw(both), "GB/s"),
            Row(f"{label}: PCIe share", pcie_pub, 100 * shares.get("host_ring", 0.0), "%", None),
            Row(f"{label}: NIC share", nic_pub, 100 * shares.get("nic_ring", 0.0), "%", None),
        ]
    return rows


FUSELINK_PUBLISHED = {1: 49.3, 6: 212.4}


def fuselink() -> list[Row]:
    topo = load("hopper8-8nic-fuselink")
    rows = []
    for k in range(1, 7):
        rows.append(Row(f"one GPU, {k} NIC{'s' if k > 1 else ''} ({k - 1} borrowed)", FUSELINK_PUBLISHED.get(k),
                        borrowed_nic_stream(topo, k), "GB/s",
                        note="" if k in FUSELINK_PUBLISHED else "not published"))
    return rows


NIMBLE_RELAYS = {0: 120.0, 1: 213.0, 2: 278.0}
NIMBLE_RAILS = {1: 45.0, 4: 170.0}
NIMBLE_HOT = (None, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
GIB = 1 << 30


def nimble_skew(hot: float | None, per_rank_bytes: int = 256 << 20) -> tuple[float, float]:
    """(speedup of routed over single-path, routed plan time us) for one hotspot fraction."""
    topo = load("h100x4-mesh-4rail-nimble")
    m = skewed_matrix(topo.num_gpus, per_rank_bytes, hot)
    single = simulate_matrix(topo, m, multipath=False)
    multi = simulate_matrix(topo, m, multipath=True)
    return single.time_us / multi.time_us, multi.plan_time_us


def nimble() -> list[Row]:
    topo = load("h100x4-mesh-4rail-nimble")
    rows = []
    for r, pub in NIMBLE_RELAYS.items():
        m = [[0] * topo.num_gpus for _ in range(topo.num_gpus)]
        m[0][1] = GIB
        res = simulate_matrix(topo, m, multipath=r > 0, relays=r > 0, max_relays=r)
        rows.append(Row(f"intra-node pair, {r} relay{'s' if r != 1 else ''}", pub, res.bw_gbps, "GB/s",
                        note="input (pair_gbps)" if r == 0 else ""))
    for k in range(1, 5):
        m = [[0] * topo.num_gpus for _ in range(topo.num_gpus)]
        m[0][topo.gpus_per_node] = GIB
        res = simulate_matrix(topo, m, multipath=k > 1, max_rails=k)
        rows.append(Row(f"inter-node pair, {k} rail{'s' if k > 1 else ''}", NIMBLE_RAILS.get(k), res.bw_gbps, "GB/s",
                        note="input (nic_gbps)" if k == 1 else ("" if k in NIMBLE_RAILS else "not published")))
    for hot in NIMBLE_HOT:
        speedup, _ = nimble_skew(hot)
        if hot is None:
            rows.append(Row("all-to-all-v balanced: speedup over single path", 1.0, speedup, "x", 0.15,
                            note="published: equal to NCCL"))
        else:
            pub = 5.0 if hot >= 0.7 else None
            rows.append(Row(f"all-to-all-v hot {hot:.1f}: speedup over single path", pub, speedup, "x",
                            rule="at_least", note="published: >= 5x from 0.7 (up to 5.2x)" if pub else "not published"))
    return rows


EXPERIMENTS = {"flexlink": flexlink, "fuselink": fuselink, "nimble": nimble}
PRESET_OF = {"flexlink": "h800x8-flexlink", "fuselink": "hopper8-8nic-fuselink", "nimble": "h100x4-mesh-4rail-nimble"}


def reproduce(name: str) -> list[Row]:
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown reproduction {name!r}; known: {', '.join(EXPERIMENTS)}")
    return EXPERIMENTS[name]()
