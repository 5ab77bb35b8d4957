"""The fast path of a repeated call, in one place: a call the native library takes whole (NCCL on
GPUs, gloo on a CPU communicator) goes straight to it (`native_fast`); a split call whose shape last
replayed a prepared graph posts its word, reads the round and launches (`fast_prepared`, with the
word, post, round and launch in one native call where that built: `native_replay`). Whether a
shape is whole or split is the shortcuts' answer (comm/shortcuts.py), asked by the op's own entry
on the communicator; anything these decline takes the op's full path (comm/exchange.py).
"""
from __future__ import annotations

import datetime
import logging
import time

import torch
import torch.distributed as dist

from .. import envs
from ..collectives.reduce import REDUCE_DTYPES
from ..errors import BraidError, BraidTimeoutError, LaneFailureError, MisuseError, PeerMismatchError
from ..executor import Handle, sweep
from ..lanes import _cuda
from ..node import COLL_MBOX_BYTES, COLL_SLOTS
from . import native_rounds
from .prepared import _RAW, NO_OBS, _capturing
from .rounds import DeferredHandle, Job

log = logging.getLogger("braid")

GLOO_WAIT_STEP = datetime.timedelta(milliseconds=50)   # how often a wait inside gloo looks for aborts


NATIVE_SHARE_REDS = ("sum", "avg", "min", "max", "product")   # NCCL's own all_reduce may take a share

_RED_T = type(dist.ReduceOp.SUM)    # plain reduce ops (premul-sum comes as another type); singletons

_FAST_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT)


def fast_reduce_ok(op, dtype, cuda: bool) -> bool:
    """The native library's reduction may take the call as is: a plain ReduceOp on a
    reducible dtype (avg: NCCL only, which averages integers as braid does)."""
    if dtype not in REDUCE_DTYPES or type(op) is not type(dist.ReduceOp.SUM):
        return False
    if op in _FAST_OPS:
        return True
    return op == dist.ReduceOp.AVG and cuda   # gloo has no AVG


class CallPath:
    """The fast path's part of a communicator. It owns `round`: a prepared call's round that the
    fast path read and missed (a peer's word differed), handed to the full path, which goes on from
    it (Exchange.run_prepared; the rounds thread sets it for its rebuilds). Its collaborators:
    the node segment, the call ledger (counts, the last call and its handle), the native
    library's calls, the split policy, the prepared calls and their deferred rounds (or None),
    the shortcuts, the faults part (closed, aborted, broken, give_up), the queue of pending
    sends/recvs (comm/p2p.py), the copy-engine lane (or None) and the whole CPU calls."""

    def __init__(self, rank: int, world_size: int, cuda: bool, device: torch.device, segment, ledger, library,
                 policy, prepared, rounds, shortcuts, faults, pending, ce_lane, cpu):
        self.rank, self.world_size, self.cuda, self.device, self.segment = rank, world_size, cuda, device, segment
        self.ledger, self.library, self.policy, self.prepared = ledger, library, policy, prepared
        self.rounds, self.shortcuts, self.faults, self.pending = rounds, shortcuts, faults, pending
        self.ce, self.cpu = ce_lane, cpu
        self.round = None       # a prepared call's round already posted by the fast path

    def device_for(self, t) -> torch.device:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            if not self.cuda:
                raise MisuseError("CUDA tensor passed, but this communicator has no GPU lanes "
                                  "(initialise torch.distributed with the 'nccl' backend)")
            return self.device
        return torch.device("cpu")

    def fast_ok(self, *tensors) -> bool:
        """Cheap checks for the fast path: CUDA tensors on our device, contiguous. Anything else
        takes the full path, which validates and explains."""
        if not self.cuda or self.faults.closed:
            return False
        idx = self.device.index
        for t in tensors:
            if type(t) is not torch.Tensor or not t.is_cuda or t.get_device() != idx or not t.is_contiguous():
                return False
        return True

    # whole, through the native library ----------------------------------------------------------
    def native_fast(self, method: str, args: tuple, kind: str, async_op: bool, op=None, root: int = 0,
                    fallback=None, counted: bool = False):
        """The fast path's call, whole, through the native library (comm/library.py), waited here
        when synchronous (a CPU communicator's gloo call in steps that see a peer's abort)."""
        lib = self.library
        if lib.backend is None and self.pending and not self.cuda:   # as the full path does before a collective
            self.pending.flush()
        work = lib.start(method, args, kind, async_op, op, root, fallback, counted)
        if async_op:
            return self.finish(work, True)
        if work is not None:
            if self.cuda:
                work.wait()
            else:
                self.wait_gloo(work)
        self.ledger.last_handle = lib.done
        return None

    def finish(self, work, async_op: bool):
        handle = Handle(native=work)
        handle.native_lane = "nccl" if self.cuda else "gloo"
        if not self.cuda:
            handle.waiter = self.wait_gloo
        self.ledger.last_handle = handle
        if async_op:
            return handle
        handle.wait()
        return None

    def wait_gloo(self, work) -> None:
        """Wait for a call on braid's gloo group in steps of GLOO_WAIT_STEP_S, between which a
        peer's abort (it raised and marked the node segment) or a dead peer ends the wait with a
        braid error. gloo has no abort: a rank blocked inside its call stayed there until the peer's
        process ended (or gloo's own timeout of 30 minutes), and then raised gloo's own error. The
        gloo call itself stays queued; the communicator is broken from then on."""
        seg = self.segment
        if seg is None or seg.closed:
            work.wait()
            return
        deadline = time.monotonic() + envs.get("BRAID_TIMEOUT_S")
        p2p = self.cpu.p2p
        watchdog = self.faults.watchdog
        while True:
            if p2p is not None and p2p.pending:
                p2p.progress()          # a peer may wait in a recv for this rank's pending send
            try:
                work.wait(GLOO_WAIT_STEP)
                return
            except RuntimeError as exc:
                if "timed out" not in str(exc).lower():
                    # a peer that raised marked the segment before its exit closed gloo's
                    # connections: its error says what went wrong, gloo's only that it left
                    try:
                        seg.raise_if_peer_aborted()
                    except BraidError as peer:
                        raise peer from exc
                    raise LaneFailureError(f"gloo failed on rank {self.rank}: {exc}") from exc
            seg.raise_if_peer_aborted()
            if watchdog is not None and watchdog.failed:
                raise LaneFailureError(f"braid communicator is broken: {watchdog.failed}")
            if time.monotonic() > deadline:
                raise BraidTimeoutError(
                    f"rank {self.rank} waited {envs.get('BRAID_TIMEOUT_S'):.0f} s inside gloo's own "
                    f"{self.ledger.last_call[0]} for its peers: {self.ledger.mine()}. "
                    f"Check that every rank makes the same calls in the same order (BRAID_TIMEOUT_S to change the limit).")

    # split, a prepared call replayed (comm/prepared.py) ----------------------------------------------
    def fast_prepared(self, tkey, inp, outs: tuple, async_op: bool, redo=None):
        """A call whose shape last replayed a graph (a Ticket under the op's own arguments):
        the round of words and the launch, nothing else; with a rounds thread (comm/rounds.py)
        only the post of this rank's word, the rest on that thread. None: not this way (the
        caller takes the full path; after a round that missed, that path goes on from this
        round). `redo()`: the op's own call with the same arguments (the thread's full path)."""
        prep = self.prepared
        tk = self._ticket(tkey)
        rd = self.rounds
        faults = self.faults
        if tk is None or ((rd is not None or not prep.fast) and _capturing()):   # (else the native call checks)
            return None
        if rd is not None and redo is not None and tk.entry.exec_ptr:
            if self.shortcuts.rebuilding():     # the rounds thread's own rebuild: the full path
                return None
            return self.deferred(rd, prep, tk, inp, outs, async_op, redo)
        seg = self.segment
        ledger = self.ledger
        fast = prep.fast if prep.fast is not False else self.native_calls()
        # the round belongs to this call: counted while it waits, so that a peer still at the
        # previous call (taken whole) reads as late, not as a different call (CallLedger.check_peer)
        ledger.ncalls += 1
        if fast is not None and tk.entry.exec_ptr and prep.entries.get(tk.key) is tk.entry:
            done, posted = self.native_replay(fast, prep, seg, tk, inp, outs, async_op)
            if posted is None:
                return done         # a handle (launched), or None (nothing posted: the full path)
            word, token = posted    # posted, the round not settled: it goes on here
        elif fast is not None and _capturing():     # (the native call's own check did not run)
            ledger.ncalls -= 1
            return None
        else:
            word, token = prep.finish_word(tk.base, inp, tk.lanes), None
        t0 = time.perf_counter()
        try:
            got = seg.read_values(token if token is not None else seg.post_values([word, *NO_OBS]), tk.op)
        except (PeerMismatchError, BraidTimeoutError, LaneFailureError) as exc:
            faults.give_up(exc)
            raise
        # the round's host time (this rank's post and read, and its wait for the last peer's word)
        prep.stats["round_us"] += (time.perf_counter() - t0) * 1e6
        handle = self.replay_agreed(tk, [g[0] for g in got], inp, outs, async_op)
        if handle is not None:
            return handle
        ledger.ncalls -= 1                 # a miss: the full path counts the call
        self.round = (word, got)        # and goes on from this round
        return None

    def _ticket(self, tkey):
        """The Ticket of these arguments while a repeat may replay it, else None (queued
        send/recv go first, a balancer report rides the full path)."""
        prep = self.prepared
        tk = prep.tickets.get(tkey)
        faults = self.faults
        if (tk is None or not prep.enabled or faults.closed or faults.aborted or tk.bal != self.policy.balancer.version
                or self.pending or (self.policy.pending and tk.op in self.policy.pending)
                or (faults.watchdog is not None and faults.watchdog.failed)):
            return None
        return tk

    def ticket_word(self, tkey, inp):
        """(Ticket, this rank's word) for a call whose round another agreement carries (an
        all_to_all with equal split sizes: comm/uneven.py, Even), or (None, 0): no replay now
        (none prepared; a capture, which takes the full path; a rounds thread, whose rebuilds
        may change the tickets while this round waits: the balanced call's deferred replay)."""
        tk = self._ticket(tkey)
        if tk is None or self.rounds is not None or _capturing():
            return None, 0
        return tk, self.prepared.finish_word(tk.base, inp, tk.lanes)

    def replay_agreed(self, tk, words, inp, outs: tuple, async_op: bool):
        """The launch of a Ticket's program after a round in which every rank posted its word
        (`words`, in rank order), where each is the one the program was built with; else None.
        A hit only where the cache would hit (and with the same least-recently-used update), so
        every rank's cache keeps the same keys whichever way its calls came in."""
        prep = self.prepared
        if len(words) == len(tk.key) and all(w == k for w, k in zip(words, tk.key)) and prep.get(tk.key) is tk.entry:
            ledger = self.ledger
            ledger.last_call = tk.ledger
            handle = prep.launch(tk.entry, self.ce.stream, async_op, (inp, *outs))
            ledger.last_handle = handle
            return handle
        return None

    def native_replay(self, fast, prep, seg, tk, inp, outs: tuple, async_op: bool, vals=None, wpos: int = 0):
        """The word, its post, the round and the launch of a Ticket's call in one native call
        (native_rounds.FastCalls). Returns (handle, None) where it launched, (None, None) where it
        posted nothing (a capture: the full path takes the call), else (None, (word, token)): the
        word is posted and the caller reads the round (a word that differs, a late peer).
        `vals`: the round another agreement shapes (FastCalls.call_vals: the word at `wpos`, the
        input's own word at 1; the input has elements and the ticket's lanes include the copy
        engines), else the round of the word alone."""
        caller = _RAW(self.device.index)
        mode = 2 if async_op else 1 if prep.dirty else 0     # async; forked; on the caller's stream
        end = prep.end_event() if mode else 0
        t = tk.native
        if t is None:
            t = tk.native = fast.ticket(tk.base, tk.entry.exec_ptr, self.ce.stream.cuda_stream,
                                        prep.fork_event(), tk.key)
        seq = seg.next_seq()
        if vals is None:
            n = 1 + len(NO_OBS)
            code = fast.call(t, seq, inp.data_ptr() if inp is not None and inp.numel() and "ce" in tk.lanes else 0,
                             caller, end, mode)
        else:
            n = len(vals)
            code = fast.call_vals(t, seq, inp.data_ptr(), caller, end, mode, vals, wpos, 1)
        if code == native_rounds.HIT:
            prep.stats["round_us"] += fast.round_ns.value * 1e-3
            prep.get(tk.key)
            prep.stats["replays"] += 1
            prep.stats["native_calls"] += 1
            ledger = self.ledger
            ledger.last_call = tk.ledger
            handle = prep.joined(mode == 2, end, self.ce.stream, (inp, *outs), tk.entry.plan, tk.entry.done) \
                if mode else tk.entry.done
            ledger.last_handle = handle
            return handle, None
        if code in (native_rounds.CAPTURING, native_rounds.ID_ERR, native_rounds.TOO_MANY):     # nothing posted: undone
            seg.coll_seq -= 1
            self.ledger.ncalls -= 1
            if code == native_rounds.ID_ERR:
                _cuda.check(fast.rc.value, "cuPointerGetAttribute(BUFFER_ID)")
            return None, None
        if code == native_rounds.LATE:      # a peer not there within the spin: Python waits
            prep.stats["native_late"] += 1
        elif code != native_rounds.DIFF:
            _cuda.check(fast.rc.value or -1, "the launch of a prepared call")
        return None, (fast.word.value, (seq, n))

    def native_calls(self):
        """The communicator's native repeated calls (native_rounds.FastCalls), made at the first
        call that could take them; None where BRAID_NATIVE_CALL is 0 or they did not build."""
        prep = self.prepared
        prep.fast = None
        if not envs.get("BRAID_NATIVE_CALL"):
            return None
        lib = native_rounds.build()
        if lib is None:
            return None
        seg = self.segment
        try:
            prep.fast = native_rounds.FastCalls(
                lib, self.world_size, self.rank, COLL_SLOTS, 1 + len(NO_OBS), COLL_MBOX_BYTES,
                [seg.address + c for c in seg._coll_ctr], [seg.address + s[0] for s in seg._coll_slots],
                _cuda.native_fns(), seg.spin_s)
        except (OSError, LaneFailureError) as exc:
            log.info("braid: repeated calls stay in Python (%s)", exc)
        return prep.fast

    def deferred(self, rd, prep, tk, inp, outs: tuple, async_op: bool, redo):
        """Post this rank's word and queue the rest of the call on the rounds thread
        (comm/rounds.py): the caller's stream (synchronous) or the handle's waiter (async) waits
        for the call's end counter. Counted in the ledger here, in call order."""
        rd.room()
        word = prep.finish_word(tk.base, inp, tk.lanes)
        ledger = self.ledger
        ledger.count(tk.ledger)
        try:
            token = self.segment.post_values([word, *NO_OBS], hook=False)
        except (PeerMismatchError, BraidTimeoutError, LaneFailureError) as exc:
            self.faults.give_up(exc)
            raise
        caller = _RAW(self.device.index)
        start = rd.start_event(caller)
        n = rd.next_number()
        tensors = (inp, *outs)
        # the words the program was built for, while the entry is the cache's (else the thread in
        # Python decides, as on a changed word)
        rd.push(Job(token, word, tk, start, n, tensors, redo, ledger.ncalls, tk.op),
                tk.key if prep.entries.get(tk.key) is tk.entry else None)
        # the program runs on the lane stream, which only the caller's stream waits for: a later
        # call on another stream of the caller's (FSDP2's gathers and reductions) must not start
        # its program beside it (two programs on the same flags)
        prep.dirty = True
        if async_op:
            sweep()         # (the handle keeps the tensors until its wait)
            handle = DeferredHandle(rd, n, tensors, tk.entry.plan, self.device.index)
        else:
            rd.stream_wait(caller, n)
            handle = tk.entry.done
        ledger.last_handle = handle
        return handle
