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
counter in the node segment, so the CPU never blocks; reductions go on the GPU after the H2D.
The ring memory is bounded by BRAID_HOST_BUFFER_MB.

A prepared call (comm/prepared.py) captures its host part once and replays it (`programs`,
`emit`): the counters above rise from call to call, which a replayed program cannot do, so a
captured program stages through a ring of its own (Layout.graph_rings, GRAPH_SLOTS slots),
starting at slot 0 in every call, and hands each slot over with flags that return to rest:

    producer:  [take free[s][c] for every reader c of slot s's previous use in this call]
               D2H (input piece -> slot s);  set full[s][c] = 1 for every reader c of the chunk
               ... at the end: take free[s][c] of every slot's last use
    consumer:  take full[s][me] (wait for 1, set back to 0);  H2D (slot s -> output piece(s));
               set free[s][me] = 1

(take: wait until the flag is 1, then set it back to 0; one batch of stream memory operations.)
A flag is set only after its waiter took its previous setting, and the producer's program ends
only when every reader has read every slot, so after each call every flag is 0 and every slot
free: the same program runs right the next time, and the posted calls' ring is never touched.
An abort sets the flags far above 1 (NodeSegment.release_flags), releasing every wait.
"""
from __future__ import annotations

import torch

from ..node import GRAPH_SLOTS
from ..planner.plan import LaneKind, Transfer
from ..planner.rings import graph_schedule, schedule
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
        return LaneRun(self.kind, start=start, end=self._end(cs))

    # captured programs (see the module docstring) ----------------------------------------------
    def programs(self, me: int, transfers: list[Transfer], in_ptr: int, out_ptrs: list[int]) -> tuple[list, list]:
        """This rank's host part of a collective call as two replay-safe programs (producer,
        consumer): lists of ("ops", [(wait, device address, value)...]) (one batch of flag
        operations) and ("copy", dst, src, nbytes)."""
        lc = self.lc
        return graph_programs(lc.layout, me, transfers, in_ptr, out_ptrs, lc.seg_dev_ptr, lc.segment.address)

    def beside(self, stream, progs: tuple[list, list], keep: list):
        """The two programs on the lane's streams once `stream` reached this point (posted or
        inside a capture, where they become two branches of the graph); returns join(s), which
        makes stream `s` wait for both. Events go into `keep` (alive with the graph)."""
        hs = (self.produce_stream, self.consume_stream)
        fork = torch.cuda.Event()
        fork.record(stream)
        for st in hs:
            st.wait_event(fork)
        self.emit(hs[0].cuda_stream, hs[1].cuda_stream, progs)
        keep.append(fork)

        def join(s) -> None:
            for st in hs:
                end = torch.cuda.Event()
                end.record(st)
                s.wait_event(end)
                keep.append(end)
        return join

    @staticmethod
    def emit(ph: int, ch: int, progs: tuple[list, list]) -> None:
        """The two programs on streams `ph` (producer) and `ch` (consumer)."""
        for sh, prog in ((ph, progs[0]), (ch, progs[1])):
            run_program(sh, prog)


def run_program(sh: int, prog: list) -> None:
    """One program's operations on stream `sh` (raw): batches of flag operations (as lists, or
    as arrays made once: posted_form) and copies."""
    for op in prog:
        if op[0] == "ops":
            _cuda.memops(sh, op[1])
        elif op[0] == "batch":
            _cuda.memops_posted(sh, op[1])
        else:
            _cuda.memcpy_async(op[1], op[2], op[3], sh)


def posted_form(prog: list) -> list:
    """A program that is posted call after call (a prepared send/recv's), with each batch of
    flag operations as the driver's array made here once: the same driver calls as `prog`, ~1-3
    us less a batch than building it at every post."""
    out = []
    for op in prog:
        arr = _cuda.memop_batch(op[1]) if op[0] == "ops" else None
        out.append(op if arr is None else ("batch", arr))
    return out


def graph_programs(lay, me: int, transfers: list[Transfer], in_ptr: int, out_ptrs: list[int],
                   dev_base: int, host_base: int, pair: tuple[int, int] | None = None) -> tuple[list, list]:
    """HostLane.programs on a layout and the segment's device (flags) and host (slots) bases;
    consecutive flag operations go in one batch. `pair` (src, dst): a send/recv's host share,
    through that direction's graph ring and flags (Layout.pair_graph_rings) instead of the
    collective calls' per-rank ones."""
    if pair is None:
        ring = lay.graph_rings[me]

        def flag(name: str, producer: int, slot: int, reader: int) -> int:
            return dev_base + lay.host_flag("flag_host_" + name, producer, slot, reader)

        def slot_addr(producer: int, slot: int) -> int:
            return host_base + lay.graph_rings[producer].slot_offset(slot)
    else:
        ring = lay.pair_graph_rings[pair]

        def flag(name: str, producer: int, slot: int, reader: int) -> int:
            return dev_base + lay.pair_flag("flag_pair_" + name, pair[0], pair[1], slot)

        def slot_addr(producer: int, slot: int) -> int:
            return host_base + ring.slot_offset(slot)
    produce, consume, tail = graph_schedule(transfers, me, ring.slot_bytes, GRAPH_SLOTS)

    def take(addr: int) -> list:
        return [(True, addr, 1), (False, addr, 0)]

    prod: list = []
    batch: list = []
    for st in produce:
        for c in st.free:
            batch += take(flag("free", me, st.slot, c))
        if batch:
            prod.append(("ops", batch))
        prod.append(("copy", slot_addr(me, st.slot), in_ptr + st.src_off, st.nbytes))
        batch = [(False, flag("full", me, st.slot, c), 1) for c in st.readers]
    for slot, readers in tail:
        for c in readers:
            batch += take(flag("free", me, slot, c))
    if batch:
        prod.append(("ops", batch))
    cons: list = []
    batch = []
    for st in consume:
        batch += take(flag("full", st.producer, st.slot, me))
        cons.append(("ops", batch))
        src = slot_addr(st.producer, st.slot)
        for b, off in st.dsts:
            cons.append(("copy", out_ptrs[b] + off, src, st.nbytes))
        batch = [(False, flag("free", st.producer, st.slot, me), 1)]
    if batch:
        cons.append(("ops", batch))
    return prod, cons


def pair_programs(sending: bool, ptr: int, ready: int, done: int, copies, host: list, drain: bool = False
                  ) -> list[list]:
    """One side of a prepared send/recv (comm/pairs.py) as programs of the host lane's kind, the
    first for the call's stream, any second for a stream beside it (forked from the first at
    its start, joined into it at its end):

        sender:    [set ready]  host producer (input -> the direction's graph ring)  [take done]
        receiver:  [take ready  pull the copy engines' share from the sender's input  set done]
                   beside it:  host consumer (ring -> output)

    ready/done are the direction's flags on the copy engines (0: no copy engines' share);
    `copies`: the receiver's (output offset, mapped source address, bytes) of that share;
    `host`: this side's host program built with a base pointer of 0 (graph_programs with
    `pair`), its input (sender) or output (receiver) offsets moved here by `ptr`. A drain (the
    receiver refusing a send that ran ahead) takes every hand-off and copies nothing. Every flag
    is back at 0 once both sides' programs ended."""
    if sending:
        prog = [("ops", [(False, ready, 1)])] if ready else []
        prog += [op if op[0] == "ops" else ("copy", op[1], ptr + op[2], op[3]) for op in host]
        if ready:
            prog.append(("ops", [(True, done, 1), (False, done, 0)]))
        return [_batched(prog)] if prog else []
    main: list = []
    if ready:
        main.append(("ops", [(True, ready, 1), (False, ready, 0)]))
        if not drain:
            main += [("copy", ptr + off, src, nbytes) for off, src, nbytes in copies]
        main.append(("ops", [(False, done, 1)]))
    side = [op if op[0] == "ops" else ("copy", ptr + op[1], op[2], op[3]) for op in host
            if not (drain and op[0] == "copy")]
    return [_batched(p) for p in (main, side) if p]


def _batched(prog: list) -> list:
    """Consecutive batches of flag operations as one (one driver call)."""
    out: list = []
    for op in prog:
        if op[0] == "ops" and out and out[-1][0] == "ops":
            out[-1] = ("ops", out[-1][1] + op[1])
        else:
            out.append(op)
    return out
