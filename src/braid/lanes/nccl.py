"""`nccl` lane: NCCL kernels over NVLink, through a torch NCCL sub-group on the lane's own stream.

Its share of a plan is posted as one batch of NCCL sends and receives (ncclGroupStart/End inside
torch's batch_isend_irecv), which places any byte range anywhere (no staging copy). When the plan
is NCCL alone, the communicator calls NCCL's own collective instead (see comm/callpath.py): that is the
small-message path and must cost no more than NCCL itself.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..planner.plan import LaneKind, Transfer
from .base import GpuLaneMixin, Lane, LaneRun, OpContext


class NcclLane(GpuLaneMixin, Lane):
    kind = LaneKind.NCCL
    device_type = "cuda"

    def __init__(self, group, device: torch.device):
        self.group = group
        self.device = device
        self.stream = torch.cuda.Stream(device=device) if group is not None else None

    def available(self) -> tuple[bool, str]:
        if self.group is None:
            return False, "no NCCL group (torch built without NCCL, or no GPUs)"
        return True, ""

    def post(self, ctx: OpContext, transfers: list[Transfer]) -> LaneRun:
        me, s = ctx.rank, self.stream
        start = self._begin(ctx, s)
        ops = []
        for t in transfers:
            if t.src == me:
                piece = ctx.inp[t.src_off: t.src_off + t.nbytes]
                for d, _, _ in t.dsts:
                    ops.append(dist.P2POp(dist.isend, piece, group=self.group, group_peer=d))
            for d, b, off in t.dsts:
                if d == me:
                    ops.append(dist.P2POp(dist.irecv, ctx.outs[b][off: off + t.nbytes], group=self.group, group_peer=t.src))
        with torch.cuda.stream(s):
            if ops:
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
        return LaneRun(self.kind, start=start, end=self._end(s))
