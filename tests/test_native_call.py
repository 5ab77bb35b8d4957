"""The native repeated call (comm/_rounds.c fast_call, native_rounds.FastCalls) on CPU, over a real
node segment of two ranks, with the driver calls it makes simulated by callbacks that record them.
What is checked: its word is the Python path's word (mix_word, on many values); its post is read
by the Python round and it reads the Python round's post (either rank may take either path); a
round whose words match launches the program on the caller's stream (synchronous), or forked on
the lane stream with its end event (and the caller's wait when synchronous); a word that differs,
a count that differs and a late peer leave the round posted and readable; a capture, and a driver
error in the allocation's id, post nothing; a driver error in the launch is reported with its
code. Then CallPath.fast_prepared with it: a hit books the call as the Python path does, a miss
hands the round to the full path, a capture undoes the count and the sequence number."""
from __future__ import annotations

import ctypes
import random
import threading
from types import SimpleNamespace

import pytest
import torch

from braid.comm import callpath, native_rounds
from braid.comm import prepared as prepared_mod
from braid.comm.callpath import CallPath
from braid.comm.ledger import CallLedger
from braid.comm.prepared import NO_OBS, Entry, Ticket, mix_word
from braid.comm.uneven import ROUND_TAG, round_len
from braid.errors import LaneFailureError, PeerMismatchError
from braid.node import COLL_MBOX_BYTES, COLL_SLOTS, Layout, NodeSegment

NV = 1 + len(NO_OBS)
_vp, _u64, _int = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int


class Driver:
    """Records every driver call (name, arguments) per calling thread's rank, answers with the ids
    and errors set here."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.ids: dict[int, int] = {}       # pointer -> allocation id
        self.capturing = False
        self.fail: dict[str, int] = {}      # driver function -> error code it returns
        self.lock = threading.Lock()
        self.keep = []

    def _rec(self, name, *args):
        with self.lock:
            self.calls.append((name, *[a or 0 for a in args]))
        return self.fail.get(name, 0)

    def fns(self) -> dict:
        def ptr_attr(data, attr, ptr):
            if attr != 7:
                return 1
            ctypes.c_uint64.from_address(data).value = self.ids[ptr]
            return self._rec("ptr_attr", ptr)

        def is_capturing(stream, status):
            status[0] = 1 if self.capturing else 0
            return self.fail.get("is_capturing", 0)
        cbs = {
            "ptr_attr": ctypes.CFUNCTYPE(_int, _vp, _int, _u64)(ptr_attr),
            "event_record": ctypes.CFUNCTYPE(_int, _vp, _vp)(lambda e, s: self._rec("event_record", e, s)),
            "wait_event": ctypes.CFUNCTYPE(_int, _vp, _vp, ctypes.c_uint)(lambda s, e, f: self._rec("wait_event", s, e)),
            "graph_launch": ctypes.CFUNCTYPE(_int, _vp, _vp)(lambda x, s: self._rec("graph_launch", x, s)),
            "is_capturing": ctypes.CFUNCTYPE(_int, _vp, ctypes.POINTER(_int))(is_capturing),
        }
        self.keep.append(cbs)
        return {k: ctypes.cast(f, _vp).value for k, f in cbs.items()}


@pytest.fixture
def world(tmp_path, monkeypatch):
    monkeypatch.setenv("BRAID_CACHE_DIR", str(tmp_path))
    lib = native_rounds.build()
    if lib is None:
        pytest.skip("no C compiler for the native call")
    layout = Layout(2, 1 << 16, 4096)
    name = NodeSegment.new_name()
    segs = [NodeSegment(name, layout, 0, create=True), NodeSegment(name, layout, 1, create=False)]
    segs[0].unlink()
    drv = Driver()
    fns = drv.fns()
    fasts = [native_rounds.FastCalls(lib, 2, r, COLL_SLOTS, NV, COLL_MBOX_BYTES,
                                     [seg.address + c for c in seg._coll_ctr],
                                     [seg.address + s[0] for s in seg._coll_slots], fns, 0.05)
             for r, seg in enumerate(segs)]
    yield lib, segs, fasts, drv
    for f in fasts:
        f.close()
    for s in segs:
        s.close()


def test_the_word_is_the_python_paths_word(world):
    lib = world[0]
    rng = random.Random(5)
    for _ in range(2000):
        base = rng.getrandbits(64) - (1 << 63)          # a Python hash: signed
        ident = rng.choice([0, 1, rng.getrandbits(16), rng.getrandbits(64)])
        assert lib.mix_word(base & ((1 << 64) - 1), ident) == mix_word(base, ident)
    assert mix_word(-1, 0) == (1 << 63) - 1


def _ticket(fast, base, key, exec_ptr=0x5000, stream=0x77, start=0x31):
    return fast.ticket(base, exec_ptr, stream, start, key)


def test_a_native_post_meets_a_python_post_both_ways(world):
    _, segs, fasts, drv = world
    drv.ids = {0xA000: 11, 0xB000: 12}
    w0, w1 = mix_word(3, 11), mix_word(-4, 12)
    # rank 1 posts in Python first, rank 0 calls natively: its round is complete, it launches
    token1 = segs[1].post_values([w1, *NO_OBS])
    t0 = _ticket(fasts[0], 3, (w0, w1))
    seq = segs[0].next_seq()
    assert seq == token1[0]
    assert fasts[0].call(t0, seq, 0xA000, 0x900, 0, 0) == native_rounds.HIT
    assert fasts[0].word.value == w0
    assert drv.calls == [("ptr_attr", 0xA000), ("graph_launch", 0x5000, 0x900)]
    assert segs[1].read_values(token1, "t") == [[w0, *NO_OBS], [w1, *NO_OBS]]
    # the other way round: rank 0 native first (rank 1 not there yet: late, posted), rank 1 in Python
    drv.calls.clear()
    seq = segs[0].next_seq()
    assert fasts[0].call(t0, seq, 0xA000, 0x900, 0, 0) == native_rounds.LATE
    assert drv.calls == [("ptr_attr", 0xA000)]          # no launch
    token1 = segs[1].post_values([w1, *NO_OBS])
    assert segs[1].read_values(token1, "t") == [[w0, *NO_OBS], [w1, *NO_OBS]]
    assert segs[0].read_values((seq, NV), "t") == [[w0, *NO_OBS], [w1, *NO_OBS]]


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_both_ranks_native_launch_as_the_mode_says(world, mode):
    _, segs, fasts, drv = world
    drv.ids = {0xA000: 1, 0xB000: 2}
    key = (mix_word(10, 1), mix_word(20, 2))
    tks = [_ticket(fasts[0], 10, key, exec_ptr=0x5000, stream=0x70), _ticket(fasts[1], 20, key, exec_ptr=0x6000,
                                                                             stream=0x71)]
    codes = [None, None]

    def rank(r):
        for _ in range(50):
            seq = segs[r].next_seq()
            codes[r] = fasts[r].call(tks[r], seq, (0xA000, 0xB000)[r], 0x900 + r, 0xE0 + r, mode)
            if codes[r] != native_rounds.HIT:
                return
    th = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in th:
        t.start()
    for t in th:
        t.join(30)
    assert codes == [native_rounds.HIT, native_rounds.HIT]
    mine = [c for c in drv.calls if c[0] != "ptr_attr" and (0x900 in c or 0x70 in c or 0xE0 in c)]
    one = {0: [("graph_launch", 0x5000, 0x900)],
           1: [("event_record", 0x31, 0x900), ("wait_event", 0x70, 0x31), ("graph_launch", 0x5000, 0x70),
               ("event_record", 0xE0, 0x70), ("wait_event", 0x900, 0xE0)],
           2: [("event_record", 0x31, 0x900), ("wait_event", 0x70, 0x31), ("graph_launch", 0x5000, 0x70),
               ("event_record", 0xE0, 0x70)]}[mode]
    assert mine == one * 50
    assert fasts[0].round_ns.value >= 0


def test_a_differing_word_or_count_leaves_the_round_to_python(world):
    _, segs, fasts, drv = world
    drv.ids = {0xA000: 1}
    w0 = mix_word(10, 1)
    token1 = segs[1].post_values([999, *NO_OBS])            # rank 1 made another call
    seq = segs[0].next_seq()
    assert fasts[0].call(_ticket(fasts[0], 10, (w0, 5)), seq, 0xA000, 0x900, 0, 0) == native_rounds.DIFF
    assert not [c for c in drv.calls if c[0] == "graph_launch"]
    assert segs[0].read_values((seq, NV), "t")[1][0] == 999
    segs[1].read_values(token1, "t")
    # a peer whose post has another count: not launched, and the Python read names the mismatch
    segs[1].post_values([5, 0])
    seq = segs[0].next_seq()
    assert fasts[0].call(_ticket(fasts[0], 10, (w0, 5)), seq, 0xA000, 0x900, 0, 0) == native_rounds.DIFF
    with pytest.raises(PeerMismatchError):
        segs[0].read_values((seq, NV), "t")


def test_a_capture_or_an_id_error_posts_nothing(world):
    _, segs, fasts, drv = world
    drv.ids = {0xA000: 1}
    t = _ticket(fasts[0], 10, (1, 2))
    before = segs[0].u32[segs[0]._coll_ctr[0] // 4]
    drv.capturing = True
    assert fasts[0].call(t, 1, 0xA000, 0x900, 0, 0) == native_rounds.CAPTURING
    drv.capturing = False
    drv.fail = {"is_capturing": 900}                        # a check that fails counts as capturing
    assert fasts[0].call(t, 1, 0xA000, 0x900, 0, 0) == native_rounds.CAPTURING
    drv.fail = {"ptr_attr": 400}
    assert fasts[0].call(t, 1, 0xA000, 0x900, 0, 0) == native_rounds.ID_ERR
    assert fasts[0].rc.value == 400
    assert segs[0].u32[segs[0]._coll_ctr[0] // 4] == before
    assert not [c for c in drv.calls if c[0] != "ptr_attr"]


def test_a_launch_error_comes_back_with_its_code(world):
    _, segs, fasts, drv = world
    key = (mix_word(10, 0), mix_word(20, 0))
    token1 = segs[1].post_values([key[1], *NO_OBS])
    drv.fail = {"graph_launch": 719}
    seq = segs[0].next_seq()
    assert fasts[0].call(_ticket(fasts[0], 10, key), seq, 0, 0x900, 0, 1) == native_rounds.LAUNCH_ERR
    assert fasts[0].rc.value == 719
    assert [c[0] for c in drv.calls] == ["event_record", "wait_event", "graph_launch"]
    segs[1].read_values(token1, "t")


# CallPath.fast_prepared with the native call ------------------------------------------------------

class _Prep(SimpleNamespace):
    pass


def _comm(seg, fast, key, monkeypatch):
    entry = Entry(None, "plan", {"ce": 1.0}, ["ce"], 1, native=False)
    entry.exec_ptr = 0x5000
    tk = Ticket(base=10, bal=0, key=key, entry=entry, op="all_reduce",
                ledger=("all_reduce", 4096, "torch.float32", "split"), lanes=["ce"])
    stats = {"round_us": 0.0, "replays": 0, "hits": 0, "native_calls": 0, "native_late": 0}
    prep = _Prep(tickets={"t": tk}, enabled=True, stats=stats, fast=fast, dirty=False, entries={key: entry},
                 end_event=lambda: 0xE0, fork_event=lambda: 0x31)
    prep.get = lambda k: (stats.__setitem__("hits", stats["hits"] + 1), prep.entries.get(k))[1]
    prep.joined = lambda async_op, end, stream, tensors, plan, done=None: ("joined", async_op, end)
    led = CallLedger(0, True, None)
    led.ncalls = 40
    comm = SimpleNamespace(
        prepared=prep, rounds=None, pending=[], segment=seg,
        policy=SimpleNamespace(balancer=SimpleNamespace(version=0), pending={}), device=torch.device("cpu"),
        ce=SimpleNamespace(stream=SimpleNamespace(cuda_stream=0x70)), ledger=led, round=None, gave_up=[])
    comm.faults = SimpleNamespace(closed=False, aborted=False, watchdog=None, give_up=comm.gave_up.append)
    for name in ("native_replay", "_ticket", "replay_agreed"):
        setattr(comm, name, getattr(CallPath, name).__get__(comm))
    monkeypatch.setattr(callpath, "_RAW", lambda dev: 0x900)
    monkeypatch.setattr(callpath, "_capturing", lambda: False)
    return comm, tk


class _Inp:
    def __init__(self, ptr):
        self.ptr = ptr

    def data_ptr(self):
        return self.ptr

    def numel(self):
        return 4


def test_fast_prepared_books_a_native_hit_as_the_python_path(world, monkeypatch):
    _, segs, fasts, drv = world
    drv.ids = {0xA000: 7}
    key = (mix_word(10, 7), 55)
    comm, tk = _comm(segs[0], fasts[0], key, monkeypatch)
    token1 = segs[1].post_values([55, *NO_OBS])
    assert CallPath.fast_prepared(comm, "t", _Inp(0xA000), (), False) is prepared_mod._DONE
    assert comm.ledger.ncalls == 41 and comm.ledger.last_call == tk.ledger
    st = comm.prepared.stats
    assert st["replays"] == 1 and st["hits"] == 1 and st["native_calls"] == 1
    assert tk.native is not None and [c[0] for c in drv.calls] == ["ptr_attr", "graph_launch"]
    segs[1].read_values(token1, "t")
    # async: forked, the handle from the cache's bookkeeping
    token1 = segs[1].post_values([55, *NO_OBS])
    assert CallPath.fast_prepared(comm, "t", _Inp(0xA000), (), True) == ("joined", True, 0xE0)
    segs[1].read_values(token1, "t")


def test_fast_prepared_hands_a_miss_to_the_full_path(world, monkeypatch):
    _, segs, fasts, drv = world
    drv.ids = {0xA000: 7}
    key = (mix_word(10, 7), 55)
    comm, tk = _comm(segs[0], fasts[0], key, monkeypatch)
    segs[1].post_values([56, *NO_OBS])                      # rank 1's buffer changed
    assert CallPath.fast_prepared(comm, "t", _Inp(0xA000), (), False) is None
    assert comm.ledger.ncalls == 40                          # the full path counts the call
    assert comm.round == (key[0], [[key[0], *NO_OBS], [56, *NO_OBS]])
    assert not [c for c in drv.calls if c[0] == "graph_launch"]


def test_fast_prepared_under_capture_undoes_its_count(world, monkeypatch):
    _, segs, fasts, drv = world
    drv.ids = {0xA000: 7}
    comm, tk = _comm(segs[0], fasts[0], (mix_word(10, 7), 55), monkeypatch)
    drv.capturing = True
    seq = segs[0].coll_seq
    assert CallPath.fast_prepared(comm, "t", _Inp(0xA000), (), False) is None
    assert segs[0].coll_seq == seq and comm.ledger.ncalls == 40
    drv.capturing = False
    drv.fail = {"ptr_attr": 1}

    def check(rc, what):                                     # the driver's error names (no libcuda here)
        raise LaneFailureError(f"CUDA driver call {what} failed ({rc})")
    monkeypatch.setattr(callpath._cuda, "check", check)
    with pytest.raises(LaneFailureError, match="BUFFER_ID"):
        CallPath.fast_prepared(comm, "t", _Inp(0xA000), (), False)
    assert segs[0].coll_seq == seq and comm.ledger.ncalls == 40


def test_fast_prepared_books_a_late_peer_and_launches_from_python(world, monkeypatch):
    _, segs, fasts, drv = world
    drv.ids = {0xA000: 7}
    key = (mix_word(10, 7), 55)
    comm, tk = _comm(segs[0], fasts[0], key, monkeypatch)
    launched = []
    comm.prepared.launch = lambda entry, stream, async_op, tensors: launched.append(entry) or "launched"
    # rank 1 posts 200 ms later: the native call's spin (the segment's, 2 ms) gives up
    later = threading.Timer(0.2, lambda: segs[1].post_values([55, *NO_OBS]))
    later.start()
    try:
        assert CallPath.fast_prepared(comm, "t", _Inp(0xA000), (), False) == "launched"
    finally:
        later.join()
    st = comm.prepared.stats
    assert st["native_late"] == 1 and st["native_calls"] == 0 and st["hits"] == 1
    assert launched == [tk.entry] and comm.ledger.ncalls == 41
    assert not [c for c in drv.calls if c[0] == "graph_launch"]     # the native call did not launch


def test_an_async_replay_holds_its_tensors_in_its_handle(monkeypatch):
    """PreparedCalls.joined: an async replay's handle holds the call's tensors (no record_stream,
    which would leave their blocks allocated after the step in torch's CUDA-graph pools) and lets
    them go at its wait; dropped unwaited, it hands them on until its end event has completed.
    The handle carries the lane stream its end was recorded on."""
    import gc
    import weakref
    from braid import executor
    from braid.comm.prepared import PreparedCalls, PreparedHandle

    class T:
        def __init__(self, n):
            self.n = n

        def numel(self):
            return self.n

        def record_stream(self, s):
            raise AssertionError("record_stream called")

    ended = {0xE0: False, 0xE2: False}
    waits = []
    monkeypatch.setattr(executor, "_UNWAITED", [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(prepared_mod._cuda, "event_query", lambda ev: ended[ev])
    monkeypatch.setattr(prepared_mod._cuda, "stream_wait_event", lambda s, ev: waits.append(ev))
    monkeypatch.setattr(prepared_mod, "_RAW", lambda dev: 1)
    me = SimpleNamespace(dirty=False, _dev_index=0)
    t, out = T(8), T(4)
    ref = weakref.ref(t)
    h = PreparedCalls.joined(me, True, 0xE0, "lane", (t, t, None, out), None)
    assert isinstance(h, PreparedHandle) and h.stream == "lane" and me.dirty is True
    del t
    gc.collect()
    assert ref() is not None                # held by the handle
    h.wait()
    assert waits == [0xE0]
    gc.collect()
    assert ref() is None                    # let go at the wait
    t2 = T(3)
    ref2 = weakref.ref(t2)
    h2 = PreparedCalls.joined(me, True, 0xE2, "lane", (t2,), None)
    del t2, h2                              # dropped unwaited
    gc.collect()
    assert ref2() is not None and len(executor._UNWAITED) == 1
    executor.sweep()
    assert ref2() is not None
    ended[0xE2] = True
    executor.sweep()
    gc.collect()
    assert ref2() is None
    assert PreparedCalls.joined(me, False, 0xE1, "lane", (T(1),), None) is prepared_mod._DONE and me.dirty is False


# the round another agreement shapes (fast_call_vals), and Routing.a2a_even over it ----------------

W2 = 2
N_EVEN = 6 + W2                             # the uneven round: big, input word, agreement, row, word, pair hash, tag


class _Tensor:
    """What word_of and the native call read of an input: its address and element count."""

    def __init__(self, ptr, n=4):
        self.ptr, self.n = ptr, n

    def data_ptr(self):
        return self.ptr

    def numel(self):
        return self.n

    def element_size(self):
        return 4

    dtype = torch.float32


def test_the_uneven_round_has_a_count_no_other_round_has():
    # the segment tells calls apart by their rounds' counts: a balanced call's word round (1 +
    # len(NO_OBS)) or a small call's (1) against an uneven call's must raise, never be read as it
    assert N_EVEN == round_len(W2)
    for w in range(2, 65):
        assert round_len(w) not in (1, 1 + len(NO_OBS)), w


def _even(big=8 << 20, agree=4242, pair=0):
    return [big, 0, agree, big, big, 0, pair, ROUND_TAG]


def _python_post(seg, vals, inp_word, pword):
    v = list(vals)
    v[1], v[-3] = inp_word, pword
    return seg.post_values(v)


def test_a_round_of_values_meets_the_python_uneven_round(world, monkeypatch):
    from braid.comm import a2av
    _, segs, fasts, drv = world
    drv.ids = {0xA000: 11, 0xB000: 12}
    monkeypatch.setattr(a2av._cuda, "buffer_id", lambda ptr: drv.ids[ptr])
    key = (mix_word(3, 11), mix_word(-4, 12))
    t0 = _ticket(fasts[0], 3, key)
    vals = native_rounds.FastCalls.values(_even())
    # rank 1 posts the round in Python (its input word is a2av.word_of's), rank 0 natively: every
    # value but the input words the same, the words the program's: launched
    token1 = _python_post(segs[1], _even(), a2av.word_of(_Tensor(0xB000)), key[1])
    seq = segs[0].next_seq()
    assert fasts[0].call_vals(t0, seq, 0xA000, 0x900, 0, 0, vals, 5, 1) == native_rounds.HIT
    assert fasts[0].word.value == key[0]
    assert [c[0] for c in drv.calls] == ["ptr_attr", "graph_launch"]
    got = segs[1].read_values(token1, "t")
    mine = _even()
    mine[1], mine[-3] = a2av.word_of(_Tensor(0xA000)), key[0]
    assert got[0] == mine and got[0][1] != got[1][1]
    # each value in turn differs on rank 1 (a row, the agreement, the pair hash, the word): the
    # round is posted, not launched, and both read it
    for pos, value in ((0, 1 << 30), (2, 17), (3, 5), (4, 5), (6, 99), (7, 1), (5, key[1] + 1)):
        drv.calls.clear()
        other = _even()
        other[pos] = value
        token1 = _python_post(segs[1], other, 77, other[5] if pos == 5 else key[1])
        seq = segs[0].next_seq()
        assert fasts[0].call_vals(t0, seq, 0xA000, 0x900, 0, 0, vals, 5, 1) == native_rounds.DIFF, pos
        assert not [c for c in drv.calls if c[0] == "graph_launch"]
        assert segs[0].read_values((seq, N_EVEN), "t")[1][pos] == value
        segs[1].read_values(token1, "t")
    # a peer in the small calls' agreement, or in a balanced call's word round: another count
    for theirs in ([1 << 30], [key[1], *NO_OBS]):
        token1 = segs[1].post_values(theirs)
        seq = segs[0].next_seq()
        assert fasts[0].call_vals(t0, seq, 0xA000, 0x900, 0, 0, vals, 5, 1) == native_rounds.DIFF
        with pytest.raises(PeerMismatchError, match="different call"):
            segs[0].read_values((seq, N_EVEN), "t")
        with pytest.raises(PeerMismatchError, match="different call"):
            segs[1].read_values(token1, "t")


def test_a_round_of_values_both_native_and_too_many_values(world):
    _, segs, fasts, drv = world
    drv.ids = {0xA000: 1, 0xB000: 2}
    key = (mix_word(10, 1), mix_word(20, 2))
    tks = [_ticket(fasts[0], 10, key), _ticket(fasts[1], 20, key, exec_ptr=0x6000)]
    vals = [native_rounds.FastCalls.values(_even()) for _ in range(2)]
    codes = [[], []]

    def rank(r):
        for _ in range(20):
            seq = segs[r].next_seq()
            codes[r].append(fasts[r].call_vals(tks[r], seq, (0xA000, 0xB000)[r], 0x900, 0, 0, vals[r], 5, 1))
    th = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in th:
        t.start()
    for t in th:
        t.join(30)
    assert codes == [[native_rounds.HIT] * 20] * 2
    assert sorted(c[1] for c in drv.calls if c[0] == "graph_launch") == [0x5000] * 20 + [0x6000] * 20
    before = segs[0].u32[segs[0]._coll_ctr[0] // 4]
    big = native_rounds.FastCalls.values([1] * (COLL_MBOX_BYTES // 8))
    assert fasts[0].call_vals(tks[0], 1, 0xA000, 0x900, 0, 0, big, 0, 1) == native_rounds.TOO_MANY
    assert segs[0].u32[segs[0]._coll_ctr[0] // 4] == before


class _EvenPolicy:
    """The copy engines take every call: a matrix whose entries are all equal is a balanced call."""
    fixed, digest = None, "calib"
    balancer = SimpleNamespace(version=0)
    pending: dict = {}

    @staticmethod
    def shares_for(op, size, lanes):
        return {"ce": 1.0}

    @staticmethod
    def native_ok(shares):
        return set(shares) == {"nccl"}


def _routing(seg, fast, key, rank, monkeypatch):
    """Routing.a2a_even over the fake call path of _comm and a real UnevenAgreement over `seg`."""
    from braid.comm import uneven as U
    from braid.comm.routing import Routing
    comm, tk = _comm(seg, fast, key, monkeypatch)
    tk.op = "all_to_all_single"
    comm.native_calls = lambda: fast
    comm.faults.check_open = lambda: None
    comm.policy = _EvenPolicy()
    uneven = U.UnevenAgreement(rank, W2, seg, comm.policy, comm.ledger, lambda: ["ce"], lambda: "auto",
                               lambda: None, comm.gave_up.append, lambda why, wait=True: None, 1 << 20)
    ent = (torch.float32, 8, 8, 1 << 20, 1 << 20, True, True)  # 8 rows of 1 MiB in and out; lean; agreed
    rt = SimpleNamespace(calls=comm, prepared=comm.prepared, uneven=uneven, world_size=W2, mode="auto",
                         policy=comm.policy, faults=comm.faults, segment=seg, ledger=comm.ledger,
                         a2av_entry=lambda i, o: ent)
    rt.a2a_even = Routing.a2a_even.__get__(rt)
    return rt, comm, tk


def test_a2a_even_launches_where_every_rank_posted_the_even_round(world, monkeypatch):
    _, segs, fasts, drv = world
    drv.ids = {0xA000: 7, 0xB000: 8}
    key = (mix_word(10, 7), mix_word(10, 8))
    rts = [_routing(segs[r], fasts[r], key, r, monkeypatch) for r in (0, 1)]
    inps = [_Tensor(0xA000, 8 << 18), _Tensor(0xB000, 8 << 18)]
    out = [[], []]

    def rank(r):
        rt, comm, tk = rts[r]
        for _ in range(10):
            out[r].append(rt.a2a_even("t", None, inps[r], [4, 4], [4, 4], False))
    th = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in th:
        t.start()
    for t in th:
        t.join(30)
    assert out == [[(prepared_mod._DONE, None)] * 10] * 2
    for rt, comm, tk in rts:
        assert comm.ledger.ncalls == 50 and comm.ledger.last_call == tk.ledger
        assert comm.prepared.stats["native_calls"] == 10 and tk.even[3] is not None
    # what was posted is the uneven round of equal split sizes: each rank's row 4 MiB per peer
    got = segs[0].read_values((segs[0].coll_seq, N_EVEN), "t")
    assert [g[3:5] for g in got] == [[4 << 20, 4 << 20]] * 2 and [g[5] for g in got] == list(key)


def test_a2a_even_hands_a_round_that_differs_to_the_python_verdict(world, monkeypatch):
    """Rank 1's split sizes are not all equal: it takes the Python round (UnevenAgreement.round),
    rank 0 the native call; both read the same values and reach the same verdict (the copy
    engines alone, with the uneven matrix)."""
    _, segs, fasts, drv = world
    drv.ids = {0xA000: 7, 0xB000: 8}
    key = (mix_word(10, 7), mix_word(10, 8))
    rt0, comm0, tk0 = _routing(segs[0], fasts[0], key, 0, monkeypatch)
    _, comm1, _ = _routing(segs[1], fasts[1], key, 1, monkeypatch)
    uneven1 = rt0.uneven.__class__(1, W2, segs[1], comm1.policy, comm1.ledger, lambda: ["ce"], lambda: "auto",
                                   lambda: None, comm1.gave_up.append, lambda why, wait=True: None, 1 << 20)
    res = [None, None]

    def rank1():
        mib = 1 << 20
        res[1] = uneven1.round("all_to_all_single", 4 * mib, [55, uneven1.agreement(), 4 * mib, 2 * mib, 0],
                               [4 * mib, 2 * mib])
    th = threading.Thread(target=rank1)
    th.start()
    res[0] = rt0.a2a_even("t", None, _Tensor(0xA000, 8 << 18), [4, 4], [4, 4], False)
    th.join(30)
    assert res[0][0] is None
    assert res[0][1] == res[1] and res[1][0] is True and res[1][1] is False
    assert res[1][2][0] == [[4 << 20, 4 << 20], [4 << 20, 2 << 20]]
    assert not [c for c in drv.calls if c[0] == "graph_launch"]
    assert comm0.ledger.ncalls == 41 and comm0.ledger.last_call[3] == "agreeing"


def test_a2a_even_declines_what_the_round_would_decide_otherwise(world, monkeypatch):
    _, segs, fasts, drv = world
    drv.ids = {0xA000: 7}
    rt, comm, tk = _routing(segs[0], fasts[0], (mix_word(10, 7), 5), 0, monkeypatch)
    inp = _Tensor(0xA000, 8 << 18)
    seq = segs[0].coll_seq
    # two ranks and a call below the copy engines' size: each decides alone, no round
    rt.uneven.ce_min = 64 << 20
    assert rt.a2a_even("t", None, inp, [4, 4], [4, 4], False) is None and tk.even[3] is None
    rt.uneven.ce_min = 1 << 20
    tk.even = None
    # lists that do not make up the shape; a deferred run of NCCL-whole calls; no native calls
    assert rt.a2a_even("t", None, inp, [3, 3], [3, 3], False) is None
    rt.uneven.small_run = 100
    assert rt.a2a_even("t", None, inp, [4, 4], [4, 4], False) is None and tk.even[3] is not None
    rt.uneven.small_run = 0
    comm.prepared.fast = None
    assert rt.a2a_even("t", None, inp, [4, 4], [4, 4], False) is None
    comm.prepared.fast = fasts[0]
    # under a capture nothing is posted and nothing counted
    drv.capturing = True
    assert rt.a2a_even("t", None, inp, [4, 4], [4, 4], False) is None
    assert segs[0].coll_seq == seq and comm.ledger.ncalls == 40
