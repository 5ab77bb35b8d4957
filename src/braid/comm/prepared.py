"""Prepared calls: a split collective agreed and built once, then replayed.

A training loop repeats the same calls on the same buffers (DDP's buckets, FSDP's shards, a
bench loop). Done from scratch, a split call's host time went to a JSON descriptor exchange, a
plan, and tens of driver calls per lane (220-1500 us per call against 26-50 us for NCCL's own,
2 ranks on one H100, 2026-11-25). Here the first call of a shape does that work once and keeps
it; a repeat costs one round of a few words and, on GPUs, one CUDA graph launch.

One split collective call on rank r:

    word  = hash of what this rank knows alone: op, dtype, sizes, root, lanes, shares (the
            balancer's moves show there), calibration, cache epoch, the buffers' addresses (where the copy engines or the
            host lane can run) and, where the copy engines read it, the driver's id of the input's
            allocation (a new allocation at the same address has
            another id: a peer's mapping of the old one is never read)
    post [word, last split call's lane times] through the node segment; read every rank's
    T     = every rank's words, in rank order: the same tuple on every rank
    entry = cache[T]
      hit:  run the entry (below)
      miss: the full exchange (JSON descriptors, agreement checks, plan); cache[T] = a new entry
    run:  shares on the copy engines and the host lane, and an all_reduce with NCCL's prefix
          beside them (GPU): the entry's CUDA graph, captured at its first call; a synchronous
          repeat with no braid work left unjoined launches it on the caller's stream (one driver
          call), others on the ce lane's stream between two events;
          any other split: each lane posts its part from the kept descriptors and plan (no JSON)

A split over several lanes whose shares the balancer still moves is posted at its first
SAMPLE_FIRST calls and every SAMPLE_EVERY-th (its lanes timed, their times in the next round),
replayed between: every rank counts the same calls of the same shape (across the entries its
balancer's moves build), so every rank takes the same way. Fixed shares always replay (but under
fixed_shares(..., timed=True), the calibration's balancing, where every split call posts). Measured on 2 x H200 (2026-11-28), a repeated split with
the host lane cost 29-87 us of host time a call (ce + host, nccl + host, 1-64 MiB), against
520-1747 us posted.

A repeat of a shape whose last call replayed a graph goes from the op's entry straight to the
round and the launch (a Ticket keyed by the op's own arguments). Measured with 2 ranks sharing one
H100 (2026-11-25): 19-56 us of host time per repeated call on the copy engines against NCCL's
23-51 us in the same windows, 260-950 us without the cache.

Every rank reads the same T and its cache holds the same keys (entries are made at the same call
on every rank, evicted in the same order), so all ranks take the same branch with no further
word. A change on one rank (a new buffer, a share move, a new calibration) changes its word, so
T is new for everyone. Graphs use replay-safe flags (lanes/signals.py), never a captured
sequence number. The balancer's input (the slowest rank's lane times of the previous split call)
rides in the same round, so every rank makes the same move at the same call.

Inside a user's CUDA graph capture a split call that replays a graph here is emitted into the
caller's capturing stream with the same flags; any other split cannot be captured and says so.
The host lane's programs stage through rings of their own with replay-safe flags (lanes/host.py):
the posted calls' rings and counters, which advance from call to call, are never touched by a
replay, so posted calls and replays may follow each other in any order.
Rejected: keying the cache by this rank's own facts alone (ranks could disagree on hit or miss
and one would replay while its peer exchanges: a hang).
"""
from __future__ import annotations

import logging
import time
import zlib
from collections import OrderedDict

import torch

from .. import envs
from ..errors import LaneFailureError, MisuseError
from ..executor import Handle, sweep
from ..lanes import _cuda
from ..lanes.ce import lane_stream

log = logging.getLogger("braid")

# is the caller's current stream capturing a CUDA graph (torch's own accessor where present)
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing
MASK63 = (1 << 63) - 1
M64 = (1 << 64) - 1
OBS_LANES = ("ce", "host", "nccl", "gloo", "shm")   # lane times in the round, in this order
NO_OBS = (0,) * (1 + len(OBS_LANES))                # the round's values after the word, nothing observed
EVENT_RING = 16          # end events of async replays (reused in turn)


def mix_word(base: int, ident: int) -> int:
    """A call's word from its base and the id of its input's allocation (0: none); the native
    call (`_rounds.c` mix_word) computes the same, so either path's word meets the other's."""
    if not ident:
        return base & MASK63
    h = (base & M64) ^ ((ident * 0x9E3779B97F4A7C15) & M64)
    h ^= h >> 31
    h = (h * 0xBF58476D1CE4E5B9) & M64
    h ^= h >> 29
    return h & MASK63


GRAPH_LANES = frozenset(("ce", "host"))
# a split over several lanes that the balancer still moves is posted (its lanes timed) at its
# first SAMPLE_FIRST calls and every SAMPLE_EVERY-th after, and replayed between
SAMPLE_FIRST, SAMPLE_EVERY = 8, 64


def graph_shares(shares: dict[str, float]) -> bool:
    """Shares a data movement can replay as a CUDA graph: the copy engines, the host lane, or
    both (a reduction's own program says which shares it holds: Reductions.graphable)."""
    return bool(shares) and GRAPH_LANES.issuperset(shares)


def ce_alone(shares: dict[str, float]) -> bool:
    return len(shares) == 1 and "ce" in shares


def _current_raw_stream():
    """The caller's current CUDA stream as a raw handle (torch's own accessor where present,
    ~0.3 us; torch.cuda.current_stream() costs 4-7 us)."""
    get = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if get is not None:
        return lambda dev: get(dev)
    return lambda dev: torch.cuda.current_stream(dev).cuda_stream


class Entry:
    """One prepared call: what every rank agreed (descriptors, lanes, shares, plan) and, where
    one program can hold it on GPUs, the captured program."""

    __slots__ = ("descs", "plan", "shares", "agreed", "size", "native", "graph", "exec_ptr", "keep", "done",
                 "graph_ok", "sample_key")

    def __init__(self, descs, plan, shares, agreed, size, native: bool):
        self.descs, self.plan, self.shares, self.agreed, self.size = descs, plan, shares, agreed, size
        self.native = native            # the agreed lanes left the native library alone
        self.graph = None
        self.exec_ptr = 0
        self.keep: list = []            # events the captured program records (alive with it)
        self.graph_ok = None            # one CUDA graph can hold the call (Exchange.run_prepared)
        self.sample_key = None          # the shape whose sampled calls it counts (Exchange.sampled)
        self.done = _DONE if ce_alone(shares) else _Replayed(shares)      # a synchronous replay's handle


class Ticket:
    """A call shape whose last call replayed a graph, keyed by the op's own arguments (op,
    pointers, sizes, dtype, reduction, root): the next identical call goes from the op's entry
    straight to the round and the launch (CallPath.fast_prepared). Valid while the cache's
    epoch (calibration, fixed shares) and the balancer's version are those it was made under."""

    __slots__ = ("base", "bal", "key", "entry", "op", "ledger", "lanes", "native", "even")

    def __init__(self, base: int, bal: int, key: tuple, entry: Entry, op: str, ledger: tuple, lanes):
        self.base, self.bal, self.key, self.entry, self.op, self.ledger, self.lanes = \
            base, bal, key, entry, op, ledger, lanes
        self.native = None          # its native_rounds.TicketC, made at its first native call
        self.even = None            # an all_to_all's round values with equal split sizes (Routing.a2a_even)


class PreparedHandle(Handle):
    """An async replay: wait() makes the caller's current stream wait for its end event; the
    tensors stay referenced until then (as NCCL's Work keeps them). `stream`: the lane stream the
    end event was recorded on, the last of its work when the call returns."""

    def __init__(self, event: int, plan, tensors: tuple, device_index: int, stream=None):
        super().__init__(plan=plan)
        self._event, self.keep, self._dev = event, tensors, device_index
        self.stream = stream

    def wait(self, timeout=None) -> bool:
        if not self._waited:
            self._waited = True
            _cuda.stream_wait_event(_RAW(self._dev), self._event)
            self.keep = ()
        return True

    def end_test(self):
        ev = self._event
        return lambda: _cuda.event_query(ev)

    def is_completed(self) -> bool:
        return _cuda.event_query(self._event)

    def lane_times_us(self) -> dict[str, float]:
        return {}


_RAW = _current_raw_stream()


class _Replayed(Handle):
    """last_handle after a synchronous replay (already in the caller's stream)."""

    def __init__(self, shares=None):
        super().__init__()
        self._waited = True
        self._shares = dict(shares or {"ce": 1.0})

    @property
    def shares(self) -> dict[str, float]:
        return dict(self._shares)


_DONE = _Replayed()


class PreparedCalls:
    """The communicator's cache of prepared calls (see the module docstring). It owns the
    entries, their graphs and the streams and events their replays use."""

    def __init__(self, rank: int, world_size: int, device: torch.device, cuda: bool):
        self.rank, self.world_size, self.device, self.cuda = rank, world_size, device, cuda
        self.enabled = bool(envs.get("BRAID_PREPARED"))
        self.max_entries = envs.get("BRAID_PREPARED_MAX")
        self.entries: OrderedDict = OrderedDict()
        self.tickets: dict = {}     # the op's own arguments -> Ticket (fast path of graph replays)
        self.epoch = 0
        # True while braid work may be on the ce lane's stream (or another lane's) that the
        # caller's stream has not waited for: a synchronous replay then forks and joins instead of
        # launching on the caller's stream (two programs on the same flags must never overlap)
        self.dirty = False
        self.stats = {"built": 0, "hits": 0, "graphs": 0, "replays": 0, "captured": 0, "round_us": 0.0,
                      "p2p_built": 0, "p2p_hits": 0, "native_calls": 0,
                      "native_late": 0}
        self._pool = None
        self._cap = None            # the capture stream and two side streams (reductions)
        self._anchor = None
        self._sides = None
        self._ev_start = 0
        self._ev_ring: list[int] = []
        self._ev_next = 0
        self._dev_index = device.index if cuda else -1
        # the native repeated call (native_rounds.FastCalls): False until its first use, None
        # where it is off or did not build (CallPath.native_calls)
        self.fast = False
        if cuda and self.enabled:
            self.streams()          # made now: not inside a user's capture

    # the word and the round ----------------------------------------------------------------
    def word_base(self, op: str, desc: dict, inp, outs, lanes: list[str], shares: dict[str, float],
                  calib: str, capturing: bool) -> int:
        """This rank's facts of the call but the input's allocation, hashed (within this process).
        Not the balancer's version: a move shows in the shares of its own bucket's calls, and an
        entry of another shape stays good (with the version in every word, each move built every
        shape anew)."""
        facts = [op, tuple(desc.items()), tuple(lanes), tuple(shares.items()), calib, self.epoch, capturing,
                 -1 if inp is None else inp.numel(), tuple(o.numel() for o in outs)]
        if self.cuda and ("ce" in lanes or "host" in lanes):   # programs read and write these buffers in place
            facts += [inp.data_ptr() if inp is not None else 0, tuple(o.data_ptr() for o in outs)]
        try:
            return hash(tuple(facts))
        except TypeError:                    # a descriptor value that is not hashable
            return hash(repr(facts))

    def finish_word(self, base: int, inp, lanes) -> int:
        """The word: the base and, where peers map the input, the id of its allocation."""
        if self.cuda and "ce" in lanes and inp is not None and inp.numel():
            return mix_word(base, _cuda.buffer_id(inp.data_ptr()))
        return base & MASK63

    @staticmethod
    def obs_values(obs) -> list[int]:
        """The previous split call's observation as fixed-width values: a key that is the same
        on every rank for the same bucket and shares (a stable hash), then lane times in 0.1 us."""
        if obs is None or any(k not in OBS_LANES for k in obs[1]):
            return list(NO_OBS)
        key = zlib.crc32(repr((obs[0], sorted(obs[1].items()))).encode()) + 1
        return [key] + [max(0, int(round(obs[2].get(k, 0.0) * 10))) for k in OBS_LANES]

    @staticmethod
    def agreed_obs(obs, got: list[list[int]]):
        """(bucket, shares used, slowest rank's lane times) when every rank reported the same
        observation as this one, else None."""
        if obs is None or not got or got[0][1] == 0 or any(g[1] != got[0][1] for g in got):
            return None
        times = {k: max(g[2 + i] for g in got) / 10.0 for i, k in enumerate(OBS_LANES) if k in obs[1]}
        bkey = (obs[0][0], obs[0][1], tuple(obs[0][2]))
        return bkey, obs[1], times

    # the cache -------------------------------------------------------------------------------
    def get(self, key: tuple) -> Entry | None:
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
            self.stats["hits"] += 1
        return entry

    def put(self, key: tuple, entry: Entry) -> None:
        self.entries[key] = entry
        self.stats["built"] += 1
        while len(self.entries) > self.max_entries:
            self.entries.popitem(last=False)

    def clear(self) -> None:
        """Forget every entry (a new calibration, fixed shares, close): the next call of any
        shape agrees and builds again. The epoch in every word makes stale keys unreachable."""
        self.epoch += 1
        self.entries.clear()
        self.tickets.clear()

    def ticket(self, tkey, base: int, bal: int, key: tuple, entry: Entry, op: str, ledger: tuple, lanes) -> None:
        if len(self.tickets) >= self.max_entries:
            self.tickets.clear()
        self.tickets[tkey] = Ticket(base, bal, key, entry, op, ledger, lanes)

    # GPU programs ---------------------------------------------------------------------------------
    def streams(self):
        """(capture stream, (reduce stream, gather stream)), made once."""
        if self._cap is None:
            self._cap = lane_stream(self.device)
            self._sides = (lane_stream(self.device), lane_stream(self.device))
            self._pool = torch.cuda.graph_pool_handle()
            # torch frees a graph pool when its last graph goes, and a later capture into the same
            # handle then fails: a one-node graph held for the communicator's life keeps it
            self._anchor = torch.cuda.CUDAGraph()
            with torch.cuda.stream(self._cap):
                self._anchor.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                torch.zeros(1, device=self.device)
                self._anchor.capture_end()
            self._ev_start = _cuda.event_create()
            self._ev_ring = [_cuda.event_create() for _ in range(EVENT_RING)]
            if envs.get("BRAID_WARM"):
                self._warm()
        return self._cap, self._sides

    def _warm(self) -> None:
        """Pay the process's first-use costs of a captured program now, not in the first split
        call: one small graph with what a program holds (a copy, a batch of flag operations on
        the side streams, the sum kernels of float32 and bfloat16 that a reduction of this world
        size runs) captured, instantiated and replayed once. Kernels load on their first launch
        (CUDA's lazy loading); inside the first call's capture that cost 13-16 ms of its 22-48
        (4 ranks sharing one H200, 2026-11-26). A failure here only logs: the calls still work,
        their first call is slower."""
        from ..collectives.reduce import reduce_pair, reduce_slots
        t0 = time.perf_counter()
        cap, (rs, gs) = self._cap, self._sides
        try:
            flag = torch.zeros(4, dtype=torch.int32, device=self.device)
            bufs = [torch.ones((2, 4096), dtype=dt, device=self.device) for dt in (torch.float32, torch.bfloat16)]
            outs = [torch.empty(4096, dtype=b.dtype, device=self.device) for b in bufs]
            copy = torch.empty_like(bufs[0])
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(cap):
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    start = torch.cuda.Event()
                    start.record(cap)
                    for s in (rs, gs):
                        s.wait_event(start)
                    _cuda.memcpy_async(copy.data_ptr(), bufs[0].data_ptr(), bufs[0].nbytes, gs.cuda_stream)
                    _cuda.memops(gs.cuda_stream, [(False, flag.data_ptr(), 1), (True, flag.data_ptr(), 1),
                                                  (False, flag.data_ptr(), 0)])
                    with torch.cuda.stream(rs):
                        for b, o in zip(bufs, outs):
                            if self.world_size == 2:
                                reduce_pair(b[0], b[1], "sum", o)
                            # the staged reduction's kernel (the host lane's share) at any world size
                            reduce_slots(b, 2, "sum", o)
                    for s in (rs, gs):
                        ev = torch.cuda.Event()
                        ev.record(s)
                        cap.wait_event(ev)
                finally:
                    graph.capture_end()
            graph.replay()
            cap.synchronize()
            ok = bool(torch.equal(outs[0], torch.full_like(outs[0], 2.0)))
            if not ok:
                log.warning("braid: the warm-up graph gave a wrong sum; calls are unaffected")
        except Exception as e:      # noqa: BLE001 (a warm-up never stops the communicator)
            log.warning("braid: the warm-up of captured programs failed (%s); first split calls "
                        "will be slower", e)
        self.stats["warm_ms"] = (time.perf_counter() - t0) * 1e3

    def capture(self, entry: Entry, emit) -> None:
        """Capture `emit(stream, sides, keep)` (the call's GPU work with Flags signals, started
        on `stream`, joined back into it) as the entry's CUDA graph. Every entry shares one
        memory pool: their replays run one after another on one stream, so a temporary of one
        graph never meets another's."""
        cap, sides = self.streams()
        graph = torch.cuda.CUDAGraph()
        keep: list = []
        with torch.cuda.stream(cap):
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                emit(cap, sides, keep)
            finally:
                graph.capture_end()
        # events stay with the graph; scratch tensors go back to the shared pool, where the
        # next capture may reuse them (replays never overlap: one stream)
        entry.graph, entry.keep = graph, [k for k in keep if not isinstance(k, torch.Tensor)]
        raw = getattr(graph, "raw_cuda_graph_exec", None)
        entry.exec_ptr = int(raw()) if raw is not None else 0
        self.stats["graphs"] += 1

    def launch(self, entry: Entry, stream, async_op: bool, tensors: tuple):
        """One replay. Synchronous, with nothing of braid's left unjoined: on the caller's
        stream itself (one driver call). Otherwise on `stream` (the ce lane's: after its earlier
        work) once the caller's current stream reached this call; the caller's stream waits for
        its end unless async."""
        dev = self._dev_index
        caller = _RAW(dev)
        if not async_op and not self.dirty and entry.exec_ptr:
            _cuda.graph_launch(entry.exec_ptr, caller)
            self.stats["replays"] += 1
            return entry.done
        self.fork(stream, caller)
        if entry.exec_ptr:
            _cuda.graph_launch(entry.exec_ptr, stream.cuda_stream)
        else:                       # a torch without the raw handle: replay on the lane stream
            with torch.cuda.stream(stream):
                entry.graph.replay()
        self.stats["replays"] += 1
        return self.join(caller, stream, async_op, tensors, entry.plan, entry.done)

    def fork(self, stream, caller: int | None = None) -> int:
        """`stream` (a lane's) waits for the caller's current stream to reach this call; returns
        the caller's stream (raw)."""
        if caller is None:
            caller = _RAW(self._dev_index)
        _cuda.event_record(self._ev_start, caller)
        _cuda.stream_wait_event(stream.cuda_stream, self._ev_start)
        return caller

    def fork_event(self) -> int:
        """The event the caller's stream records for a lane stream to wait on (fork)."""
        self.streams()
        return self._ev_start

    def end_event(self) -> int:
        """The next end event of the ring (reused in turn)."""
        end = self._ev_ring[self._ev_next]
        self._ev_next = (self._ev_next + 1) % EVENT_RING
        return end

    def join(self, caller: int, stream, async_op: bool, tensors: tuple, plan=None, done=None):
        """The end of a call posted on `stream` after fork(): synchronous, the caller's stream
        waits for it; async, a handle whose wait() does that."""
        end = self.end_event()
        _cuda.event_record(end, stream.cuda_stream)
        if not async_op:
            _cuda.stream_wait_event(caller, end)
        return self.joined(async_op, end, stream, tensors, plan, done)

    def joined(self, async_op: bool, end: int, stream, tensors: tuple, plan=None, done=None):
        """After the end event of a forked call was recorded on `stream` (and, synchronous, the
        caller's stream made to wait for it): the handle, and what braid's streams now owe."""
        if not async_op:
            self.dirty = False          # the caller's stream is now after everything braid posted
            return done if done is not None else _DONE
        self.dirty = True
        sweep()
        return PreparedHandle(end, plan, tensors, self._dev_index, stream)

    def close(self) -> None:
        if self.fast:
            self.fast.close()
        self.fast = None
        self.entries.clear()
        for ev in ([self._ev_start] if self._ev_start else []) + self._ev_ring:
            try:
                _cuda.event_destroy(ev)
            except LaneFailureError as exc:
                log.debug("braid: destroying an event failed: %s", exc)
        self._ev_start, self._ev_ring = 0, []
        self._cap = self._sides = self._pool = self._anchor = None


# NCCL connects a pair of ranks for a kind of call at that call's first run (cudaMalloc among it),
# which a capture forbids: a first NCCL call of its kind inside a user's capture breaks the graph
# (one H200 shared by 2 ranks, NCCL 2.28: "operation not permitted when stream is capturing"). So
# the way to capture a call on NCCL is NCCL's own: run it once before.
ON_NCCL = ("Capture it on NCCL: make the same call once outside the captured region under "
           "comm.fixed_shares({'nccl': 1.0}) (NCCL connects the ranks at a call's first run, which cannot "
           "happen inside a capture), then capture it under the same setting; or take it out of the "
           "captured region.")


def posted_not_capturable(op: str, shares: dict[str, float], how: str) -> MisuseError:
    """A call that posts its lanes call by call, inside a user's CUDA graph capture: its signals
    are counters that rise from call to call, which a captured graph would freeze (its second
    replay would pass its waits before the peers are ready), so it is refused at capture time.
    `how`: "routed" (the router's plan), "plan" (run_plan), "uneven" (the copy engines' uneven
    all_to_all) or "full" (a split on the full path)."""
    what = {"routed": "planned by the router (a skewed all_to_all)",
            "plan": f"a plan over lanes {sorted(shares)}",
            "uneven": "an uneven all_to_all on the copy engines, posted call by call",
            }.get(how, f"split over lanes {sorted(shares)} on the full path (an uneven all_to_all, or a "
                       f"call whose descriptors every call exchanges)")
    even = " (an all_to_all whose split sizes are all equal can)" if op == "all_to_all_single" else ""
    way = "Run it outside the captured region." if how == "plan" else ON_NCCL
    return MisuseError(f"{op}: this call is {what}, which cannot be captured in a CUDA graph{even}. {way}")


def not_capturable(op: str, shares: dict[str, float]) -> MisuseError:
    if ce_alone(shares):        # the copy engines alone, on a path that is not one program
        return MisuseError(
            f"{op}: this call takes the copy engines' staged path (a reduce of fewer elements than ranks "
            f"does), which cannot be captured in a CUDA graph. {ON_NCCL}")
    return MisuseError(
        f"{op}: this call is split over lanes {sorted(shares)}, which cannot be captured in a CUDA graph "
        f"(NCCL's whole call, the copy engines, the host lane and, in an all_reduce, NCCL's share beside "
        f"them can). Capture it with the copy engines "
        f"alone (comm.fixed_shares({{'ce': 1.0}}) around the capture, or BRAID_LANES=nccl,ce) or take "
        f"it out of the captured region.")
