"""Deferred prepared calls: the round of words and the launch leave the caller's thread.

A prepared call that replays a CUDA graph (comm/prepared.py) costs the caller one round of words
between ranks, and the rank whose CPU reaches the call first waits there for the last. Back to
back that wait is 6-12 us; inside training steps the ranks' CPUs drift apart, and it was 58 us a
call in DDP, 246 with 256 MB buckets and 88-446 in FSDP2 (2 x H200, 2026-11-26), while NCCL's own
call returns at once and lets the GPU wait. Here the caller only posts its word and leaves the
rest to a thread of the communicator:

    caller (a call whose shape last replayed a graph, comm/callpath.py CallPath.fast_prepared):
        post the word (the round's slot)
        record a start event on the caller's stream
        synchronous: the caller's stream waits until end >= n (a stream memory wait);
        asynchronous: the handle's wait() puts that wait on the waiter's stream
        queue job n, return
    rounds thread, jobs in call order:
        read the round (every rank's word), as the caller would have
        hit:  the lane stream waits for the start event; graph launch; end = n (stream write)
        miss: the op's full path, on the thread, in a stream that waits for the start event
              and the lane stream; its exchanges go through the segment's second channel
              (every rank misses the same job: they read the same words); end = n after it

`end` is a counter of the node segment, so an abort (which pushes every counter ahead) releases a
stream that waits on it. Every other braid call of the communicator first lets the queue drain
(Rounds.drain): the rounds of words are one sequence per rank, the copy engines' stream must see
programs in the same order on every rank, and the prepared-call cache must not change under the
thread. The caller counts its calls in the ledger when it makes them, in call order; the thread
only reads rounds. At most DEFER_DEPTH jobs wait at once (the node segment's slots allow that
many unread rounds); a caller that gets ahead waits for the thread.

The thread must not hold the interpreter lock while it waits for a peer: it polls the peers'
posts between short sleeps before the segment's own wait (sleeps of 0.5 ms, with its timeout and
abort checks). It needs the lock to read a round and launch, and while the caller's thread runs
Python without a break it gets the lock only at the interpreter's switch interval: on the 2-core
container a thread waking from a sleep waited 5.2 ms (median) for it beside a pure-Python loop, 0.4
ms at a 200 us interval, 0.3 ms at 100 us, while the loop ran up to a third slower as long as the
thread polled (2026-11-26, scripts/probes/lock_handoff.py). So the first such communicator lowers
the interval (BRAID_DEFER_SWITCH_US, 200 us).

The native launcher (comm/native_rounds.py, `_rounds.c`, BRAID_DEFER_NATIVE): a thread in C, in
front of the Python one, waits for each round, compares the words with those the program was built
for and launches, never taking the interpreter lock; a round it cannot decide (a word that differs,
a peer later than HANDOFF_S, a driver error) it hands to the Python thread, which runs that job as
above while the native thread waits. What the native thread ran is booked (out of the queue, the
cache's order of use, the counts) by the caller when it waits for room or drains the queue, so a
call back to back needs no switch of the interpreter lock. Without a C compiler the Python thread
does everything.

Rejected: launching at the caller's next braid call instead of on a thread (a caller that next
synchronizes its stream would wait forever), and each rank launching on its own word and checking
the peers' afterwards (a peer's buffer reallocated at the same address would be read through a
stale mapping before anyone noticed).
"""
from __future__ import annotations

import collections
import logging
import sys
import threading
import time
import weakref

import torch

from .. import envs
from ..errors import BraidError, LaneFailureError, PeerMismatchError
from ..executor import Handle
from ..lanes import _cuda
from ..node import COLL_MBOX_BYTES, COLL_SLOTS, DEFER_DEPTH
from .prepared import _RAW, NO_OBS

log = logging.getLogger("braid")

HANDOFF_S = 0.05        # the native launcher hands a round back to Python after waiting this long
POLL_S = 0.002          # the thread polls a round this long, in short sleeps, before the segment's wait
NAP_S = 20e-6           # one short sleep (the kernel makes it ~60-80 us)
EVENTS = 4 * DEFER_DEPTH   # start events, used in turn (more than can be queued at once)


class Job:
    __slots__ = ("token", "word", "ticket", "start", "n", "tensors", "redo", "calls", "op", "t0")

    def __init__(self, token, word, ticket, start, n, tensors, redo, calls, op):
        self.token, self.word, self.ticket, self.start, self.n = token, word, ticket, start, n
        self.tensors, self.redo, self.calls, self.op = tensors, redo, calls, op
        self.t0 = time.perf_counter()


class DeferredHandle(Handle):
    """An asynchronous deferred call: wait() makes the waiter's current stream wait until the
    call's end (no CPU block); an error the rounds thread met is raised there."""

    def __init__(self, rounds: "Rounds", n: int, tensors: tuple, plan, device_index: int):
        super().__init__(plan=plan)
        self._rounds, self._n, self.keep, self._dev = rounds, n, tensors, device_index

    def wait(self, timeout=None) -> bool:
        if not self._waited:
            self._waited = True
            self._rounds.raise_error()
            self._rounds.stream_wait(_RAW(self._dev), self._n)
            self.keep = ()
        return True

    def end_test(self):
        rounds, n = self._rounds, self._n
        return lambda: rounds.reached(n)

    def is_completed(self) -> bool:
        return self._rounds.reached(self._n)

    def lane_times_us(self) -> dict[str, float]:
        return {}


class Rounds:
    """The communicator's queue of deferred calls and the thread that runs it."""

    def __init__(self, comm, fns: dict | None = None):
        """`fns`: the driver functions the native launcher calls (tests pass their own)."""
        self._comm = weakref.ref(comm)       # the thread must not keep the communicator alive
        self.segment = comm.segment
        self.rank = comm.rank
        self.end_off = comm.layout.counter("defer_end", comm.rank)
        self.end_addr = comm.seg_dev_ptr + self.end_off
        self.n = self.segment.get(self.end_off)     # the last job's number (counts from the counter)
        self.lane_stream = comm._lanes["ce"].stream.cuda_stream
        self.device = comm.device
        self.queue: collections.deque = collections.deque()
        self.cv = threading.Condition()
        self.error: BaseException | None = None
        self.missing = False        # the thread is running a job's full path (a miss)
        self.reading = 0            # the ledger's count of the call whose round the thread reads
        self.ident = 0
        # in the prepared calls' counts (the bench prints them): calls deferred, rebuilt by the
        # thread, and the thread's time from a call's post to its launch
        self.stats = comm._prepared.stats
        self.stats.update(deferred=0, rebuilt=0, launch_us=0.0)
        self._thread = None
        self._stop = False
        self._starts = [_cuda.event_create() for _ in range(EVENTS)]
        self._next = 0
        self._tail = _cuda.event_create()
        self._redo_stream = torch.cuda.Stream(device=self.device)
        self._native = None          # the native launcher (comm/native_rounds.py), if it builds
        self._pushed = 0             # jobs pushed to it
        self._seen = 0               # ... of which booked here (taken out of the queue)
        self._native_ns = 0          # its summed push-to-launch time, as far as booked
        if envs.get("BRAID_DEFER_NATIVE"):
            self._native = _launcher(self, comm, fns)
        switch = envs.get("BRAID_DEFER_SWITCH_US") / 1e6
        if switch > 0 and sys.getswitchinterval() > switch:
            log.info("braid: the interpreter's switch interval %.0f -> %.0f us (BRAID_DEFER_SWITCH_US)",
                     sys.getswitchinterval() * 1e6, switch * 1e6)
            sys.setswitchinterval(switch)

    # the caller's side --------------------------------------------------------------------------
    def room(self) -> None:
        """Before a post: wait until fewer than DEFER_DEPTH jobs are queued and no miss is being
        run; raise the thread's error if it met one."""
        self.raise_error()
        if len(self.queue) < DEFER_DEPTH and not self.missing:
            return
        self._settle(lambda: len(self.queue) >= DEFER_DEPTH or self.missing)
        self.raise_error()

    def _settle(self, busy) -> None:
        """Wait while busy() and no error. The jobs the native launcher finished are booked by
        the waiting caller itself (polled without the interpreter lock): handing them to the
        Python thread cost the caller a switch of the lock per call. A job handed back to Python,
        and a miss, are the Python thread's; its progress wakes this wait."""
        while self.error is None and busy():
            nat = self._native
            if nat is not None and not self.missing:
                done, why, _, ns = nat.poll(self._seen, 0.05)
                self._booked(done, ns)
                if not why:
                    continue
            with self.cv:
                if self.error is None and busy():
                    self.cv.wait(0.05)

    def start_event(self, caller: int) -> int:
        ev = self._starts[self._next]
        self._next = (self._next + 1) % EVENTS
        _cuda.event_record(ev, caller)
        return ev

    def push(self, job: Job, expect=None) -> None:
        """Queue `job`; `expect`: every rank's word its program was built for (the native
        launcher launches when the round holds exactly these; None: the entry is not the cache's
        any more, the thread in Python decides)."""
        with self.cv:
            if self.error is not None:
                raise self.error
            self.queue.append(job)
            self.stats["deferred"] += 1
            if self._native is not None:
                tk = job.ticket
                words = expect if expect is not None else (0,) * len(tk.key)
                if not self._native.push(job.token[0], job.token[0] % COLL_SLOTS, job.n, words, job.start,
                                         tk.entry.exec_ptr):
                    self.queue.pop()
                    raise LaneFailureError("braid: the native launcher's queue is full")
                self._pushed += 1
            if self._thread is None:
                run = _run_native if self._native is not None else _run
                self._thread = threading.Thread(target=run, args=(weakref.ref(self),), name="braid-rounds",
                                                daemon=True)
                self._thread.start()
            self.cv.notify_all()

    def next_number(self) -> int:
        self.n = (self.n + 1) & 0xFFFFFFFF
        return self.n

    def stream_wait(self, stream: int, n: int) -> None:
        _cuda.wait_value(stream, self.end_addr, n)

    def reached(self, n: int) -> bool:
        if self.error is not None:
            return True
        return ((self.segment.get(self.end_off) - n) & 0xFFFFFFFF) < 0x80000000

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def drain(self, raising: bool = True) -> None:
        """Wait until every queued job ran (not from the thread itself); raise its error."""
        if threading.get_ident() == self.ident:
            return
        if self.queue:
            self._settle(lambda: bool(self.queue))
        if raising:
            self.raise_error()

    def close(self) -> None:
        """Stop the thread once the queue drained (or failed); free the events."""
        try:
            self.drain()
        except BraidError:
            pass
        with self.cv:
            self._stop = True
            self.cv.notify_all()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=2.0)
        if self._native is not None:
            self._native.close()
            self._native = None
        for ev in self._starts + [self._tail]:
            try:
                _cuda.event_destroy(ev)
            except LaneFailureError:
                pass
        self._starts, self._tail = [], 0

    # the thread's side --------------------------------------------------------------------------
    def _run_one(self, job: Job) -> bool:
        """Run the job at the queue's head in Python and take it out; False when it failed (the
        error is kept for the caller, every queued job released)."""
        try:
            self._do(job)
        except BaseException as exc:    # noqa: BLE001  raised to the caller at its next call
            log.debug("braid: a deferred call failed: %s", exc)
            self._fail(exc)
            return False
        with self.cv:
            if self.queue:
                self.queue.popleft()
            self.cv.notify_all()
        return True

    def _booked(self, done: int, launch_ns: int) -> None:
        """The native launcher has finished `done` jobs (their push-to-launch times summing to
        `launch_ns`): those not booked yet leave the queue, with what the Python path would have
        recorded (the cache's order of use, which every rank keeps alike, and the counts). Either
        thread may book; each job once, in order."""
        comm = self._comm()
        prep = comm._prepared if comm is not None else None
        with self.cv:
            k = done - self._seen
            if k <= 0:
                return
            for _ in range(min(k, len(self.queue))):
                job = self.queue.popleft()
                if prep is not None:
                    prep.get(job.ticket.key)
                    prep.stats["replays"] += 1
                self.stats["native"] = self.stats.get("native", 0) + 1
            self._seen = done
            self.stats["launch_us"] += (launch_ns - self._native_ns) / 1e3
            self._native_ns = launch_ns
            self.cv.notify_all()

    def _fail(self, exc: BaseException) -> None:
        """The thread met an error: every queued call ends (its stream waits are released, its
        data is not moved) and every later call of the communicator raises `exc`."""
        comm = self._comm()
        if comm is not None and isinstance(exc, BraidError):
            comm._faults.give_up(exc)
        with self.cv:           # no push after this (push checks the error under the same lock)
            if self._native is not None:
                self._native.clear()
                self._seen = self._pushed
            # in this order, for callers that read without the lock (_settle, drain, room): one
            # that sees the error finds the counter released, one that sees the queue empty (or
            # no miss running) finds the error
            self.release()
            self.error = exc
            self.queue.clear()
            self.missing = False
            self.cv.notify_all()

    def release(self) -> None:
        """End every job pushed so far: now from the CPU (the lane stream may be stuck behind a
        dead peer's flags until the abort releases them), and after the lane stream's own work,
        so that the counter ends at the last job's number whatever that stream writes meanwhile."""
        try:
            self.segment.set(self.end_off, self.n)
            _cuda.write_value(self.lane_stream, self.end_addr, self.n)
        except Exception as exc:     # noqa: BLE001  the segment may be closed already
            log.debug("braid: releasing deferred calls: %s", exc)

    def _await(self, token, what: str):
        seg = self.segment
        if not seg.posted(token):
            t_end = time.perf_counter() + POLL_S
            while time.perf_counter() < t_end and not seg.posted(token):
                time.sleep(NAP_S)
        return seg.read_values(token, what, spin_s=0.0)

    def _do(self, job: Job) -> None:
        comm = self._comm()
        if comm is None or comm.closed or comm.aborted:
            raise LaneFailureError("the braid communicator was closed or aborted with calls still queued")
        self.reading = job.calls
        try:
            got = self._await(job.token, job.op)
        except PeerMismatchError:
            self.segment.raise_if_peer_aborted()    # a peer's abort pushed the counters: its cause
            raise
        self.segment.raise_if_peer_aborted()        # an abort pushed the counters: nothing was posted
        if comm.aborted:
            raise LaneFailureError(f"this braid communicator was aborted ({comm.aborted}) with calls still queued")
        tk = job.ticket
        prep = comm._prepared
        if (len(got) == len(tk.key) and all(g[0] == k for g, k in zip(got, tk.key))
                and prep.get(tk.key) is tk.entry and tk.entry.exec_ptr):
            ls = self.lane_stream
            _cuda.stream_wait_event(ls, job.start)
            _cuda.graph_launch(tk.entry.exec_ptr, ls)
            _cuda.write_value(ls, self.end_addr, job.n)
            prep.stats["replays"] += 1
            self.stats["launch_us"] += (time.perf_counter() - job.t0) * 1e6
            return
        # a miss: some rank's word changed (a buffer reallocated, say). Every rank read the same
        # words, so every rank's thread is here for this job and runs the op's full path from them
        self.stats["rebuilt"] += 1
        with self.cv:
            self.missing = True
            if self._native is not None:
                # the rebuild may evict entries that later queued jobs were pushed for: those are
                # decided here again, against the cache as it will then be (as every rank decides)
                self._native.handback()
        try:
            rs = self._redo_stream
            _cuda.stream_wait_event(rs.cuda_stream, job.start)
            _cuda.event_record(self._tail, self.lane_stream)
            _cuda.stream_wait_event(rs.cuda_stream, self._tail)
            comm._calls.round = (job.word, got)
            comm.shortcuts.redo_thread = self.ident
            try:
                with torch.cuda.stream(rs):
                    job.redo()
            finally:
                comm.shortcuts.redo_thread = 0
                comm._calls.round = None
                comm._prepared.dirty = True     # the rebuild's own stream bookkeeping is not the caller's
            _cuda.event_record(self._tail, rs.cuda_stream)
            _cuda.stream_wait_event(self.lane_stream, self._tail)
            _cuda.write_value(self.lane_stream, self.end_addr, job.n)
        finally:
            with self.cv:
                self.missing = False
                self.cv.notify_all()


def _launcher(rd: "Rounds", comm, fns):
    """The native launcher of `rd` (comm/native_rounds.py), or None where it does not build."""
    from . import native_rounds
    lib = native_rounds.build()
    if lib is None:
        return None
    seg = rd.segment
    try:
        fns = fns if fns is not None else _cuda.native_fns()
        return native_rounds.Launcher(
            lib, comm.world_size, comm.rank, COLL_SLOTS, 1 + len(NO_OBS), COLL_MBOX_BYTES,
            [seg.address + c for c in seg._coll_ctr], [seg.address + s[0] for s in seg._coll_slots],
            rd.lane_stream, fns.get("ctx", 0), rd.end_addr, fns, HANDOFF_S)
    except (OSError, LaneFailureError) as exc:
        log.info("braid: the native launcher of deferred calls did not start (%s)", exc)
        return None


def _started(ref) -> bool:
    """A rounds thread's start: it keeps its id and takes the communicator's device; False when
    the Rounds is gone already."""
    me = ref()
    if me is None:
        return False
    me.ident = threading.get_ident()
    torch.cuda.set_device(me.device)
    return True


def _run_native(ref) -> None:
    """The rounds thread beside the native launcher: it runs in Python each job handed back (a
    word that differs, a late peer, a driver error), until the communicator closes. The jobs the
    launcher finished are booked by the caller when it waits for room or drains
    (`Rounds._settle`), and here before a handed-back job."""
    if not _started(ref):
        return
    while True:
        me = ref()
        if me is None or me._native is None:
            return
        if me._stop and not me.queue:
            return
        done, why, rc, ns = me._native.poll(None, 0.05)     # without the interpreter lock
        if why:
            me._booked(done, ns)        # the jobs before the one handed back
            with me.cv:
                job = me.queue[0] if me.queue else None
            if job is None:             # nothing of ours left (cleared after an error)
                me._native.resume()
            else:
                if why == 3:
                    log.debug("braid: the native launcher met driver error %d; launching from Python", rc)
                ok = me._run_one(job)
                job = None
                if not ok:
                    continue
                with me.cv:
                    me._seen += 1       # before the launcher counts it: no one books it twice
                me._native.resume()
        del me


def _run(ref) -> None:
    """The rounds thread: jobs in call order until the communicator closes."""
    if not _started(ref):
        return
    while True:
        me = ref()
        if me is None:
            return
        with me.cv:
            while not me.queue and not me._stop and me._comm() is not None:
                me.cv.wait(1.0)
            if not me.queue:
                return              # closed, or the communicator was collected without close()
            job = me.queue[0]
        me._run_one(job)
        job = None
        del me

