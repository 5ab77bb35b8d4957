"""Errors, not hangs; nothing left behind.

One world (module fixture) runs every argument and agreement check in turn and reports each
check's outcome; the tests below assert on those reports one by one. Timeouts, dead peers and
/dev/shm hygiene get worlds of their own. Settings are checked in this process.
"""
from __future__ import annotations

import os
import re
import time
import traceback

import pytest
import torch

import braid
from braid import envs
from braid.errors import (BraidError, BraidTimeoutError, LaneFailureError, LaneUnavailableError, MisuseError,
                          PeerMismatchError)
from conftest import braid_shm_entries, run_world, stay_away

CHECKS_WORLD = 3


# ---------------------------------------------------------------------------------------------
# the checks world
# ---------------------------------------------------------------------------------------------

def _expect(exc_type, fn, *needles):
    """Run fn; it must raise exc_type (or a subclass) whose message holds every needle."""
    try:
        fn()
    except exc_type as exc:
        text = str(exc)
        missing = [n for n in needles if n not in text]
        assert not missing, f"{type(exc).__name__} message lacks {missing}: {text}"
        return exc
    except BaseException as exc:
        raise AssertionError(f"expected {exc_type.__name__}, got {type(exc).__name__}: {exc}") from exc
    raise AssertionError(f"expected {exc_type.__name__}, nothing was raised")


class _FakeCuda(torch.Tensor):
    """A CPU tensor that claims to live on a GPU (what a CUDA tensor looks like to braid)."""

    @property
    def is_cuda(self):
        return True


def _checks_worker(rank, w):
    import torch.distributed as dist
    report: dict[str, str] = {}

    def check(name, fn):
        try:
            fn()
            report[name] = "ok"
        except BaseException as exc:      # noqa: BLE001 - every outcome goes back to the parent
            report[name] = f"FAIL {type(exc).__name__}: {exc}\n{traceback.format_exc()}"

    # settings are read when the communicator is made
    def bad_buffer_setting():
        with envs.override(BRAID_HOST_BUFFER_MB="abc"):
            _expect(MisuseError, lambda: braid.Communicator(), "BRAID_HOST_BUFFER_MB", "abc")
    check("init_invalid_env", bad_buffer_setting)
    check("init_unknown_lane_name", lambda: _expect(MisuseError, lambda: braid.Communicator(lanes=["bogus"]), "bogus"))

    comm = braid.init()
    assert braid.default() is comm and braid.init() is comm

    def segment_unlinked():
        name = comm.segment.name
        assert name.startswith("braid-"), name
        assert name not in os.listdir("/dev/shm"), f"{name} still in /dev/shm after every rank mapped it"
        assert len(comm.segment.mm) == comm.layout.total_bytes      # yet still mapped and usable
    check("segment_unlinked_after_creation", segment_unlinked)

    n_good = [0]

    def good_calls(tag):
        """A correct all_gather, broadcast, send/recv and all_to_all_single (the comm still works)."""
        def run():
            for shares in ({"gloo": 0.5, "shm": 0.5}, {"shm": 1.0}, {"gloo": 1.0}):
                with comm.fixed_shares(shares):
                    n = 70_001
                    x = torch.arange(n, dtype=torch.int64) * (rank + 2) + 1
                    out = torch.zeros(n * w, dtype=torch.int64)
                    comm.all_gather_into_tensor(out, x)
                    want = torch.cat([torch.arange(n, dtype=torch.int64) * (r + 2) + 1 for r in range(w)])
                    assert torch.equal(out, want), f"{tag}: all_gather wrong after errors ({shares})"
                    b = x.clone() if rank == 1 else torch.zeros(n, dtype=torch.int64)
                    comm.broadcast(b, 1)
                    assert torch.equal(b, torch.arange(n, dtype=torch.int64) * 3 + 1), f"{tag}: broadcast"
                    if rank == 0:
                        comm.send(x, 2)
                    elif rank == 2:
                        y = torch.zeros(n, dtype=torch.int64)
                        comm.recv(y, 0)
                        assert torch.equal(y, torch.arange(n, dtype=torch.int64) * 2 + 1), f"{tag}: recv"
                    ins = torch.full((3 * w,), rank + 1, dtype=torch.int16)
                    o = torch.zeros(3 * w, dtype=torch.int16)
                    comm.all_to_all_single(o, ins)
                    assert o.tolist() == [s + 1 for s in range(w) for _ in range(3)], f"{tag}: a2a {o.tolist()}"
            n_good[0] += 1
        return run

    check("works_before_errors", good_calls("before"))

    # ranks that disagree: every rank gets PeerMismatchError, none hangs -------------------------
    def mismatched_all_gather_sizes_check():
        with envs.override(BRAID_CHECK="1"):
            checked = braid.Communicator()       # BRAID_CHECK is read when a communicator is made
        with checked:
            assert checked.check is True
            x = torch.ones(100 + rank)
            out = torch.empty((100 + rank) * w)
            _expect(PeerMismatchError, lambda: checked.all_gather_into_tensor(out, x), "nbytes")
            outs = [torch.empty(100 + rank) for _ in range(w)]
            _expect(PeerMismatchError, lambda: checked.all_gather(outs, x), "nbytes")
            # gloo alone would be handed to gloo's own collective; BRAID_CHECK checks it first
            with checked.fixed_shares({"gloo": 1.0}):
                _expect(PeerMismatchError, lambda: checked.all_gather_into_tensor(out, x), "nbytes")
                _expect(PeerMismatchError, lambda: checked.broadcast(x, 0), "nbytes")
            good = torch.empty(100 * w)
            checked.all_gather_into_tensor(good, torch.full((100,), float(rank)))
            assert good.tolist() == [float(r) for r in range(w) for _ in range(100)]
    check("mismatch_all_gather_sizes_braid_check", mismatched_all_gather_sizes_check)

    def mismatched_all_gather_sizes_multilane():
        with comm.fixed_shares({"gloo": 0.5, "shm": 0.5}):
            x = torch.ones(5000 * (rank + 1), dtype=torch.uint8)
            outs = [torch.empty(5000 * (rank + 1), dtype=torch.uint8) for _ in range(w)]
            _expect(PeerMismatchError, lambda: comm.all_gather(outs, x), "nbytes")
    check("mismatch_all_gather_sizes_multilane", mismatched_all_gather_sizes_multilane)

    def mismatched_dtypes():
        # same byte count, different dtype
        dtype = torch.float32 if rank == 0 else torch.int32
        x = torch.ones(64, dtype=dtype)
        out = torch.empty(64 * w, dtype=dtype)
        with comm.fixed_shares({"gloo": 0.5, "shm": 0.5}):
            _expect(PeerMismatchError, lambda: comm.all_gather_into_tensor(out, x), "dtype")
        # different dtype and byte count, default shares
        dtype = torch.float16 if rank == 1 else torch.float64
        x = torch.ones(64, dtype=dtype)
        out = torch.empty(64 * w, dtype=dtype)
        _expect(PeerMismatchError, lambda: comm.all_gather_into_tensor(out, x), "dtype")
    check("mismatch_dtypes", mismatched_dtypes)

    def mismatched_roots():
        t = torch.ones(1000)
        _expect(PeerMismatchError, lambda: comm.broadcast(t, src=rank % 2), "root")
    check("mismatch_broadcast_root", mismatched_roots)

    def mismatched_ops():
        t = torch.ones(100)
        if rank == 0:
            _expect(PeerMismatchError, lambda: comm.broadcast(t, 0), "op")
        else:
            _expect(PeerMismatchError, lambda: comm.all_gather_into_tensor(torch.empty(100 * w), t), "op")
    check("mismatch_ops", mismatched_ops)

    def mismatched_splits():
        # each rank's own split sizes are valid for its tensors, but the ranks disagree:
        # rank r sends r + 1 rows to everybody, and expects 2 rows from everybody
        ins = [rank + 1] * w
        outs = [2] * w
        x = torch.ones(sum(ins), 4)
        o = torch.empty(sum(outs), 4)
        for shares in ({"gloo": 1.0}, {"gloo": 0.3, "shm": 0.7}):
            with comm.fixed_shares(shares):
                _expect(PeerMismatchError, lambda: comm.all_to_all_single(o, x, outs, ins), "split sizes")
    check("mismatch_all_to_all_splits", mismatched_splits)

    def mismatched_p2p():
        if rank == 0:
            _expect(PeerMismatchError, lambda: comm.send(torch.ones(10), 1), "nbytes")
            _expect(PeerMismatchError, lambda: comm.send(torch.ones(10), 1), "dtype")
        elif rank == 1:
            _expect(PeerMismatchError, lambda: comm.recv(torch.empty(20), 0), "nbytes")
            _expect(PeerMismatchError, lambda: comm.recv(torch.empty(10, dtype=torch.int32), 0), "dtype")
    check("mismatch_send_recv", mismatched_p2p)

    # local misuse: raised on the calling rank before any communication ---------------------------
    def misuse():
        x = torch.ones(10)
        E = MisuseError
        _expect(E, lambda: comm.send(x, rank), "itself")
        _expect(E, lambda: comm.recv(x, rank), "itself")
        _expect(E, lambda: comm.send(x, w), "out of range")
        _expect(E, lambda: comm.send(x, -1), "out of range")
        _expect(E, lambda: comm.recv(x, w + 5), "out of range")
        _expect(E, lambda: comm.send(x, 1.0), "int")
        _expect(E, lambda: comm.send(x, True), "int")
        _expect(E, lambda: comm.broadcast(x, w), "out of range")
        _expect(E, lambda: comm.broadcast(x, -1), "out of range")
        # outputs must be contiguous
        big = torch.empty(20 * w)
        _expect(E, lambda: comm.all_gather_into_tensor(big[::2], x), "contiguous")
        _expect(E, lambda: comm.all_gather([torch.empty(20)[::2] for _ in range(w)], x), "contiguous")
        _expect(E, lambda: comm.broadcast(torch.empty(10, 2).t(), 0), "contiguous")
        _expect(E, lambda: comm.recv(torch.empty(20)[::2], (rank + 1) % w), "contiguous")
        _expect(E, lambda: comm.all_to_all_single(torch.empty(6 * w, 2).t(), torch.ones(2, 6 * w)), "contiguous")
        # sizes
        _expect(E, lambda: comm.all_gather_into_tensor(torch.empty(10 * w + 1), x), "world_size")
        _expect(E, lambda: comm.all_gather_into_tensor(torch.empty(10), x), "world_size")
        _expect(E, lambda: comm.all_gather([torch.empty(10)] * (w + 1), x), "world_size")
        _expect(E, lambda: comm.all_gather([torch.empty(10)] * (w - 1) + [torch.empty(11)], x), "elements")
        _expect(E, lambda: comm.all_gather(torch.empty(10 * w), x), "list")
        # dtypes
        _expect(E, lambda: comm.all_gather_into_tensor(torch.empty(10 * w, dtype=torch.float64), x), "dtype")
        _expect(E, lambda: comm.all_to_all_single(torch.empty(w, dtype=torch.int32), torch.ones(w)), "dtype")
        # all_to_all split sizes
        a, o = torch.ones(3 * w), torch.empty(3 * w)
        _expect(E, lambda: comm.all_to_all_single(o, a, [3] * w, [3] * (w + 1)), "entries")
        _expect(E, lambda: comm.all_to_all_single(o, a, [3] * w, [-1] + [3] * (w - 2) + [3 + 1 + 3]), ">= 0")
        _expect(E, lambda: comm.all_to_all_single(o, a, [3] * w, [4] * w), "sum")
        _expect(E, lambda: comm.all_to_all_single(torch.empty(3 * w + 1), torch.ones(3 * w + 1)), "divisible")
        # not tensors, wrong devices, sparse
        _expect(E, lambda: comm.all_gather_into_tensor(torch.empty(10 * w), [1.0] * 10), "torch.Tensor")
        _expect(E, lambda: comm.send(torch.empty(10, device="meta"), (rank + 1) % w), "meta")
        _expect(E, lambda: comm.all_gather_into_tensor(torch.empty(10 * w), torch.ones(10, device="meta")), "meta")
        sparse = torch.ones(10).to_sparse()
        _expect(E, lambda: comm.broadcast(sparse, 0), "sparse")
        assert issubclass(MisuseError, ValueError)
    check("misuse", misuse)

    def cuda_tensor_on_cpu_machine():
        fake = torch.Tensor._make_subclass(_FakeCuda, torch.ones(10))
        assert fake.is_cuda
        _expect(MisuseError, lambda: comm.all_gather_into_tensor(torch.empty(10 * w), fake), "nccl")
        _expect(MisuseError, lambda: comm.send(fake, (rank + 1) % w), "CUDA")
        _expect(MisuseError, lambda: comm.broadcast(fake, 0), "CUDA")
        if not torch.cuda.is_available():
            _expect((RuntimeError, AssertionError), lambda: torch.ones(1, device="cuda"))
    check("cuda_tensor_on_cpu_machine", cuda_tensor_on_cpu_machine)

    def lane_unavailable():
        with braid.Communicator(lanes=["gloo"]) as only_gloo:
            assert only_gloo.lanes_for(torch.device("cpu")) == ["gloo"]
            x = torch.ones(100)
            out = torch.empty(100 * w)
            with only_gloo.fixed_shares({"shm": 1.0}):
                _expect(LaneUnavailableError, lambda: only_gloo.all_gather_into_tensor(out, x), "shm")
            only_gloo.all_gather_into_tensor(out, x * (rank + 1))
            assert out.tolist() == [float(r + 1) for r in range(w) for _ in range(100)]
        assert only_gloo.closed
        with envs.override(BRAID_LANES="shm"):
            with braid.Communicator() as only_shm:
                assert only_shm.lanes_for(torch.device("cpu")) == ["shm"]
                only_shm.all_gather_into_tensor(out, x * (rank + 1))
                assert only_shm.last_handle.shares == {"shm": 1.0}
    check("lane_unavailable", lane_unavailable)

    def gloo_alone_reports_gloo():
        x = torch.arange(1000, dtype=torch.float32) + rank
        out = torch.empty(1000 * w)
        with comm.fixed_shares({"gloo": 1.0}):
            comm.all_gather_into_tensor(out, x)
        assert torch.equal(out, torch.cat([torch.arange(1000, dtype=torch.float32) + r for r in range(w)]))
        assert comm.last_handle.shares == {"gloo": 1.0}, comm.last_handle.shares
    check("gloo_alone_handle_reports_gloo", gloo_alone_reports_gloo)

    def other_group():
        sub = dist.new_group([0, 1])          # collective: every rank calls it
        _expect(MisuseError, lambda: braid.Communicator(group=sub), "world")
    check("group_not_world", other_group)

    check("works_after_errors", good_calls("after"))
    assert n_good[0] <= 2

    # closing ----------------------------------------------------------------------------------
    def closing():
        seg = comm.segment
        braid.close()
        assert comm.closed and seg.closed
        _expect(MisuseError, lambda: comm.all_gather_into_tensor(torch.empty(10 * w), torch.ones(10)), "closed")
        _expect(MisuseError, lambda: braid.default(), "braid.init()")
        _expect(MisuseError, lambda: braid.broadcast(torch.ones(3), 0), "braid.init()")
        with open("/proc/self/maps") as f:
            assert seg.name not in f.read(), "segment still mapped after close()"
        comm.close()            # idempotent
        again = braid.init()    # a new default communicator
        assert again is not comm and not again.closed
        t = torch.full((5,), float(rank))
        again.broadcast(t, 2)
        assert t.tolist() == [2.0] * 5
    check("close", closing)
    dist.barrier()
    return report


@pytest.fixture(scope="module")
def checks():
    before = braid_shm_entries()
    info: dict = {}
    reports = run_world(_checks_worker, CHECKS_WORLD, info=info, env={"BRAID_TIMEOUT_S": "15"}, timeout=150)
    after = braid_shm_entries()
    return {"reports": reports, "pids": info["pids"], "before": before, "after": after}


def _assert_check(checks, name):
    reports = checks["reports"]
    bad = {r: rep.get(name, "not run") for r, rep in enumerate(reports) if rep.get(name) != "ok"}
    assert not bad, f"{name}:\n" + "\n".join(f"rank {r}: {v}" for r, v in bad.items())


@pytest.mark.parametrize("name", [
    "init_invalid_env", "segment_unlinked_after_creation", "works_before_errors",
    "mismatch_all_gather_sizes_braid_check", "mismatch_all_gather_sizes_multilane", "mismatch_dtypes",
    "mismatch_broadcast_root", "mismatch_ops", "mismatch_all_to_all_splits", "mismatch_send_recv",
    "misuse", "lane_unavailable", "group_not_world", "works_after_errors", "close",
])
def test_errors_in_a_world(checks, name):
    _assert_check(checks, name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a CUDA tensor on a CPU-only machine")
def test_cuda_tensor_on_cpu_only_machine(checks):
    _assert_check(checks, "cuda_tensor_on_cpu_machine")


def test_gloo_alone_handle_reports_gloo(checks):
    """A call handed to gloo's own collective says so (it once reported {'nccl': 1.0})."""
    _assert_check(checks, "gloo_alone_handle_reports_gloo")


def test_unknown_lane_name_is_misuse(checks):
    _assert_check(checks, "init_unknown_lane_name")


def test_no_segment_left_after_normal_close(checks):
    # segments are named braid-<pid of the creating rank>-<random>; other programs' segments are ignored
    pids = checks["pids"]
    ours = {n for n in checks["after"] if any(n.startswith(f"braid-{p}-") for p in pids)}
    assert not ours, ours
    assert checks["reports"][0].get("segment_unlinked_after_creation") == "ok"


# ---------------------------------------------------------------------------------------------
# timeouts and dead peers
# ---------------------------------------------------------------------------------------------

def _timeout_worker(rank, w, peer_sleep, flag):
    import braid
    comm = braid.init()
    if rank == 1:
        # never makes the call, then exits cleanly: once rank 0 has its answer, or after peer_sleep
        stay_away(flag, peer_sleep)
        return None
    t0 = time.monotonic()
    try:
        comm.all_gather_into_tensor(torch.empty(1000 * w), torch.ones(1000))
    except BraidError as exc:
        return {"error": type(exc).__name__, "msg": str(exc), "waited": time.monotonic() - t0}
    finally:
        open(flag, "w").close()
    return {"error": None}


_NO_DESTROY = """
import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp

def run(rank, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    import braid  # noqa: F401
    dist.init_process_group("braid", rank=rank, world_size=2)
    t = torch.full((1 << 18,), rank + 1.0)
    dist.all_reduce(t)                       # through the node segment: the lanes hold views of it
    out = torch.empty(2 << 18)
    dist.all_gather_into_tensor(out, t)
    assert torch.all(t == 3.0) and torch.all(out == 3.0)
    # one write (print's pieces of two ranks sharing the pipe interleave), and the process ends
    # without destroy_process_group
    print(f"rank {rank} done pid {os.getpid()}", flush=True)

if __name__ == "__main__":
    mp.spawn(run, args=(sys.argv[1],), nprocs=2)
"""


def test_a_process_that_ends_without_destroy_ends_quietly(tmp_path):
    """Most scripts never call destroy_process_group: at their exit the segment's views are still
    alive, and the exit itself frees them; no warning for that, and nothing left in /dev/shm."""
    import socket
    import subprocess
    import sys
    script = tmp_path / "no_destroy.py"
    script.write_text(_NO_DESTROY)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    proc = subprocess.run([sys.executable, str(script), port], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, BRAID_LOG_LEVEL="WARNING"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0 done" in proc.stdout and "rank 1 done" in proc.stdout
    assert "still referenced" not in proc.stderr, proc.stderr[-3000:]
    pids = re.findall(r"done pid (\d+)", proc.stdout)
    assert len(pids) == 2, proc.stdout
    # segments are named braid-<pid of the rank that made it>-...: none of this script's ranks left one
    left = {n for n in braid_shm_entries() if any(n.startswith(f"braid-{p}-") for p in pids)}
    assert not left, left


def test_a_segment_closed_while_viewed_warns_but_not_at_exit(caplog):
    """A close while views of the segment live on (inside a run: the mapping stays) is a warning;
    the same at interpreter exit (`quiet`) only a debug line."""
    from types import SimpleNamespace

    from braid.node import NodeSegment

    class Held:
        def close(self):
            raise BufferError("cannot close exported pointers exist")

    for quiet, warned in ((False, True), (True, False)):
        caplog.clear()
        seg = SimpleNamespace(closed=False, u32=object(), buf=object(), mm=Held())
        with caplog.at_level("DEBUG", logger="braid"):
            NodeSegment.close(seg, quiet=quiet)
        assert seg.closed and seg.u32 is None and seg.buf is None
        hits = [r for r in caplog.records if "still referenced" in r.getMessage()]
        assert len(hits) == 1
        assert (hits[0].levelname == "WARNING") == warned
        NodeSegment.close(seg)              # idempotent: a second close does nothing
        assert len([r for r in caplog.records if "still referenced" in r.getMessage()]) == 1


def test_peer_that_never_calls_times_out(tmp_path):
    peer_sleep = 9.0
    results = run_world(_timeout_worker, 2, peer_sleep, str(tmp_path / "answered"), env={"BRAID_TIMEOUT_S": "3"},
                        timeout=90)
    got = results[0]
    # a LaneFailureError would mean the wait outlived the sleeping peer: the timeout did not fire
    assert got["error"] == "BraidTimeoutError", got
    assert "rank 1" in got["msg"] and "BRAID_TIMEOUT_S" in got["msg"], got["msg"]
    assert issubclass(BraidTimeoutError, TimeoutError)


def _dead_peer_worker(rank, w, when):
    import braid
    comm = braid.init()
    me_dies = rank == w - 1
    n = 400_000
    x = torch.full((n,), rank + 1, dtype=torch.int32)
    out = torch.empty(n * w, dtype=torch.int32)
    if me_dies and when == "before":
        os._exit(1)
    with comm.fixed_shares({"gloo": 0.5, "shm": 0.5}):
        if me_dies:               # mid-way: a call in flight on both lanes, then the process is gone
            for i in range(3):
                comm.all_gather_into_tensor(out, x)
            comm.all_gather_into_tensor(out, x, async_op=True)
            os._exit(1)
        for i in range(9):
            try:
                comm.all_gather_into_tensor(out, x)
            except BraidError as exc:
                return {"error": type(exc).__name__, "msg": str(exc), "calls": i}
            want = torch.arange(1, w + 1, dtype=torch.int32).repeat_interleave(n)
            assert torch.equal(out, want), f"call {i} wrong"
    return {"error": None}


@pytest.mark.parametrize("when", ["before", "mid"])
def test_dead_peer_raises_and_leaves_no_segment(when):
    w = 3 if when == "before" else 2
    info: dict = {}
    results = run_world(_dead_peer_worker, w, when, env={"BRAID_TIMEOUT_S": "10"}, timeout=100,
                        allowed_exit={w - 1: 1}, info=info)
    for r in range(w - 1):
        got = results[r]
        assert got is not None and got["error"] in ("LaneFailureError", "BraidTimeoutError"), (r, got)
        if got["error"] == "LaneFailureError":
            # the shm lane and the exchange name the dead rank; the gloo lane passes on gloo's
            # "connection reset by peer"
            assert f"rank {w - 1}" in got["msg"] or "lane gloo failed" in got["msg"], got["msg"]
        # before: the very first call fails; mid-way: the three calls the peer made succeed
        assert got["calls"] == 0 if when == "before" else got["calls"] >= 3, got
    assert results[w - 1] is None       # the dead rank returned nothing
    left = {n for n in braid_shm_entries() if any(n.startswith(f"braid-{p}-") for p in info["pids"])}
    assert not left, left


# ---------------------------------------------------------------------------------------------
# settings
# ---------------------------------------------------------------------------------------------

def test_invalid_setting_names_the_variable(monkeypatch):
    monkeypatch.setenv("BRAID_HOST_BUFFER_MB", "abc")
    with pytest.raises(MisuseError) as info:
        envs.get("BRAID_HOST_BUFFER_MB")
    assert "BRAID_HOST_BUFFER_MB" in str(info.value) and "abc" in str(info.value)
    assert isinstance(info.value, ValueError)
    for name, value in [("BRAID_HOST_CHUNK_KB", "0"), ("BRAID_HOST_CHUNK_KB", "-4"), ("BRAID_TIMEOUT_S", "0"),
                        ("BRAID_TIMEOUT_S", "soon"), ("BRAID_CHECK", "maybe"), ("BRAID_MIN_SPLIT_KB", "1.5")]:
        monkeypatch.setenv(name, value)
        with pytest.raises(MisuseError, match=name):
            envs.get(name)
        monkeypatch.delenv(name)


def test_settings_parse_and_default(monkeypatch):
    for name, _, _ in envs.describe():
        monkeypatch.delenv(name, raising=False)
    assert envs.get("BRAID_HOST_BUFFER_MB") == 64
    assert envs.get("BRAID_CHECK") is False
    assert envs.get("BRAID_LANES") is None
    monkeypatch.setenv("BRAID_CHECK", " Yes ")
    assert envs.get("BRAID_CHECK") is True
    monkeypatch.setenv("BRAID_LANES", " SHM, gloo ,")
    assert envs.get("BRAID_LANES") == ("shm", "gloo")
    monkeypatch.setenv("BRAID_LANES", "auto")
    assert envs.get("BRAID_LANES") is None
    monkeypatch.setenv("BRAID_TIMEOUT_S", "2.5")
    assert envs.get("BRAID_TIMEOUT_S") == 2.5
    names = [d[0] for d in envs.describe()]
    assert len(names) == len(set(names)) and "BRAID_HOST_CHUNK_KB" in names
    assert all(doc for _, _, doc in envs.describe())


def test_override_sets_and_restores(monkeypatch):
    monkeypatch.setenv("BRAID_HOST_BUFFER_MB", "8")
    monkeypatch.delenv("BRAID_CHECK", raising=False)
    monkeypatch.delenv("BRAID_LANES", raising=False)
    monkeypatch.delenv("BRAID_TIMEOUT_S", raising=False)
    with envs.override(BRAID_HOST_BUFFER_MB=16, BRAID_CHECK="1", BRAID_LANES=["shm", "gloo"]):
        assert envs.get("BRAID_HOST_BUFFER_MB") == 16
        assert envs.get("BRAID_CHECK") is True
        assert envs.get("BRAID_LANES") == ("shm", "gloo")
        with envs.override(BRAID_HOST_BUFFER_MB=None):
            assert envs.get("BRAID_HOST_BUFFER_MB") == 64 and "BRAID_HOST_BUFFER_MB" not in os.environ
        assert envs.get("BRAID_HOST_BUFFER_MB") == 16
    assert os.environ["BRAID_HOST_BUFFER_MB"] == "8"
    assert "BRAID_CHECK" not in os.environ and "BRAID_LANES" not in os.environ
    # restored when the block raises, too
    with pytest.raises(KeyError):
        with envs.override(BRAID_TIMEOUT_S="7"):
            assert envs.get("BRAID_TIMEOUT_S") == 7.0
            raise KeyError("boom")
    assert "BRAID_TIMEOUT_S" not in os.environ
    with pytest.raises(MisuseError, match="BRAID_NOT_A_SETTING"):
        with envs.override(BRAID_NOT_A_SETTING="1"):
            pass


# ---------------------------------------------------------------------------------------------
# without torch.distributed
# ---------------------------------------------------------------------------------------------

def test_no_process_group_is_misuse():
    import torch.distributed as dist
    assert not dist.is_initialized()
    with pytest.raises(MisuseError, match="init_process_group"):
        braid.Communicator()
    with pytest.raises(MisuseError, match="braid.init"):
        braid.default()
    with pytest.raises(MisuseError, match="braid.init"):
        braid.all_gather_into_tensor(torch.empty(2), torch.empty(1))
    braid.close()      # nothing to close: no error
    for exc in (MisuseError, LaneUnavailableError, LaneFailureError, PeerMismatchError, BraidTimeoutError):
        assert issubclass(exc, BraidError) and issubclass(exc, RuntimeError)
