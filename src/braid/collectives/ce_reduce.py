"""The copy engines' own reduction: a pipelined reduce-scatter (and all-gather) over NVLink.

The first cut of braid's reductions ran three steps one after the other (pull every slot, reduce,
pull the reduced chunks back) with a second descriptor exchange in between; on 2 x H200 that was
250 GB/s against NCCL's 309 for all_reduce. Here the steps overlap, piece by piece.

Rank r of w reduces chunk r of the region the `ce` lane was given (chunk d is a range of elements
`(off_d, len_d)` of every rank's input). Each chunk is cut into K pieces. Three streams per rank:

    pull stream   (copy engine)  write arrive[r]; wait arrive[p] (every peer's input is ready)
                                 for k: for p != r: pull p's input[chunk r, piece k] -> slot[p, k]
                                        record event k
    reduce stream (SMs)          for k: wait event k
                                        out[chunk r, piece k] = x_0 (op) x_1 (op) ... x_{w-1}   (rank order)
    gather stream (copy engine, all_reduce only)
                                 for k: wait for my reduction of piece k
                                        for p != r: push my out[chunk r, piece k] -> p's out[chunk r, piece k]
                                 write red[r] = base + K (after the last push: the stream's pushes
                                 end in order, and the peers wait only for the last piece), and
                                 wait red[p] >= base + (p's piece count) for every p != r
    then, on the pull stream: join the others (reduce_scatter also writes finish[r] and waits
    finish[p] for every peer: nobody reads my buffers once the call is over).

A reduce to rank `root` runs the same pipeline and pushes only to the root: rank r != root reduces
its chunk into a scratch row (its own tensor stays as it was, as NCCL's reduce leaves it) and
pushes each reduced piece into the root's tensor; the root reduces its own chunk in place and
pushes nothing. Every rank then says its last piece and waits for every peer's, as the pushed
all_reduce does: a rank's last piece comes after its last pull, so that wait also says that no
peer reads this rank's input any more.

Why the all_reduce needs no closing handshake: p's last piece counter says that p pushed its last
reduced piece into my output, and p pushes a piece only after pulling that piece from every rank,
so once every peer's last piece has come, every peer is done reading my input and writing my
output. (That holds when every rank reduces a non-empty chunk; a call with an empty chunk, and
BRAID_CE_PUSH=0, take the older scheme: the peers pull each reduced piece once its counter says
so, and the call closes with finish[].) The push saves one GPU-to-GPU signal on the call's
critical path, and its pieces need no signal of their own: one after the last push says them all,
in one batch with the wait for the peers' last pieces (K stream memory operation nodes fewer per
replayed call; a launch costs the host per node: ~2.5 us a node inside DDP's steps on 2 x H200,
2026-11-27).

Why an in-place all_reduce (and reduce) is safe: p reads my chunk p (its pulls) and writes my
chunk p (its pushes, each after the pull of the same piece); I read and write only my own chunk r,
and p's chunk r. Nobody reads my chunk r before I reduce it.

The counters live in the node segment like the `ce` lane's arrive/finish; `base` is the call's
sequence number times MAX_PIECES, so the counters only grow (GEQ waits are cyclic in 32 bits).
Each element is reduced once, in rank order, accumulating half precision in float32 and rounding
once: the same inputs give bitwise the same output on every rank and every run.

What the GPU does (torch.profiler timeline, 2 x H200 of the 4-GPU host, 1 GiB, 2026-11-22, when
the gather pulled the peers' reduced pieces): the gathers do not overlap the pulls. Both are
peer-to-peer copies into this GPU and run one after the other, each at 340-372 GB/s, so the incoming direction is busy throughout and the piece count
hardly matters for bandwidth; what it changes is host work per call (more launches) and the small
gaps between copies. 4 pieces of ~123 MB: 3106 us per call of GPU time; 16 pieces of 32 MiB: 3227.

Rejected: one stream that interleaves pulls and gathers (a gather that waits for a lagging peer
blocks the next pulls); a bounded ring of slots instead of one slot row per peer (back-pressure
needs one more counter per piece and the memory saved is the size of the chunk); on two GPUs,
each rank pulling the peer's whole input and reducing all of it (no gather, no wait on the peer's
reduction, same bytes per NVLink direction): one pull stream at 349 GB/s, 3288 us per call at
1 GiB against 3106 for this pipeline (measured, then removed).
"""
from __future__ import annotations

import torch

from .. import envs
from ..lanes import _cuda
from ..lanes.base import LaneRun, kept_buffer
from ..lanes.ce import lane_stream
from ..lanes.signals import Rising
from ..planner import pieces as _pc
from ..planner.pieces import MAX_PIECES, pieces
from ..planner.plan import LaneKind
from .reduce import reduce_pair, reduce_slots


def slot_rows(world: int, me: int, root: int | None) -> int:
    """Scratch rows of one call: the peer's row (two ranks) or every rank's, and for a reduce's
    non-root rank one more, the last, for its reduced chunk."""
    return (1 if world == 2 else world) + (root is not None and me != root)


def piece_elems(chunks: list[tuple[int, int]], esz: int) -> int:
    """Elements per piece for these agreed chunks (`planner.pieces`' rule on the largest)."""
    longest = max((n for _, n in chunks), default=0) * esz
    return _pc.piece_elems(longest, esz, piece_mb=envs.get("BRAID_CE_PIECE_MB"),
                           min_piece=envs.get("BRAID_CE_MIN_PIECE_MB") << 20)


def tail_elems(per: int, esz: int) -> int:
    """The smallest piece of a chunk's tapered end (`planner.pieces`), in elements; 0: none."""
    if not envs.get("BRAID_CE_TAPER"):
        return 0
    return _pc.tail_elems(per, esz, envs.get("BRAID_CE_TAPER_FROM_KB") << 10)


class CeReduction:
    """Posts one pipelined reduction on rank `lc.rank` (see the module docstring)."""

    def __init__(self, lane, lc):
        self.lane = lane
        self.lc = lc
        dev = lane.device
        self.gather_stream = lane_stream(dev)
        self.reduce_stream = lane_stream(dev)
        self.buf: torch.Tensor | None = None
        self.pool: list = []

    def post(self, *, start_event, inp: torch.Tensor, out: torch.Tensor, chunks: list[tuple[int, int]],
             out_offsets: list[int], gather: bool, descs: list, name: str, factor: float,
             root: int | None = None) -> LaneRun:
        """inp/out: this rank's flat tensors (out may be inp: in place). chunks[d] = (element offset
        into every rank's input, length) of chunk d; out_offsets[d]: where chunk d's result goes in
        the output of the rank that reduces it (and, with `gather`, in every rank's output).
        `root`: a reduce to that rank (in place, every chunk non-empty; `gather` False)."""
        lc, lane = self.lc, self.lane
        lane.coll_seq += 1
        seq = lane.coll_seq
        sig = Rising(lc.seg_dev_ptr, lc.layout, seq, (seq * MAX_PIECES) & 0xFFFFFFFF)
        ps, rs, gs = lane.stream, self.reduce_stream, self.gather_stream
        for s in (ps, rs, gs):
            s.wait_event(start_event)
        start = torch.cuda.Event(enable_timing=True)
        start.record(ps)
        my_len = chunks[lc.rank][1]
        slots = self._scratch(slot_rows(lc.world_size, lc.rank, root), my_len, inp.dtype) if my_len else None
        events = self._events(2 * self.num_pieces(chunks, inp.element_size()))
        self.emit(ps, rs, gs, inp=inp, out=out, chunks=chunks, out_offsets=out_offsets, gather=gather,
                  peers=self.peer_ptrs(descs), name=name, factor=factor, sig=sig, slots=slots, events=events,
                  root=root)
        return LaneRun(LaneKind.CE, start=start, end=lane._end(ps))

    def peer_ptrs(self, descs: list) -> dict[int, int]:
        """Mapped bases of every peer's input (opened once per allocation)."""
        me, w = self.lc.rank, self.lc.world_size
        return {p: self.lane._peer_ptr(p, descs[p]) for p in range(w)
                if p != me and descs[p] and "ce_h" in descs[p]}

    def num_pieces(self, chunks: list[tuple[int, int]], esz: int) -> int:
        per = piece_elems(chunks, esz)
        return len(pieces(chunks[self.lc.rank][1], per, tail_elems(per, esz)))

    def emit(self, ps, rs, gs, *, inp: torch.Tensor, out: torch.Tensor, chunks: list[tuple[int, int]],
             out_offsets: list[int], gather: bool, peers: dict[int, int], name: str, factor: float, sig,
             slots: torch.Tensor | None, events: list, root: int | None = None) -> None:
        """The pipeline on streams ps (pulls), rs (reductions), gs (gathers), all three already
        after the call's start; ends with rs and gs joined into ps. `sig`: the signal scheme
        (lanes/signals.py); `slots`: (slot_rows(...), my chunk) scratch; `events`: two per piece;
        `root`: a reduce to that rank (see the module docstring)."""
        lc = self.lc
        me, w = lc.rank, lc.world_size
        esz = inp.element_size()
        per = piece_elems(chunks, esz)
        my_off, my_len = chunks[me]
        tail = tail_elems(per, esz)
        mine = pieces(my_len, per, tail)
        others = [(me + i) % w for i in range(1, w)]          # rotated: sources are read evenly
        psh = ps.cuda_stream
        sig.ready_then_wait(psh, me, others, others)
        row = (lambda p: 0) if w == 2 else (lambda p: p)                # noqa: E731
        my_in = inp[my_off: my_off + my_len]
        if root is None or me == root:
            my_out = out[out_offsets[me]: out_offsets[me] + my_len]
        else:                 # a reduce's non-root rank: its reduced chunk goes to the root alone
            my_out = slots[-1]
        slot_ptr = slots.data_ptr() if slots is not None else 0
        row_bytes = my_len * esz
        readers = others if gather or root is not None else ()
        # an all_reduce pushes its reduced pieces (no closing handshake: see the docstring) when
        # every rank reduces something, so that every rank hears from every peer after its start;
        # a reduce always does (Reductions.reduce_cuts gives it the copy engines only then)
        push = root is not None or (gather and envs.get("BRAID_CE_PUSH") and all(n for _, n in chunks))
        pushees = others if root is None else [root] if me != root else []
        with torch.cuda.stream(rs):
            for k, (a, b) in enumerate(mine):
                for p in others:
                    _cuda.memcpy_async(slot_ptr + row(p) * row_bytes + a * esz, peers[p] + (my_off + a) * esz,
                                       (b - a) * esz, psh)
                events[k].record(ps)
                rs.wait_event(events[k])
                if w == 2:            # two ranks reduce the peer's row with the own input directly
                    other = slots[0, a:b]
                    x0, x1 = (my_in[a:b], other) if me == 0 else (other, my_in[a:b])
                    reduce_pair(x0, x1, name, my_out[a:b], factor)
                else:
                    slots[me, a:b].copy_(my_in[a:b])
                    reduce_slots(slots[:w, a:b], w, name, my_out[a:b], factor)
                if push:              # my reduced piece into the peers' outputs (a reduce: the root's)
                    done_k = events[len(mine) + k]
                    done_k.record(rs)
                    gs.wait_event(done_k)
                    at = (out_offsets[me] + a) * esz
                    for p in pushees:
                        _cuda.memcpy_async(peers[p] + at, my_out[a:b].data_ptr(), (b - a) * esz, gs.cuda_stream)
                else:
                    sig.piece(rs.cuda_stream, me, k, readers)
        if push:
            # one signal after the last push says every piece; then every peer's last piece is in
            # my output, and with it every peer's last pull of my input is over (a peer pushes a
            # piece only after pulling it from every rank): one batch
            sig.piece_then_wait_pieces(gs.cuda_stream, me, len(mine) - 1, readers,
                                       {p: len(pieces(chunks[p][1], per, tail)) for p in others})
        elif gather:
            out_ptr = out.data_ptr()
            theirs = {p: pieces(chunks[p][1], per, tail) for p in others}
            rounds = max((len(v) for v in theirs.values()), default=0)
            for k in range(rounds):
                # every peer's piece k waited for in one batch (one graph node), then pulled
                have = [p for p in others if k < len(theirs[p])]
                sig.wait_piece(gs.cuda_stream, have, me, k)
                for p in have:
                    a, b = theirs[p][k]
                    at = (out_offsets[p] + a) * esz
                    _cuda.memcpy_async(out_ptr + at, peers[p] + at, (b - a) * esz, gs.cuda_stream)
        for s in (rs, gs):
            ev = torch.cuda.Event()
            ev.record(s)
            ps.wait_event(ev)
        if not push:
            sig.done_then_wait(psh, me, others, others)

    def _events(self, n: int) -> list:
        """Reused events (recording an event again is stream-ordered after its earlier waits)."""
        while len(self.pool) < n:
            self.pool.append(torch.cuda.Event())
        return self.pool[:n]

    def _scratch(self, rows: int, n: int, dtype: torch.dtype) -> torch.Tensor:
        """The slot rows, kept from call to call. A fresh allocation each call cost ~2 ms on
        2 x H200 (2026-11-22): the caching allocator cannot hand back the previous call's block
        while our streams still hold it, so it went to cudaMalloc. Reuse is safe: the next call's
        pulls run on the pull stream after it joined this call's reduce and gather streams."""
        need = rows * n * torch.empty((), dtype=dtype).element_size()
        if self.buf is None or self.buf.numel() < need:
            self.buf = None
            self.buf = kept_buffer(need, self.lane.device)
        return self.buf[:need].view(dtype).view(rows, n)

    def close(self) -> None:
        self.buf = None
