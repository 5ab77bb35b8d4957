"""The uneven all_to_all's native posting on the copy engines (`_rounds.c` uneven_post, through
comm/a2av.py UnevenCe) on CPU: every rank's round posted in a real node segment, the driver calls
recorded by callbacks. For random matrices (zeros among them: ranks that send nothing, receive
nothing, or keep nothing for themselves), 2 to 6 ranks, synchronous and async calls, with batched
and single memory operations, every rank's native posting makes the same driver calls with the
same arguments in the same order as the Python posting it replaces. A source with bytes but no
mapped input, and a driver error, are refused with what went wrong.

The round (`_rounds.c` uneven_round, UnevenAgreement.round_native), ranks in threads over one
segment: for random matrices each round decides the same on every rank whether all ranks make it
in Python or some natively, and split sizes that disagree raise on the native path too."""
from __future__ import annotations

import ctypes
import random
import threading
from types import SimpleNamespace

import pytest

from braid.comm import a2av, native_rounds
from braid.comm import uneven as U
from braid.comm.a2av import UnevenCe
from braid.comm.uneven import ROUND_TAG, round_len
from braid.errors import LaneFailureError, PeerMismatchError
from braid.lanes import _cuda
from braid.node import COLL_MBOX_BYTES, COLL_SLOTS, Layout, NodeSegment

_vp, _u64, _u32, _int, _uint = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint
CALLER, LANE, START, END = 0x11, 0x22, 0x33, 0x44
DEV = 0x7000_0000          # the segment's device address in these tests
IN_AT, OUT_AT = 0x1_0000_0000, 0x2_0000_0000


class Recorder:
    """The driver calls as both postings make them: ("copy", dst, src, n, stream), ("ops", stream,
    ((wait, address, value), ...)) for one batch or one single operation each, ("record", event,
    stream), ("wait_event", stream, event)."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.fail: dict[str, int] = {}
        self.keep = []

    def fns(self, batch: bool) -> dict:
        def rec(name, *args):
            self.calls.append((name, *args))
            return self.fail.get(name, 0)

        def batch_fn(stream, count, ops, flags):
            arr = ctypes.cast(ops, ctypes.POINTER(_cuda.MemOp))
            got = tuple((arr[i].operation == _cuda.CU_STREAM_MEM_OP_WAIT_VALUE_32, arr[i].address, arr[i].value)
                        for i in range(count))
            assert flags == 0 and all(arr[i].flags == 0 for i in range(count))
            return rec("ops", stream or 0, got)
        cbs = {
            "event_record": ctypes.CFUNCTYPE(_int, _vp, _vp)(lambda e, s: rec("record", e or 0, s or 0)),
            "wait_event": ctypes.CFUNCTYPE(_int, _vp, _vp, _uint)(lambda s, e, f: rec("wait_event", s or 0, e or 0)),
            "memcpy": ctypes.CFUNCTYPE(_int, _u64, _u64, ctypes.c_size_t, _vp)(
                lambda d, s, n, st: rec("copy", d, s, n, st or 0)),
            "wait_value": ctypes.CFUNCTYPE(_int, _vp, _u64, _u32, _uint)(
                lambda st, a, v, f: rec("ops", st or 0, ((True, a, v),))),
            "write_value": ctypes.CFUNCTYPE(_int, _vp, _u64, _u32, _uint)(
                lambda st, a, v, f: rec("ops", st or 0, ((False, a, v),))),
        }
        if batch:
            cbs["batch"] = ctypes.CFUNCTYPE(_int, _vp, _uint, _vp, _uint)(batch_fn)
        unused = ctypes.CFUNCTYPE(_int)(lambda: 99)
        self.keep += [cbs, unused]
        addr = {k: ctypes.cast(f, _vp).value for k, f in cbs.items()}
        for k in ("ptr_attr", "graph_launch", "is_capturing"):
            addr[k] = ctypes.cast(unused, _vp).value
        return addr

    def patch(self, monkeypatch, batch: bool) -> None:
        """The Python posting's driver calls into the same record."""
        def memops(stream, ops):
            if len(ops) == 1 or not batch:
                for op in ops:
                    self.calls.append(("ops", stream, ((op[0], op[1], op[2] & 0xFFFFFFFF),)))
            else:
                self.calls.append(("ops", stream, tuple((o[0], o[1], o[2] & 0xFFFFFFFF) for o in ops)))
        monkeypatch.setattr(_cuda, "memops", memops)
        monkeypatch.setattr(_cuda, "memcpy_async", lambda d, s, n, st: self.calls.append(("copy", d, s, n, st)))
        monkeypatch.setattr(_cuda, "event_record", lambda e, s: self.calls.append(("record", e, s)))
        monkeypatch.setattr(_cuda, "stream_wait_event", lambda s, e: self.calls.append(("wait_event", s, e)))


class Prep:
    """PreparedCalls' fork, join and events as UnevenCe uses them."""
    _dev_index = 0

    def fork(self, stream):
        _cuda.event_record(START, CALLER)
        _cuda.stream_wait_event(stream.cuda_stream, START)
        return CALLER

    def fork_event(self):
        return START

    def end_event(self):
        return END

    def join(self, caller, stream, async_op, tensors):
        _cuda.event_record(END, stream.cuda_stream)
        if not async_op:
            _cuda.stream_wait_event(caller, END)
        return self.joined(async_op, END, stream, tensors)

    def joined(self, async_op, end, stream, tensors):
        return ("handle" if async_op else "done", end, stream.cuda_stream)


def _tensor(ptr):
    return SimpleNamespace(data_ptr=lambda: ptr)


def _world(w, tmp_path, monkeypatch, rec, batch, fns=None, spin_s=0.05):
    """w ranks' segments (one process) and native calls over them, with the recorder's driver
    (or `fns`); skips where there is no C compiler."""
    monkeypatch.setenv("BRAID_CACHE_DIR", str(tmp_path))
    lib = native_rounds.build()
    if lib is None:
        pytest.skip("no C compiler for the native call")
    layout = Layout(w, 1 << 16, 4096)
    name = NodeSegment.new_name()
    segs = [NodeSegment(name, layout, r, create=(r == 0)) for r in range(w)]
    segs[0].unlink()
    fns = fns or rec.fns(batch)
    fasts = [native_rounds.FastCalls(lib, w, r, COLL_SLOTS, 7, COLL_MBOX_BYTES,
                                     [seg.address + c for c in seg._coll_ctr],
                                     [seg.address + s[0] for s in seg._coll_slots], fns, spin_s)
             for r, seg in enumerate(segs)]
    return layout, segs, fasts


def _ce(layout, w, me, peers):
    ce = SimpleNamespace(stream=SimpleNamespace(cuda_stream=LANE), coll_seq=1000 + me)
    u = UnevenCe(me, w, None, DEV, layout, ce, Prep())
    u.maps[("words",)] = peers
    return u


def _round(segs, matrix):
    """Every rank's round with this matrix (its row among the values); the tokens."""
    return [seg.post_values([max(matrix[r]), 5 + r, 9, *matrix[r], 0, 0, ROUND_TAG]) for r, seg in enumerate(segs)]


def _matrix(rng, w):
    m = [[rng.choice([0, 0, 1, 64, 4096, rng.randrange(1, 1 << 20)]) for _ in range(w)] for _ in range(w)]
    if rng.random() < 0.2:
        m[rng.randrange(w)] = [0] * w            # a rank that sends nothing
    return m


@pytest.mark.parametrize("batch", [True, False])
@pytest.mark.parametrize("w", [2, 3, 4, 6])
def test_the_native_posting_makes_the_python_postings_calls(w, batch, tmp_path, monkeypatch):
    rec = Recorder()
    layout, segs, fasts = _world(w, tmp_path, monkeypatch, rec, batch)
    monkeypatch.setattr(a2av, "_capturing", lambda: False)
    monkeypatch.setattr(a2av, "_RAW", lambda dev: CALLER)
    rec.patch(monkeypatch, batch)
    rng = random.Random(w * 10 + batch)
    try:
        for trial in range(25):
            matrix = _matrix(rng, w)
            tokens = _round(segs, matrix)
            assert all(t[1] == round_len(w) for t in tokens)
            for me in range(w):
                peers = {p: 0x9_0000_0000 + (p << 28) for p in range(w) if p != me}
                async_op = bool(rng.getrandbits(1))
                got = []
                for native in (False, True):
                    rec.calls.clear()
                    u = _ce(layout, w, me, peers)
                    out = u.run(_tensor(OUT_AT), _tensor(IN_AT), matrix, ("words",), async_op,
                                fasts[me] if native else None, tokens[me])
                    got.append((out, list(rec.calls), u.ce.coll_seq))
                assert got[1] == got[0], (trial, me, matrix)
                # the calls say what the matrix says: one pull per source with bytes for me
                pulls = [c for c in got[0][1] if c[0] == "copy" and c[4] == LANE]
                assert len(pulls) == sum(1 for s in range(w) if s != me and matrix[s][me])
                assert sum(c[3] for c in pulls) == sum(matrix[s][me] for s in range(w) if s != me)
            for seg in segs:                       # every rank reads the round (the slot rule)
                seg.read_values((tokens[0][0], round_len(w)), "t")
    finally:
        for f in fasts:
            f.close()
        for s in segs:
            s.close()


def test_a_source_without_a_mapping_or_a_driver_error_is_refused(tmp_path, monkeypatch):
    rec = Recorder()
    layout, segs, fasts = _world(2, tmp_path, monkeypatch, rec, True)
    monkeypatch.setattr(a2av, "_capturing", lambda: False)
    monkeypatch.setattr(a2av, "_RAW", lambda dev: CALLER)
    try:
        matrix = [[8, 16], [32, 64]]
        tokens = _round(segs, matrix)
        u = _ce(layout, 2, 0, {})                 # rank 1 sends me 32 bytes: no mapping of its input
        with pytest.raises(PeerMismatchError, match="no mapped input"):
            u.run(_tensor(OUT_AT), _tensor(IN_AT), matrix, ("words",), False, fasts[0], tokens[0])
        assert rec.calls == []                    # refused before anything was posted
        rec.fail["copy"] = 700

        def check(rc, what):                      # the driver's error name needs libcuda
            if rc:
                raise LaneFailureError(f"CUDA driver call {what} failed ({rc})")
        monkeypatch.setattr(_cuda, "check", check)
        u = _ce(layout, 2, 0, {1: 0x9_0000_0000})
        with pytest.raises(LaneFailureError, match=r"uneven all_to_all.*\(700\)"):
            u.run(_tensor(OUT_AT), _tensor(IN_AT), matrix, ("words",), False, fasts[0], tokens[0])
        assert [c[0] for c in rec.calls] == ["record", "wait_event", "ops", "copy"]   # it stopped at the copy
        for seg in segs:
            seg.read_values(tokens[0], "t")
    finally:
        for f in fasts:
            f.close()
        for s in segs:
            s.close()


# the round ---------------------------------------------------------------------------------------
MiB = 1 << 20


class _Policy:
    """The copy engines from 64 MiB, else NCCL (as tests/test_a2av_round.py's)."""

    def __init__(self):
        self.fixed, self.digest = None, "calib"
        self.balancer = SimpleNamespace(version=0)

    def shares_for(self, op, size, lanes):
        return {"ce": 1.0} if size >= 64 * MiB else {"nccl": 1.0}

    def native_ok(self, shares):
        return set(shares) == {"nccl"}


def _ptr_attr_fns(rec, ids):
    fns = rec.fns(True)

    def ptr_attr(data, attr, ptr):
        ctypes.c_uint64.from_address(data).value = ids[ptr]
        return 0
    cb = ctypes.CFUNCTYPE(_int, _vp, _int, _u64)(ptr_attr)
    rec.keep.append(cb)
    fns["ptr_attr"] = ctypes.cast(cb, _vp).value
    return fns


def _kind(res):
    agreed, small, lean = res
    if lean is None:
        return ("small" if small else "full", None)
    if isinstance(lean, U.Even):
        return ("even", lean.words)
    return ("ce", tuple(lean[1]))


@pytest.mark.parametrize("w", [2, 3, 4])
def test_the_native_round_decides_as_the_python_round(w, tmp_path, monkeypatch):
    """Random matrices (small, the copy engines' size, even, one rank with nothing to send), each
    round once with every rank in Python and once with a random half of the ranks native: every
    rank returns the same verdict in both, with the input words Python's word_of makes; a rank
    whose split sizes disagree with a peer's raises PeerMismatchError from the native round too."""
    from braid.comm.ledger import CallLedger
    from braid.comm.prepared import mix_word
    rec = Recorder()
    ptrs = [0xA0000 + 0x1000 * r for r in range(w)]
    ids = {p: 50 + r for r, p in enumerate(ptrs)}
    _, segs, fasts = _world(w, tmp_path, monkeypatch, rec, True, _ptr_attr_fns(rec, ids), 5.0)
    words = [mix_word(p, ids[p]) | 1 for p in ptrs]
    ags = [U.UnevenAgreement(r, w, segs[r], _Policy(), CallLedger(r, True, None), lambda: ["ce", "nccl", "host"],
                             lambda: "auto", lambda: None, lambda exc: None, lambda why, wait=True: None, 32 * MiB)
           for r in range(w)]
    rng = random.Random(w)

    def one_round(matrix, native, recv_of=None):
        out, errs = [None] * w, [None] * w

        def run(r):
            try:
                row = list(matrix[r])
                recv = recv_of(r) if recv_of else [matrix[s][r] for s in range(w)]
                big = max([v for d, v in enumerate(row) if d != r] + [v for s, v in enumerate(recv) if s != r])
                vals = [ags[r].agreement(), *row, 7000 + r]
                got = ags[r].round_native(fasts[r], "all_to_all_single", big, vals, recv, ptrs[r]) \
                    if native[r] else None
                if got is None:
                    got = ags[r].round("all_to_all_single", big, [words[r], *vals], recv)
                out[r] = got
            except BaseException as exc:     # noqa: BLE001 - reported below
                errs[r] = exc
        ts = [threading.Thread(target=run, args=(r,)) for r in range(w)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        return out, errs

    try:
        seen = set()
        for trial in range(40):
            pick = trial % 5
            if pick == 0:
                matrix = [[rng.randrange(0, 1 << 19) for _ in range(w)] for _ in range(w)]      # small
            elif pick == 1:
                v = rng.randrange(1, 64) * MiB
                matrix = [[v] * w for _ in range(w)]                                             # even
            else:
                matrix = [[rng.randrange(0, 80 * MiB) for _ in range(w)] for _ in range(w)]
                if pick == 4:
                    matrix[rng.randrange(w)] = [0] * w
            ref, errs = one_round(matrix, [False] * w)
            assert errs == [None] * w, errs
            native = [rng.random() < 0.5 for _ in range(w)]
            native[trial % w] = True
            got, errs = one_round(matrix, native)
            assert errs == [None] * w, (trial, errs)
            kinds = {_kind(g) for g in got}
            assert kinds == {_kind(g) for g in ref} and len(kinds) == 1, (trial, matrix, ref, got)
            kind = kinds.pop()
            seen.add(kind[0])
            if kind[0] == "ce":
                assert kind[1] == tuple(words)
                for r, g in enumerate(got):     # a native rank decided from the native round's answer
                    assert g[2][2][1] == U.round_len(w) and (g[2][0] is None) == native[r], (r, g)
        assert {"ce", "small", "even"} <= seen, seen
        # split sizes that disagree: rank 1 expects one byte more from rank 0 than rank 0 sends
        matrix = [[70 * MiB] * w for _ in range(w)]
        matrix[0][1] += 3
        bad = lambda r: [matrix[s][r] + (1 if (s, r) == (0, 1) else 0) for s in range(w)]     # noqa: E731
        got, errs = one_round(matrix, [True] * w, bad)
        assert isinstance(errs[1], PeerMismatchError) and "expects" in str(errs[1]), errs
    finally:
        for f in fasts:
            f.close()
        for s in segs:
            s.close()
