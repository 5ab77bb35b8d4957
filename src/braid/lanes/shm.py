"""`shm` lane: CPU tensors through the node's POSIX shared-memory rings.

The producer copies a chunk into a ring slot and bumps the ring's `full` counter; each consumer
polls it, copies the chunk out and bumps its `done` counter. The schedule (which chunk, which
slot, whom to wait for) is planner/rings.py's, shared with the GPU `host` lane. One worker thread
per call alternates between producing and consuming whatever is ready, so a rank never blocks on
its own ring while a peer waits for it.
"""
from __future__ import annotations

import time

import torch

from .. import envs
from ..errors import BraidTimeoutError
from ..node import geq
from ..planner.plan import LaneKind, Transfer
from ..planner.rings import schedule
from .base import Lane, LaneRun, OpContext


class ShmLane(Lane):
    kind = LaneKind.SHM
    device_type = "cpu"

    def __init__(self, lc):
        self.lc = lc
        # calls on the same rings run in call order (their chunks share the rings): the collective
        # ring, and each direction's pair ring; different rings run side by side (a pair's send
        # and recv in flight together must not wait for each other)
        self._last: dict[tuple, LaneRun] = {}

    def available(self) -> tuple[bool, str]:
        if self.lc.segment is None:
            return False, "ranks are not all on one node (no shared segment)"
        return True, ""

    def post(self, ctx: OpContext, transfers: list[Transfer]) -> LaneRun:
        lc = self.lc
        produce, consume = schedule(transfers, lc.rank, lc.world_size, lc.ring_chunk(ctx.plan.p2p),
                                    lc.ring_cursors, ctx.plan.p2p)
        seg, lay, me = lc.segment, lc.layout, lc.rank
        ring_mem = lc.segment_tensor
        inp, outs = ctx.inp, ctx.outs
        timeout = envs.get("BRAID_TIMEOUT_S")

        if ctx.plan.p2p:
            t = transfers[0]
            key = ("p2p", t.src, t.dsts[0][0])
        else:
            key = ("coll",)
        previous = self._last.get(key)

        def run() -> None:
            if previous is not None and previous.thread is not None:
                previous.thread.join()      # an earlier async call still moving: finish it first
            pi = ci = 0
            idle_since = None
            while pi < len(produce) or ci < len(consume):
                progressed = False
                if pi < len(produce):
                    st = produce[pi]
                    if all(geq(seg.get(lay.done_counter(st.ring, c)), v) for c, v in st.wait_for):
                        off = lay.ring(st.ring).slot_offset(st.slot)
                        ring_mem[off: off + st.nbytes].copy_(inp[st.src_off: st.src_off + st.nbytes])
                        seg.set(lay.full_counter(st.ring), st.g + 1)
                        pi += 1
                        progressed = True
                if ci < len(consume):
                    st = consume[ci]
                    if geq(seg.get(lay.full_counter(st.ring)), st.g + 1):
                        off = lay.ring(st.ring).slot_offset(st.slot)
                        for b, doff in st.dsts:
                            outs[b][doff: doff + st.nbytes].copy_(ring_mem[off: off + st.nbytes])
                        seg.set(lay.done_counter(st.ring, me), st.g + 1)
                        ci += 1
                        progressed = True
                if progressed:
                    idle_since = None
                    continue
                now = time.monotonic()
                if idle_since is None:
                    idle_since = now
                time.sleep(0.00002)
                if now - idle_since > 0.5:
                    peer = consume[ci].producer if ci < len(consume) else None
                    if peer is not None:
                        seg.check_alive(peer)
                    if now - idle_since > timeout:
                        raise BraidTimeoutError(f"shm lane on rank {me} made no progress for {timeout:.0f} s "
                                                f"(waiting on rank {peer}); a peer stopped or called another op")

        if any(o.is_inference() for o in outs):
            ring_run = run

            def run() -> None:      # an inference tensor is written only in inference mode (per thread)
                with torch.inference_mode():
                    ring_run()

        run_ = LaneRun(self.kind, thread_fn=run, slowdown=lc.slowdown.get("shm", 1.0))
        self._last[key] = run_
        return run_
