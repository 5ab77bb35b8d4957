"""The router's model of a machine: directed links with capacities and, per ordered GPU pair, the
candidate paths between them. Pure Python, no torch.

A `Path` lists the links it crosses with the bytes it puts on each per byte routed (a host-staged
copy crosses host memory twice: weight 2). A `Topology` is the links (GB/s) and the candidates per
pair. A multi-node topology also carries its `cluster` (braid.planner.cluster): the structure that
the hierarchical planner (braid.planner.hier) works on instead of the enumerated pairs, whose
candidates it then builds on demand.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Path:
    kind: str                                  # "direct", "relay", "host", "rail"
    links: tuple[tuple[str, float], ...]       # (link id, bytes of this link per byte routed)
    via: tuple[int, ...] = ()                  # relay GPUs / rail index

    def name(self) -> str:
        return self.kind + ("" if not self.via else ":" + ",".join(map(str, self.via)))


@dataclass
class Topology:
    name: str
    num_gpus: int
    capacity: dict[str, float]                 # link id -> GB/s
    paths: dict[tuple[int, int], list[Path]] = field(default_factory=dict)
    source: str = ""                           # where the constants come from
    cluster: object = None                     # a multi-node structure (planner.cluster.Cluster), or None

    def candidates(self, s: int, d: int) -> list[Path]:
        return self.paths[(s, d)]
