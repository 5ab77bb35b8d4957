"""`host` lane: GPU to GPU through pinned shared host memory (PCIe), on copy engines.

The chunk schedule is planner/rings.py's (shared with the CPU `shm` lane). On rank r:

    producer stream:  for each chunk g r stages:
                          wait done[ring][c] >= g - slots + 1 for every reader c of the slot's last chunk
                          cuMemcpyAsync D2H  (input piece -> ring slot)
                          write full[ring] = g + 1
    consumer stream:  for each chunk r reads (round-robin over producers):
                          wait full[ring] >= g + 1
                          cuMemcpyAsync H2D  (ring slot -> output piece)
                          write done[ring][r] = g + 1

Producer and consumer run on two streams: on one stream a rank's staging could wait for a peer
that itself waits for this rank to read (a cycle). Every wait is a stream memory operation on a
counter in the node segment, so the CPU never blocks; reductions (next issue) go on the GPU after
the H2D. The ring memory is bounded by BRAID_HOST_BUFFER_MB.
"""
from __future__ import annotations

import torch

from ..planner.plan import LaneKind, Transfer
from ..planner.rings import schedule
from . import _cuda
from .base import GpuLaneMixin, Lane, LaneRun, OpContext


class HostLane(GpuLaneMixin, Lane):
    kind = LaneKind.HOST
    device_type = "cuda"

    def __init__(self, lc, device: torch.device):
        self.lc = lc
        self.device = device
        self._why = ""
        self.produce_stream = self.consume_stream = None
        if lc.segment is None or lc.seg_dev_ptr is None:
            self._why = "ranks are not on one node or the node segment is not pinned"
        else:
            self.produce_stream = torch.cuda.Stream(device=device)
            self.consume_stream = torch.cuda.Stream(device=device)

    def available(self) -> tuple[bool, str]:
        return (self.produce_stream is not None, self._why)

    def post(self, ctx: OpContext, transfers: list[Transfer]) -> LaneRun:
        lc, me = self.lc, ctx.rank
        lay, dev_base, host_base = lc.layout, lc.seg_dev_ptr, lc.segment.address
        produce, consume = schedule(transfers, me, lc.world_size, lc.ring_chunk(ctx.plan.p2p),
                                    lc.ring_cursors, ctx.plan.p2p)
        ps, cs = self.produce_stream, self.consume_stream
        start = self._begin(ctx, cs)
        ps.wait_event(ctx.start_event)
        ph, ch = ps.cuda_stream, cs.cuda_stream
        inp = ctx.inp.data_ptr() if ctx.inp is not None and ctx.inp.numel() else 0
        for st in produce:
            for c, v in st.wait_for:
                _cuda.wait_value(ph, dev_base + lay.done_counter(st.ring, c), v)
            slot = host_base + lay.ring(st.ring).slot_offset(st.slot)
            _cuda.memcpy_async(slot, inp + st.src_off, st.nbytes, ph)
            _cuda.write_value(ph, dev_base + lay.full_counter(st.ring), st.g + 1)
        outs = [o.data_ptr() if o.numel() else 0 for o in ctx.outs]
        for st in consume:
            _cuda.wait_value(ch, dev_base + lay.full_counter(st.ring), st.g + 1)
            slot = host_base + lay.ring(st.ring).slot_offset(st.slot)
            for b, off in st.dsts:
                _cuda.memcpy_async(outs[b] + off, slot, st.nbytes, ch)
            _cuda.write_value(ch, dev_base + lay.done_counter(st.ring, me), st.g + 1)
        cs.wait_stream(ps)
        self._keep_alive(ctx, ps, cs)
        return LaneRun(self.kind, start=start, end=self._end(cs))
