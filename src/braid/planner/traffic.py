"""Traffic matrices shared by the bench (`braid.workloads`) and the simulator (`braid.sim.own`);
pure Python, no torch."""
from __future__ import annotations


def hot_matrix(world: int, numel: int, h: float) -> list[list[int]]:
    """Elements each rank sends each rank: a fraction h of every row to the last rank (the hot
    one), the rest evenly over the other ranks."""
    hot = world - 1
    rows = []
    for _ in range(world):
        row = [0] * world
        row[hot] = int(numel * h)
        rest = numel - row[hot]
        others = [d for d in range(world) if d != hot]
        for i, d in enumerate(others):
            row[d] = rest // len(others) + (1 if i < rest % len(others) else 0)
        rows.append(row)
    return rows
