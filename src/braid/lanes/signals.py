"""How the copy engines' programs order themselves across ranks: two signal schemes, one interface.

Every GPU program of the `ce` lane and of the copy engines' reduction says four things to its
peers, with stream memory operations on words of the pinned node segment:

    ready(me, readers)        my input may be read             (before the first pull of me)
    wait_ready(srcs, me)      each src's input may be read     (before I pull from them)
    done(me, sources)         I finished reading my sources    (after my last pull)
    wait_done(readers, me)    each reader finished reading me  (before my program ends)
and the reductions add, per piece k:
    piece(me, k, readers)     my reduced piece k may be read
    wait_piece(srcs, me, k)   each src's reduced piece k may be read
    wait_pieces(counts, me)   each src's first counts[src] pieces have been said (one batch): a
                              src that says its pieces in order on one stream may say only its
                              last one (the pushed all_reduce does), which is all this waits for

Each of these is one batch of stream memory operations (`_cuda.memops`): one node of a captured
graph, whatever the number of peers (a graph launch costs ~1.1 us of host time per memory
operation node, so a 4-rank all_reduce's 27 flag operations cost ~30 us as separate nodes; ~2.5 us
a node inside DDP's steps on 2 x H200). Where a program says and then waits on the same stream
with nothing between, `ready_then_wait` and `done_then_wait` put both in one batch (a batch runs
in order: the writes land before the waits start); so does `piece_then_wait_pieces`, the pushed
all_reduce's last piece and its wait for the peers' last pieces.

`Rising` is the scheme of calls posted one by one: a counter per rank that every call raises to
its sequence number (waits are >= comparisons, cyclic in 32 bits). Posting costs one write per
announcement, but the values change with every call, so a captured program could not run twice.

`Flags` is the scheme of programs built once and replayed (CUDA graphs, ours or a user's): one
flag per ordered pair of ranks (and piece), 0 at rest. The writer sets it to 1; the one rank that
waits for it waits for >= 1 and sets it back to 0. Every flag a program sets is reset by its
peer's program of the same call, so after every call the flags are 0 again and the same program
runs right the next time. A flag is set only for the ranks that will wait for it (the agreed plan
tells every rank the same readers and sources), so none is left set. The next call's writer
cannot set a flag before its waiter reset it: the writer's previous program ended with waiting
for that reader's `done`, which the reader wrote after its reset.

An abort sets every flag far above 1 (NodeSegment.release_flags), releasing every wait.
Rejected: a rising sequence number captured in a graph (frozen at capture: the second replay
waits for the value the first one wrote, and passes before the peer is ready).
"""
from __future__ import annotations

from . import _cuda


def _emit(sh: int, ops: list) -> None:
    """`ops` on stream `sh` as one batch (nothing where there are none)."""
    if ops:
        _cuda.memops(sh, ops)


class _Scheme:
    """The signals on a stream, from each scheme's lists of operations ((wait, address, value))."""

    def ready(self, sh: int, me: int, readers) -> None:
        _emit(sh, self._ready_ops(me, readers))

    def wait_ready(self, sh: int, srcs, me: int) -> None:
        _emit(sh, self._wait_ready_ops(srcs, me))

    def ready_then_wait(self, sh: int, me: int, readers, srcs) -> None:
        _emit(sh, self._ready_ops(me, readers) + self._wait_ready_ops(srcs, me))

    def done(self, sh: int, me: int, sources) -> None:
        _emit(sh, self._done_ops(me, sources))

    def wait_done(self, sh: int, readers, me: int) -> None:
        _emit(sh, self._wait_done_ops(readers, me))

    def done_then_wait(self, sh: int, me: int, sources, readers) -> None:
        _emit(sh, self._done_ops(me, sources) + self._wait_done_ops(readers, me))

    def piece(self, sh: int, me: int, k: int, readers) -> None:
        _emit(sh, self._piece_ops(me, k, readers))

    def wait_piece(self, sh: int, srcs, me: int, k: int) -> None:
        _emit(sh, self._wait_piece_ops(srcs, me, k))

    def wait_pieces(self, sh: int, counts: dict, me: int) -> None:
        _emit(sh, self._wait_pieces_ops(counts, me))

    def piece_then_wait_pieces(self, sh: int, me: int, k: int, readers, counts: dict) -> None:
        _emit(sh, self._piece_ops(me, k, readers) + self._wait_pieces_ops(counts, me))


class Rising(_Scheme):
    """Per-rank counters raised to the call's sequence number (`seq`); `piece_base` is where
    the reduction's piece counter starts in this call (seq * MAX_PIECES)."""

    replayable = False

    def __init__(self, seg_dev_ptr: int, layout, seq: int, piece_base: int = 0):
        self.base, self.lay, self.seq, self.piece_base = seg_dev_ptr, layout, seq, piece_base

    def _counter(self, name: str, rank: int) -> int:
        return self.base + self.lay.counter(name, rank)

    def _ready_ops(self, me: int, readers) -> list:
        return [(False, self._counter("ce_arrive", me), self.seq)]

    def _wait_ready_ops(self, srcs, me: int) -> list:
        return [(True, self._counter("ce_arrive", s), self.seq) for s in srcs]

    def _done_ops(self, me: int, sources) -> list:
        return [(False, self._counter("ce_finish", me), self.seq)]

    def _wait_done_ops(self, readers, me: int) -> list:
        return [(True, self._counter("ce_finish", p), self.seq) for p in readers]

    def _piece_ops(self, me: int, k: int, readers) -> list:
        return [(False, self._counter("ce_red", me), self.piece_base + k + 1)]

    def _wait_piece_ops(self, srcs, me: int, k: int) -> list:
        return [(True, self._counter("ce_red", s), self.piece_base + k + 1) for s in srcs]

    def _wait_pieces_ops(self, counts: dict, me: int) -> list:
        return [(True, self._counter("ce_red", s), self.piece_base + n) for s, n in counts.items() if n]


class Flags(_Scheme):
    """Per-pair flags set to 1 by the writer and reset to 0 by the waiter (replay-safe)."""

    replayable = True

    def __init__(self, seg_dev_ptr: int, layout):
        self.base, self.lay = seg_dev_ptr, layout

    def _flag(self, name: str, *index: int) -> int:
        return self.base + self.lay.counter(name, *index)

    @staticmethod
    def _sets(addrs) -> list:
        return [(False, a, 1) for a in addrs]

    @staticmethod
    def _takes(addrs) -> list:
        """Wait for each flag and set it back to 0 (each wait before its reset)."""
        return [op for a in addrs for op in ((True, a, 1), (False, a, 0))]

    def _ready_ops(self, me: int, readers) -> list:
        return self._sets([self._flag("flag_ready", me, p) for p in readers])

    def _wait_ready_ops(self, srcs, me: int) -> list:
        return self._takes([self._flag("flag_ready", s, me) for s in srcs])

    def _done_ops(self, me: int, sources) -> list:
        return self._sets([self._flag("flag_done", me, s) for s in sources])

    def _wait_done_ops(self, readers, me: int) -> list:
        return self._takes([self._flag("flag_done", p, me) for p in readers])

    def _piece_ops(self, me: int, k: int, readers) -> list:
        return self._sets([self._flag("flag_piece", me, p, k) for p in readers])

    def _wait_piece_ops(self, srcs, me: int, k: int) -> list:
        return self._takes([self._flag("flag_piece", s, me, k) for s in srcs])

    def _wait_pieces_ops(self, counts: dict, me: int) -> list:
        # the last piece's flag only: its writer says its pieces in order and sets no other
        return self._takes([self._flag("flag_piece", s, me, n - 1) for s, n in counts.items() if n])
