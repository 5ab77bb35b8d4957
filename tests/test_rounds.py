"""Deferred prepared calls (comm/rounds.py) on CPU: the rounds thread of two ranks, over a real
node segment, with the driver calls it makes (events, graph launches, stream writes of the end
counter) simulated in order per stream. What is checked: hits launch each rank's program in call
order and raise the end counter; a caller more than DEFER_DEPTH calls ahead waits for the thread;
a round where a word changed runs the op's full path on the thread, from that round, on both
ranks; an error there ends every queued call (the counter is released) and is raised to the
caller; a peer's abort ends a call waiting for its word; every other post of the caller drains the
queue first (posts stay in call order)."""
from __future__ import annotations

import ctypes
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from braid.comm import native_rounds
from braid.comm import rounds as rounds_mod
from braid.comm.prepared import NO_OBS, Entry, PreparedCalls, Ticket
from braid.errors import LaneFailureError
from braid.node import DEFER_DEPTH, Layout, NodeSegment


class FakeDriver:
    """What the rounds thread asks of the driver, per process: a graph launch runs at once (the
    'GPU' is the CPU here) and a stream write of the end counter lands in the segment."""

    def __init__(self):
        self.segments: dict[int, NodeSegment] = {}     # base address -> segment of that rank
        self.launches: list[tuple] = []
        self.lock = threading.Lock()
        self.events = 0
        self.keep: list = []

    def event_create(self):
        self.events += 1
        return self.events

    def event_destroy(self, ev):
        pass

    def event_record(self, ev, stream):
        pass

    def stream_wait_event(self, stream, ev):
        pass

    def graph_launch(self, exec_ptr, stream):
        with self.lock:
            self.launches.append((stream, exec_ptr))

    def write_value(self, stream, addr, value):
        base = max(b for b in self.segments if b <= addr)
        self.segments[base].set(addr - base, value)

    def wait_value(self, stream, addr, value):
        pass


class FakeComm(SimpleNamespace):
    """The parts of a communicator the rounds thread reads (weakly referenced, as a real one)."""


class FakeStream:
    def __init__(self, ident):
        self.cuda_stream = ident


def _native_fns(drv: FakeDriver) -> dict:
    """The fake driver as C function pointers, for the native launcher's thread (each call takes
    the interpreter lock, as a callback must)."""
    wait = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)(
        lambda s, e, f: drv.stream_wait_event(s, e) or 0)
    launch = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(
        lambda x, s: drv.graph_launch(x, s) or 0)
    write = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint)(
        lambda s, a, v, f: drv.write_value(s, a, v) or 0)
    drv.keep.append((wait, launch, write))      # alive as long as the threads that call them
    addr = lambda f: ctypes.cast(f, ctypes.c_void_p).value     # noqa: E731
    return {"wait_event": addr(wait), "graph_launch": addr(launch), "write_value": addr(write), "ctx": 0}


@pytest.fixture(params=["python", "native"])
def world(monkeypatch, request, tmp_path):
    """Two ranks' rounds threads; `native`: with the native launcher (comm/_rounds.c) in front."""
    drv = FakeDriver()
    native = request.param == "native"
    monkeypatch.setenv("BRAID_CACHE_DIR", str(tmp_path))     # where the launcher is built (once per process)
    if native and native_rounds.build() is None:
        pytest.skip("no C compiler for the native launcher")
    monkeypatch.setenv("BRAID_DEFER_NATIVE", "1" if native else "0")
    monkeypatch.setattr(rounds_mod, "_cuda", drv)
    monkeypatch.setattr(rounds_mod.torch.cuda, "Stream", lambda device=None: FakeStream(99))
    monkeypatch.setattr(rounds_mod.torch.cuda, "set_device", lambda dev: None)

    class _Ctx:
        def __init__(self, s):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False
    monkeypatch.setattr(rounds_mod.torch.cuda, "stream", _Ctx)
    switch = sys.getswitchinterval()
    layout = Layout(2, 1 << 16, 4096)
    name = NodeSegment.new_name()
    segs = [NodeSegment(name, layout, 0, create=True), NodeSegment(name, layout, 1, create=False)]
    segs[0].unlink()
    comms = []
    for r, seg in enumerate(segs):
        base = 1_000_000 * (r + 1)            # each rank's "device pointer" of its segment
        drv.segments[base] = seg
        prep = PreparedCalls(r, 2, torch.device("cpu"), cuda=False)
        comm = FakeComm(segment=seg, rank=r, layout=layout, seg_dev_ptr=base, device=torch.device("cpu"),
                               _lanes={"ce": SimpleNamespace(stream=FakeStream(10 + r))}, _prepared=prep,
                               closed=False, aborted="", shortcuts=SimpleNamespace(redo_thread=0),
                               _calls=SimpleNamespace(round=None), gave_up=[])
        comm._faults = SimpleNamespace(give_up=comm.gave_up.append)
        comm.world_size = 2
        comm.rd = rounds_mod.Rounds(comm, _native_fns(drv) if native else None)
        assert (comm.rd._native is not None) == native
        comms.append(comm)
    # the first rounds thread's communicator lowers the interpreter's switch interval (the thread
    # gets the lock sooner beside a caller that runs Python)
    assert sys.getswitchinterval() == pytest.approx(min(switch, 200e-6))
    yield drv, comms
    for c in comms:
        c.rd.close()
    for s in segs:
        s.close()
    sys.setswitchinterval(switch)


def _ticket(comm, words: tuple, exec_ptr: int) -> Ticket:
    """An entry every rank keeps under the words of both ranks (as a built call leaves it)."""
    entry = Entry(None, None, {"ce": 1.0}, ["ce"], 1, native=False)
    entry.exec_ptr = exec_ptr
    comm._prepared.put(words, entry)
    return Ticket(0, 0, words, entry, "all_gather", ("all_gather", 4, "float32", "split"), ["ce"])


def _call(comm, tk, word, redo=None):
    """The caller's side of a deferred call (CallPath.deferred without the tensors)."""
    rd = comm.rd
    rd.room()
    token = comm.segment.post_values([word, *NO_OBS], hook=False)
    n = rd.next_number()
    expect = tk.key if comm._prepared.entries.get(tk.key) is tk.entry else None
    rd.push(rounds_mod.Job(token, word, tk, rd.start_event(0), n, (), redo or (lambda: None), n, tk.op), expect)
    return n


def _ended(comm, n, timeout=10.0) -> bool:
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if comm.rd.reached(n):
            return True
        time.sleep(0.001)
    return False


def test_hits_launch_in_call_order_and_raise_the_end_counter(world):
    drv, comms = world
    words = [(11, 21), (12, 22)]
    tks = [[_ticket(c, w, exec_ptr=100 * (i + 1) + c.rank) for i, w in enumerate(words)] for c in comms]
    ns = []
    for k in range(6):                       # two shapes in turn, both ranks from their own threads
        i = k % 2
        got = [None, None]

        def rank(r):
            got[r] = _call(comms[r], tks[r][i], words[i][r])
        ts = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        ns.append(got)
    for c in comms:
        assert _ended(c, ns[-1][c.rank])
        c.rd.drain()
        mine = [p for s, p in drv.launches if s == 10 + c.rank]
        assert mine == [100 * (k % 2 + 1) + c.rank for k in range(6)], mine
        assert c._prepared.stats["deferred"] == 6 and c._prepared.stats["rebuilt"] == 0
        assert c._prepared.stats["hits"] == 6
        # with the native launcher in front, every one of them was launched without Python
        assert c._prepared.stats.get("native", 0) == (6 if c.rd._native is not None else 0)


def test_a_caller_ahead_waits_for_the_thread_at_the_depth(world):
    drv, comms = world
    tk0 = _ticket(comms[0], (1, 2), 7)
    _ticket(comms[1], (1, 2), 8)
    posted = []

    def ahead():
        for _ in range(DEFER_DEPTH + 2):
            posted.append(_call(comms[0], tk0, 1))
    t = threading.Thread(target=ahead)
    t.start()
    time.sleep(0.3)
    # rank 1 has posted nothing: rank 0's thread waits for its first word, its caller at the depth
    assert len(posted) == DEFER_DEPTH, posted
    assert not comms[0].rd.reached(posted[0])
    tk1 = Ticket(0, 0, (1, 2), comms[1]._prepared.entries[(1, 2)], "all_gather", ("all_gather", 4, "f", "split"), ["ce"])
    for _ in range(DEFER_DEPTH + 2):
        _call(comms[1], tk1, 2)
    t.join(10)
    assert not t.is_alive() and len(posted) == DEFER_DEPTH + 2
    assert _ended(comms[0], posted[-1])
    comms[0].rd.drain()
    # launched in order either way (the native launcher hands a round late beyond HANDOFF_S to Python)
    assert [p for s, p in drv.launches if s == 10] == [7] * (DEFER_DEPTH + 2)


def test_a_changed_word_runs_the_full_path_on_the_thread_from_that_round(world):
    drv, comms = world
    tks = [_ticket(c, (5, 6), 40 + c.rank) for c in comms]
    seen = {}

    def redo_of(c):
        def redo():
            seen[c.rank] = (threading.get_ident() == c.rd.ident, c._calls.round, c.shortcuts.redo_thread == c.rd.ident)
        return redo
    ns = [_call(comms[0], tks[0], 5, redo_of(comms[0])), _call(comms[1], tks[1], 66, redo_of(comms[1]))]
    for c, n in zip(comms, ns):
        assert _ended(c, n)
        c.rd.drain()
    # both ranks read the same words and both ran the op's full path, on their thread, from them
    assert seen[0] == (True, (5, [[5, *NO_OBS], [66, *NO_OBS]]), True), seen
    assert seen[1] == (True, (66, [[5, *NO_OBS], [66, *NO_OBS]]), True), seen
    assert not drv.launches
    for c in comms:
        assert c._prepared.stats["rebuilt"] == 1 and c._calls.round is None and c.shortcuts.redo_thread == 0


def test_an_error_on_the_thread_ends_every_queued_call_and_reaches_the_caller(world):
    drv, comms = world
    tks = [_ticket(c, (5, 6), 40 + c.rank) for c in comms]

    def bad():
        raise LaneFailureError("test: the rebuild failed")
    n0 = _call(comms[0], tks[0], 5, bad)
    n1 = _call(comms[0], tks[0], 5)                 # queued behind it: rank 1 has posted nothing yet
    _call(comms[1], tks[1], 66)                     # the first round misses: the rebuild fails
    with pytest.raises(LaneFailureError, match="rebuild failed"):
        comms[0].rd.drain()
    assert comms[0].rd.reached(n0) and comms[0].rd.reached(n1)
    assert comms[0].segment.get(comms[0].rd.end_off) == n1      # released from the CPU
    assert comms[0].gave_up, "the error is marked in the segment for the peers"
    with pytest.raises(LaneFailureError, match="rebuild failed"):
        _call(comms[0], tks[0], 5)


def test_a_peer_abort_ends_a_call_waiting_for_its_word(world):
    drv, comms = world
    tk = _ticket(comms[0], (1, 2), 7)
    n = _call(comms[0], tk, 1)
    time.sleep(0.05)
    comms[1].segment.mark_aborted(4, "rank 1: test abort")
    comms[1].segment.abort()
    with pytest.raises(LaneFailureError, match="rank 1 aborted"):
        t_end = time.monotonic() + 20
        while time.monotonic() < t_end:
            comms[0].rd.drain()
            time.sleep(0.01)
    assert comms[0].rd.reached(n) and not drv.launches


def test_other_posts_drain_the_queue_first(world):
    drv, comms = world
    c0, c1 = comms
    c0.segment.before_post = lambda: c0.rd.queue and c0.rd.drain()
    tk = _ticket(c0, (1, 2), 7)
    _ticket(c1, (1, 2), 8)
    n = _call(c0, tk, 1)
    out = {}

    def other_post():                        # e.g. the full path of another call on rank 0
        out["got"] = c0.segment.exchange_values([77], "next call")
        out["ended_first"] = c0.rd.reached(n)
    t = threading.Thread(target=other_post)
    t.start()
    time.sleep(0.2)
    assert "got" not in out                  # held: rank 0's deferred call has not run yet
    tk1 = Ticket(0, 0, (1, 2), c1._prepared.entries[(1, 2)], "all_gather", ("all_gather", 4, "f", "split"), ["ce"])
    _call(c1, tk1, 2)
    c1.rd.drain()
    got1 = c1.segment.exchange_values([78], "next call")
    t.join(10)
    assert out["ended_first"] and out["got"] == got1 == [[77], [78]]


def test_calls_queued_behind_a_rebuild_are_decided_after_it(world):
    """A rebuild may change the cache that later queued calls were pushed against: they are
    decided after it, against the cache as it then is (the native launcher hands them back)."""
    drv, comms = world
    tks = [_ticket(c, (5, 6), 40 + c.rank) for c in comms]
    later = [_ticket(c, (7, 8), 60 + c.rank) for c in comms]
    n0 = [_call(comms[0], tks[0], 5), _call(comms[0], later[0], 7)]
    n1 = [_call(comms[1], tks[1], 66), _call(comms[1], later[1], 8)]      # the first call's word differs
    for c, ns in zip(comms, (n0, n1)):
        assert _ended(c, ns[-1])
        c.rd.drain()
        assert [p for s, p in drv.launches if s == 10 + c.rank] == [60 + c.rank]
        assert c._prepared.stats["rebuilt"] == 1
    # rank 0 had queued both before its first round could be read: the second was decided in Python
    # after the rebuild (rank 1 may push its second after the rebuild, against the new cache)
    assert comms[0]._prepared.stats.get("native", 0) == 0
