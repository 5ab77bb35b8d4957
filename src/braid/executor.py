"""Runs a plan: posts each lane's part, makes this rank's local copies, and joins them in a Handle.

Timeline of one call on a GPU rank (time runs right):

    caller stream  --[start event]--[local copies]-------------------------[wait lanes]-->
    ce stream                  \\--[arrive][pull pieces from peers][finish][wait readers]--/
    host producer              \\--[D2H chunk][D2H chunk]...--\\                          /
    host consumer              \\--[wait full][H2D chunk]...---[join producer]-----------/
    nccl stream                \\--[NCCL sends/recvs]-------------------------------------/

`wait()` only makes the caller's current stream wait (no CPU block), like NCCL's Work.wait().
On CPU lanes the lanes are worker threads and `wait()` joins them.
"""
from __future__ import annotations

from typing import Callable

import torch

from .lanes.base import LaneContext, LaneRun, OpContext
from .planner.plan import Plan


# The tensors of async GPU calls whose handles were dropped before their wait(): each with a test
# of its end, held until that test passes (swept at later calls). braid keeps a call's tensors
# this way rather than with record_stream: a record_stream'd block stays allocated after its
# tensor dies until the allocator next polls its events, and torch's CUDA-graph trees can read
# that as a tensor of their pool the step did not return ("tensor(s) in the cudagraph pool not
# tracked as outputs"); a handle's wait lets them go in the caller's stream order instead
_UNWAITED: list = []


def hold_until(done: Callable[[], bool], tensors: tuple) -> None:
    """Keep `tensors` alive until `done()` (an async call's end) is true."""
    if tensors:
        _UNWAITED.append((done, tensors))
        if len(_UNWAITED) % 64 == 0:        # bounded where no later call of braid's sweeps
            sweep()


def sweep() -> None:
    """Release the tensors of dropped handles whose calls ended (not inside a capture: an event
    query there is not allowed)."""
    if _UNWAITED and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        _UNWAITED[:] = [(d, t) for d, t in _UNWAITED if not _ended(d)]


def _ended(done: Callable[[], bool]) -> bool:
    try:
        return bool(done())
    except Exception:       # (a closed communicator's counters, a destroyed event: nothing runs any more)
        return True


class _Ended:
    """A native library's Work once waited (Handle.wait), holding nothing: is_completed() says
    True from then on, as BraidWork's does after its wait (the caller's stream is after the call)."""

    @staticmethod
    def wait(timeout=None) -> bool:
        return True

    @staticmethod
    def is_completed() -> bool:
        return True


_ENDED = _Ended()


def _all_done(events: tuple) -> Callable[[], bool]:
    return lambda: all(e.query() for e in events)


class Handle:
    """What an async braid call returns (torch's Work shape: wait, is_completed). On GPUs `keep`
    holds the tensors the call reads and writes on braid's streams: the caller may drop its own
    references before waiting, and the allocator must not hand their memory to later work on the
    caller's stream. wait() (the caller's stream after the call) releases them; a handle dropped
    unwaited passes them to `hold_until` its lanes' end events."""

    # GPU: a stream whose last work, when the call returns, is the call's end (its future can be
    # completed there: backend_work.BraidWork.get_future); None where the call ends on several
    stream = None

    def __init__(self, runs: list[LaneRun] | None = None, native=None, after: Callable[[], None] | None = None,
                 plan: Plan | None = None, event=None):
        self.runs = runs or []
        self.event = event          # GPU: the call's last work (multi-phase ops on braid's op stream)
        self.native_lane = "nccl"   # which library's own call `native` is
        self.native = native
        self.after = after
        self.plan = plan
        self.waiter = None          # how to wait for `native` (CPU: in steps that see a peer's abort)
        self._waited = False
        self.keep: tuple = ()

    def __del__(self):
        if getattr(self, "keep", None) and not self._waited:    # dropped unwaited: kept until its end
            done = self.end_test()
            if done is not None:
                hold_until(done, self.keep)

    def end_test(self) -> Callable[[], bool] | None:
        """A test that the call has ended on the GPU (None: nothing to wait for)."""
        ends = tuple(e for e in [self.event, *(r.end for r in self.runs)] if e is not None)
        return _all_done(ends) if ends else None

    def wait(self, timeout=None) -> bool:
        if self._waited:
            return True
        self._waited = True
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)
        else:
            for run in self.runs:
                run.join()
        if self.native is not None:
            if self.waiter is not None:
                self.waiter(self.native)
            else:
                self.native.wait()
            # the library's Work holds the call's tensors (NCCL's, in C++) and this handle may be
            # kept as the communicator's last_handle: let it go once the caller waited
            self.native = _ENDED
        if self.after is not None:
            with torch.no_grad():        # the call's last step (a division, a copy out) is not autograd's
                self.after()
        self.keep = ()
        return True

    def is_completed(self) -> bool:
        return all(r.done() for r in self.runs) and (self.native is None or self.native.is_completed())

    def lane_times_us(self) -> dict[str, float]:
        """Each lane's own time for this call (blocks until they are done)."""
        out: dict[str, float] = {}
        for r in self.runs:
            out[str(r.kind)] = out.get(str(r.kind), 0.0) + r.elapsed_us()
        return out

    @property
    def shares(self) -> dict[str, float]:
        if self.plan is None:
            return {self.native_lane: 1.0} if self.native is not None else {}
        return dict(self.plan.shares)


def execute(lc: LaneContext, plan: Plan, inp: torch.Tensor | None, outs: list[torch.Tensor],
            descs: list[dict | None], peer: int | None = None, start_event=None) -> Handle:
    """Post every lane's part of `plan`. `start_event`: where on the caller's stream the call was
    made (a deferred send/recv posts its lanes later, from the position of its call)."""
    cuda = comm_device_is_cuda(inp, outs)
    ctx = OpContext(lc=lc, plan=plan, inp=inp, outs=outs, descs=descs, peer=peer)
    if cuda:
        sweep()
        ctx.start_event = start_event
        if ctx.start_event is None:
            ctx.start_event = torch.cuda.Event()
            ctx.start_event.record(torch.cuda.current_stream())
    runs = []
    for name, transfers in plan.lanes.items():
        if transfers:
            runs.append(lc.lane(name).post(ctx, transfers))
    for c in plan.local:
        if c.rank == lc.rank and c.nbytes:
            outs[c.buf][c.dst_off: c.dst_off + c.nbytes].copy_(inp[c.src_off: c.src_off + c.nbytes],
                                                               non_blocking=True)
    handle = Handle(runs, plan=plan)
    if cuda:
        handle.keep = (inp, *outs)
    return handle


def comm_device_is_cuda(inp, outs) -> bool:
    for t in ([inp] if inp is not None else []) + list(outs):
        return t.is_cuda
    return False


class Works:
    """Several waitables as one (torch Works, braid handles): waiting waits for each (on GPUs the
    current stream waits, no CPU block), and it is complete once each is. A native
    batch_isend_irecv's Works, torch's coalesced forms run pair by pair."""

    def __init__(self, works):
        self.works = list(works or [])

    def wait(self, timeout=None) -> bool:
        for wk in self.works:
            wk.wait()
        return True

    def is_completed(self) -> bool:
        return all(wk.is_completed() for wk in self.works)


def as_handle(work, lane: str) -> Handle:
    handle = work if isinstance(work, Handle) else Handle(native=work)
    handle.native_lane = lane
    return handle
