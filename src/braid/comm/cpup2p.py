"""send/recv of CPU tensors through the node segment: one byte ring per ordered pair of ranks.

A CPU communicator that runs its collectives through the segment (comm/cpushm.py) sends every
untagged send/recv here too, whatever the tensor's size or layout: both ranks of a pair choose the
path from facts they share, so each direction's messages stay in order on one transport. gloo's
loopback TCP took 140-520 us for a 4-64 KiB message on 2 cores; here a message is two memory
copies and two counter writes.

A message is a header (its byte count and dtype code, 16 bytes) and its bytes, written into the
ring of (sender, receiver) as space frees up. Two counters per ordered pair, in bytes modulo
2**32: written (by the sender) and taken (by the receiver). They lie after the counters an abort
pushes ahead, so an abort never reads as data; the waits here look for aborts themselves. The
receiver checks the header against its own tensor: a disagreement raises PeerMismatchError there
and marks the segment aborted, so the sender raises too.

A call returns at once when its message fits the ring (a send) or has arrived whole (a recv);
else it is left pending and moves on whenever this rank waits for anything of braid's: its own
handle, a later send/recv, a collective's round (`CpuShm` calls `progress` while it waits). So
isend + irecv on both ranks of a pair completes in any order, as with gloo; one direction's
messages move in call order. A blocking send bigger than the ring waits for the receiver, as
gloo's does.
"""
from __future__ import annotations

import collections
import os
import time

import torch

from .. import envs
from ..errors import BraidTimeoutError, LaneFailureError, PeerMismatchError
from .cpushm import YIELD_S, _as_bytes, _dtype_code

HEADER = 16
PIECE = 256 << 10   # bytes copied between two counter writes: the peer copies one piece while
                    # this rank copies the next (whole-ring steps ran 0.8x gloo from 4 MiB)
_M = 0xFFFFFFFF
_HEADS: dict = {}   # (bytes, dtype code) -> a send's header, never written after it is made


class Transfer:
    """One send or recv in flight: torch's Work shape (wait, is_completed) for Handle.native."""

    __slots__ = ("p2p", "sending", "peer", "parts", "part", "at", "done", "after", "nbytes", "code", "error")

    def __init__(self, p2p: "CpuP2P", sending: bool, peer: int, parts: list, nbytes: int, code: int, after=None):
        self.p2p, self.sending, self.peer = p2p, sending, peer
        self.parts = parts           # uint8 tensors, moved in order: the header, then the data
        self.part, self.at = 0, 0    # the part moving now and the byte within it
        self.done = False
        self.after = after           # a recv into a copy (non-contiguous tensor): copy back at the end
        self.nbytes, self.code = nbytes, code
        self.error: BaseException | None = None

    def is_completed(self) -> bool:
        if not self.done and self.error is None:
            self.p2p.progress()
        if self.error is not None:
            raise self.error
        return self.done

    def wait(self, timeout=None) -> bool:
        self.p2p.wait_for(self)
        return True


class CpuP2P:
    """The send/recv of one CPU communicator through its node segment."""

    def __init__(self, seg, lay, mem: torch.Tensor, rank: int, world: int, give_up=None):
        self.seg, self.rank, self.world = seg, rank, world
        self.ring = lay.p2p_ring
        self.mem = mem
        self.u32 = seg.u32
        self.give_up = give_up or (lambda exc: None)
        me, peers = rank, [r for r in range(world) if r != rank]
        self.out_ring = {d: mem[lay.p2p_rings[(me, d)]: lay.p2p_rings[(me, d)] + self.ring] for d in peers}
        self.in_ring = {s: mem[lay.p2p_rings[(s, me)]: lay.p2p_rings[(s, me)] + self.ring] for s in peers}
        self.out_written = {d: lay.counter("p2p_written", me, d) // 4 for d in peers}
        self.out_taken = {d: lay.counter("p2p_taken", me, d) // 4 for d in peers}
        self.in_written = {s: lay.counter("p2p_written", s, me) // 4 for s in peers}
        self.in_taken = {s: lay.counter("p2p_taken", s, me) // 4 for s in peers}
        self.wrote = {d: 0 for d in peers}       # bytes this rank wrote to d, and took from s
        self.took = {s: 0 for s in peers}
        self.queues: dict = {}                   # (sending, peer) -> transfers in call order
        self.pending = 0
        # a yield that kept the core away this long means other threads want the cores (read once)
        self.slow_yield_s = envs.get("BRAID_CPU_SLOW_YIELD_US") / 1e6 or float("inf")

    def close(self) -> None:
        """Drop every view of the segment (a transfer still held by a caller keeps none)."""
        for q in self.queues.values():
            for x in q:
                x.parts = []
                x.error = x.error or LaneFailureError(f"rank {self.rank}: the communicator was closed with "
                                                      f"this {'send' if x.sending else 'recv'} unfinished")
        self.queues.clear()
        self.out_ring.clear()
        self.in_ring.clear()
        self.mem = self.u32 = None
        self.pending = 0

    # calls ------------------------------------------------------------------------------------
    def post(self, t: torch.Tensor, peer: int, sending: bool) -> Transfer:
        """Start a send of `t` to peer, or a recv into `t` from peer; moves what it can now."""
        after, code = None, _dtype_code(t.dtype)
        if sending:
            src = t.detach() if t.requires_grad else t
            if not src.is_contiguous():
                src = src.contiguous()      # a copy now: the caller may change t after the call
            data = _as_bytes(src)
            key = (data.numel(), code)
            head = _HEADS.get(key)          # read only: one per message shape, kept
            if head is None:
                if len(_HEADS) > 1024:
                    _HEADS.clear()
                head = _HEADS[key] = torch.tensor(list(key), dtype=torch.int64).view(torch.uint8)
        else:
            dst = t if t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype)
            if dst is not t:
                def after(dst=dst, t=t):
                    with torch.no_grad():
                        t.copy_(dst)
            data = _as_bytes(dst.detach() if dst.requires_grad else dst)
            head = torch.empty(HEADER, dtype=torch.uint8)
        x = Transfer(self, sending, peer, [head, data], data.numel(), code, after)
        q = self.queues.get((sending, peer))
        if q is None:
            q = self.queues[(sending, peer)] = collections.deque()
        q.append(x)
        self.pending += 1
        self.progress()
        return x

    def progress(self) -> bool:
        """Move every direction's first pending transfer as far as the rings allow (never blocks).
        True when anything moved."""
        if not self.pending:
            return False
        moved = False
        for (sending, peer), q in self.queues.items():
            while q:
                x = q[0]
                if x.error is not None:
                    break
                try:
                    moved |= self._push(x) if sending else self._pull(x)
                except BaseException as exc:
                    x.error = exc
                    raise
                if not x.done:
                    break
                q.popleft()
                self.pending -= 1
        return moved

    def wait_for(self, x: Transfer) -> None:
        """Until x is done, moving every pending transfer meanwhile; a peer's abort or death, or
        BRAID_TIMEOUT_S without progress, raises."""
        if x.error is not None:
            raise x.error
        self.progress()
        if not x.done:
            self.wait_while(lambda: not x.done, x.peer, "send" if x.sending else "recv")
        if x.error is not None:
            raise x.error

    def wait_while(self, busy, peer: int, what: str) -> None:
        """Spin, moving pending transfers, while busy() (see wait_for): first in a tight loop, then
        giving the core away between looks for up to YIELD_S since the last move (the peer is
        most likely copying its piece of the ring, maybe on this core), then in sleeps of 0.2 and
        later 1 ms. A yield that kept the core away for BRAID_CPU_SLOW_YIELD_US (other threads
        want the cores) goes to the sleeps at once. (Sleeping from the 200th look made a message
        that turns a 512 KiB ring several times, 16 ranks on 2 cores, run 0.53-1.20x gloo at 4 MiB.)"""
        seg = self.seg
        limit = envs.get("BRAID_TIMEOUT_S")
        slow_yield = self.slow_yield_s
        last_move = time.monotonic()
        yield_until = time.perf_counter() + YIELD_S
        looks = naps = 0
        while busy():
            if self.progress():
                last_move = time.monotonic()
                yield_until = time.perf_counter() + YIELD_S
                looks = naps = 0
                continue
            looks += 1
            if looks < 200:
                continue
            t = time.perf_counter()
            if t < yield_until:
                os.sched_yield()
                if time.perf_counter() - t > slow_yield:
                    yield_until = 0.0           # the cores are wanted: sleep from now on
                if looks % 1024:
                    continue
            else:
                naps += 1
                time.sleep(0.0002 if naps < 1800 else 0.001)
                if naps % 64:
                    continue
            # every 1,024 yields or 64 sleeps: an abort, a dead peer, the timeout
            seg.raise_if_peer_aborted()
            seg.check_alive(peer)
            if time.monotonic() - last_move > limit:
                exc = BraidTimeoutError(
                    f"rank {self.rank} waited {limit:.0f} s for rank {peer} ({what} through the node "
                    f"segment): the peer did not make the matching call. Check that every send has its "
                    f"recv (BRAID_TIMEOUT_S to change the limit).")
                self.give_up(exc)
                raise exc

    # moving bytes ---------------------------------------------------------------------------------
    def _push(self, x: Transfer) -> bool:
        d, ring, size = x.peer, self.out_ring[x.peer], self.ring
        wrote = self.wrote[d]
        free = size - ((wrote - int(self.u32[self.out_taken[d]])) & _M)
        moved = 0
        while free > 0 and x.part < len(x.parts):
            part = x.parts[x.part]
            left = part.numel() - x.at
            if left == 0:
                x.part, x.at = x.part + 1, 0
                continue
            pos = (wrote + moved) % size
            k = min(free, left, size - pos, PIECE)
            ring[pos: pos + k].copy_(part if k == left == part.numel() else part[x.at: x.at + k])
            x.at += k
            moved += k
            free -= k
            self.u32[self.out_written[d]] = (wrote + moved) & _M    # after the bytes: the reader sees both
        while x.part < len(x.parts) and x.at == x.parts[x.part].numel():
            x.part, x.at = x.part + 1, 0
        if moved:
            self.wrote[d] = (wrote + moved) & _M
        if x.part == len(x.parts):
            x.done = True
        return moved > 0

    def _pull(self, x: Transfer) -> bool:
        s, ring, size = x.peer, self.in_ring[x.peer], self.ring
        took = self.took[s]
        avail = (int(self.u32[self.in_written[s]]) - took) & _M
        moved = 0
        while avail > 0 and x.part < len(x.parts):
            part = x.parts[x.part]
            left = part.numel() - x.at
            if left:
                pos = (took + moved) % size
                k = min(avail, left, size - pos, PIECE)
                (part if k == left == part.numel() else part[x.at: x.at + k]).copy_(ring[pos: pos + k])
                x.at += k
                moved += k
                avail -= k
                self.u32[self.in_taken[s]] = (took + moved) & _M
            if x.at == part.numel():
                if x.part == 0:
                    self._check_header(x)
                x.part, x.at = x.part + 1, 0
        if moved:
            self.took[s] = (took + moved) & _M
        if x.part == 1 and x.parts[1].numel() == 0:
            x.part = 2
        if x.part == len(x.parts) and not x.done:
            x.done = True
            if x.after is not None:
                x.after()
        return moved > 0

    def _check_header(self, x: Transfer) -> None:
        nbytes, code = x.parts[0].view(torch.int64).tolist()
        if nbytes != x.nbytes or code != x.code:
            exc = PeerMismatchError(
                f"recv on rank {self.rank}: rank {x.peer} sent {nbytes} bytes (dtype code {code}), this "
                f"rank receives {x.nbytes} bytes (dtype code {x.code}); a send and its recv must have the "
                f"same size and dtype, in the same order on both ranks")
            exc.peers_left_waiting = True
            self.give_up(exc)
            raise exc

