"""The Lane interface: what every mechanism that moves bytes between ranks offers.

A lane says whether it can run here (`available()` -> (bool, reason)), and `post()`s its part of
a plan: the transfers it carries, for this rank. On GPUs post enqueues work on the lane's own
streams (after the caller's stream reached the call) and returns at once; on CPUs it starts a
worker thread. The returned `LaneRun` joins the caller (a stream wait on GPU, a thread join on CPU)
and reports the lane's own time, which the calibration and the balancer read.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from ..errors import BraidError, LaneFailureError
from ..planner.plan import LaneKind, Plan, Transfer

if TYPE_CHECKING:
    from ..node import Layout, NodeSegment


def kept_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A GPU buffer braid keeps from call to call (scratch, staging), allocated outside any memory
    pool the calling thread's allocations are routed to. torch's CUDA-graph trees route a thread's
    allocations to their pool while they warm up or capture a step; a buffer of braid's made in a
    step's first call would stay there and stop them ("tensor(s) in the cudagraph pool not tracked
    as outputs"). So a short-lived thread allocates it, on the caller's current stream. Inside a
    capture (where another thread's allocation would break it) the caller's own allocation."""
    device = torch.device(device)
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.current_stream(device)
    got: list = []

    def alloc() -> None:
        try:
            with torch.cuda.device(device), torch.cuda.stream(stream):
                got.append(torch.empty(nbytes, dtype=torch.uint8, device=device))
        except BaseException as exc:        # raised in the caller
            got.append(exc)
    t = threading.Thread(target=alloc, name="braid-alloc", daemon=True)
    t.start()
    t.join()
    if isinstance(got[0], BaseException):
        raise got[0]
    return got[0]


@dataclass
class LaneContext:
    """What the lanes of one communicator share: who this rank is, its device, the node segment
    (its layout, its bytes as a tensor, their device address where pinned), the ring cursors, the
    other lanes. The communicator makes one and hands it to every lane it makes; a lane needs
    nothing else of it."""
    rank: int
    world_size: int
    device: torch.device
    segment: "NodeSegment | None" = None
    layout: "Layout | None" = None
    segment_tensor: torch.Tensor | None = None
    seg_dev_ptr: int | None = None
    ring_cursors: dict = field(default_factory=dict)
    slowdown: dict = field(default_factory=dict)        # test/bench hook: CPU lane -> time multiplier
    lanes: dict = field(default_factory=dict)           # name -> lane (filled in by the communicator)

    def lane(self, name: str):
        return self.lanes[name]

    def ring_chunk(self, p2p: bool) -> int:
        """Bytes per ring slot: the pair rings' for send/recv, the collective rings' otherwise."""
        if p2p:
            return next(iter(self.layout.pair_rings.values())).slot_bytes
        return self.layout.coll_rings[0].slot_bytes


@dataclass
class OpContext:
    """What a lane needs to run its part of one call on this rank."""
    lc: LaneContext
    plan: Plan
    inp: torch.Tensor | None            # this rank's input, flat uint8
    outs: list[torch.Tensor]            # this rank's outputs, flat uint8 each
    descs: list[dict | None]            # every participant's call descriptor (None: not exchanged)
    peer: int | None = None             # the other rank of a send/recv
    start_event: "torch.cuda.Event | None" = None
    seq: dict = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return self.lc.rank


class LaneRun:
    """One lane's part of one call, in flight."""

    def __init__(self, kind: LaneKind, *, start=None, end=None, thread_fn: Callable[[], None] | None = None,
                 slowdown: float = 1.0):
        self.kind = kind
        self.start, self.end = start, end          # CUDA events (GPU lanes)
        self.error: BaseException | None = None
        self.t0 = time.perf_counter()
        self.t1: float | None = None
        self.thread = None
        if thread_fn is not None:
            def body() -> None:
                try:
                    thread_fn()
                    if slowdown > 1.0:    # test hook: this lane behaves `slowdown` times slower
                        time.sleep((time.perf_counter() - self.t0) * (slowdown - 1.0))
                except BaseException as exc:     # re-raised in the caller by wait()
                    self.error = exc
                finally:
                    self.t1 = time.perf_counter()
            self.thread = threading.Thread(target=body, name=f"braid-{kind}", daemon=True)
            self.thread.start()

    def join(self) -> None:
        """GPU: the current stream waits for the lane. CPU: block until the worker ends."""
        if self.end is not None:
            torch.cuda.current_stream().wait_event(self.end)
        if self.thread is not None:
            self.thread.join()
            if self.error is not None:
                err = self.error
                if isinstance(err, BraidError):
                    raise err
                raise LaneFailureError(f"lane {self.kind} failed: {type(err).__name__}: {err}") from err

    def done(self) -> bool:
        if self.end is not None:
            return self.end.query()
        return self.thread is None or not self.thread.is_alive()

    def elapsed_us(self) -> float:
        """The lane's own time for this call (valid once done)."""
        if self.end is not None and self.start is not None:
            self.end.synchronize()
            return self.start.elapsed_time(self.end) * 1e3
        return ((self.t1 or time.perf_counter()) - self.t0) * 1e6


class Lane:
    kind: LaneKind
    device_type: str  # "cuda" or "cpu"

    def available(self) -> tuple[bool, str]:
        raise NotImplementedError

    def post(self, ctx: OpContext, transfers: list[Transfer]) -> LaneRun:
        raise NotImplementedError

    def descriptor(self, inp: torch.Tensor | None) -> dict:
        """What peers need from this rank to run this lane (merged into the call descriptor)."""
        return {}

    def close(self) -> None:
        pass


class GpuLaneMixin:
    """Streams and events for lanes that run on CUDA streams."""

    def _begin(self, ctx: OpContext, stream: "torch.cuda.Stream"):
        stream.wait_event(ctx.start_event)
        start = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        return start

    @staticmethod
    def _end(stream: "torch.cuda.Stream"):
        end = torch.cuda.Event(enable_timing=True)
        end.record(stream)
        return end
