"""GPU tier on ONE GPU: the braid backend's Work and forwarding path on CUDA.

- `BraidWork.get_future()` of a GPU call is a CUDA future, as NCCL's: the caller's stream is not
  made to wait (DDP keeps computing the backward pass beside a bucket's all_reduce), whoever uses
  the value waits for the call, and a later `wait()` still orders the caller's stream after it;
  the same where the future completes on the call's own lane stream (a replayed call).
- Under `init_process_group("braid")` on a world of one GPU, every call is NCCL's whole: the first
  call of a shape takes braid's full path, its repeats return NCCL's own Work, and every result is
  right across dtypes, sizes and buffer changes; after a window of whole calls the group hands its
  all_reduce, all-gather and reduce-scatter to NCCL (BRAID_HANDOFF), every call still counted.
Skips without a GPU.
"""
from __future__ import annotations

import os
import socket
import time

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class _EventHandle:
    """A braid handle whose call ends with `event` (recorded on another stream)."""

    def __init__(self, event):
        self.event = event
        self.waits = 0

    def wait(self, timeout=None):
        self.waits += 1
        torch.cuda.current_stream().wait_event(self.event)
        return True

    def is_completed(self):
        return self.event.query()


def _slow_call(value: float, n: int = 1 << 20):
    """A 'call' on a side stream that takes ~0.2 s of GPU time, then writes `value` into out."""
    prod = torch.cuda.Stream()
    out = torch.zeros(n, device="cuda")
    prod.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(prod):
        torch.cuda._sleep(int(3e8))
        out.fill_(value)
        ev = torch.cuda.Event()
        ev.record(prod)
    return out, ev


def test_future_of_a_gpu_call_does_not_block_the_callers_stream():
    from braid.backend import BraidWork
    torch.cuda._sleep(10)                          # load the kernel before any stream waits
    torch.cuda.synchronize()
    out, ev = _slow_call(3.0)
    handle = _EventHandle(ev)
    work = BraidWork(handle, [out])
    fut = work.get_future()
    mark = torch.cuda.Event()
    mark.record(torch.cuda.current_stream())        # the caller's stream, right after get_future
    deadline = time.monotonic() + 5.0
    while not mark.query() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert mark.query(), "the caller's stream waits for the call after get_future()"
    assert not ev.query(), "the slow call ended before the check: the test proves nothing"
    assert not work.is_completed()
    # whoever uses the value waits for the call
    got = fut.wait()[0]
    total = got.sum()
    assert total.item() == 3.0 * out.numel()
    # a later wait() orders the caller's stream after the call (through the future's stream)
    out2, ev2 = _slow_call(5.0)
    work2 = BraidWork(_EventHandle(ev2), [out2])
    work2.get_future()
    work2.wait()
    after = out2.sum()                               # runs on the caller's stream
    assert after.item() == 5.0 * out2.numel()
    assert work2.is_completed() and handle.waits == 1


class _LaneHandle(_EventHandle):
    """A braid handle whose call's end is the last work on `stream` (a replayed call's lane)."""

    def __init__(self, event, stream):
        super().__init__(event)
        self.stream = stream


def test_future_of_a_call_that_ends_on_its_lane_stream():
    """get_future() completes the future on the lane stream itself (no side stream): the
    caller's stream still runs on, the value's user waits for the call, and wait() orders the
    caller's stream after it."""
    from braid.backend import BraidWork
    torch.cuda._sleep(10)
    torch.cuda.synchronize()
    lane = torch.cuda.Stream()
    out = torch.zeros(1 << 20, device="cuda")
    lane.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(lane):
        torch.cuda._sleep(int(3e8))
        out.fill_(7.0)
        ev = torch.cuda.Event()
        ev.record(lane)
    handle = _LaneHandle(ev, lane)
    work = BraidWork(handle, [out])
    fut = work.get_future()
    assert handle.waits == 0 and work._side_done is None        # no side stream's wait
    mark = torch.cuda.Event()
    mark.record(torch.cuda.current_stream())
    deadline = time.monotonic() + 5.0
    while not mark.query() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert mark.query(), "the caller's stream waits for the call after get_future()"
    assert not ev.query(), "the slow call ended before the check: the test proves nothing"
    other = torch.cuda.Stream()
    with torch.cuda.stream(other):                 # a user of the value on a third stream
        total = fut.wait()[0].sum()
    other.synchronize()
    assert total.item() == 7.0 * out.numel()
    work.wait()
    assert out.sum().item() == 7.0 * out.numel() and handle.waits == 1


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _world_of_one(port: int, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **GPU_ENV)
    import torch.distributed as dist
    import braid  # noqa: F401  registers the backend
    from braid.backend import BraidWork
    try:
        torch.cuda.set_device(0)
        dist.init_process_group("braid", rank=0, world_size=1)
        kinds, bad = [], []
        for k in range(40):
            n, dt = ((1001, torch.bfloat16), (65537, torch.float32), (1 << 20, torch.float16),
                     (4099, torch.int32))[k % 4]
            x = (torch.arange(n, device="cuda") % 97 + 1).to(dt)
            t = x.clone()                            # a fresh buffer every call
            w = dist.all_reduce(t, async_op=True)
            kinds.append(isinstance(w, BraidWork))
            w.get_future().wait()
            out = torch.empty(n, device="cuda", dtype=dt)
            dist.all_gather_into_tensor(out, x)
            rs = torch.empty(n, device="cuda", dtype=dt)
            dist.reduce_scatter_tensor(rs, x)
            torch.cuda.synchronize()
            for name, got in (("all_reduce", t), ("all_gather", out), ("reduce_scatter", rs)):
                if not torch.equal(got, x):
                    bad.append(f"call {k} {name} {dt} n={n}")
        pg = dist.distributed_c10d._get_default_group()
        handed, calls = sorted(pg._handed), pg._comm.ledger.ncalls
        dist.destroy_process_group()
        q.put({"kinds": kinds, "bad": bad, "handed": handed, "calls": calls})
    except BaseException as exc:       # noqa: BLE001  reported to the parent
        import traceback
        q.put({"error": f"{exc!r}\n{traceback.format_exc()}"})


def _world_of_one_handing_off(port: int, q) -> None:
    os.environ["BRAID_HANDOFF"] = "8"         # looks every 8 whole calls (default 256)
    _world_of_one(port, q)


def _in_fresh_process(target, tries: int = 3) -> dict:
    """Run target(port, queue) in a spawned process (its own default group) and return what it
    put on the queue; a process that hangs is killed. The port is free when chosen, but another
    process may take it while the child starts (seen once on a shared GPU host): then the child's
    store cannot listen, and the world runs again on another port."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    res: dict = {}
    for _ in range(tries):
        q = ctx.Queue()
        p = ctx.Process(target=target, args=(_port(), q))
        p.start()
        try:
            res = q.get(timeout=180)
        finally:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        if "EADDRINUSE" not in res.get("error", ""):
            break
    return res


def test_world_of_one_forwards_repeats_to_nccls_own_work():
    res = _in_fresh_process(_world_of_one)
    assert "error" not in res, res.get("error")
    assert res["bad"] == [], res["bad"]
    # 4 call shapes: each first call takes the full path, every repeat forwards
    assert res["kinds"][:4] == [True] * 4 and not any(res["kinds"][4:]), res["kinds"]
    assert res["handed"] == [] and res["calls"] == 120, res     # 120 whole calls: no look yet


def test_world_of_one_hands_its_whole_calls_to_nccl():
    """Every call whole: after a look the group's all_reduce, all-gather and reduce-scatter of the
    shapes seen go straight to NCCL (torch's method names of this version); results stay right
    and every call is still counted."""
    res = _in_fresh_process(_world_of_one_handing_off)
    assert "error" not in res, res.get("error")
    assert res["bad"] == [], res["bad"]
    assert res["kinds"][:4] == [True] * 4 and not any(res["kinds"][4:]), res["kinds"]
    assert "allreduce" in res["handed"] and len(res["handed"]) == 3, res
    assert res["calls"] == 120, res


def _abort_world_of_one(port: int, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **GPU_ENV)
    import torch.distributed as dist
    import braid
    from braid.errors import LaneFailureError
    try:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1)
        comm = braid.init()
        x = torch.ones(1 << 20, device="cuda")
        comm.all_reduce(x)
        groups = len(comm._faults.native_groups())
        braid.abort("stopping on purpose")          # aborts braid's NCCL groups for real
        try:
            comm.all_reduce(x)
            after = None
        except LaneFailureError as exc:
            after = str(exc)
        braid.close()
        q.put({"after": after, "groups": groups})
    except BaseException as exc:       # noqa: BLE001  reported to the parent
        import traceback
        q.put({"error": f"{exc!r}\n{traceback.format_exc()}"})


def test_abort_aborts_nccl_and_refuses_later_calls():
    res = _in_fresh_process(_abort_world_of_one)
    assert "error" not in res, res.get("error")
    assert res["groups"] >= 1
    assert res["after"] is not None and "aborted (stopping on purpose)" in res["after"], res


def _nccl_only_dtypes(port: int, q) -> None:
    """braid's direct API on a world of one GPU (NCCL default group): float8 and complex
    reductions, which braid's own reductions do not do and NCCL does, go to NCCL whole."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **GPU_ENV)
    import torch.distributed as dist
    import braid
    try:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1)
        comm = braid.init()
        done, bad = [], []
        cases = [(dt, op) for dt in (torch.float8_e4m3fn, torch.float8_e5m2)
                 for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX)] + [(torch.complex64, dist.ReduceOp.SUM)]
        for dt, op in cases:
            x = (torch.arange(64, device="cuda", dtype=torch.float32) / 8).to(dt)
            for name in ("all_reduce", "reduce"):
                t = x.clone()
                (braid.all_reduce(t, op=op) if name == "all_reduce" else braid.reduce(t, dst=0, op=op))
                torch.cuda.synchronize()
                same = torch.equal(t.view(torch.uint8), x.view(torch.uint8))
                if not same or comm.last_handle.shares != {"nccl": 1.0}:
                    bad.append(f"{name} {dt} {op}: same={same} shares={comm.last_handle.shares}")
                done.append(f"{name} {dt}")
        braid.close()
        dist.destroy_process_group()
        q.put({"done": done, "bad": bad})
    except BaseException as exc:       # noqa: BLE001  reported to the parent
        import traceback
        q.put({"error": f"{exc!r}\n{traceback.format_exc()}"})


def test_float8_and_complex_reductions_go_to_nccl_whole():
    res = _in_fresh_process(_nccl_only_dtypes)
    assert "error" not in res, res.get("error")
    assert res["bad"] == [] and len(res["done"]) == 10, res
