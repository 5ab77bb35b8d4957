"""`gloo` lane: point-to-point through a gloo sub-group, for CPU tensors.

Every transfer piece is one isend/irecv pair; both sides post them in the plan's global order, so
gloo matches them per pair without tags. A worker thread waits for them so the lane runs beside
the others and reports its own time.
"""
from __future__ import annotations

import torch.distributed as dist

from ..planner.plan import LaneKind, Transfer
from .base import Lane, LaneRun, OpContext


class GlooLane(Lane):
    kind = LaneKind.GLOO
    device_type = "cpu"

    def __init__(self, group):
        self.group = group

    def available(self) -> tuple[bool, str]:
        if self.group is None:
            return False, "no gloo group"
        return True, ""

    def post(self, ctx: OpContext, transfers: list[Transfer]) -> LaneRun:
        me = ctx.rank
        works = []
        for t in transfers:
            if t.src == me:
                piece = ctx.inp[t.src_off: t.src_off + t.nbytes]
                for d, _, _ in t.dsts:
                    works.append(dist.isend(piece, group_dst=d, group=self.group))
            for d, b, off in t.dsts:
                if d == me:
                    works.append(dist.irecv(ctx.outs[b][off: off + t.nbytes], group_src=t.src, group=self.group))

        def finish() -> None:
            for w in works:
                w.wait()

        return LaneRun(self.kind, thread_fn=finish, slowdown=ctx.lc.slowdown.get("gloo", 1.0))
