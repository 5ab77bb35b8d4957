"""Where a GPU call's future completes (backend_work.BraidWork.get_future), with torch's CUDA
future, streams and events replaced by recorders: a call that ends on one stream (a replayed
call's lane stream) completes its future there, with no side stream and no event of braid's own;
any other call's future completes on the side stream after that stream waited for the call."""
from __future__ import annotations

import contextlib

import torch

from braid import backend_work
from braid.backend_work import BraidWork


class _GpuTensor(torch.Tensor):
    """A CPU tensor that says it is on cuda:0 (what get_future reads of it)."""

    @property
    def is_cuda(self):
        return True

    @property
    def device(self):
        return torch.device("cuda", 0)


class _Handle:
    def __init__(self, stream=None):
        self.stream = stream
        self.waits = []

    def wait(self, timeout=None):
        self.waits.append(_World.current)
        return True

    def is_completed(self):
        return False


class _World:
    current = "caller"
    log: list = []
    device = 0          # the current GPU


class _Lane:
    """A lane stream as torch's CUDA stream describes itself (id, device, type)."""
    stream_id, device_index, device_type = 7, 0, 1

    def __eq__(self, other):
        return other == "lane"

    def __hash__(self):
        return hash("lane")


_IDS = {1: "caller", 7: "lane"}


def _patch(monkeypatch, low_level=True):
    """low_level: torch's calls beneath torch.cuda.stream() (a CUDA build's) are there."""
    _World.current, _World.log, _World.device = "caller", [], 0

    class Future:
        def __init__(self, devices=None):
            _World.log.append(("future", tuple(str(d) for d in devices or ())))

        def set_result(self, value):
            _World.log.append(("set_result", _World.current, len(value)))

        def set_exception(self, exc):
            _World.log.append(("set_exception", repr(exc)))

    class Event:
        def __init__(self):
            _World.log.append(("event",))

        def record(self, stream):
            _World.log.append(("record", stream))

    @contextlib.contextmanager
    def stream(s):
        before, _World.current = _World.current, s
        try:
            yield
        finally:
            _World.current = before

    monkeypatch.setattr(backend_work.torch.futures, "Future", Future)
    monkeypatch.setattr(backend_work.torch.cuda, "stream", stream)
    monkeypatch.setattr(backend_work.torch.cuda, "Event", Event)
    monkeypatch.setattr(backend_work, "_future_stream", lambda device: "side")

    def get_current(index):
        assert index == _World.device
        return ({v: k for k, v in _IDS.items()}[_World.current], index, 1)

    def set_stream(stream_id, device_index, device_type):
        assert device_index == _World.device and device_type == 1
        _World.log.append(("set_stream", _IDS[stream_id]))
        _World.current = _IDS[stream_id]
    monkeypatch.setattr(backend_work, "_STREAM_CALLS",
                        (get_current, set_stream, lambda: _World.device) if low_level else None)


def _result():
    return [torch.Tensor._make_subclass(_GpuTensor, torch.arange(6.0))]


def test_a_call_that_ends_on_one_stream_completes_its_future_there(monkeypatch):
    _patch(monkeypatch)
    h = _Handle(stream=_Lane())
    work = BraidWork(h, _result())
    fut = work.get_future()
    assert work.get_future() is fut                       # one future per Work
    assert _World.log == [("future", ("cuda:0",)), ("set_stream", "lane"), ("set_result", "lane", 1),
                          ("set_stream", "caller")]       # torch's own stream switch, there and back
    assert h.waits == [] and work._side_done is None      # no side stream, no event of braid's own
    assert _World.current == "caller"                     # the caller's stream is current again
    work.wait()                                           # the caller's stream waits for the call itself
    assert h.waits == ["caller"]


def test_the_stream_switch_without_torch_s_low_level_calls_or_on_another_gpu(monkeypatch):
    for low_level, device in ((False, 0), (True, 1)):
        _patch(monkeypatch, low_level)
        _World.device = device              # the current GPU is not the lane's: torch.cuda.stream()
        work = BraidWork(_Handle(stream=_Lane()), _result())
        work.get_future()
        assert _World.log == [("future", ("cuda:0",)), ("set_result", "lane", 1)]
        assert _World.current == "caller"


def test_a_failed_result_leaves_the_caller_s_stream_current(monkeypatch):
    _patch(monkeypatch)

    def set_result(self, value):
        raise RuntimeError("no room")
    monkeypatch.setattr(backend_work.torch.futures.Future, "set_result", set_result)
    work = BraidWork(_Handle(stream=_Lane()), _result())
    work.get_future()
    assert _World.current == "caller" and _World.log[-1] == ("set_exception", "RuntimeError('no room')")
    assert work.exception() is not None and not work.is_success()


def test_any_other_call_completes_its_future_on_the_side_stream(monkeypatch):
    _patch(monkeypatch)
    h = _Handle(stream=None)
    work = BraidWork(h, _result())
    work.get_future()
    assert h.waits == ["side"]                            # the side stream waited for the call first
    assert _World.log == [("future", ("cuda:0",)), ("event",), ("record", "side"), ("set_result", "side", 1)]
    assert work._side_done is not None and _World.current == "caller"


def test_a_finished_call_completes_its_future_at_once(monkeypatch):
    _patch(monkeypatch)
    h = _Handle(stream=_Lane())
    work = BraidWork(h, _result())
    work.wait()
    work.get_future()
    assert _World.log == [("future", ("cuda:0",)), ("set_result", "caller", 1)]


def test_the_side_streams_future_holds_the_calls_tensors_to_its_event(monkeypatch):
    # the side stream's wait lets the handle's tensors go (Handle.wait): get_future holds them
    # until the side stream's event, which follows the call
    import gc
    import weakref
    from braid import executor
    _patch(monkeypatch)
    monkeypatch.setattr(executor, "_UNWAITED", [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    done = {"v": False}
    monkeypatch.setattr(torch.cuda.Event, "query", lambda self: done["v"], raising=False)
    h = _Handle(stream=None)
    t = torch.randn(9)
    ref = weakref.ref(t)
    h.keep = (t,)
    work = BraidWork(h, _result())
    del t
    work.get_future()
    h.keep = ()                 # what the real handle's wait does
    gc.collect()
    assert ref() is not None and len(executor._UNWAITED) == 1
    executor.sweep()
    assert ref() is not None
    done["v"] = True
    executor.sweep()
    gc.collect()
    assert ref() is None
