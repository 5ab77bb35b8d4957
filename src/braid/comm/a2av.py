"""Uneven all_to_all on the copy engines: one round of words, then the pulls, per call.

An MoE layer's dispatch and combine are uneven all_to_all calls whose split sizes change with
every batch, so a program captured for one set of sizes would rarely run twice. What stays from
call to call is the buffers. So each call:

    round  every rank posts [its largest demand, word, agreement, the bytes it sends each rank]
           through the node segment and reads every rank's: the whole matrix, on every rank
    word   the input's address and the driver's id of its allocation (a new allocation at the
           same address has another id: a peer never reads it through an old mapping)
    maps   every rank's words in a tuple key the peers' mapped inputs; a new tuple exchanges the
           IPC descriptors once (every rank sees the same tuple, so all exchange together)
    post   on the copy-engine lane's stream, counters raised to the call's sequence number
           (lanes/signals.py, Rising): ready, for each source that sends me bytes: wait for its
           ready, pull its part for me into my output; done, wait for my readers' done. My own
           part is copied on the caller's stream beside it.

Where the native calls are built (`BRAID_NATIVE_CALL`), the round's post, read and checks are one
call (`_rounds.c` uneven_round, through UnevenAgreement.round_native) and so is the post
(uneven_post, which reads the matrix from the round's slots): the same values and driver calls
as in Python, about half the host time.

The round replaces the agreement on the largest demand that every uneven call makes anyway
(comm/routing.py), so the matrix costs no second exchange. A call goes this way when the
calibration (or fixed shares) gives the call's size to the copy engines alone; ce + host splits
and routed plans take the full path with its descriptors. A matrix whose entries are all equal is
a balanced call and takes the prepared path instead (comm/uneven.py, Even). The counters rise
from call to call, so a call here refuses a CUDA graph capture (as the full path does).
"""
from __future__ import annotations

import ctypes
from collections import OrderedDict

import torch

from ..errors import PeerMismatchError
from ..lanes import _cuda
from ..lanes.signals import Rising
from .prepared import _RAW, _capturing, mix_word, posted_not_capturable

MAX_MAPS = 64        # tuples of words kept (each holds the peers' mapped inputs, mapped once per allocation)
ROW_AT = 3           # where a rank's row starts among the round's values (matrix_of)


def word_of(inp: torch.Tensor) -> int:
    """This rank's input as one non-zero word: its address and the driver's id of its allocation
    (not its length: an MoE layer's inputs are views of one buffer whose length changes with
    every batch; what a peer may read of it, the matrix says). The native call of an all_to_all
    with equal split sizes posts the same word (`_rounds.c` fast_round)."""
    ptr = inp.data_ptr()
    return mix_word(ptr, _cuda.buffer_id(ptr) if inp.numel() else 0) | 1


def matrix_of(got: list[list[int]], world: int) -> list[list[int]]:
    """Bytes rank s sends rank d, from the round's values ([big, word, agree, row...])."""
    return [list(g[ROW_AT:ROW_AT + world]) for g in got]


def check_columns(matrix: list[list[int]], me: int, recv: list[int], op: str) -> None:
    """What each rank sends me must be what I expect from it."""
    for s, row in enumerate(matrix):
        if row[me] != recv[s]:
            raise PeerMismatchError(
                f"{op}: rank {s} sends {row[me]} bytes to rank {me}, but rank {me} expects {recv[s]} bytes "
                f"from rank {s} (input/output split sizes disagree)")


class UnevenCe:
    """The peers' mapped inputs, kept per tuple of words, and the per-call program."""

    def __init__(self, rank: int, world_size: int, segment, seg_dev_ptr: int, layout, ce, prepared):
        self.rank, self.world_size = rank, world_size
        self.segment, self.seg_dev_ptr, self.layout = segment, seg_dev_ptr, layout
        self.ce, self.prepared = ce, prepared
        self.maps: OrderedDict = OrderedDict()
        self.stats = {"calls": 0, "mapped": 0, "native": 0}
        self._arrays = None         # _native's arrays: every rank's counters, the peers' inputs
        self._peer_key = None       # the peers' mapping those arrays hold

    def _peers(self, words: tuple, inp: torch.Tensor) -> dict[int, int]:
        got = self.maps.get(words)
        if got is not None:
            self.maps.move_to_end(words)
            return got
        desc = {"op": "all_to_all_single", **self.ce.descriptor(inp)}
        descs = self.segment.exchange_collective(desc, list(range(self.world_size)))
        for r, d in enumerate(descs):
            if d.get("op") != "all_to_all_single":
                raise PeerMismatchError(f"all_to_all_single: rank {r} made a different call ({d.get('op')!r}) "
                                        f"where every rank exchanges its input's mapping")
        got = {p: self.ce._peer_ptr(p, descs[p]) for p in range(self.world_size)
               if p != self.rank and descs[p].get("ce_h")}
        self.maps[words] = got
        self.stats["mapped"] += 1
        while len(self.maps) > MAX_MAPS:
            self.maps.popitem(last=False)
        return got

    def run(self, out: torch.Tensor, inp: torch.Tensor, matrix: list[list[int]], words: tuple, async_op: bool,
            fast=None, token: tuple | None = None):
        """This rank's part of the call: the round (`token`) is done and the matrix agreed (None:
        in the round's slots). Returns the prepared calls' handle (async) or their done marker.
        `fast`: the native calls (native_rounds.FastCalls), which post it in one call from the
        round's slots."""
        if _capturing():            # the counters below rise from call to call
            raise posted_not_capturable("all_to_all_single", {"ce": 1.0}, "uneven")
        me, w = self.rank, self.world_size
        peers = self._peers(words, inp)
        if fast is not None and token is not None:
            return self._native(fast, token, out, inp, peers, async_op)
        if matrix is None:          # a native round's verdict (it left the matrix in the slots)
            matrix = matrix_of(self.segment.read_values(token, "all_to_all_single"), w)
        row = matrix[me]
        col = [matrix[s][me] for s in range(w)]
        out_at = [sum(col[:s]) for s in range(w)]
        prep, ce = self.prepared, self.ce
        stream = ce.stream
        sh = stream.cuda_stream
        caller = prep.fork(stream)
        ce.coll_seq += 1
        sig = Rising(self.seg_dev_ptr, self.layout, ce.coll_seq)
        readers = [d for d in range(w) if d != me and row[d]]
        sources = [(me + i) % w for i in range(1, w) if col[(me + i) % w]]
        out_ptr = out.data_ptr()
        for i, s in enumerate(sources):
            if i:
                sig.wait_ready(sh, (s,), me)
            else:                       # my ready and the first wait: one batch
                sig.ready_then_wait(sh, me, readers, (s,))
            _cuda.memcpy_async(out_ptr + out_at[s], peers[s] + sum(matrix[s][:me]), col[s], sh)
        if not sources:
            sig.ready(sh, me, readers)
        sig.done_then_wait(sh, me, sources, readers)
        if row[me]:                     # my own part, on the caller's stream beside the pulls
            _cuda.memcpy_async(out_ptr + out_at[me], inp.data_ptr() + sum(row[:me]), row[me], caller)
        self.stats["calls"] += 1
        return prep.join(caller, stream, async_op, (inp, out))

    def _native(self, fast, token: tuple, out: torch.Tensor, inp: torch.Tensor, peers: dict, async_op: bool):
        """run() in one native call (`_rounds.c` uneven_post): the same driver calls in the same
        order, from the matrix in the round's slots (one H200 shared by 2 ranks, 4 MiB,
        2026-12-03: 22 us of host time, 58 in Python)."""
        w, prep, ce = self.world_size, self.prepared, self.ce
        arr = self._arrays
        if arr is None:             # the counters' device addresses, for the communicator's life
            words = ctypes.c_uint64 * w
            arr = self._arrays = (words(*[self.seg_dev_ptr + self.layout.counter("ce_arrive", r) for r in range(w)]),
                                  words(*[self.seg_dev_ptr + self.layout.counter("ce_finish", r) for r in range(w)]),
                                  words())
        pk = self._peer_key
        if pk is not peers:         # this tuple of words' mapped inputs, as the native call takes them
            for r in range(w):
                arr[2][r] = peers.get(r, 0)
            self._peer_key = peers
        start, caller = prep.fork_event(), _RAW(prep._dev_index)
        ce.coll_seq += 1
        end = prep.end_event()
        rc = fast.uneven_post(token[0], token[1], ROW_AT, arr[2], arr[0], arr[1], ce.coll_seq, inp.data_ptr(),
                              out.data_ptr(), caller, ce.stream.cuda_stream, start, end, not async_op)
        if rc:
            if rc == fast.UP_DRIVER:
                _cuda.check(fast.rc.value, "in the uneven all_to_all's posting")
            raise PeerMismatchError(f"all_to_all_single: the copy engines' posting refused the call: "
                                    f"{fast.UP_ERRORS.get(rc, rc)}")
        self.stats["calls"] += 1
        self.stats["native"] += 1
        return prep.joined(async_op, end, ce.stream, (inp, out))

    def close(self) -> None:
        self.maps.clear()           # the mappings themselves belong to the ce lane (closed there)
