"""How nccl-tests turns a time into bandwidth: the bytes an op's algorithm bandwidth counts and the
factor from algorithm to bus bandwidth. Shared by the simulator's collectives and the topology's
measured NCCL tables."""
from __future__ import annotations


def bus_factor(op: str, world: int) -> float:
    """busbw = algbw x this factor (nccl-tests' definition): the share of the data each link carries."""
    if op == "all_reduce":
        return 2 * (world - 1) / world
    if op in ("all_gather", "reduce_scatter", "all_to_all_single"):
        return (world - 1) / world
    return 1.0


def algbytes(op: str, world: int, nbytes: int) -> int:
    """What bandwidth is computed over (braid bench's algbytes): all_gather's output is W x input."""
    return nbytes * world if op == "all_gather" else nbytes
