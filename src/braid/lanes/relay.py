"""`relay` lane: rank s -> rank v -> rank d, pipelined in chunks through a bounded buffer on v.

The chunk schedule (cuts, slots, counter values, who waits for whom) is planner/relay.py's, the
same for GPU and CPU tensors; every rank derives it from the plan alone. Counters live in the
node segment before its `pid` block, so `NodeSegment.abort()` releases every wait on them.

GPU (copy engines, no CPU waits), on rank r:

    produce stream:  write arrive[r] = seq                       # my input is ready to be read
                     for each chunk g of my ring (r relays it), in the global order:
                         wait done[r][c] >= h + 1 for the consumers c of chunk h = g - slots
                         wait arrive[src] >= seq                 # first chunk of each source
                         cuMemcpyAsync(my slot g % slots, src's input)   # pull over NVLink (IPC)
                         write full[r] = g + 1
                     write finish[r] = seq                       # I stopped reading inputs
    consume stream:  for each chunk g of ring v addressed to me, in the global order:
                         wait full[v] >= g + 1
                         cuMemcpyAsync(my output, v's slot)      # pull from v's buffer (IPC)
                         write done[v][r] = g + 1
                     join the produce stream
                     wait finish[v] >= seq for every relay v that reads my input
                     wait done[r][c] for the last chunk of each consumer c of my ring (drain)

Staging pulls and draining pulls run on two streams: on one, a relay's next pull could wait for a
consumer that itself waits for this rank to drain a chunk (a cycle). The relay's own ce/host work
in the same call runs on those lanes' streams; what relaying takes from it is bounded by the
buffer (BRAID_RELAY_BUFFER_MB, device memory, allocated at the first relayed call) and by the
bytes the plan routes through it. Peer mappings (sources' inputs and relays' buffers) go through
the `ce` lane's IPC cache, so a segment is opened once per process whichever lane needs it (the
staging buffer and a user tensor may share one caching-allocator segment, hence one handle).

CPU (one worker thread per call, polling): no process can read another's private tensor, so the
source stages each chunk into v's slot in the shared segment itself, and since a ring then has
several writers, the writer of chunk g first waits full[v] >= g. Consumers and the drain are as
on GPUs. The worker alternates between its stage and consume steps, doing whatever is ready.

Rejected: staging on the source (s -> its own buffer -> d is just the host lane, and adds a copy
on the GPU); one ring per (source, relay) pair (memory grows with the world; a relay's cap would
be per pair instead of per rank).
"""
from __future__ import annotations

import time

import torch

from .. import envs
from ..errors import BraidTimeoutError, LaneFailureError, LaneUnavailableError, PeerMismatchError
from ..node import geq
from ..planner.plan import LaneKind, Transfer
from ..planner.relay import NUM_SLOTS, RelayCursor, geometry, schedule
from . import _cuda
from .base import GpuLaneMixin, Lane, LaneRun, OpContext, kept_buffer


def _tensors_on_cuda(ctx: OpContext) -> bool:
    for t in ([ctx.inp] if ctx.inp is not None else []) + list(ctx.outs):
        return t.is_cuda
    return False


class RelayLane(GpuLaneMixin, Lane):
    """One lane object for both devices: post() runs the GPU engine for CUDA tensors and the
    CPU engine for CPU tensors (the call's tensors decide, as they decide `lanes_for`)."""
    kind = LaneKind.RELAY

    def __init__(self, lc, ce=None, device: torch.device | None = None):
        self.lc = lc
        self.ce = ce
        self.device = device
        self.device_type = "cuda" if device is not None else "cpu"
        self.seq = 0
        self.cursors = {v: RelayCursor(NUM_SLOTS) for v in range(lc.world_size)}
        self._last_cpu: LaneRun | None = None
        self.produce_stream = self.consume_stream = None
        self.buf: torch.Tensor | None = None
        self._buf_desc: dict | None = None
        self._gpu_why = "no CUDA device"
        if device is not None:
            self.gpu_geom = geometry(envs.get("BRAID_RELAY_BUFFER_MB") << 20)
            if ce is None or not ce.available()[0]:
                self._gpu_why = f"needs the ce lane (CUDA IPC, stream memory operations): " \
                                f"{ce.available()[1] if ce is not None else 'not created'}"
            else:
                self._gpu_why = ""
                self.produce_stream = torch.cuda.Stream(device=device)
                self.consume_stream = torch.cuda.Stream(device=device)

    # capabilities ------------------------------------------------------------------------------
    def available_for(self, device_type: str) -> tuple[bool, str]:
        if device_type == "cuda":
            return (self.produce_stream is not None, self._gpu_why)
        lay = self.lc.layout
        if self.lc.segment is None or lay is None:
            return False, "ranks are not all on one node (no shared segment)"
        if not lay.relay_rings:
            return False, "the node segment has no relay staging area"
        return True, ""

    def available(self) -> tuple[bool, str]:
        return self.available_for(self.device_type)

    def descriptor(self, inp: torch.Tensor | None, device_type: str | None = None) -> dict:
        """Geometry (every rank must cut chunks alike) and, on GPUs, the IPC handles of this
        rank's staging buffer and of its input (relays pull from it)."""
        if (device_type or self.device_type) != "cuda":
            ring = self.lc.layout.relay_rings[0]
            return {"relay_geom": [ring.num_slots, ring.slot_bytes]}
        desc = dict(self._staging_desc())
        desc.update(self.ce.descriptor(inp))
        return desc

    def _staging_desc(self) -> dict:
        if self._buf_desc is None:
            slots, slot_bytes = self.gpu_geom
            self.buf = kept_buffer(slots * slot_bytes, self.device)
            ptr = self.buf.data_ptr()
            base, _ = _cuda.address_range(ptr)
            self._buf_desc = {"relay_geom": [slots, slot_bytes], "relay_h": _cuda.ipc_handle(base).hex(),
                              "relay_base": base, "relay_off": ptr - base}
        return self._buf_desc

    # one call ------------------------------------------------------------------------------------
    def post(self, ctx: OpContext, transfers: list[Transfer]) -> LaneRun:
        if ctx.plan.p2p:
            raise LaneUnavailableError("relay lane: a relay needs a third rank; it runs in collective plans "
                                       "(Communicator.run_plan), not in send/recv")
        cuda = _tensors_on_cuda(ctx)
        ok, why = self.available_for("cuda" if cuda else "cpu")
        if not ok:
            raise LaneUnavailableError(f"relay lane is not available for {'CUDA' if cuda else 'CPU'} tensors: {why}")
        want = list(self.gpu_geom) if cuda else [self.lc.layout.relay_rings[0].num_slots,
                                                 self.lc.layout.relay_rings[0].slot_bytes]
        for r, d in enumerate(ctx.descs):
            if d is not None and d.get("relay_geom", want) != want:
                raise PeerMismatchError(f"relay lane: rank {r} cuts its relay buffer into {d['relay_geom']} "
                                        f"(slots, bytes), this rank into {want}; set BRAID_RELAY_BUFFER_MB "
                                        f"alike on every rank")
        return self._post_gpu(ctx, transfers) if cuda else self._post_cpu(ctx, transfers)

    def _counters(self):
        lay = self.lc.layout
        return (lambda r: lay.counter("relay_arrive", r), lambda r: lay.counter("relay_finish", r),
                lambda v: lay.counter("relay_full", v), lambda v, c: lay.counter("relay_done", v, c))

    def _post_gpu(self, ctx: OpContext, transfers: list[Transfer]) -> LaneRun:
        if self._last_cpu is not None and self._last_cpu.thread is not None:
            self._last_cpu.thread.join()     # a CPU-tensor relay call still writes our counters
        lc, me = self.lc, ctx.rank
        slots, slot_bytes = self.gpu_geom
        sched = schedule(transfers, lc.world_size, slot_bytes, self.cursors)
        self.seq += 1
        seq = self.seq
        base = lc.seg_dev_ptr
        arrive, finish, full, done = self._counters()
        ps, cs = self.produce_stream, self.consume_stream
        start = self._begin(ctx, cs)
        ps.wait_event(ctx.start_event)
        ph, ch = ps.cuda_stream, cs.cuda_stream
        self._staging_desc()                 # allocated here at the latest (run_plan's exchange does it first)
        my_buf = self.buf.data_ptr()
        _cuda.write_value(ph, base + arrive(me), seq)
        arrived = set()
        for c in sched.staged_by(me, "relay"):
            for q, value in c.reuse:
                _cuda.wait_value(ph, base + done(me, q), value)
            if c.src not in arrived:
                _cuda.wait_value(ph, base + arrive(c.src), seq)
                arrived.add(c.src)
            src = self._peer(ctx, c.src, "ce_h", "ce_base", "ce_off") + c.src_off
            _cuda.memcpy_async(my_buf + c.slot * slot_bytes, src, c.nbytes, ph)
            _cuda.write_value(ph, base + full(me), c.g + 1)
        _cuda.write_value(ph, base + finish(me), seq)
        outs = [o.data_ptr() if o.numel() else 0 for o in ctx.outs]
        for c, here in sched.consumed_by(me):
            _cuda.wait_value(ch, base + full(c.ring), c.g + 1)
            buf = my_buf if c.ring == me else self._peer(ctx, c.ring, "relay_h", "relay_base", "relay_off")
            for b, off in here:
                _cuda.memcpy_async(outs[b] + off, buf + c.slot * slot_bytes, c.nbytes, ch)
            _cuda.write_value(ch, base + done(c.ring, me), c.g + 1)
        cs.wait_stream(ps)
        for v in sched.readers_of(me):
            _cuda.wait_value(ch, base + finish(v), seq)
        for q, value in sched.drain.get(me, ()):
            _cuda.wait_value(ch, base + done(me, q), value)
        return LaneRun(self.kind, start=start, end=self._end(cs))

    def _peer(self, ctx: OpContext, peer: int, h: str, b: str, o: str) -> int:
        """A peer's buffer mapped here (through the ce lane's cache of IPC mappings)."""
        desc = ctx.descs[peer]
        if desc is None or h not in desc:
            what = "its input" if h == "ce_h" else "its relay buffer"
            raise LaneFailureError(f"relay lane: rank {peer} sent no IPC handle for {what}")
        return self.ce._peer_ptr(peer, {"ce_h": desc[h], "ce_base": desc[b], "ce_off": desc[o]})

    def _post_cpu(self, ctx: OpContext, transfers: list[Transfer]) -> LaneRun:
        lc, me = self.lc, ctx.rank
        seg, lay = lc.segment, lc.layout
        rings = lay.relay_rings
        sched = schedule(transfers, lc.world_size, rings[0].slot_bytes, self.cursors)
        self.seq += 1
        stage = sched.staged_by(me, "source")
        consume = sched.consumed_by(me)
        drain = list(sched.drain.get(me, ()))
        _, _, full, done = self._counters()
        mem = lc.segment_tensor
        inp, outs = ctx.inp, ctx.outs
        timeout = envs.get("BRAID_TIMEOUT_S")
        previous = self._last_cpu
        gpu_streams = [s for s in (self.produce_stream, self.consume_stream) if s is not None]

        def run() -> None:
            if previous is not None and previous.thread is not None:
                previous.thread.join()      # an earlier async call still moving: finish it first
            for s in gpu_streams:           # GPU relay calls before this one write the same counters
                s.synchronize()
            si = ci = di = 0
            copied = False
            idle_since = None
            while si < len(stage) or ci < len(consume) or di < len(drain):
                progressed = False
                waiting_on = None
                if si < len(stage):
                    c = stage[si]
                    if not copied:
                        late = [q for q, value in c.reuse if not geq(seg.get(done(c.ring, q)), value)]
                        if not late:
                            off = rings[c.ring].slot_offset(c.slot)
                            mem[off: off + c.nbytes].copy_(inp[c.src_off: c.src_off + c.nbytes])
                            copied = progressed = True
                        else:
                            waiting_on = late[0]
                    if copied:
                        if geq(seg.get(full(c.ring)), c.g):      # the ring publishes in order
                            seg.set(full(c.ring), c.g + 1)
                            si += 1
                            copied, progressed = False, True
                        else:
                            waiting_on = c.prev_writer
                if ci < len(consume):
                    c, here = consume[ci]
                    if geq(seg.get(full(c.ring)), c.g + 1):
                        off = rings[c.ring].slot_offset(c.slot)
                        for b, doff in here:
                            outs[b][doff: doff + c.nbytes].copy_(mem[off: off + c.nbytes])
                        seg.set(done(c.ring, me), c.g + 1)
                        ci += 1
                        progressed = True
                    elif waiting_on is None:
                        waiting_on = c.src
                if di < len(drain):
                    q, value = drain[di]
                    if geq(seg.get(done(me, q)), value):
                        di += 1
                        progressed = True
                    elif waiting_on is None:
                        waiting_on = q
                if progressed:
                    idle_since = None
                    continue
                now = time.monotonic()
                if idle_since is None:
                    idle_since = now
                time.sleep(0.00002)
                if now - idle_since > 0.5:
                    if waiting_on is not None and waiting_on >= 0:
                        seg.check_alive(waiting_on)
                    if now - idle_since > timeout:
                        raise BraidTimeoutError(
                            f"relay lane on rank {me} made no progress for {timeout:.0f} s (waiting on rank "
                            f"{waiting_on}); a peer stopped or called another op (BRAID_TIMEOUT_S to change "
                            f"the limit)")

        self._last_cpu = LaneRun(self.kind, thread_fn=run, slowdown=lc.slowdown.get("relay", 1.0))
        return self._last_cpu

    def close(self) -> None:
        if self._last_cpu is not None and self._last_cpu.thread is not None:
            self._last_cpu.thread.join(timeout=1.0)
        self._last_cpu = None
        self.buf = None          # peers unmap it in their own ce lane's close()
        self._buf_desc = None
