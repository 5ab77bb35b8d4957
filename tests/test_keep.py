"""The tensors of an async call stay alive until the call's end without record_stream: the handle
holds them until wait(); a handle dropped unwaited passes them on until its end is reached, and a
later call's sweep releases them then (executor.hold_until / sweep). CPU stand-ins for the lanes'
end events; the GPU tier runs the real ones (tests/gpu/test_gpu_backend.py's compiled step)."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from braid import executor
from braid.executor import Handle
from braid.lanes.base import kept_buffer


class _End:
    def __init__(self):
        self.done = False

    def query(self) -> bool:
        return self.done


class _Run:
    def __init__(self, end):
        self.end = end
        self.joined = 0

    def join(self):
        self.joined += 1


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.setattr(executor, "_UNWAITED", [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    yield


def _handle_with(t: torch.Tensor, ends) -> Handle:
    h = Handle([_Run(e) for e in ends])
    h.keep = (t, t[1:])
    return h


def test_a_waited_handle_lets_its_tensors_go_at_wait():
    t = torch.randn(1000)
    ref = weakref.ref(t)
    h = _handle_with(t, [_End()])
    del t
    assert ref() is not None            # held by the handle before its wait
    h.wait()
    assert h.runs[0].joined == 1
    gc.collect()
    assert ref() is None
    del h
    assert executor._UNWAITED == []     # nothing handed on


def test_a_dropped_handle_keeps_its_tensors_until_every_end_is_reached():
    t = torch.randn(1001)
    ref = weakref.ref(t)
    ends = [_End(), _End()]
    h = _handle_with(t, ends)
    del t, h
    gc.collect()
    assert ref() is not None and len(executor._UNWAITED) == 1
    executor.sweep()                    # neither lane ended: still held
    assert ref() is not None
    ends[0].done = True
    executor.sweep()                    # one of two: still held
    assert ref() is not None
    ends[1].done = True
    executor.sweep()
    gc.collect()
    assert ref() is None and executor._UNWAITED == []


def test_a_handle_with_its_event_only_waits_for_that_event():
    t = torch.randn(17)
    ref = weakref.ref(t)
    ev = _End()
    h = Handle([], event=ev)
    h.keep = (t,)
    del t, h
    executor.sweep()
    assert ref() is not None
    ev.done = True
    executor.sweep()
    gc.collect()
    assert ref() is None


def test_a_failing_end_test_releases_rather_than_holds_forever():
    t = torch.randn(5)
    ref = weakref.ref(t)

    def gone():
        raise RuntimeError("the communicator was closed")
    executor.hold_until(gone, (t,))
    del t
    executor.sweep()
    gc.collect()
    assert ref() is None and executor._UNWAITED == []


def test_a_handle_without_tensors_hands_on_nothing():
    h = Handle([_Run(_End())])
    del h
    assert executor._UNWAITED == []


def test_kept_buffer_on_cpu_is_a_plain_byte_buffer():
    b = kept_buffer(4097, torch.device("cpu"))
    assert b.dtype == torch.uint8 and b.numel() == 4097 and b.device.type == "cpu"


def test_a_waited_native_work_is_let_go():
    # the library's Work holds the call's tensors: a handle kept as last_handle must not pin it
    class Work:
        waited = 0

        def wait(self):
            Work.waited += 1
            return True

        def is_completed(self):
            return False
    w = Work()
    ref = weakref.ref(w)
    h = Handle(native=w)
    del w
    assert ref() is not None
    h.wait()
    gc.collect()
    assert ref() is None and Work.waited == 1
    assert h.is_completed() and h.shares == {"nccl": 1.0}


def test_held_tensors_are_swept_as_they_grow_even_without_later_calls():
    ends = []
    refs = []
    for i in range(64):
        t = torch.randn(3)
        refs.append(weakref.ref(t))
        e = _End()
        e.done = i < 32
        ends.append(e)
        executor.hold_until(e.query, (t,))
        del t
    gc.collect()
    assert sum(r() is None for r in refs) == 32 and len(executor._UNWAITED) == 32
