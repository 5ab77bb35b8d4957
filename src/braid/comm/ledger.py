"""Faults that reach every rank: the call ledger (CallLedger: calls made, the last one) published
to the node segment, mismatch detection while waiting for a peer, timeouts that say what each side posted,
and abort: marking the segment so peers raise at once, and aborting the NCCL communicators a peer
could be blocked in. The watchdog thread does the polling.
"""
from __future__ import annotations

import logging
import sys
import time
from threading import get_ident

import torch

from .. import envs
from ..errors import BraidTimeoutError, LaneFailureError, MisuseError, PeerMismatchError
from ..node import NodeSegment

log = logging.getLogger("braid")
_DTYPE_NAMES: dict = {}     # torch.float32 -> "float32" (published with every call)


class _Watchdog:
    """A thread per communicator with a node segment. A few times a second it publishes this
    rank's call ledger (peers read it to tell a mismatch from a slow rank, see Faults.on_wait)
    and looks for peers that marked themselves aborted; once a second it checks that every peer's
    process is alive. A peer that exited or aborted marks this communicator broken (the next call
    raises), and on GPUs releases every stream wait on the node's counters and aborts the NCCL
    communicators a call of this rank could be blocked in (so no GPU stream, and no rank inside
    NCCL, waits forever for a dead or failed peer).

    On GPUs it also gives up on a peer that stays behind: a call NCCL takes whole posts nothing
    in the segment, so a rank that made it waits on its GPU (and its host in the next sync) for a
    peer that may never come (one that raised in its own code, say, and lives on). A peer whose
    published count of calls stays below this rank's for BRAID_TIMEOUT_S is late, as a peer that
    does not post its word in time is (`late_peer`); this rank then gives up with a
    BraidTimeoutError that names the peer, which releases every rank of the node (and, through
    comm/hier.py, of every node)."""

    PERIOD_S = 0.2

    def __init__(self, segment: NodeSegment, rank: int, world_size: int, cuda: bool, status, on_peer_abort,
                 overdue=None):
        import threading
        self.failed = ""
        self._stop = threading.Event()
        self._segment, self._rank, self._world, self._cuda = segment, rank, world_size, cuda
        self._status, self._on_peer_abort = status, on_peer_abort
        self._overdue = overdue         # this rank's own reason to give up (a send nobody receives), or ""
        # GPUs: seconds a peer may stay behind this rank's count of calls (None: no such check)
        self._late_after = envs.get("BRAID_TIMEOUT_S") if cuda else None
        self._behind: dict[int, tuple[int, float]] = {}     # peer -> (its count, since when)
        self._thread = threading.Thread(target=self._run, name="braid-watchdog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        ticks = 0
        while not self._stop.wait(self.PERIOD_S):
            ticks += 1
            try:
                why = self._tick(ticks)
            except Exception:   # segment closed under us
                return
            if why:
                self.failed = why
                log.warning("braid: %s; releasing this rank's pending waits", why)
                if self._cuda:
                    # the stream waits first: aborting NCCL frees device memory, which waits for
                    # every stream of the device, one held by a wait on a flag included
                    self._segment.abort()
                    self._segment.release_flags()
                self._on_peer_abort(why)
                if self._cuda:
                    keep_released(self._segment, self._stop, self._rank, why, self.PERIOD_S)
                return

    def _tick(self, ticks: int) -> str:
        """One look: publish the ledger; the cause when a peer aborted or died, else ""."""
        st = self._status()
        if st is None:          # the communicator is gone
            return ""
        self._segment.publish(*st)
        hit = self._segment.aborted()
        if hit is not None:
            return f"rank {hit[0]} aborted: {hit[2]}"
        why = self._overdue() if self._overdue is not None else ""
        if not why and self._late_after is not None and ticks % 5 == 0:
            why = self.late_peer(st[0], time.monotonic())
        if why:
            self._segment.mark_aborted(2, f"BraidTimeoutError: {why}")     # the peers raise too
            return why
        if ticks % 5 == 0:
            for peer in range(self._world):
                if peer != self._rank:
                    try:
                        self._segment.check_alive(peer)
                    except LaneFailureError as exc:
                        return str(exc)
        return ""

    def late_peer(self, mine: int, now: float) -> str:
        """Why a peer counts as late (its published count of calls stayed below `mine` for
        BRAID_TIMEOUT_S seconds up to `now`), or ""."""
        for peer in range(self._world):
            if peer == self._rank:
                continue
            st = self._segment.status(peer)
            theirs = st["calls"] if st is not None else 0
            if theirs >= mine:
                self._behind.pop(peer, None)
                continue
            seen = self._behind.get(peer)
            if seen is None or seen[0] != theirs:
                self._behind[peer] = (theirs, now)
            elif now - seen[1] > self._late_after:
                latest = (f"its latest is call #{theirs}, {st['op']} of {st['nbytes']} bytes of {st['dtype']}"
                          if st is not None and theirs else "it has made no call yet")
                return (f"rank {peer} has not made call #{theirs + 1} for {now - seen[1]:.0f} s while rank "
                        f"{self._rank} made {mine} calls ({latest}); a call NCCL takes whole waits on the GPU "
                        f"for every rank. Check that every rank makes the same calls in the same order "
                        f"(BRAID_TIMEOUT_S to change the limit)")
        return ""

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)


class TeardownWatch:
    """Says why where torch's destroy_process_group has not returned after AFTER_S. The usual
    cause is outside braid: NCCL's communicator destroy waits until every CUDA graph that captured
    one of its calls is freed (under torch's NCCL backend too), and a graph torch.compile made
    lives until torch._dynamo.reset(). braid's wrap of destroy_process_group (backend.py) starts
    the watch's thread (`start`) as the destroy begins; it looks until the destroy returned."""

    AFTER_S = 10.0

    def __init__(self, after_s: float | None = None):
        self.after_s = self.AFTER_S if after_s is None else after_s
        self.since: float | None = None
        self.said = False

    @staticmethod
    def frame():
        """The innermost frame of a thread whose stack holds torch's destroy_process_group, or None."""
        for top in sys._current_frames().values():
            f = top
            while f is not None:
                if f.f_code.co_name == "destroy_process_group":
                    return top
                f = f.f_back
        return None

    def look(self, now: float) -> bool:
        """One look at `now` (monotonic seconds); False once no destroy is under way (or it was said)."""
        top = self.frame()
        if top is None:
            self.since = None
            return False
        if self.since is None:
            self.since = now
        elif not self.said and now - self.since >= self.after_s:
            self.said = True
            log.warning("braid: destroy_process_group has not returned in %.0f s (it waits at %s:%d in %s). "
                        "If a CUDA graph that captured NCCL calls is still alive, that is why: NCCL's "
                        "communicator destroy waits until every such graph is freed. Delete them "
                        "(torch._dynamo.reset() frees torch.compile's) before destroy_process_group",
                        self.after_s, top.f_code.co_filename, top.f_lineno, top.f_code.co_name)
        return not self.said

    @classmethod
    def start(cls, after_s: float | None = None, period_s: float = 0.25):
        """A daemon thread that looks every `period_s` until the destroy returned or was said."""
        import threading
        watch = cls(after_s)

        def run():
            while watch.look(time.monotonic()):
                time.sleep(period_s)
        t = threading.Thread(target=run, name="braid-teardown-watch", daemon=True)
        t.start()
        return t


def _nccl_abort_stuck() -> bool:
    """Is an NCCL abort this process started still running (a call it should have released
    may still sit in NCCL)?"""
    import threading
    return any(t.name == "braid-nccl-abort" and t.is_alive() for t in threading.enumerate())


def keep_released(segment: NodeSegment | None, stop, rank: int, why: str, period: float,
                  busy=None) -> None:
    """After a GPU communicator gave up: a replayed program resets the flags it waited on, so
    keep them released while a second program queued behind the first may still wait (until
    `stop` is set, at close); and end the process once, BRAID_ABORT_EXIT_S later, NCCL's abort
    has still not returned or `busy()` says a call is still inside (_end_process)."""
    limit = envs.get("BRAID_ABORT_EXIT_S")
    t_end = time.monotonic() + limit
    while not stop.wait(period):
        if segment is not None:
            try:
                segment.release_flags()
            except Exception:    # noqa: BLE001  segment closed under us
                return
        if limit and time.monotonic() > t_end and (_nccl_abort_stuck() or (busy is not None and busy())):
            _end_process(rank, why, limit)


def _end_process(rank: int, why: str, limit: float) -> None:
    """The last resort of a GPU rank whose NCCL abort did not return within BRAID_ABORT_EXIT_S:
    a thread blocked inside NCCL (or on the stream of an NCCL kernel that waits for a dead peer)
    cannot be given an exception, so end the process, as torch does after an NCCL error."""
    import os
    import sys
    msg = (f"braid: rank {rank}: {why}; NCCL's abort has not released this rank's NCCL calls "
           f"within BRAID_ABORT_EXIT_S={limit:g} s: ending the process (exit code 70)\n")
    try:
        sys.stderr.write(msg)
        sys.stderr.flush()
    finally:
        os._exit(70)


def _call(ref, name: str, *args):
    """`ref()`'s method `name`, or None once the communicator is gone (weak callbacks)."""
    obj = ref()
    return getattr(obj, name)(*args) if obj is not None else None


class CallLedger:
    """The collective calls this rank has made (every path: whole, split, steps) and the last one
    as (op, bytes, dtype, path), published to the node segment so that a peer waiting for this
    rank can tell a mismatch from a slow rank and name both calls. `ncalls` is the one count of
    calls that must advance alike on every rank; a call counts itself once, before it exchanges
    anything with its peers. `last_handle`: the handle of this rank's last call (what
    Communicator.last_handle reads), set by whichever path ran it."""

    def __init__(self, rank: int, cuda: bool, segment: NodeSegment | None):
        self.rank, self.cuda, self.segment = rank, cuda, segment
        self.ncalls = 0
        self.last_call: tuple = ("", 0, None, "")
        self.last_handle = None

    def count(self, call: tuple) -> None:
        """One more call: `call` is (op, bytes, dtype, path)."""
        self.ncalls += 1
        self.last_call = call

    def enter(self, op: str, t: torch.Tensor, path: str) -> None:
        """Count a call and publish it before it exchanges anything."""
        self.count((op, t.numel() * t.element_size(), t.dtype, path))
        self.publish()

    def status(self) -> tuple:
        """(calls, op, bytes, dtype, path), for the watchdog to publish."""
        op, nbytes, dtype, path = self.last_call
        name = _DTYPE_NAMES.get(dtype)
        if name is None:
            name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
        return self.ncalls, op, nbytes, name, path

    def publish(self) -> None:
        seg = self.segment
        if seg is not None and not seg.closed:
            seg.publish(*self.status())

    def describe(self, who: str, calls: int, op: str, nbytes: int, dtype: str, path: str) -> str:
        how = {"whole": f"taken whole by {'NCCL' if self.cuda else 'gloo'}",
               "split": "on braid's lanes (it starts by exchanging descriptors)"}.get(path, path)
        return f"{who} call #{calls} is {op} of {nbytes} bytes of {dtype}, {how}"

    def mine(self) -> str:
        """This rank's last call, described."""
        return self.describe(f"rank {self.rank}", *self.status())

    def peer_said(self, peer: int) -> str:
        st = self.segment.status(peer) if self.segment is not None else None
        if st is None:
            return f"rank {peer} has published no call yet"
        ago = max(time.time() - st["time"], 0.0)
        return (self.describe(f"rank {peer}'s latest", st["calls"], st["op"], st["nbytes"], st["dtype"],
                              st["path"]) + f" (reported {ago:.1f} s ago)")

    def check_peer(self, peer: int, what: str, posted, mine: int) -> None:
        """While this rank waits for `peer` in its call number `mine`: raise PeerMismatchError,
        naming both calls, once the peer has shown that it made a different call at this point:
        it reported a later call, or this very call taken whole by the native library (which
        posts nothing here: the peer may then sit inside NCCL or gloo). An exchange a call makes
        before its path counts it must count it while it waits (the prepared calls' round, the
        whole-or-split trial), else a peer still at the previous call, taken whole, reads as a
        mismatch."""
        st = self.segment.status(peer)
        if st is None or not (st["calls"] > mine or (st["calls"] == mine and st["path"] == "whole")):
            return
        if posted():            # the peer posted after all (its report raced the post): no mismatch
            return
        msg = (f"ranks {self.rank} and {peer} made different calls: {self.mine()} (waiting in {what}); "
               f"{self.peer_said(peer)}. "
               f"Every rank must make the same collective calls in the same order with matching "
               f"sizes and dtypes.")
        exc = PeerMismatchError(msg)
        exc.peers_left_waiting = True       # see Faults.give_up
        raise exc

    def timeout(self, peer: int, what: str) -> BraidTimeoutError:
        return BraidTimeoutError(
            f"rank {self.rank} waited {envs.get('BRAID_TIMEOUT_S'):.0f} s for rank {peer} ({what}): "
            f"{self.mine()}; {self.peer_said(peer)}. Check that "
            f"every rank makes the same calls in the same order (BRAID_TIMEOUT_S to change the limit).")


class Faults:
    """Whether this communicator may still run calls (closed; aborted, and why; broken: its
    watchdog saw a peer fail) and what a call that went wrong on one rank does to every rank: the
    mismatch and timeout reports, the abort marked in the node segment, the NCCL communicators
    aborted. Its collaborators come in its constructor; those the communicator makes later (the
    watchdog, the whole-or-split shortcuts, the deferred calls' rounds, the prepared send/recv)
    are handed to it as they are made."""

    def __init__(self, rank: int, cuda: bool, device, segment: NodeSegment | None, ledger: CallLedger,
                 groups: tuple = (), hier=None):
        self.rank, self.cuda, self.device = rank, cuda, device
        self.segment, self.ledger = segment, ledger
        self.groups = [g for g in groups if g is not None]     # braid's NCCL group, the fast path's
        self.hier = hier                # a multi-node world's steps (its rail group, the node's communicator)
        self.closed = False
        self.aborted = ""               # why abort() was called (the communicator is unusable)
        self.backend_groups: list = []  # the braid backend's inner NCCL group (backend.py sets it)
        self.watchdog: _Watchdog | None = None
        self.shortcuts = None           # cleared at an abort: the next call takes the full path
        self.rounds = None              # deferred prepared calls (comm/rounds.py), released at an abort
        self.pairs = None               # prepared send/recv (comm/pairs.py): sends that ran ahead

    def check_open(self) -> None:
        if self.closed:
            raise MisuseError("this braid communicator was closed")
        if self.aborted:
            raise LaneFailureError(f"this braid communicator was aborted ({self.aborted}); it cannot run "
                                   f"calls any more: create a new process group and communicator")
        if self.watchdog is not None and self.watchdog.failed:
            raise LaneFailureError(f"braid communicator is broken: {self.watchdog.failed}; "
                                   f"create a new process group and communicator")

    def p2p_overdue(self) -> str:
        """The watchdog's look at sends that ran ahead (comm/pairs.py): why to give up, or ""."""
        pairs = self.pairs
        if pairs is None or not pairs.ahead:
            return ""
        return pairs.overdue(envs.get("BRAID_TIMEOUT_S"))

    def on_wait(self, peer: int, what: str, posted) -> None:
        """Called while this rank waits for `peer` in a collective exchange (CallLedger.check_peer);
        the rounds thread reads an earlier call's round than the ledger's count."""
        if not what.startswith("collective #") or self.segment is None:
            return
        mine = self.ledger.ncalls
        rd = self.rounds
        if rd is not None and rd.ident == get_ident():
            mine = rd.reading
        self.ledger.check_peer(peer, what, posted, mine)

    def on_timeout(self, peer: int, what: str) -> None:
        raise self.ledger.timeout(peer, what)

    def give_up(self, exc: BaseException) -> None:
        """Mark this rank aborted in the node segment with `exc` as the cause (peers waiting on it
        raise at once; their watchdogs abort the NCCL communicators they could sit in), where a
        peer may be left waiting: a timeout, a lane failure, a mismatch seen in the call ledger.
        Not for a disagreement every rank found in the same exchange (each raised it and all
        stay in step: the communicator goes on working), nor for an error that repeats a peer's
        abort or this communicator's broken state. A mismatch read after a peer aborted raises
        that peer's abort instead (from `exc`)."""
        seg = self.segment
        text = str(exc)
        if seg is None or seg.closed or " aborted: " in text or "communicator is broken" in text:
            return
        if isinstance(exc, PeerMismatchError):
            # a peer's abort pushes its counters far ahead, which ends this rank's waits on them:
            # what it then read was no call of the peer's, so the abort is the cause to report
            seg.raise_if_peer_aborted()
        if isinstance(exc, PeerMismatchError) and not getattr(exc, "peers_left_waiting", False):
            return
        kind = 1 if isinstance(exc, PeerMismatchError) else 2 if isinstance(exc, BraidTimeoutError) else 3
        try:
            seg.mark_aborted(kind, f"{type(exc).__name__}: {text}")
        except Exception as err:       # noqa: BLE001  reporting must not hide the first error
            log.debug("braid: marking the abort failed: %s", err)

    def native_groups(self) -> list:
        """The NCCL process groups a peer of this rank may be blocked in because of braid: braid's
        own, the fast path's (the default group when it is NCCL's), and under the braid backend
        its inner NCCL group (the backend lists it in `backend_groups`)."""
        groups = self.groups + list(self.backend_groups)
        if self.hier is not None:     # a multi-node world's rail group
            groups.append(self.hier.rail_group)
        return list({id(g): g for g in groups}.values())

    def abort_native(self, why: str, wait: bool = True) -> None:
        """Abort the NCCL communicators of native_groups (a call blocked in one of them then
        fails instead of waiting forever). From the watchdog thread (wait=False: the aborts run
        on a thread of their own, as NCCL's abort can take seconds or block on a peer that
        died, and the watchdog must go on releasing stream waits) or abort()."""
        self.aborted = self.aborted or why
        self.shortcuts.clear()  # the next call takes the full path, which refuses it
        if not self.cuda:
            return          # gloo has no abort that releases a blocked call; its timeout does
        groups = self.native_groups()
        if not wait:
            import threading
            threading.Thread(target=self.abort_groups, args=(groups,), name="braid-nccl-abort",
                             daemon=True).start()
            return
        self.abort_groups(groups)

    def abort_groups(self, groups: list) -> None:
        for g in groups:
            try:
                be = g._get_backend(self.device) if hasattr(g, "_get_backend") else g
                fn = getattr(be, "abort", None) or getattr(be, "_abort", None)
                if fn is not None:
                    fn()
            except Exception as exc:     # noqa: BLE001  aborting is best effort, one group at a time
                log.debug("braid: aborting an NCCL group failed: %s", exc)

    def abort(self, reason: str = "abort() was called", wait: bool = True) -> None:
        """Communicator.abort (its docstring says what it does)."""
        if self.closed or self.aborted:
            return
        seg = self.segment
        if seg is not None and not seg.closed:
            seg.mark_aborted(4, f"rank {self.rank}: {reason}")
            if self.cuda:
                seg.abort()
                seg.release_flags()
        rd = self.rounds
        if rd is not None:          # queued calls end now; their thread stops at the next job
            rd.release()
        self.abort_native(reason, wait)
        if self.hier is not None:     # the node's communicator, and its peers
            self.hier.node.abort(reason)
