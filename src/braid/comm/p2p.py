"""send/recv and batches of them. A split send/recv is matched per direction (a's k-th send to b
with b's k-th recv from a), posted at once and started when the peer's side is posted, so isend
and irecv never block on the other rank; the pair runs the sender's shares. With prepared calls
on, a split send/recv goes through comm/pairs.py (the sender names the agreed entry in one message).
A batch is one uneven all_to_all under the hood.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from ..collectives import check_rank, input_bytes, output_bytes
from ..errors import MisuseError
from ..executor import Handle, Works, as_handle, execute
from ..planner.plan import p2p_movement
from .pairs import Pairs, PendingP2P, ticket_key

log = logging.getLogger("braid")


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
    """The point-to-point part of a communicator: send/recv and batches of them. It fills the
    queue of sends/recvs posted but not started (`pending`, a P2PQueue the other parts flush
    before a collective) and owns the prepared send/recv (`pairs`, comm/pairs.py, with prepared
    calls on and a node segment). Its collaborators: the node segment and its layout, the lanes
    and their context, the split policy, the prepared calls, the native library's calls and
    group, the call ledger, the faults part, the fast path's part, the full path's part, the
    all_to_all part (a batch is an uneven all_to_all), the router's samples and the whole CPU
    calls (a CPU communicator's send/recv through the segment)."""

    def __init__(self, *, rank: int, world_size: int, cuda: bool, device: torch.device, segment, layout,
                 seg_dev_ptr, lanes: dict, lane_ctx, lanes_for, check: bool, policy, prepared, library, native_group,
                 ledger, faults, calls, exchange, routing, samples, pending, cpu):
        self.rank, self.world_size, self.cuda, self.device = rank, world_size, cuda, device
        self.segment, self.layout, self.seg_dev_ptr = segment, layout, seg_dev_ptr
        self.lanes, self.lane_ctx, self.lanes_for, self.check = lanes, lane_ctx, lanes_for, check
        self.policy, self.prepared, self.library, self.native_group = policy, prepared, library, native_group
        self.ledger, self.faults, self.calls, self.exchange = ledger, faults, calls, exchange
        self.routing, self.samples, self.pending, self.cpu = routing, samples, pending, cpu
        self.fast_ok = calls.fast_ok
        # prepared send/recv: through the node segment, with prepared calls on
        self.pairs = Pairs(self) if segment is not None and prepared.enabled else None

    def close(self) -> None:
        if self.pairs is not None:
            self.pairs.close()

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
            dev = dev or self.calls.device_for(tensor)
            b = (input_bytes if sending else output_bytes)(tensor, f"item {i}'s tensor", dev, what)
            (sends if sending else recvs).setdefault(peer, []).append(b)
            items.append((sending, b, peer))
        if dev is None:
            dev = self.device if self.cuda else torch.device("cpu")
        self.faults.check_open()
        w = self.world_size
        ins = [sum(t.numel() for t in sends.get(d, [])) for d in range(w)]
        outs = [sum(t.numel() for t in recvs.get(s, [])) for s in range(w)]
        ib = _adjacent([t for d in range(w) for t in sends.get(d, [])], dev)
        ob = _adjacent([t for s in range(w) for t in recvs.get(s, [])], dev)
        zc = ib is not None and ob is not None
        if not zc:
            ib = ob = torch.empty(0, dtype=torch.uint8, device=dev)
        desc = {"op": op, "dtype": str(torch.uint8), "in": ins, "out": outs, "zc": zc,
                **self.samples.report()}

        def native(g):
            ops = [dist.P2POp(dist.isend if snd else dist.irecv, t, group=g, group_peer=p) for snd, t, p in items if t.numel()]
            return Works(dist.batch_isend_irecv(ops) if ops else [])

        def multi(descs, shares, plan1, agreed):
            """A share-based split moves one buffer per rank: only when every rank has one."""
            if all(d.get("zc", True) for d in descs if d is not None):
                return execute(self.lane_ctx, plan1, ib, [ob], descs)
            lane = "nccl" if "nccl" in agreed else "gloo"
            return as_handle(native(self.exchange.group_for({lane: 1.0})), lane)

        movement_of, route = self.routing.a2a_rules(op, dev)
        handle = self.exchange.run(op, desc, sum(ins), ib, [ob], movement_of, native, ("op", "dtype"), True,
                                   always_exchange=True, multi=multi, route=route)
        return [handle]

    def call(self, tensor, peer, sending: bool, async_op: bool):
        """Communicator.send (sending) or recv with `peer`."""
        op = "send_recv"
        if (self.cpu.p2p is not None and self.policy.fixed is None and not self.check and type(tensor) is torch.Tensor
                and not tensor.is_cuda and tensor.layout is torch.strided and type(peer) is int
                and 0 <= peer < self.world_size and peer != self.rank):
            # every CPU send/recv of a communicator with the segment's path, whatever its size or
            # layout: both ranks of a pair pick the same transport (comm/cpup2p.py)
            self.faults.check_open()
            x = self.cpu.p2p.post(tensor, peer, sending)
            handle = Handle(native=x)
            handle.native_lane = "shm"
            self.ledger.last_handle = handle
            if async_op:
                return handle
            handle.wait()
            return None
        pairs = self.pairs
        if pairs is not None and pairs.tickets and type(tensor) is torch.Tensor and type(peer) is int:
            # a repeat of a send/recv on the copy engines (comm/pairs.py, _Ticket)
            tk = pairs.tickets.get(ticket_key(sending, peer, tensor))
            faults = self.faults
            if (tk is not None and self.fast_ok(tensor) and not faults.aborted
                    and not (faults.watchdog is not None and faults.watchdog.failed)):
                handle = pairs.send_fast(tk, tensor, async_op) if sending else pairs.recv_fast(tk, tensor, async_op)
                if handle is not None:
                    self.ledger.last_handle = handle
                    if async_op:
                        return handle
                    handle.wait()
                    return None
        if (not self.pending and self.fast_ok(tensor) and type(peer) is int and 0 <= peer < self.world_size
                and peer != self.rank and self.policy.native_for(op, tensor.numel() * tensor.element_size())):
            work = self.library.point(tensor, peer, sending, self.native_group)
            if async_op:
                return self.calls.finish(work, True)
            work.wait()
            self.ledger.last_handle = self.library.done
            return None
        dev = self.calls.device_for(tensor)
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
            return self.exchange.run(op, desc, n, inp, outs,
                                     lambda d: (n, ("p2p", src, dst, n), lambda: p2p_movement(self.world_size, src, dst, n)),
                                     native, ("op", "dtype", "nbytes", "src", "dst"), async_op, peer=peer)
        self.faults.check_open()
        lanes = self.lanes_for(dev)
        shares = self.policy.shares_for(op, n, lanes)
        if self.policy.native_ok(shares):
            if any((h.src, h.dst) == (src, dst) for h in self.pending):
                # an earlier split call of this direction has not started: the library's own
                # call waits behind it, else the peer would pair the messages out of order
                handle = PendingP2P(self, None, desc, inp, outs, peer, n, src, dst, dev, None,
                                    native=lambda: native(self.exchange.group_for(shares)), lane=next(iter(shares)))
                self.pending.append(handle)
                self.pending.progress()
            else:
                handle = as_handle(native(self.exchange.group_for(shares)), next(iter(shares)))
            self.ledger.last_handle = handle
            if async_op:
                return handle
            handle.wait()
            return None
        # Split: matched per direction, posted now, run once the peer's matching call is posted
        # (at the latest in wait()). So isend + irecv on both ranks of a pair works, as in
        # torch.distributed: neither call blocks on the other rank. The sender's shares, chosen
        # now, are the pair's: the receiver's balancer and calibration may see it otherwise.
        calib = self.policy.digest        # as at the call (the descriptor may be built later)

        def full_of() -> dict:
            d = dict(desc, lanes=lanes, calib=calib, rank=self.rank, shares=shares if sending else None,
                     timed=self.policy.lane_timing)
            if "ce" in lanes:
                d.update(self.lanes["ce"].descriptor(inp))
            return d

        if self.pairs is not None:
            tkey = ticket_key(sending, peer, tensor) if dev.type == "cuda" and tensor.is_contiguous() else None
            handle = self.pairs.call(sending, peer, desc, lanes, shares, calib, inp, outs, n, dev, full_of, async_op,
                                     tkey)
            self.ledger.last_handle = handle
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
        self.pending.append(handle)
        self.pending.progress()
        self.ledger.last_handle = handle
        if async_op:
            return handle
        handle.wait()
        return None
