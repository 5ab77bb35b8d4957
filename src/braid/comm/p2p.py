"""send/recv and batches of them. A split send/recv is matched per direction (a's k-th send to b
with b's k-th recv from a), posted at once and started when the peer's side is posted, so isend
and irecv never block on the other rank; the pair runs the sender's shares. A batch is one uneven
all_to_all under the hood.
"""
from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from .. import envs
from ..collectives import check_rank, input_bytes, output_bytes
from ..errors import BraidTimeoutError, LaneUnavailableError, MisuseError, PeerMismatchError
from ..executor import Handle, as_handle, execute
from ..lanes import _cuda
from ..planner.plan import p2p_movement
from .prepared import _RAW, not_capturable

_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing

log = logging.getLogger("braid")


class PendingP2P:
    """A send or recv whose descriptor is posted and whose lanes start once the peer's matching
    call (same direction, same position in that direction's order) is posted. Quacks like Handle."""

    def __init__(self, comm, token, desc, inp, outs, peer, n, src, dst, dev, start_event, native=None, lane=None):
        self.comm, self.token, self.desc = comm, token, desc
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
        for h in list(self.comm._p2p_pending):        # a direction's calls start in call order
            if h is self:
                break
            if (h.src, h.dst) == (self.src, self.dst) and not h.try_complete():
                return False
        if self._whole is not None:
            self._drop()
            self.inner = as_handle(self._whole(), self._lane)
            return True
        theirs = self.comm.segment.poll_pair(self.token)
        if theirs is None:
            return False
        self._start(theirs)
        return True

    def complete(self) -> None:
        """Block until the peer's side is posted (other pending calls progress meanwhile)."""
        if self.try_complete():
            return
        seg = self.comm.segment
        deadline = time.monotonic() + envs.get("BRAID_TIMEOUT_S")
        spins = 0
        while not self.try_complete():
            self.comm._progress_p2p()
            spins += 1
            if spins > 200:
                time.sleep(0.0002)
                if spins % 2000 == 0:
                    seg.check_alive(self.peer)
                if time.monotonic() > deadline:
                    what = "send to" if self.src == self.comm.rank else "recv from"
                    self.error = BraidTimeoutError(
                        f"rank {self.comm.rank}: {what} rank {self.peer} waited {envs.get('BRAID_TIMEOUT_S'):.0f} s "
                        f"for rank {self.peer}'s matching {'recv' if self.src == self.comm.rank else 'send'}")
                    self._drop()
                    raise self.error

    def _drop(self) -> None:
        if self in self.comm._p2p_pending:
            self.comm._p2p_pending.remove(self)

    def _start(self, theirs: dict) -> None:
        comm, me = self.comm, self.comm.rank
        self._drop()
        descs: list = [None] * comm.world_size
        descs[me], descs[self.peer] = self.desc, theirs
        try:
            comm._agree("send_recv", descs, ("op", "dtype", "nbytes", "src", "dst", "calib"))
        except PeerMismatchError as exc:
            self.error = exc
            raise
        shares = _pair_shares(descs[self.src], comm._agreed_lanes(descs))
        if comm._native_ok(shares):
            g = comm._native_group(shares)
            tb = self.inp if self.src == me else self.outs[0]
            work = dist.isend(tb, group_dst=self.peer, group=g) if self.src == me else dist.irecv(tb, group_src=self.peer, group=g)
            self.inner = as_handle(work, next(iter(shares)))
            return
        src, dst, n = self.src, self.dst, self.n
        plan = comm._plan(("p2p", src, dst, n), lambda: p2p_movement(comm.world_size, src, dst, n), shares, n, self.dev)
        self.inner = execute(comm.lane_ctx, plan, self.inp, self.outs, descs, self.peer, start_event=self.start_event)

    def wait(self, timeout=None) -> bool:
        self.complete()
        self.comm._progress_p2p()          # start whatever else is ready before blocking on lanes
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


class PairEntry:
    """One prepared send/recv shape of a direction, as both of its ranks agreed it: the two
    descriptors, the shares and the plan; for a receiver on the copy engines alone, its copies
    (destination offset, mapped source address, bytes)."""

    __slots__ = ("descs", "plan", "shares", "native", "copies")

    def __init__(self, descs, plan, shares, native: bool, copies=None):
        self.descs, self.plan, self.shares, self.native, self.copies = descs, plan, shares, native, copies


class _RawStart:
    """A raw CUDA event where torch's lanes expect a torch Event (they call stream.wait_event)."""

    __slots__ = ("ev",)

    def __init__(self, ev: int):
        self.ev = ev

    def wait(self, stream) -> None:
        _cuda.stream_wait_event(stream.cuda_stream, self.ev)


class _FlagRun:
    """The handle of a prepared send/recv on the copy engines: wait() makes the caller's current
    stream wait for the program's end (no CPU block)."""

    __slots__ = ("prep", "end", "entry", "tensors", "_waited", "native", "runs")

    def __init__(self, prep, end: int, entry: PairEntry, tensors: tuple):
        self.prep, self.end, self.entry, self.tensors = prep, end, entry, tensors
        self._waited = False
        self.native, self.runs = None, []

    def wait(self, timeout=None) -> bool:
        if not self._waited:
            self._waited = True
            _cuda.stream_wait_event(_RAW(self.prep._dev_index), self.end)
            self.prep.give_event(self.end)
            self.tensors = ()
        return True

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


class PreparedP2P(PendingP2P):
    """A split send/recv through the prepared-call cache (comm/prepared.py). At the call each side
    posts one word on channel 0 of the direction's mailbox and returns; once both words are there,
    the pair's key (sender's word, receiver's word) finds the entry both ranks built at the first
    call of that shape, and the lanes start from it: no descriptor, no agreement, no plan. On the
    copy engines alone the program is a handful of stream operations on replay-safe flags (the
    same in a user's CUDA graph capture). A miss (a new size, buffer, allocation, share or
    calibration on either side) makes both sides post their full descriptors on channel 1 and
    build the entry as the unprepared path would."""

    def __init__(self, comm, token, word: int, full_of, inp, outs, peer, n, src, dst, dev, start: int,
                 async_op: bool):
        super().__init__(comm, token, None, inp, outs, peer, n, src, dst, dev, None)
        self.word, self.full_of, self.start, self.async_op = word, full_of, start, async_op
        self.key = None
        self.stage = 0          # 0: waiting for the peer's word; 1: for its full descriptor

    def try_complete(self) -> bool:
        if self.inner is not None:
            return True
        if self.error is not None:
            raise self.error
        comm = self.comm
        for h in list(comm._p2p_pending):        # a direction's calls start in call order
            if h is self:
                break
            if (h.src, h.dst) == (self.src, self.dst) and not h.try_complete():
                return False
        seg = comm.segment
        theirs = seg.poll_pair(self.token)
        if theirs is None:
            return False
        prep, me = comm._prepared, comm.rank
        sending = self.src == me
        if self.stage == 0:
            w = theirs.get("w")
            if w is None:
                self._fail(PeerMismatchError(
                    f"rank {me}: send/recv with rank {self.peer}: the peer's matching call did not take the "
                    f"prepared path (BRAID_PREPARED must be the same on every rank)"))
            self.key = (self.word, w) if sending else (w, self.word)
            entry = prep.pair_get((self.src, self.dst), self.key)
            if entry is not None:
                self._go(entry)
                return True
            self.desc = self.full_of()
            self.token = seg.post_pair(self.desc, self.peer, sending, channel=1)
            self.stage = 1
            theirs = seg.poll_pair(self.token)
            if theirs is None:
                return False
        entry = self._build(theirs)
        prep.pair_put((self.src, self.dst), self.key, entry)
        self._go(entry)
        return True

    def _fail(self, exc: BaseException):
        self.error = exc
        self._drop()
        self.comm._prepared.give_event(self.start) if self.start else None
        self.start = 0
        raise exc

    def _build(self, theirs: dict) -> PairEntry:
        """The full agreement of a shape not prepared yet (both sides at their k-th miss)."""
        comm, me, src, dst, n = self.comm, self.comm.rank, self.src, self.dst, self.n
        if "w" in theirs:
            self._fail(PeerMismatchError(f"rank {me}: send/recv with rank {self.peer}: the ranks' caches of "
                                         f"prepared calls disagree (one missed, the other did not)"))
        descs: list = [None] * comm.world_size
        descs[me], descs[self.peer] = self.desc, theirs
        try:
            comm._check_direction(self.desc, theirs, self.peer)
            comm._agree("send_recv", descs, ("op", "dtype", "nbytes", "src", "dst", "calib"))
        except PeerMismatchError as exc:
            self._fail(exc)
        shares = _pair_shares(descs[src], comm._agreed_lanes(descs))
        if comm._native_ok(shares):
            return PairEntry(descs, None, shares, native=True)
        plan = comm._plan(("p2p", src, dst, n), lambda: p2p_movement(comm.world_size, src, dst, n), shares, n, self.dev)
        copies = None
        if self.dev.type == "cuda" and shares == {"ce": 1.0}:
            copies = []
            if dst == me:
                transfers = plan.lanes.get("ce", [])
                peers = comm._lanes["ce"].peer_ptrs(transfers, me, descs)
                copies = [(off, peers[t.src] + t.src_off, t.nbytes)
                          for t in transfers for d, _, off in t.dsts if d == me and t.nbytes]
        return PairEntry(descs, plan, shares, native=False, copies=copies)

    def _go(self, entry: PairEntry) -> None:
        """Start this call's lanes from the entry."""
        comm, me = self.comm, self.comm.rank
        self._drop()
        sending = self.src == me
        start, self.start = self.start, 0
        prep = comm._prepared
        try:
            if entry.native:
                g = comm._native_group(entry.shares)
                tb = self.inp if sending else self.outs[0]
                work = dist.isend(tb, group_dst=self.peer, group=g) if sending else dist.irecv(tb, group_src=self.peer, group=g)
                self.inner = as_handle(work, next(iter(entry.shares)))
            elif entry.copies is not None:
                self.inner = self._flags(entry, start, sending)
            else:
                if self.dev.type == "cuda" and _capturing():
                    raise not_capturable("send_recv", entry.shares)
                self.inner = execute(comm.lane_ctx, entry.plan, self.inp, self.outs, entry.descs, self.peer,
                                     start_event=_RawStart(start) if start else None)
        finally:
            if start:
                prep.give_event(start)      # every stream that waits on it has been told so

    def _flags(self, entry: PairEntry, start: int, sending: bool) -> _FlagRun:
        """The copy engines' program of this side: the sender sets `ready` and waits for `done`
        (on the lane's send stream, so that its wait never holds up this rank's recvs); the
        receiver waits for `ready`, pulls, sets `done`. Each waiter resets its flag (replay-safe,
        lanes/signals.py)."""
        comm = self.comm
        prep, ce = comm._prepared, comm._lanes["ce"]
        stream = ce.p2p_stream(sending)
        sh = stream.cuda_stream
        base, lay = comm.seg_dev_ptr, comm.layout
        ready = base + lay.counter("flag_p2p_ready", self.src, self.dst)
        done = base + lay.counter("flag_p2p_done", self.src, self.dst)
        if start:
            _cuda.stream_wait_event(sh, start)
        if sending:
            _cuda.write_value(sh, ready, 1)
            _cuda.wait_value(sh, done, 1)
            _cuda.write_value(sh, done, 0)
        else:
            _cuda.wait_value(sh, ready, 1)
            _cuda.write_value(sh, ready, 0)
            out = self.outs[0].data_ptr()
            for off, src_ptr, nbytes in entry.copies:
                _cuda.memcpy_async(out + off, src_ptr, nbytes, sh)
            _cuda.write_value(sh, done, 1)
        end = prep.take_event()
        _cuda.event_record(end, sh)
        tensors = (self.inp,) if sending else (self.outs[0],)
        if self.async_op:
            prep.dirty = True
            for t in tensors:          # the caller may free them before waiting: the allocator must know
                if t.numel():
                    t.record_stream(stream)
        return _FlagRun(prep, end, entry, tensors)


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


class _Works:
    """Several torch Works as one (a native batch_isend_irecv)."""

    def __init__(self, works):
        self.works = list(works or [])

    def wait(self, timeout=None) -> bool:
        for wk in self.works:
            wk.wait()
        return True

    def is_completed(self) -> bool:
        return all(wk.is_completed() for wk in self.works)


def _adjacent(views: list[torch.Tensor], dev: torch.device) -> torch.Tensor | None:
    """One flat uint8 tensor over `views` (flat uint8 views, in order) when they lie back to back
    in one allocation, else None. No views: an empty tensor."""
    parts = [v for v in views if v.numel()]
    if not parts:
        return torch.empty(0, dtype=torch.uint8, device=dev)
    storage = parts[0].untyped_storage()
    base = storage.data_ptr()
    at = parts[0].data_ptr()
    for v in parts:
        if v.untyped_storage().data_ptr() != base or v.data_ptr() != at:
            return None
        at += v.numel()
    total = at - parts[0].data_ptr()
    return torch.empty(0, dtype=torch.uint8, device=dev).set_(storage, parts[0].data_ptr() - base, (total,))


class PointToPoint:
    """Part of braid.comm.Communicator (a mixin: state lives on the communicator)."""

    def batch_isend_irecv(self, p2p_op_list, device: torch.device | None = None) -> list:
        """A batch of sends and receives; a skewed batch is routed as one uneven all_to_all (the
        router spreads it over every path; each pair's bytes arrive in order).

        `p2p_op_list`: torch.distributed.P2POp objects (or (op, tensor, peer) tuples) whose op is
        dist.isend / dist.irecv (braid's send/recv are accepted too), on the world group. Unlike
        torch's call this is collective: **every rank of the communicator calls it**, with an empty
        list if it has nothing to move. The bytes a rank sends to a peer, in list order, fill the
        tensors that peer receives from it, in its list order (one byte stream per pair: the totals
        per pair must match, or every rank raises PeerMismatchError). Returns a list with one
        handle; its wait() completes every op (on GPUs: the current stream waits).

        Without copies: braid's lanes move a rank's sends as one buffer, so the batch is routed
        (or split) only when on every rank the send tensors, taken by destination rank and then in
        list order, lie back to back in one allocation, and so do the receive tensors by source
        (a MoE dispatch cut from one buffer does). Otherwise the batch is NCCL's (gloo's) own
        batch_isend_irecv of the same ops: packing would cost two device copies of the batch, and
        measured slower than NCCL's own batch (4 x H200, hot fraction 0.7 at 1 GiB: 8.8 ms
        against 6.7, `scripts/batch_probe.py`, 2026-11-22)."""
        op = "all_to_all_single"          # planned, routed and calibrated as the uneven all_to_all
        what = "batch_isend_irecv"
        sends: dict[int, list[torch.Tensor]] = {}
        recvs: dict[int, list[torch.Tensor]] = {}
        items = []
        dev = device
        if not isinstance(p2p_op_list, (list, tuple)):
            raise MisuseError(f"{what}: expected a list of P2POp, got {type(p2p_op_list).__name__}")
        for i, item in enumerate(p2p_op_list):
            if isinstance(item, tuple) and len(item) == 3:
                fn, tensor, peer = item
                group = None
            elif all(hasattr(item, a) for a in ("op", "tensor", "peer")):
                fn, tensor, peer, group = item.op, item.tensor, item.peer, getattr(item, "group", None)
            else:
                raise MisuseError(f"{what}: item {i} is {item!r}; pass torch.distributed.P2POp(dist.isend or "
                                  f"dist.irecv, tensor, peer) objects")
            if group not in (None, dist.group.WORLD):
                raise MisuseError(f"{what}: item {i} names a process group; braid runs on the world group only")
            name = getattr(fn, "__name__", "")
            if name not in ("isend", "irecv", "send", "recv"):
                raise MisuseError(f"{what}: item {i}'s op is {fn!r}; use dist.isend or dist.irecv")
            sending = name in ("isend", "send")
            check_rank(peer, self.world_size, "peer", what, me=self.rank)
            dev = dev or self._device_for(tensor)
            b = (input_bytes if sending else output_bytes)(tensor, f"item {i}'s tensor", dev, what)
            (sends if sending else recvs).setdefault(peer, []).append(b)
            items.append((sending, b, peer))
        if dev is None:
            dev = self.device if self.cuda else torch.device("cpu")
        self._check_open()
        w = self.world_size
        ins = [sum(t.numel() for t in sends.get(d, [])) for d in range(w)]
        outs = [sum(t.numel() for t in recvs.get(s, [])) for s in range(w)]
        ib = _adjacent([t for d in range(w) for t in sends.get(d, [])], dev)
        ob = _adjacent([t for s in range(w) for t in recvs.get(s, [])], dev)
        zc = ib is not None and ob is not None
        if not zc:
            ib = ob = torch.empty(0, dtype=torch.uint8, device=dev)
        desc = {"op": op, "dtype": str(torch.uint8), "in": ins, "out": outs, "zc": zc,
                **self._routed.report(self._routed_observation())}

        def native(g):
            ops = [dist.P2POp(dist.isend if snd else dist.irecv, t, group=g, group_peer=p) for snd, t, p in items if t.numel()]
            return _Works(dist.batch_isend_irecv(ops) if ops else [])

        def multi(descs, shares, plan1, agreed):
            """A share-based split moves one buffer per rank: only when every rank has one."""
            if all(d.get("zc", True) for d in descs if d is not None):
                return execute(self.lane_ctx, plan1, ib, [ob], descs)
            lane = "nccl" if "nccl" in agreed else "gloo"
            return as_handle(native(self._native_group({lane: 1.0})), lane)

        movement_of, route = self._a2a_rules(op, dev)
        handle = self._run(op, desc, sum(ins), ib, [ob], movement_of, native, ("op", "dtype"), True,
                           always_exchange=True, multi=multi, route=route)
        return [handle]

    def send(self, tensor: torch.Tensor, dst: int, async_op: bool = False):
        return self._p2p(tensor, dst, sending=True, async_op=async_op)

    def recv(self, tensor: torch.Tensor, src: int, async_op: bool = False):
        return self._p2p(tensor, src, sending=False, async_op=async_op)

    def _p2p(self, tensor, peer, sending: bool, async_op: bool):
        op = "send_recv"
        if (self._p2p_shm is not None and self._fixed is None and not self.check and type(tensor) is torch.Tensor
                and not tensor.is_cuda and tensor.layout is torch.strided and type(peer) is int
                and 0 <= peer < self.world_size and peer != self.rank):
            # every CPU send/recv of a communicator with the segment's path, whatever its size or
            # layout: both ranks of a pair pick the same transport (comm/cpup2p.py)
            self._check_open()
            x = self._p2p_shm.post(tensor, peer, sending)
            handle = Handle(native=x)
            handle.native_lane = "shm"
            self.last_handle = handle
            if async_op:
                return handle
            handle.wait()
            return None
        if (not self._p2p_pending and self._fast_ok(tensor) and type(peer) is int and 0 <= peer < self.world_size
                and peer != self.rank and self._native_for(op, tensor.numel() * tensor.element_size())):
            be = self._fast_be
            if be is not None:           # the backend's own send/recv (tag 0, as torch's isend/irecv)
                work = be.send([tensor], peer, 0) if sending else be.recv([tensor], peer, 0)
            else:
                g = self.native_group
                work = dist.isend(tensor, group_dst=peer, group=g) if sending else dist.irecv(tensor, group_src=peer, group=g)
            if async_op:
                return self._finish(work, True)
            work.wait()
            self.last_handle = self._native_done
            return None
        dev = self._device_for(tensor)
        check_rank(peer, self.world_size, "dst" if sending else "src", "send" if sending else "recv", me=self.rank)
        if sending:
            tb = input_bytes(tensor, "tensor", dev, "send")
            inp, outs = tb, []
        else:
            tb = output_bytes(tensor, "tensor", dev, "recv")
            inp, outs = None, [tb]
        n = tb.numel()
        src, dst = (self.rank, peer) if sending else (peer, self.rank)
        desc = {"op": op, "dtype": str(tensor.dtype), "nbytes": n, "src": src, "dst": dst}

        def native(g):
            return (dist.isend(tb, group_dst=peer, group=g) if sending else dist.irecv(tb, group_src=peer, group=g))

        if self.segment is None:
            return self._run(op, desc, n, inp, outs, lambda d: (n, ("p2p", src, dst, n), lambda: p2p_movement(self.world_size, src, dst, n)),
                             native, ("op", "dtype", "nbytes", "src", "dst"), async_op, peer=peer)
        self._check_open()
        lanes = self.lanes_for(dev)
        shares = self.shares_for(op, n, lanes)
        if self._native_ok(shares):
            if any((h.src, h.dst) == (src, dst) for h in self._p2p_pending):
                # an earlier split call of this direction has not started: the library's own
                # call waits behind it, else the peer would pair the messages out of order
                handle = PendingP2P(self, None, desc, inp, outs, peer, n, src, dst, dev, None,
                                    native=lambda: native(self._native_group(shares)), lane=next(iter(shares)))
                self._p2p_pending.append(handle)
                self._progress_p2p()
            else:
                handle = as_handle(native(self._native_group(shares)), next(iter(shares)))
            self.last_handle = handle
            if async_op:
                return handle
            handle.wait()
            return None
        # Split: matched per direction, posted now, run once the peer's matching call is posted
        # (at the latest in wait()). So isend + irecv on both ranks of a pair works, as in
        # torch.distributed: neither call blocks on the other rank. The sender's shares, chosen
        # now, are the pair's: the receiver's balancer and calibration may see it otherwise.
        calib = self.calib_digest        # as at the call (the descriptor may be built later)

        def full_of() -> dict:
            d = dict(desc, lanes=lanes, calib=calib, rank=self.rank, shares=shares if sending else None)
            if "ce" in lanes:
                d.update(self._lanes["ce"].descriptor(inp))
            return d

        prep = self._prepared
        if prep.enabled:
            word = prep.pair_word(desc, lanes, shares, calib, inp)
            start = 0
            if dev.type == "cuda":
                start = prep.take_event()
                _cuda.event_record(start, _RAW(dev.index))
            token = self.segment.post_pair({"op": op, "w": word}, peer, sending)
            handle = PreparedP2P(self, token, word, full_of, inp, outs, peer, n, src, dst, dev, start,
                                 async_op and not (dev.type == "cuda" and _capturing()))
            self._p2p_pending.append(handle)
            if async_op and dev.type == "cuda" and _capturing():
                handle.complete()       # started inside the capture, from its position there
            else:
                self._progress_p2p()
            self.last_handle = handle
            if async_op:
                return handle
            handle.wait()
            return None
        full = full_of()
        start_event = None
        if dev.type == "cuda":
            start_event = torch.cuda.Event()
            start_event.record(torch.cuda.current_stream(dev))
        token = self.segment.post_pair(full, peer, sending)
        handle = PendingP2P(self, token, full, inp, outs, peer, n, src, dst, dev, start_event)
        self._p2p_pending.append(handle)
        self._progress_p2p()
        self.last_handle = handle
        if async_op:
            return handle
        handle.wait()
        return None

    def _flush_p2p(self) -> None:
        """Start every pending send/recv (blocking until their peers posted them) before a
        collective posts lane work: every rank then queues the same calls in the same order on
        the lanes' streams, which the cross-rank counters rely on."""
        for h in list(self._p2p_pending):
            h.complete()

    def _progress_p2p(self) -> None:
        """Post the lanes of every pending send/recv whose peer has posted its side (never blocks)."""
        for h in list(self._p2p_pending):
            h.try_complete()
