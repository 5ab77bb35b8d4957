"""How a call is taken: by the native library whole (NCCL on GPUs, gloo on a CPU communicator) or
split over braid's lanes. The shares are the split policy's (comm/policy.py: the calibration, fixed
shares, the online balancer); the fast path keeps, per call shape, whether the native library
takes it, so a repeated small call costs a few Python steps besides the library's own. The
braid backend's forwarding reads the same answers (`whole_*`).
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import time
from typing import Iterator

import torch
import torch.distributed as dist

from .. import envs
from ..errors import BraidError, BraidTimeoutError, LaneFailureError
from ..executor import Handle
from ..planner.model import LaneCost

log = logging.getLogger("braid")

GLOO_WAIT_STEP = datetime.timedelta(milliseconds=50)   # how often a wait inside gloo looks for aborts


NATIVE_SHARE_REDS = ("sum", "avg", "min", "max", "product")   # NCCL's own all_reduce may take a share

_RED_T = type(dist.ReduceOp.SUM)    # plain reduce ops (premul-sum comes as another type); singletons

_FAST_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT)


class CallPath:
    """Part of braid.comm.Communicator (a mixin of the façade: the parts it composes own the state)."""

    # shares -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def fixed_shares(self, shares: dict[str, float] | None, op: str = "*") -> Iterator[None]:
        """Use these shares for every op (or one op) inside the block (tests, calibration, bench)."""
        self._drain()
        policy = self.policy
        old = policy.fixed
        policy.set_fixed(None if shares is None else {**(old or {}), op: dict(shares)})
        self.shortcuts.clear()
        self._prepared.clear()
        self._learn_update()
        try:
            yield
        finally:
            self._drain(raising=False)
            policy.set_fixed(old)
            self.shortcuts.clear()
            self._prepared.clear()
            self._learn_update()

    def _drain(self, raising: bool = True) -> None:
        """Let the deferred calls queued so far run (comm/rounds.py) before what they were
        prepared under changes (shares, calibration); raises the error one of them met."""
        rd = getattr(self, "_rounds", None)
        if rd is not None:
            rd.drain(raising)

    def _trial_exchange(self, values: list[int]) -> list[list[int]]:
        """The whole-or-split trials' agreement (comm/arbiter.py). A call asks the arbiter before
        the ledger counts it; while this exchange waits the call is counted, so that a peer still
        at the previous call, taken whole, reads as late, not as a different call (_on_wait)."""
        self.ledger.ncalls += 1
        try:
            return self.segment.exchange_values(values, "whole-or-split trial")
        finally:
            self.ledger.ncalls -= 1

    def _learn_update(self) -> None:
        """Whole or split learned in the job (comm/arbiter.py) only where braid chooses the shares:
        not under fixed shares (tests, the calibration, `--shares`) nor in check mode."""
        self.shortcuts.learn = self._arbiter.enabled and self.policy.fixed is None and not self.check
        if self.policy.set_near_trials(self.shortcuts.learn):
            self.shortcuts.clear()          # the kept answers of shapes NCCL won by little

    @contextlib.contextmanager
    def calibrated_verdict(self) -> Iterator[None]:
        """Inside the block every call of a shape the calibration splits is split, as the calibration
        chose, without trials against the whole call (the op sweep of `braid bench`: its alternating
        windows would fall inside a trial's intervals)."""
        was = self._arbiter.enabled
        self._arbiter.enabled = False
        self._learn_update()
        try:
            yield
        finally:
            self._arbiter.enabled = was
            self._learn_update()

    def shares_for(self, op: str, nbytes: int, lanes: list[str]) -> dict[str, float]:
        """This call's shares over `lanes` (comm/policy.py)."""
        return self.policy.shares_for(op, nbytes, lanes)

    def split_rule(self, op: str, costs: dict[str, LaneCost], nbytes: int) -> dict[str, float]:
        """Shares from lane costs alone (comm/policy.py; the calibration asks it)."""
        return self.policy.split_rule(op, costs, nbytes)

    def _native_group(self, shares: dict[str, float]):
        return self.native_group if "nccl" in shares else self.gloo_group

    def _fast_ok(self, *tensors) -> bool:
        """Cheap checks for the fast path: CUDA tensors on our device, contiguous. Anything else
        takes the full path, which validates and explains."""
        if not self.cuda or self.closed:
            return False
        idx = self.device.index
        for t in tensors:
            if type(t) is not torch.Tensor or not t.is_cuda or t.get_device() != idx or not t.is_contiguous():
                return False
        return True

    # the braid backend's forwarding ------------------------------------------------------------
    # Under init_process_group("braid"), a call that the native library takes whole goes from the
    # backend straight to its inner NCCL (gloo) group, with torch's own options object, and the
    # caller gets that library's Work: its future, its stream semantics, no braid object per call.
    # These read the fast path's answer for the call shape; a shape not seen yet answers False, so
    # its first call takes the full path, which fills the answer in (the same facts on every rank).
    def _takes(self, t) -> bool:
        """A tensor the fast path's answers apply to (all_reduce's test is written out in the
        backend: the same as whole_reduce_scatter's, for one tensor)."""
        return (type(t) is torch.Tensor and t.is_cuda is self.cuda and t.is_contiguous() and not self.closed
                and not self.aborted)

    #
    # A shape the calibration splits is still NCCL's whole while the job's trial says so
    # (comm/arbiter.py): these ask the arbiter too, so such a call is forwarded as well (through
    # braid's own op and Work it cost ~20-100 us more host time a call: 2 x H200, FSDP2). The
    # decision and the hand-off of the arbiter's answer to the op's own path: comm/shortcuts.py.
    def whole_reduce_scatter(self, out, inp, op) -> bool:
        if not (self._takes(inp) and self._takes(out)) or out.dtype is not inp.dtype:
            return False
        return self.shortcuts.answer("rs", inp.numel(), (inp.dtype, op, out.numel()), self._rest_rs, out, inp, op)

    def whole_all_gather(self, out, inp) -> bool:
        if not (self._takes(inp) and self._takes(out)) or out.dtype is not inp.dtype:
            return False
        return self.shortcuts.answer("ag", inp.numel(), (inp.dtype, out.numel()), self._rest_ag, out, inp)

    def whole_broadcast(self, t, root: int) -> bool:
        if not self._takes(t):
            return False
        return self.shortcuts.answer("bc", t.numel(), (t.dtype, root), self._rest_bc, t, root)

    def whole_all_reduce(self, t, op) -> bool:
        if not self._takes(t):
            return False
        return self.shortcuts.answer("ar", t.numel(), (t.dtype, op), self._rest_ar, t, op)

    def whole_all_to_all(self, out, inp) -> bool:
        """Balanced all_to_all_single (no split sizes) only: uneven calls agree per call."""
        if not (self._takes(inp) and self._takes(out)) or inp.dim() == 0 or out.dtype is not inp.dtype:
            return False
        return self.shortcuts.answer("a2a", inp.numel(), (inp.dtype, inp.size(0), out.numel()), self._rest_a2a,
                                     out, inp)

    # Each op's shape for both questions (the op's own and the backend's, comm/shortcuts.py): the
    # entry's key and facts are written at the two call sites, (element count, (dtype, the op's
    # other facts)); what only a call the entry does not settle needs is here: whether the native
    # call can take the shape at all, the op's name and bytes for the calibration, the arbiter's
    # key. Tensors are contiguous, on this communicator's kind of device.
    def _rest_ar(self, t, op) -> tuple:
        n, dt = t.numel(), t.dtype
        return self._fast_reduce_ok(op, dt), "all_reduce", n * t.element_size(), ("ar", n, dt, op)

    def _rest_rs(self, out, inp, op) -> tuple:
        n, dt = inp.numel(), inp.dtype
        return (dt is out.dtype and n == out.numel() * self.world_size and self._fast_reduce_ok(op, dt),
                "reduce_scatter", n * inp.element_size(), ("rs", n, dt, op))

    def _rest_ag(self, out, inp) -> tuple:
        n, dt = inp.numel(), inp.dtype
        return (dt is out.dtype and out.numel() == n * self.world_size, "all_gather", n * inp.element_size(),
                ("ag", n, dt))

    def _rest_bc(self, t, root) -> tuple:
        n, dt = t.numel(), t.dtype
        return 0 <= root < self.world_size, "broadcast", n * t.element_size(), ("bc", n, dt, root)

    def _rest_a2a(self, out, inp) -> tuple:
        n, dt = inp.numel(), inp.dtype
        return (dt is out.dtype and n == out.numel() and inp.size(0) % self.world_size == 0, "all_to_all_single",
                n * inp.element_size(), ("a2a", n, dt))

    def _finish(self, work, async_op: bool):
        handle = Handle(native=work)
        handle.native_lane = "nccl" if self.cuda else "gloo"
        if not self.cuda:
            handle.waiter = self._wait_gloo
        self.last_handle = handle
        if async_op:
            return handle
        handle.wait()
        return None

    def _wait_gloo(self, work) -> None:
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
        p2p = getattr(self, "_p2p_shm", None)
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
            if self.watchdog is not None and self.watchdog.failed:
                raise LaneFailureError(f"braid communicator is broken: {self.watchdog.failed}")
            if time.monotonic() > deadline:
                raise BraidTimeoutError(
                    f"rank {self.rank} waited {envs.get('BRAID_TIMEOUT_S'):.0f} s inside gloo's own "
                    f"{self.ledger.last_call[0]} for its peers: {self.ledger.mine()}. "
                    f"Check that every rank makes the same calls in the same order (BRAID_TIMEOUT_S to change the limit).")

    def _native_fast(self, method: str, args: tuple, kind: str, async_op: bool, op=None, root: int = 0,
                     fallback=None, counted: bool = False):
        """The fast path's call, whole, through the native library (comm/library.py), waited here
        when synchronous (a CPU communicator's gloo call in steps that see a peer's abort)."""
        lib = self.library
        if lib.backend is None and self._p2p_pending and not self.cuda:   # as _run does before a collective
            self._flush_p2p()
        work = lib.start(method, args, kind, async_op, op, root, fallback, counted)
        if async_op:
            return self._finish(work, True)
        if work is not None:
            if self.cuda:
                work.wait()
            else:
                self._wait_gloo(work)
        self.last_handle = self.library.done
        return None
