"""`ce` lane: copy engines over NVLink between processes, pulling from peers' tensors via CUDA IPC.

Per call, for rank r (all on r's lane stream, no CPU waits):

    write arrive[r] = seq                      # my input is ready to be read
    for each piece a peer p sends me:
        wait arrive[p] >= seq                  # p's input is ready
        cuMemcpyAsync(my output, p's input)    # the copy engine pulls over NVLink
    write finish[r] = seq                      # I am done reading
    for each peer p that reads my input:
        wait finish[p] >= seq                  # nobody still reads my input when the call ends

The counters live in the pinned node segment (stream memory operations on host-mapped memory).
Peers' inputs are mapped from the IPC handle each rank puts in its call descriptor; mappings are
cached per handle and dropped when a peer's allocation at that address changes.
Rejected: staging through a pre-registered buffer (a device-local copy costs ~20% of the time of
the NVLink transfer it feeds); torch symmetric memory (it needs the user's tensor allocated by it).
"""
from __future__ import annotations

import logging

import torch

from .. import envs
from ..errors import LaneFailureError
from ..planner.plan import LaneKind, Transfer
from . import _cuda
from .base import GpuLaneMixin, Lane, LaneRun, OpContext
from .signals import Rising


def lane_stream(device) -> "torch.cuda.Stream":
    """A stream of the copy engines' lane or its programs: CUDA's highest priority under
    BRAID_CE_PRIORITY (the reductions' kernels then take SMs ahead of compute as they free up)."""
    if envs.get("BRAID_CE_PRIORITY"):
        return torch.cuda.Stream(device=device, priority=-100)    # torch clamps it to the highest
    return torch.cuda.Stream(device=device)


log = logging.getLogger("braid")


class CeLane(GpuLaneMixin, Lane):
    kind = LaneKind.CE
    device_type = "cuda"

    def __init__(self, lc, device: torch.device):
        self.lc = lc
        self.device = device
        self.stream = None
        self.send_stream = None
        self._why = ""
        self.maps: dict[tuple[int, str], int] = {}        # (peer, handle hex) -> mapped base
        self.by_base: dict[tuple[int, int], str] = {}     # (peer, peer's base) -> handle hex
        self.coll_seq = 0
        self.pair_seq: dict[tuple[int, int], int] = {}
        try:
            _cuda.lib()
            if lc.segment is None or lc.seg_dev_ptr is None:
                raise RuntimeError("ranks are not on one node or the node segment is not pinned")
            for p in range(torch.cuda.device_count()):
                if p != device.index and not torch.cuda.can_device_access_peer(device.index, p):
                    raise RuntimeError(f"GPU {device.index} cannot access GPU {p} directly")
            self.stream = lane_stream(device)
            self.send_stream = None
        except (OSError, RuntimeError, AttributeError) as exc:
            self._why = str(exc)

    def available(self) -> tuple[bool, str]:
        return (self.stream is not None, self._why)

    def descriptor(self, inp: torch.Tensor | None) -> dict:
        if inp is None or inp.numel() == 0:
            return {}
        ptr = inp.data_ptr()
        base, _ = _cuda.address_range(ptr)
        return {"ce_h": _cuda.ipc_handle(base).hex(), "ce_base": base, "ce_off": ptr - base}

    def _peer_ptr(self, peer: int, desc: dict) -> int:
        h = desc["ce_h"]
        key = (peer, h)
        if key not in self.maps:
            old = self.by_base.get((peer, desc["ce_base"]))
            if old is not None:            # the peer's allocation at that address was replaced
                _cuda.ipc_close(self.maps.pop((peer, old)))
            self.maps[key] = _cuda.ipc_open(bytes.fromhex(h))
            self.by_base[(peer, desc["ce_base"])] = h
        return self.maps[key] + desc["ce_off"]

    def peer_ptrs(self, transfers: list[Transfer], me: int, descs: list) -> dict[int, int]:
        """The mapped base of every source this rank pulls from (opened once per allocation)."""
        out = {}
        for t in transfers:
            if t.src in out or not any(d == me for d, _, _ in t.dsts):
                continue
            desc = descs[t.src]
            if desc is None or "ce_h" not in desc:
                raise LaneFailureError(f"ce lane: rank {t.src} sent no IPC handle for its input")
            out[t.src] = self._peer_ptr(t.src, desc)
        return out

    def emit(self, sh: int, me: int, transfers: list[Transfer], peers: dict[int, int], out_ptrs: list[int],
             sig) -> None:
        """This rank's part of a collective's copy-engine transfers on stream `sh`: announce my
        input, pull every piece addressed to me (rotated order: rank r starts at r+1, so at any
        moment each source is read by one puller instead of all pulling from rank 0 first, a 2x
        egress hot spot), say I am done, wait until my readers are. `peers`: mapped bases of my
        sources (peer_ptrs); `sig`: the signal scheme (lanes/signals.py)."""
        world = self.lc.world_size
        readers = sorted({d for t in transfers if t.src == me for d, _, _ in t.dsts if d != me})
        sources = sorted({t.src for t in transfers if t.src != me and any(d == me for d, _, _ in t.dsts)})
        said = False                # my ready goes out with the first wait (one batch), or alone
        waited = set()
        for t in sorted(transfers, key=lambda t: ((t.src - me) % world, t.src_off)):
            mine = [(b, off) for d, b, off in t.dsts if d == me]
            if not mine:
                continue
            if t.src not in waited:
                if said:
                    sig.wait_ready(sh, (t.src,), me)
                else:
                    sig.ready_then_wait(sh, me, readers, (t.src,))
                    said = True
                waited.add(t.src)
            src_ptr = peers[t.src] + t.src_off
            for b, off in mine:
                _cuda.memcpy_async(out_ptrs[b] + off, src_ptr, t.nbytes, sh)
        if not said:
            sig.ready(sh, me, readers)
        sig.done_then_wait(sh, me, sources, readers)

    def post(self, ctx: OpContext, transfers: list[Transfer]) -> LaneRun:
        if not ctx.plan.p2p:
            self.coll_seq += 1
            s = self.stream
            start = self._begin(ctx, s)
            peers = self.peer_ptrs(transfers, ctx.rank, ctx.descs)
            self.emit(s.cuda_stream, ctx.rank, transfers, peers, [o.data_ptr() for o in ctx.outs],
                      Rising(self.lc.seg_dev_ptr, self.lc.layout, self.coll_seq))
            return LaneRun(self.kind, start=start, end=self._end(s))
        return self._post_p2p(ctx, transfers)

    def p2p_stream(self, sending: bool):
        """The stream of a send's side (a stream of its own: its wait for the reader must not hold
        up this rank's recvs) or of a recv's (the lane's stream)."""
        if not sending:
            return self.stream
        if self.send_stream is None:
            self.send_stream = torch.cuda.Stream(device=self.device)
        return self.send_stream

    def _post_p2p(self, ctx: OpContext, transfers: list[Transfer]) -> LaneRun:
        """send/recv: counted per direction, and the sender's side (publish, then wait for the
        reader) on a stream of its own: a rank's send and recv with the same peer may be in
        flight together, and the send's wait must not hold up the recv's pulls."""
        lc, me, s = self.lc, ctx.rank, self.stream
        lay, base = lc.layout, lc.seg_dev_ptr
        key = (transfers[0].src, transfers[0].dsts[0][0])
        seq = self.pair_seq.get(key, 0) + 1
        self.pair_seq[key] = seq
        if key[0] == me:
            s = self.p2p_stream(True)
        sh = s.cuda_stream
        start = self._begin(ctx, s)
        arrive = lambda r, d: base + lay.counter("ce_p2p_arrive", r, d)     # noqa: E731
        finish = lambda r, src: base + lay.counter("ce_p2p_finish", src, r)  # noqa: E731
        readers = sorted({d for t in transfers if t.src == me for d, _, _ in t.dsts if d != me})
        sources = sorted({t.src for t in transfers if any(d == me for d, _, _ in t.dsts)})
        if readers:
            _cuda.write_value(sh, arrive(me, ctx.peer), seq)
        peers = self.peer_ptrs(transfers, me, ctx.descs)
        waited = set()
        for t in sorted(transfers, key=lambda t: t.src_off):
            mine = [(b, off) for d, b, off in t.dsts if d == me]
            if not mine:
                continue
            if t.src not in waited:
                _cuda.wait_value(sh, arrive(t.src, me), seq)
                waited.add(t.src)
            for b, off in mine:
                _cuda.memcpy_async(ctx.outs[b].data_ptr() + off, peers[t.src] + t.src_off, t.nbytes, sh)
        if sources:
            _cuda.write_value(sh, finish(me, ctx.peer), seq)
        for p in readers:
            _cuda.wait_value(sh, finish(p, me), seq)
        return LaneRun(self.kind, start=start, end=self._end(s))

    def close(self) -> None:
        for ptr in self.maps.values():
            try:
                _cuda.ipc_close(ptr)
            except LaneFailureError as exc:
                log.warning("braid ce: closing a peer mapping failed: %s", exc)
        self.maps.clear()
        self.by_base.clear()
