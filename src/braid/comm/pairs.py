"""Prepared send/recv: each direction's shapes agreed once, kept by the sender, replayed with one
message and, on the copy engines, without waiting for the peer.

A direction (src, dst) has one sender and one receiver. The sender owns the direction's cache:
its table maps the sender's word (what it knows alone: dtype, size, peer, lanes, shares,
calibration, epoch, and where the copy engines read it, the input's address and allocation id)
to an entry id; the receiver keeps the entries by id, as the sender tells it. Every call of the
direction posts one message from the sender on channel 0 of the pair's mailbox (node.py), read by
the receiver's matching call (the k-th send meets the k-th recv):

    hit:   {"e": id}                   the receiver checks its own facts against the entry's
    miss:  {"e": id, "d": descriptor}  the receiver builds entry id from both descriptors and
                                       replies on channel 1 with its own (or a refusal)

Replies go back on channel 1, tagged with the call's number k. On a hit of an entry on the copy
engines, the host lane or both, the sender does not wait for anything: its program (set `ready`,
stage the host lane's share through the direction's graph ring, wait for `done`, reset it;
replay-safe flags per direction and ring slot, lanes/signals.py and lanes/host.py) goes on the
stream at once, and the sender's call returns. The receiver's program (wait for `ready`, reset it,
pull, set `done`; beside it on a second stream, take each staged slot, copy it out, free it) goes
on when it reads the message. Other entries (NCCL's share) wait for the receiver's reply ("ok")
before posting their lanes, as a miss does. Measured on 2 x H200 before the host lane's share ran
this way: 325-851 us of host time a call for ce 0.9 + host 0.1 at 256 MiB-1 GiB.

A receiver whose call does not match a run-ahead send (another size, dtype, calibration) cannot
stop the sender's program: it posts a drain (wait for `ready`, reset, set `done`: no copy), raises
PeerMismatchError, and replies with a refusal; the sender raises it at its next send to that rank
(as NCCL reports an asynchronous error at a later call). A miss or a refused non-run-ahead call
raises on both ranks in the call. Either way the pair goes on.

Synchronous calls with nothing of the direction still on a lane stream run their program on the
caller's stream itself (no events); asynchronous ones fork onto the lane's stream (the sender's
own send stream, so that its wait never holds up this rank's recvs) and join on wait().

`PendingP2P` (below) is a send/recv whose lanes start once the peer's side is posted: the
unprepared path (BRAID_PREPARED=0) and the base of the prepared calls' pending objects.

Rejected: both sides posting a word and keying the entry by both (the sender then waits for the
receiver's word at every call: 110 us of host time a send, 2 ranks on one H200, 2026-11-26, against
NCCL's 56); caches that each side evicts on its own rules (the sender alone decides, so the two
sides can never disagree on what an id means).
"""
from __future__ import annotations

import time
from collections import OrderedDict

import torch
import torch.distributed as dist

from .. import envs
from ..errors import BraidTimeoutError, LaneUnavailableError, PeerMismatchError
from ..executor import Handle, as_handle, execute, hold_until, sweep
from ..lanes import _cuda
from ..lanes.host import graph_programs, pair_programs, posted_form, run_program
from ..planner.plan import p2p_movement
from ..node import NodeSegment, geq
from .exchange import agree, agreed_lanes
from .prepared import GRAPH_LANES, MASK63, _RAW, _capturing, not_capturable

OP = "send_recv"


class P2PQueue(list):
    """A communicator's sends and receives posted but not started yet (their peers' sides not
    read), in call order: PendingP2P objects and the prepared calls' pending ones. The
    point-to-point part fills it; a collective first starts them all (`flush`), so that every rank
    queues the same calls in the same order on the lanes' streams, which the cross-rank counters
    rely on."""

    def flush(self) -> None:
        """Start every pending send/recv (blocking until their peers posted them)."""
        for h in list(self):
            h.complete()

    def progress(self) -> None:
        """Post the lanes of every pending send/recv whose peer has posted its side (never blocks)."""
        for h in list(self):
            h.try_complete()


class PendingP2P:
    """A send or recv whose descriptor is posted and whose lanes start once the peer's matching
    call (same direction, same position in that direction's order) is posted. Quacks like Handle.
    `p2p`: the communicator's point-to-point part (comm/p2p.py), whose queue holds it meanwhile."""

    def __init__(self, p2p, token, desc, inp, outs, peer, n, src, dst, dev, start_event, native=None, lane=None):
        self.p2p, self.token, self.desc = p2p, token, desc
        self.inp, self.outs, self.peer, self.n = inp, outs, peer, n
        self.src, self.dst, self.dev, self.start_event = src, dst, dev, start_event
        self.inner: Handle | None = None
        self.error: BaseException | None = None
        # a call the native library takes whole, queued behind an earlier split call of its
        # direction: it posts no descriptor and starts once the calls before it have
        self._whole, self._lane = native, lane

    def try_complete(self) -> bool:
        if self.inner is not None:
            return True
        if self.error is not None:
            raise self.error
        for h in list(self.p2p.pending):        # a direction's calls start in call order
            if h is self:
                break
            if (h.src, h.dst) == (self.src, self.dst) and not h.try_complete():
                return False
        return self._step()

    def _step(self) -> bool:
        """Go on from what the peer has posted (the calls before this one of its direction have
        started); True once the lanes are started."""
        if self._whole is not None:
            self._drop()
            self.inner = as_handle(self._whole(), self._lane)
            return True
        theirs = self.p2p.segment.poll_pair(self.token)
        if theirs is None:
            return False
        self._start(theirs)
        return True

    def complete(self) -> None:
        """Block until the peer's side is posted (other pending calls progress meanwhile)."""
        if self.try_complete():
            return
        seg = self.p2p.segment
        deadline = time.monotonic() + envs.get("BRAID_TIMEOUT_S")
        spins = 0
        while not self.try_complete():
            self.p2p.pending.progress()
            spins += 1
            if spins > 200:
                time.sleep(0.0002)
                if spins % 2000 == 0:
                    seg.check_alive(self.peer)
                if time.monotonic() > deadline:
                    what = "send to" if self.src == self.p2p.rank else "recv from"
                    self.error = BraidTimeoutError(
                        f"rank {self.p2p.rank}: {what} rank {self.peer} waited {envs.get('BRAID_TIMEOUT_S'):.0f} s "
                        f"for rank {self.peer}'s matching {'recv' if self.src == self.p2p.rank else 'send'}")
                    self._drop()
                    raise self.error

    def _drop(self) -> None:
        if self in self.p2p.pending:
            self.p2p.pending.remove(self)

    def _start(self, theirs: dict) -> None:
        p2p, me = self.p2p, self.p2p.rank
        self._drop()
        descs: list = [None] * p2p.world_size
        descs[me], descs[self.peer] = self.desc, theirs
        try:
            agree("send_recv", descs, ("op", "dtype", "nbytes", "src", "dst", "calib"))
        except PeerMismatchError as exc:
            self.error = exc
            raise
        shares = _pair_shares(descs[self.src], agreed_lanes(descs))
        if p2p.policy.native_ok(shares):
            g = p2p.exchange.group_for(shares)
            tb = self.inp if self.src == me else self.outs[0]
            work = dist.isend(tb, group_dst=self.peer, group=g) if self.src == me else dist.irecv(tb, group_src=self.peer, group=g)
            self.inner = as_handle(work, next(iter(shares)))
            return
        src, dst, n = self.src, self.dst, self.n
        plan = p2p.exchange.plan(("p2p", src, dst, n), lambda: p2p_movement(p2p.world_size, src, dst, n), shares, n, self.dev)
        self.inner = execute(p2p.lane_ctx, plan, self.inp, self.outs, descs, self.peer, start_event=self.start_event)

    def wait(self, timeout=None) -> bool:
        self.complete()
        self.p2p.pending.progress()          # start whatever else is ready before blocking on lanes
        return self.inner.wait()

    def is_completed(self) -> bool:
        return self.try_complete() and self.inner.is_completed()

    def lane_times_us(self) -> dict[str, float]:
        self.complete()
        return self.inner.lane_times_us()

    @property
    def shares(self) -> dict[str, float]:
        self.complete()
        return self.inner.shares

    @property
    def plan(self):
        return self.inner.plan if self.inner is not None else None

    @property
    def native(self):
        return self.inner.native if self.inner is not None else None

    @property
    def runs(self):
        return self.inner.runs if self.inner is not None else []


def _pair_shares(sender: dict, agreed: list[str]) -> dict[str, float]:
    """A split send/recv's shares, the same on both ranks: the sender's, as it chose them when it
    posted the call, over the lanes both sides have (renormalised); with none of those left, the
    native library's lane alone where both have it, else the first lane both have."""
    proposed = {k: v for k, v in (sender.get("shares") or {}).items() if k in agreed and v > 0}
    total = sum(proposed.values())
    if total > 0:
        return {k: v / total for k, v in proposed.items()}
    if not agreed:
        raise LaneUnavailableError("send/recv: the pair has no lane in common")
    native = [k for k in ("nccl", "gloo") if k in agreed]
    return {(native or agreed)[0]: 1.0}


class PairEntry:
    """One agreed shape of a direction: both descriptors, the shares and the plan; `flags`: on
    the copy engines, the host lane or both (GPU), run with the pair flags; `copies` (receiver):
    the copy engines' share as (destination offset, mapped source address, bytes); `host`: this
    side's program of the host lane's share (lanes/host.py pair_programs); `rw`: the receiver's
    facts when it was built."""

    __slots__ = ("descs", "plan", "shares", "native", "flags", "copies", "host", "rw", "progs")

    def __init__(self, descs, plan, shares, native: bool, flags: bool = False, copies=(), rw: int = 0, host=()):
        self.descs, self.plan, self.shares, self.native = descs, plan, shares, native
        self.flags, self.copies, self.rw, self.host = flags, copies, rw, host
        self.progs: dict = {}       # (sending, src, dst, tensor address, drain) -> pair programs


class _Send:
    """This rank's side of a direction where it sends: the cache (word -> [id, entry or None
    while the receiver's reply is out]), the replies read, errors to report."""

    __slots__ = ("table", "read", "replies", "errors", "open")

    def __init__(self):
        self.table: OrderedDict = OrderedDict()
        self.read = 0                   # channel-1 messages read
        self.replies: dict[int, dict] = {}
        self.errors: list[BaseException] = []
        self.open = 0                   # async programs on the lane stream not waited yet


class _Recv:
    """This rank's side of a direction where it receives: the sender's entries by id, the
    messages read, async programs not waited yet, a message the fast path read and left."""

    __slots__ = ("slots", "seq", "open", "held")

    def __init__(self):
        self.slots: dict[int, PairEntry] = {}
        self.seq = 0                    # channel-0 messages read
        self.open = 0
        self.held = None                # (k, message): read by the fast path, left to the full one


def ticket_key(sending: bool, peer: int, tensor) -> tuple:
    """What a _Ticket is filed under: the direction and the tensor's own facts."""
    return sending, peer, tensor.data_ptr(), tensor.numel(), tensor.dtype


class _Ticket:
    """A repeated call on the pair flags (the copy engines, the host lane), keyed by the tensor's
    own facts (direction, address, count, dtype): the next such call skips the lanes, shares, descriptor and word and
    goes from the op's entry to the message and the program (Pairs.send_fast / recv_fast). Valid
    while the cache's epoch (calibration, fixed shares) is the one it was made under and, for a
    sender, while its input is the same allocation and its entry is still in the table."""

    __slots__ = ("epoch", "peer", "side", "entry", "sw", "bid", "rw")

    def __init__(self, epoch, peer, side, entry, sw=0, bid=0, rw=0):
        self.epoch, self.peer, self.side, self.entry = epoch, peer, side, entry
        self.sw, self.bid, self.rw = sw, bid, rw


class _FlagRun:
    """A program of the pair flags: synchronous ones are already in the caller's stream; an
    async one's wait() makes the caller's current stream wait for its end (no CPU block)."""

    __slots__ = ("pairs", "side", "end", "entry", "keep", "_waited", "native", "runs")

    def __init__(self, pairs, side, end: int, entry: PairEntry, keep: tuple):
        self.pairs, self.side, self.end, self.entry, self.keep = pairs, side, end, entry, keep
        self._waited = not end
        self.native, self.runs = None, []

    def wait(self, timeout=None) -> bool:
        if not self._waited:
            self._waited = True
            _cuda.stream_wait_event(_RAW(self.pairs.dev_index), self.end)
            self.pairs.give_event(self.end)
            self.side.open -= 1
            self.keep = ()
        return True

    def __del__(self):
        if self.keep and not self._waited:      # dropped unwaited: kept until its end event
            end = self.end
            hold_until(lambda: _cuda.event_query(end), self.keep)

    def is_completed(self) -> bool:
        return self._waited or _cuda.event_query(self.end)

    def lane_times_us(self) -> dict[str, float]:
        return {}

    @property
    def shares(self) -> dict[str, float]:
        return dict(self.entry.shares)

    @property
    def plan(self):
        return self.entry.plan


class _RawStart:
    """A raw CUDA event where torch's lanes expect a torch Event (they call stream.wait_event)."""

    __slots__ = ("ev",)

    def __init__(self, ev: int):
        self.ev = ev

    def wait(self, stream) -> None:
        _cuda.stream_wait_event(stream.cuda_stream, self.ev)


class Pairs:
    """The communicator's prepared send/recv (see the module docstring), kept by its
    point-to-point part (`p2p`, comm/p2p.py), whose segment, lanes, prepared calls, queue of
    pending calls and full path (plans, checks) it uses."""

    def __init__(self, p2p):
        self.p2p = p2p
        self.sends: dict[int, _Send] = {}
        self.recvs: dict[int, _Recv] = {}
        self.free_events: list[int] = []
        self.dev_index = p2p.device.index if p2p.cuda else -1
        self.tickets: dict[tuple, _Ticket] = {}
        # the last send that ran ahead, per peer (the watchdog's `overdue`: a send nobody receives
        # must not leave a GPU waiting forever), and where each peer's reading stood when last seen
        self.ahead: dict[int, int] = {}
        self._seen: dict[int, tuple[int, float]] = {}
        self._beside = None

    def overdue(self, limit: float) -> str:
        """Why this rank gives up, when a receiver has left a send that ran ahead unread and read
        nothing more for `limit` seconds, else "". Called by the watchdog thread."""
        seg, me = self.p2p.segment, self.p2p.rank
        if seg is None or seg.closed:
            return ""
        now = time.monotonic()
        for peer, k in list(self.ahead.items()):
            read = seg.pair_read(peer, sending=True)
            if geq(read, k):
                self._seen.pop(peer, None)
                continue
            seen = self._seen.get(peer)
            if seen is None or seen[0] != read:
                self._seen[peer] = (read, now)
            elif now - seen[1] > limit:
                return (f"rank {me}: send #{read + 1} to rank {peer} ran ahead (pair flags) and rank {peer} "
                        f"did not post its matching recv within {limit:.0f} s (a blocking send whose recv the peer "
                        f"posts only after a later collective waits on the GPU for good: use isend); the GPU waits "
                        f"are released and this communicator is broken")
        return ""

    def ticket(self, key, tk: _Ticket) -> None:
        if len(self.tickets) >= 256:
            self.tickets.clear()
        self.tickets[key] = tk

    # events ---------------------------------------------------------------------------------
    def take_event(self) -> int:
        return self.free_events.pop() if self.free_events else _cuda.event_create()

    def give_event(self, ev: int) -> None:
        if len(self.free_events) < 64:
            self.free_events.append(ev)
        else:
            _cuda.event_destroy(ev)

    def close(self) -> None:
        self.sends.clear()
        self.recvs.clear()
        self.tickets.clear()
        free, self.free_events = self.free_events, []
        for ev in free:
            try:
                _cuda.event_destroy(ev)
            except Exception:   # noqa: BLE001  closing: nothing more to do with it
                pass

    # the call -------------------------------------------------------------------------------
    def call(self, sending: bool, peer: int, desc: dict, lanes, shares, calib: str, inp, outs, n: int, dev,
             full_of, async_op: bool, tkey=None):
        p2p = self.p2p
        cuda = dev.type == "cuda"
        start = 0
        if async_op and cuda:           # where on the caller's stream this call was made
            start = self.take_event()
            _cuda.event_record(start, _RAW(dev.index))
        if sending:
            return self._send(peer, desc, lanes, shares, calib, inp, n, dev, full_of, async_op, start, tkey)
        side = self.recvs.setdefault(peer, _Recv())
        side.seq += 1
        rw = hash((desc["dtype"], n, tuple(lanes), calib)) & MASK63
        h = _RecvCall(p2p, self, side, side.seq, rw, full_of, outs, peer, n, dev, start, async_op)
        h.tkey = tkey
        p2p.pending.append(h)
        p2p.pending.progress()
        return h

    def _send(self, peer, desc, lanes, shares, calib, inp, n, dev, full_of, async_op, start, tkey=None):
        p2p, prep = self.p2p, self.p2p.prepared
        side = self.sends.setdefault(peer, _Send())
        self.pump(peer, side)
        if side.errors:
            if start:
                self.give_event(start)
            raise side.errors.pop(0)
        facts = (desc["dtype"], n, peer, tuple(lanes), tuple(shares.items()), calib, prep.epoch)
        bid = 0
        if p2p.cuda and inp.is_cuda and inp.numel() and "ce" in lanes:
            ptr = inp.data_ptr()
            bid = _cuda.buffer_id(ptr)
            facts += (ptr, bid)
        sw = hash(facts) & MASK63
        got = side.table.get(sw)
        seg = p2p.segment
        me = p2p.rank
        if got is not None:
            side.table.move_to_end(sw)
            prep.stats["p2p_hits"] += 1
            eid, entry = got
            token = seg.post_pair(eid, peer, True)
            k = token[2]
            if (entry is not None and entry.flags and not self._queued(me, peer)):
                if tkey is not None and bid:
                    self.ticket(tkey, _Ticket(prep.epoch, peer, side, entry, sw=sw, bid=bid))
                self.ahead[peer] = k
                return self._flags(entry, True, me, peer, inp, start, async_op, side)
            h = _SendCall(p2p, self, side, k, sw, eid, entry, None, inp, peer, n, dev, start, async_op)
        else:
            if len(side.table) >= prep.max_entries:
                _, (eid, _) = side.table.popitem(last=False)
            else:
                used = {v[0] for v in side.table.values()}
                eid = next(i for i in range(len(side.table) + 1) if i not in used)
            side.table[sw] = [eid, None]
            prep.stats["p2p_built"] += 1
            mine = full_of()
            token = seg.post_pair({"op": OP, "e": eid, "d": mine}, peer, True)
            h = _SendCall(p2p, self, side, token[2], sw, eid, None, mine, inp, peer, n, dev, start, async_op)
        p2p.pending.append(h)
        p2p.pending.progress()
        return h

    def _queued(self, src: int, dst: int) -> bool:
        return any((h.src, h.dst) == (src, dst) for h in self.p2p.pending)

    def send_fast(self, tk: _Ticket, t, async_op: bool):
        """A send under a ticket (see _Ticket); None: not this way (nothing was posted)."""
        p2p = self.p2p
        side = tk.side
        if tk.epoch != p2p.prepared.epoch or p2p.pending or _cuda.buffer_id(t.data_ptr()) != tk.bid:
            return None
        got = side.table.get(tk.sw)
        if got is None or got[1] is not tk.entry:
            return None
        self.pump(tk.peer, side)
        if side.errors:
            raise side.errors.pop(0)
        side.table.move_to_end(tk.sw)
        p2p.prepared.stats["p2p_hits"] += 1
        k = p2p.segment.post_pair(got[0], tk.peer, True)[2]
        self.ahead[tk.peer] = k
        start = 0
        if async_op:
            start = self.take_event()
            _cuda.event_record(start, _RAW(self.dev_index))
        return self._flags(tk.entry, True, p2p.rank, tk.peer, t, start, async_op, side)

    def recv_fast(self, tk: _Ticket, t, async_op: bool):
        """A recv under a ticket whose sender's message is there and names an entry on the pair
        flags that fits this call; None: not this way (a message read is left to the full path)."""
        p2p = self.p2p
        side = tk.side
        if tk.epoch != p2p.prepared.epoch or p2p.pending or side.held is not None:
            return None
        k = side.seq + 1
        msg = p2p.segment.poll_pair((tk.peer, 0, k, OP))
        if msg is None:
            return None
        entry = side.slots.get(msg.get("e"))
        if "d" in msg or entry is None or not entry.flags or entry.rw != tk.rw:
            side.held = (k, msg)
            return None
        side.seq = k
        p2p.prepared.stats["p2p_hits"] += 1
        start = 0
        if async_op:
            start = self.take_event()
            _cuda.event_record(start, _RAW(self.dev_index))
        return self._flags(entry, False, tk.peer, p2p.rank, t, start, async_op, side)

    def read(self, side: _Recv, peer: int, k: int):
        """The sender's k-th message (or None): the one the fast path read, or from the mailbox."""
        if side.held is not None and side.held[0] == k:
            msg, side.held = side.held[1], None
            return msg
        return self.p2p.segment.poll_pair(NodeSegment.pair_token(peer, True, 0, k, OP))

    def pump(self, peer: int, side: _Send) -> None:
        """Read every reply the receiver `peer` has posted on channel 1 (in order)."""
        seg = self.p2p.segment
        while True:
            msg = seg.poll_pair(NodeSegment.pair_token(peer, False, 1, side.read + 1, OP))
            if msg is None:
                return
            side.read += 1
            k = msg.get("k")
            if msg.get("ahead"):             # a refusal of a run-ahead call: reported at the next send
                side.errors.append(PeerMismatchError(msg["nack"]))
            else:
                side.replies[k] = msg

    # building an entry ------------------------------------------------------------------------
    def build(self, descs: list, src: int, dst: int, n: int, dev, rw: int) -> PairEntry:
        """The entry of a new shape from both descriptors (the same on both ranks)."""
        p2p, me = self.p2p, self.p2p.rank
        shares = _pair_shares(descs[src], agreed_lanes(descs))
        if p2p.policy.native_ok(shares):
            return PairEntry(descs, None, shares, native=True, rw=rw)
        plan = p2p.exchange.plan(("p2p", src, dst, n), lambda: p2p_movement(p2p.world_size, src, dst, n), shares, n, dev)
        # the sender's `timed` (fixed_shares(..., timed=True)): a split posts its lanes and times them
        flags = (dev.type == "cuda" and GRAPH_LANES.issuperset(shares)
                 and ("host" not in shares or (src, dst) in p2p.layout.pair_graph_rings)
                 and not (len(shares) > 1 and descs[src].get("timed")))
        copies, host = (), []
        if flags and dst == me and "ce" in shares:
            transfers = plan.lanes.get("ce", [])
            peers = p2p.lanes["ce"].peer_ptrs(transfers, me, descs)
            copies = tuple((off, peers[t.src] + t.src_off, t.nbytes)
                           for t in transfers for d, _, off in t.dsts if d == me and t.nbytes)
        if flags and plan.lanes.get("host"):
            progs = graph_programs(p2p.layout, me, plan.lanes["host"], 0, [0], p2p.seg_dev_ptr,
                                   p2p.segment.address, pair=(src, dst))
            host = progs[0] if src == me else progs[1]
            if dst == me and "ce" in shares:
                self.beside_stream()            # made now: not inside a user's capture
        return PairEntry(descs, plan, shares, native=False, flags=flags, copies=copies, rw=rw, host=host)

    # running an entry -------------------------------------------------------------------------
    def run(self, entry: PairEntry, sending: bool, src: int, dst: int, inp, outs, dev, start: int, async_op: bool,
            drain: bool = False):
        p2p = self.p2p
        peer = dst if sending else src
        side = self.sends[peer] if sending else self.recvs[peer]
        if entry.flags:
            return self._flags(entry, sending, src, dst, inp if sending else outs[0], start, async_op, side, drain)
        try:
            if entry.native:
                g = p2p.exchange.group_for(entry.shares)
                work = (dist.isend(inp, group_dst=peer, group=g) if sending
                        else dist.irecv(outs[0], group_src=peer, group=g))
                return as_handle(work, next(iter(entry.shares)))
            if dev.type == "cuda" and _capturing():
                raise not_capturable(OP, entry.shares)
            if p2p.cuda:
                p2p.prepared.dirty = True
            return execute(p2p.lane_ctx, entry.plan, inp, outs, entry.descs, peer,
                           start_event=_RawStart(start) if start else None)
        finally:
            if start:
                self.give_event(start)

    def _flags(self, entry, sending: bool, src: int, dst: int, t, start: int, async_op: bool, side,
               drain: bool = False):
        """This side's program on the pair flags (see the module docstring)."""
        p2p = self.p2p
        ptr = t.data_ptr() if t.numel() else 0
        key = (sending, src, dst, ptr, drain)
        progs = entry.progs.get(key)
        if progs is None:           # built once per tensor address (a repeat reuses the list)
            ready = done = 0
            if "ce" in entry.shares:
                base, lay = p2p.seg_dev_ptr, p2p.layout
                ready = base + lay.counter("flag_p2p_ready", src, dst)
                done = base + lay.counter("flag_p2p_done", src, dst)
            progs = [posted_form(p) for p in pair_programs(sending, ptr, ready, done, entry.copies, entry.host,
                                                            drain)]
            if len(entry.progs) >= 8:
                entry.progs.clear()
            entry.progs[key] = progs
        caller = _RAW(self.dev_index)
        lane = None
        if async_op or side.open or start:
            lane = p2p.lanes["ce"].p2p_stream(sending)
            sh = lane.cuda_stream
            if start:
                _cuda.stream_wait_event(sh, start)
                self.give_event(start)
            else:
                ev = self.take_event()
                _cuda.event_record(ev, caller)
                _cuda.stream_wait_event(sh, ev)
                self.give_event(ev)
        else:
            sh = caller
        if progs:
            if len(progs) > 1:          # the host lane's share beside the copy engines' (receiver)
                bs = self.beside_stream().cuda_stream
                ev = self.take_event()
                _cuda.event_record(ev, sh)
                _cuda.stream_wait_event(bs, ev)
                self.give_event(ev)
                run_program(bs, progs[1])
            run_program(sh, progs[0])
            if len(progs) > 1:
                ev = self.take_event()
                _cuda.event_record(ev, bs)
                _cuda.stream_wait_event(sh, ev)
                self.give_event(ev)
        if lane is None:
            return _FlagRun(self, side, 0, entry, ())
        end = self.take_event()
        _cuda.event_record(end, sh)
        side.open += 1
        if async_op:
            sweep()         # (the run keeps the tensor until its wait)
            return _FlagRun(self, side, end, entry, (t,))
        run = _FlagRun(self, side, end, entry, ())
        run.wait()
        return run

    def beside_stream(self):
        """The stream a receiver's host share runs on beside its copy engines' share."""
        if self._beside is None:
            self._beside = torch.cuda.Stream(device=self.p2p.device)
        return self._beside


class _Call(PendingP2P):
    """A prepared send or recv not started yet (quacks like PendingP2P: the communicator's
    pending list progresses it; a direction's calls start in call order)."""

    def _fail(self, exc: BaseException):
        self.error = exc
        self._drop()
        if self.start:
            self.pairs.give_event(self.start)
            self.start = 0
        raise exc


class _SendCall(_Call):
    def __init__(self, p2p, pairs, side, k, sw, eid, entry, mine, inp, peer, n, dev, start, async_op):
        me = p2p.rank
        super().__init__(p2p, None, mine, inp, [], peer, n, me, peer, dev, None)
        self.pairs, self.side, self.k, self.sw, self.eid = pairs, side, k, sw, eid
        self.entry, self.start, self.async_op = entry, start, async_op

    def _step(self) -> bool:
        pairs, side = self.pairs, self.side
        got = side.table.get(self.sw)
        entry = self.entry or (got[1] if got is not None and got[0] == self.eid else None)
        if entry is not None and entry.flags and self.desc is None:
            # a hit queued behind earlier calls of the direction: runs ahead now, as it would have
            self._drop()
            self.inner = pairs.run(entry, True, self.src, self.dst, self.inp, [], self.dev, self.start,
                                   self.async_op)
            self.start = 0
            return True
        pairs.pump(self.peer, side)
        reply = side.replies.pop(self.k, None)
        if reply is None:
            return False
        if "nack" in reply:
            if self.desc is not None and got is not None and got[0] == self.eid:
                side.table.pop(self.sw, None)       # the receiver built nothing under this id
            self._fail(PeerMismatchError(reply["nack"]))
        if self.desc is not None:                    # a miss: build from both descriptors
            descs: list = [None] * self.p2p.world_size
            descs[self.src], descs[self.dst] = self.desc, reply["d"]
            entry = pairs.build(descs, self.src, self.dst, self.n, self.dev, 0)
            if got is not None and got[0] == self.eid:
                got[1] = entry
        if entry is None:
            self._fail(PeerMismatchError(f"rank {self.p2p.rank}: send to rank {self.peer}: entry {self.eid} "
                                         f"is not built on this rank"))
        self._drop()
        self.inner = pairs.run(entry, True, self.src, self.dst, self.inp, [], self.dev, self.start, self.async_op)
        self.start = 0
        return True


class _RecvCall(_Call):
    def __init__(self, p2p, pairs, side, k, rw, full_of, outs, peer, n, dev, start, async_op):
        me = p2p.rank
        super().__init__(p2p, None, None, None, outs, peer, n, peer, me, dev, None)
        self.pairs, self.side, self.k, self.rw, self.full_of = pairs, side, k, rw, full_of
        self.start, self.async_op = start, async_op
        self.tkey = None

    def _refuse(self, why: str, ahead: bool, entry: PairEntry | None = None):
        """Tell the sender (channel 1), drain a run-ahead program, raise here."""
        p2p = self.p2p
        p2p.segment.post_pair({"op": OP, "k": self.k, "nack": why, "ahead": ahead}, self.peer, False, channel=1)
        if ahead and entry is not None and entry.flags:
            self._drop()
            self.pairs.run(entry, False, self.src, self.dst, None, self.outs, self.dev, self.start, False, drain=True)
            self.start = 0
        self._fail(PeerMismatchError(why))

    def _step(self) -> bool:
        p2p, pairs = self.p2p, self.pairs
        msg = pairs.read(self.side, self.peer, self.k)
        if msg is None:
            return False
        me, eid = p2p.rank, msg.get("e")
        if eid is None:
            self._refuse(f"rank {me}: recv from rank {self.peer}: the peer's matching send did not take the prepared "
                         f"path (BRAID_PREPARED must be the same on every rank)", False)
        if "d" in msg:                                   # a new shape: agree, build, reply
            mine = self.full_of()
            theirs = msg["d"]
            descs: list = [None] * p2p.world_size
            descs[me], descs[self.peer] = mine, theirs
            try:
                p2p.exchange.check_direction(mine, theirs, self.peer)
                agree(OP, descs, ("op", "dtype", "nbytes", "src", "dst", "calib"))
            except PeerMismatchError as exc:
                self.side.slots.pop(eid, None)      # later calls naming this id are refused too
                self._refuse(str(exc), False)
            entry = pairs.build(descs, self.src, self.dst, self.n, self.dev, self.rw)
            self.side.slots[eid] = entry
            p2p.prepared.stats["p2p_built"] += 1
            p2p.segment.post_pair({"op": OP, "k": self.k, "d": mine}, self.peer, False, channel=1)
        else:
            entry = self.side.slots.get(eid)
            p2p.prepared.stats["p2p_hits"] += 1
            ahead = entry is not None and entry.flags
            if entry is None or entry.rw != self.rw:
                d = (entry.descs[self.src] if entry is not None else {}) or {}
                mine = self.full_of()
                what = (f"{mine['nbytes']} bytes of {mine['dtype']}" if entry is None or
                        (d.get("nbytes"), d.get("dtype")) != (mine["nbytes"], mine["dtype"])
                        else f"lanes {mine['lanes']} and calibration {mine['calib']}")
                self._refuse(
                    f"send_recv: rank {self.peer} sent {d.get('nbytes', '?')} bytes of {d.get('dtype', '?')} "
                    f"and rank {me}'s matching recv expects {what}. Every send must meet a recv of the same size "
                    f"and dtype.", ahead, entry)
            if not ahead:
                p2p.segment.post_pair({"op": OP, "k": self.k, "ok": 1}, self.peer, False, channel=1)
            elif self.tkey is not None:
                pairs.ticket(self.tkey, _Ticket(p2p.prepared.epoch, self.peer, self.side, None, rw=self.rw))
        self._drop()
        self.inner = pairs.run(entry, False, self.src, self.dst, None, self.outs, self.dev, self.start, self.async_op)
        self.start = 0
        return True
