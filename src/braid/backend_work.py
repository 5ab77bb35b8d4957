"""The pieces of braid's process group that are not the group itself: the Work objects it returns
(braid's handles as torch Work, CUDA futures completed on a side stream, queued send/recv work,
any-source receives), the records braid's calls leave in torch's profiler, the inner groups' method
lookup across torch versions, and small helpers. backend.py's BraidProcessGroup uses them."""
from __future__ import annotations

import logging
import os
import queue
import threading

import torch
import torch.distributed as dist

from .executor import Works, hold_until

log = logging.getLogger("braid")


def _tensors_in(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors_in(x)


def _detached(obj):
    """`obj` with every tensor that requires grad replaced by its detached alias (same storage):
    the inner group's own copies would otherwise be recorded by autograd (gloo's reduce_scatter
    and all_gather), and collectives stay out of autograd, as NCCL's do."""
    if isinstance(obj, torch.Tensor):
        return obj.detach() if obj.requires_grad else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_detached(x) for x in obj)
    return obj


_FUTURE_STREAMS: dict[int, "torch.cuda.Stream"] = {}


def _future_stream(device: torch.device):
    """One side stream per GPU on which futures of braid's GPU calls wait (see get_future)."""
    s = _FUTURE_STREAMS.get(device.index)
    if s is None:
        s = _FUTURE_STREAMS[device.index] = torch.cuda.Stream(device)
    return s


class BraidWork(dist._Work):
    """torch's Work around a braid handle. wait(): on GPUs the current stream waits for the call
    (no CPU block), on CPU it blocks until done, as Handle.wait does. get_future() returns a
    future holding `result` (the tensors the call wrote), which DDP's communication hooks chain
    on. On GPUs it is a CUDA future, as NCCL's, completed on the stream where the call ends (a
    replayed call's lane stream) or on a side stream that waits for the call, so whoever uses its
    value waits for the call and nobody else does (the caller's stream is not made to wait: in DDP
    the rest of the backward pass keeps running beside the bucket's all_reduce). handle None: the
    call has finished already."""

    _record = None      # the call's open profiler record (see _record_begin), ended once done

    def __init__(self, handle, result):
        super().__init__()
        self._handle = handle
        self._result = result
        self._waited = handle is None
        self._error: BaseException | None = None
        self._future = None
        self._side_done = None       # GPU: an event after the call, recorded by get_future

    def wait(self, timeout=None) -> bool:
        if self._error is not None:
            raise self._error
        if not self._waited:
            self._waited = True
            try:
                self._finish()
            except BaseException as exc:
                self._error = exc
                raise
            finally:
                if self._record is not None:
                    self._end_record()
        return True

    def _end_record(self) -> None:
        rec, self._record = self._record, None
        if rec is not None:
            _record_end(rec)

    def _finish(self) -> None:
        if self._side_done is not None:       # the handle was waited on the future's stream
            torch.cuda.current_stream().wait_event(self._side_done)
        else:
            self._handle.wait()

    def is_completed(self) -> bool:
        if self._waited:
            return True
        if self._side_done is not None:
            done = bool(self._side_done.query())
        else:
            done = bool(self._handle.is_completed())
        if done and self._record is not None:
            self._end_record()
        return done

    def is_success(self) -> bool:
        return self._error is None

    def exception(self):
        return self._error

    def result(self):
        return list(self._result)

    def synchronize(self) -> None:
        self.wait()

    def get_future(self):
        if self._future is None:
            lane = getattr(self._handle, "stream", None) if not self._waited else None
            if lane is not None:        # a replayed call (DDP's every bucket): the short path
                fut = self._future = torch.futures.Future(devices=_devices(lane.device_index))
                try:
                    # the call's end is the last work on its lane stream: the future's own events,
                    # recorded there, mark it (no side stream, no event of braid's own). Asked
                    # later, after more of braid's work on that stream, it completes later: never
                    # early.
                    _set_result_on(fut, list(self._result), lane)
                except BaseException as exc:
                    self._error = exc
                    fut.set_exception(exc)
                if self._record is not None:
                    self._end_record()
                return fut
            cuda = [t.device for t in self._result if isinstance(t, torch.Tensor) and t.is_cuda]
            if not cuda:
                fut = self._future = torch.futures.Future()
                try:
                    self.wait()
                except BaseException as exc:
                    fut.set_exception(exc)
                else:
                    fut.set_result(list(self._result))
                return fut
            fut = self._future = torch.futures.Future(devices=sorted({str(d) for d in cuda}))
            try:
                if self._waited:                # finished, or the caller's stream waited already
                    fut.set_result(list(self._result))
                    return fut
                side = _future_stream(cuda[0])
                kept = getattr(self._handle, "keep", ())    # (a wait lets them go: held to the side's event)
                with torch.cuda.stream(side):
                    self._handle.wait()     # the side stream waits for the call, no CPU block
                    done = torch.cuda.Event()
                    done.record(side)
                    self._side_done = done
                    fut.set_result(list(self._result))   # its events are recorded on the side stream
                if kept:
                    hold_until(done.query, kept)
            except BaseException as exc:
                self._error = exc
                fut.set_exception(exc)
            if self._record is not None:      # GPU: the call is queued behind the future's events
                self._end_record()
        return self._future


_DEVICES: dict[int, list] = {}


def _devices(index: int) -> list:
    """[cuda:index], made once per GPU (a future's devices)."""
    d = _DEVICES.get(index)
    if d is None:
        d = _DEVICES[index] = [torch.device("cuda", index)]
    return d


# torch's own calls beneath torch.cuda.stream() (a CUDA build's): the current stream of a GPU,
# setting it, the current GPU; None where torch lacks one of them
_STREAM_CALLS = tuple(getattr(torch._C, n, None) for n in ("_cuda_getCurrentStream", "_cuda_setStream",
                                                          "_cuda_getDevice"))
if None in _STREAM_CALLS:
    _STREAM_CALLS = None


def _set_result_on(fut, value, stream) -> None:
    """fut.set_result(value) with `stream` as its GPU's current stream (the future records its
    events on the current streams). On the current GPU through torch's own calls beneath
    torch.cuda.stream(): that context manager's device lookups cost ~10-20 us of host time a call,
    more inside a training step, and DDP asks every bucket's future."""
    idx = stream.device_index
    if _STREAM_CALLS is None or _STREAM_CALLS[2]() != idx:
        with torch.cuda.stream(stream):
            fut.set_result(value)
        return
    get, put, _ = _STREAM_CALLS
    prev = get(idx)
    put(stream_id=stream.stream_id, device_index=idx, device_type=stream.device_type)
    try:
        fut.set_result(value)
    finally:
        put(stream_id=prev[0], device_index=prev[1], device_type=prev[2])


class _QueuedWork(BraidWork):
    """The Work of a queued GPU send/recv: asking it anything posts the queue first."""

    def __init__(self, pg, result):      # pg: the BraidProcessGroup
        super().__init__(None, result)
        self._pg = pg
        self._waited = False
        self._inner = None

    def _posted(self, work) -> None:
        self._inner = work

    def _post(self) -> None:
        if self._inner is None:
            self._pg.flush_p2p()

    def _finish(self) -> None:
        self._post()
        if self._inner is not None:
            self._inner.wait()

    def is_completed(self) -> bool:
        self._post()
        done = self._waited or self._inner is None or bool(self._inner.is_completed())
        if done and self._record is not None:
            self._end_record()
        return done


class _AnySourceWork(BraidWork):
    """The Work of a receive from any source that braid served from a known peer: torch's
    dist.recv/irecv ask it for the sender (_source_rank)."""

    def __init__(self, handle, result, source: int):
        super().__init__(handle, result)
        self._source = source

    def _source_rank(self) -> int:
        return self._source

    def source_rank(self) -> int:
        return self._source


def _together(works: list, result) -> BraidWork:
    """One Work for `works` (torch's coalesced forms run pair by pair), its result the tensors
    `result`."""
    return BraidWork(Works(works), list(result)) if works else _done(list(result))


def _coalescing(fn, dev):
    """A backend's _start/_end_coalescing: no argument on a raw backend (torch 2.11), the device
    on a ProcessGroup."""
    try:
        return fn()
    except TypeError:
        return fn(dev)


# torch >= 2.13 calls a Python process group's single-tensor collectives by new names; the raw
# gloo/NCCL backend objects may still carry only the old ones
_OLD_NAMES = {"all_gather_single": "_allgather_base", "reduce_scatter_single": "_reduce_scatter_base",
              "all_to_all_single": "alltoall_base"}


# torch's method names as braid's op names (the call ledger, see CallLedger.enter)
_OP_OF = {"allreduce": "all_reduce", "broadcast": "broadcast", "_allgather_base": "all_gather",
          "all_gather_single": "all_gather", "_reduce_scatter_base": "reduce_scatter",
          "reduce_scatter_single": "reduce_scatter", "alltoall_base": "all_to_all_single",
          "all_to_all_single": "all_to_all_single"}


def _method(inner, name: str):
    fn = getattr(inner, name, None)
    if fn is None and name in _OLD_NAMES:
        fn = getattr(inner, _OLD_NAMES[name], None)
    if fn is None:
        raise AttributeError(f"the inner {type(inner).__name__} group has no {name!r}")
    return fn


_FINISHED: list = []


def _finished() -> BraidWork:
    """One shared Work for synchronous calls that the inner group ran without returning a Work
    (NCCL on the caller's stream): already complete, no result, so one object serves every call
    (a new Work per call cost several us of host time)."""
    if not _FINISHED:
        _FINISHED.append(BraidWork(None, []))
    return _FINISHED[0]


def _done(result=()) -> BraidWork:
    return BraidWork(None, list(result))


def _make_nccl(store, rank: int, size: int, timeout):
    """A raw ProcessGroupNCCL over `store`, or None where CUDA or NCCL is missing."""
    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        return None
    try:
        from torch.distributed import ProcessGroupNCCL
        opts = ProcessGroupNCCL.Options()
        if timeout is not None:
            opts._timeout = timeout
        return ProcessGroupNCCL(store, rank, size, opts)
    except Exception as exc:    # an API change: braid still runs, CUDA ops braid lacks then fail
        log.warning("braid backend: no inner NCCL group (%s); CUDA ops that braid does not "
                    "implement will fail", exc)
        return None


# ------------------------------------------------------------------------------------------------
# profiler records: one "braid:<op>" event per call, as gloo and NCCL record "gloo:<op>"/"nccl:<op>"
# ------------------------------------------------------------------------------------------------
# The check on every call (backend.py): torch's own test of whether a profiler runs in this thread,
# a C function bound once; the rest runs only under a profiler.
profiler_on = torch._C._autograd._profiler_enabled


def _record_begin(title: str, tensors):
    """Open the profiler record of one call, named `title` ("braid:all_reduce"), with the call's
    input tensors as its inputs (the profiler's input shapes, with record_shapes=True). Returns a
    future: completing it ends the record (see _record_end)."""
    handle = torch._C._autograd._record_function_with_args_enter(
        title, *[t for t in tensors if isinstance(t, torch.Tensor)])
    end = torch.futures.Future()
    torch.ops.profiler._call_end_callbacks_on_jit_fut(handle, end)
    return end


def _record_end(end) -> None:
    """End a record opened by _record_begin. The end runs on braid's profiler thread while the
    caller waits: a record that starts and ends on different threads is an asynchronous event,
    as the events of gloo's and NCCL's Work objects are (theirs end on their worker threads), so
    braid's calls show in the profiler as theirs do. Returns once the record has ended, so a
    profiler stopped right after the call still holds it."""
    global _ENDER
    if end.done():
        return
    done = threading.Event()
    with _ENDER_LOCK:
        if _ENDER is None or _ENDER.pid != os.getpid():     # none yet, or a forked child's copy
            _ENDER = _RecordEnder()
        _ENDER.jobs.put((end, done))
    done.wait()


class _RecordEnder:
    """The thread that ends braid's profiler records (see _record_end). Started on the first
    record; it exits after IDLE_S without one (the next record starts another)."""

    IDLE_S = 2.0

    def __init__(self):
        self.pid = os.getpid()
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name="braid-profiler", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        global _ENDER
        while True:
            try:
                end, done = self.jobs.get(timeout=self.IDLE_S)
            except queue.Empty:
                with _ENDER_LOCK:
                    if self.jobs.empty():       # jobs are put under the lock: none can follow
                        if _ENDER is self:
                            _ENDER = None
                        return
                continue
            try:
                if not end.done():
                    end.set_result(None)
            except Exception as exc:    # the profiler's own callbacks: report, keep serving
                log.debug("braid backend: ending a profiler record failed: %s", exc)
            finally:
                done.set()


_ENDER: _RecordEnder | None = None
_ENDER_LOCK = threading.Lock()
