"""braid's calls in torch's profiler: one "braid:<op>" event per call, as gloo's and NCCL's.

One spawned world of 2 CPU ranks on backend braid runs calls under torch.profiler.profile (and one
under the autograd profiler) and reports the events it saw: send/recv before braid's communicator
exists (handed to the inner gloo group), all_reduce (sync and async), all_gather, broadcast,
send/recv after it, and an all_reduce split over braid's own two CPU lanes (braid's own Work, whose
record ends when it is waited on). Each call must leave exactly one event under braid's name,
asynchronous, with the call's input shapes, and still compute the right result.
"""
from __future__ import annotations

import datetime

import pytest

from conftest import run_world

ENV = {"CUDA_VISIBLE_DEVICES": ""}


def _events(prof, prefix: str) -> list[list]:
    evs = prof.events() if hasattr(prof, "events") and callable(prof.events) else prof.function_events
    return [[e.name, bool(e.is_async), int(e.count), [list(s) for s in e.input_shapes]]
            for e in evs if e.name.startswith(prefix)]


def _worker(rank: int, w: int) -> dict:
    import threading
    import time

    import torch
    import torch.distributed as dist

    import braid  # noqa: F401  registers the backend
    from braid import backend_work

    dist.init_process_group("braid", rank=rank, world_size=w, timeout=datetime.timedelta(seconds=60))
    pg = dist.distributed_c10d._get_default_group()
    peer = 1 - rank
    out: dict = {}
    backend_work._RecordEnder.IDLE_S = 0.2        # so that the thread's exit is seen quickly

    def p2p(n: int):
        if rank == 0:
            dist.send(torch.full((n, 2), 7.0), peer)
        else:
            got = torch.zeros(n, 2)
            dist.recv(got, peer)
            assert torch.equal(got, torch.full((n, 2), 7.0)), got

    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
    with prof:
        p2p(3)                                            # before the communicator: gloo's send/recv
        made_before = pg._comm is not None
        t = torch.full((4, 3), float(rank + 1))
        dist.all_reduce(t)                                # makes the communicator (nested calls: no event)
        out["sum_ok"] = bool(torch.equal(t, torch.full((4, 3), 3.0)))
        a = torch.full((5,), float(rank))
        dist.all_reduce(a, async_op=True).wait()
        out["async_ok"] = bool(torch.equal(a, torch.full((5,), 1.0)))
        outs = [torch.empty(2, 6) for _ in range(w)]
        dist.all_gather(outs, torch.full((2, 6), float(rank)))
        out["gather_ok"] = all(bool(torch.equal(o, torch.full((2, 6), float(r)))) for r, o in enumerate(outs))
        b = torch.full((7,), float(rank + 10))
        dist.broadcast(b, 1)
        out["bcast_ok"] = bool(torch.equal(b, torch.full((7,), 11.0)))
        p2p(4)                                            # after it
        with pg.ensure_communicator().fixed_shares({"gloo": 0.5, "shm": 0.5}):
            s = torch.full((4096,), float(rank + 1))
            work = dist.all_reduce(s, async_op=True)      # braid's own lanes: braid's Work
            out["own_work"] = type(work).__name__
            work.wait()
            out["split_ok"] = bool(torch.equal(s, torch.full((4096,), 3.0)))
    out["made_before"] = made_before
    out["braid"] = _events(prof, "braid:")
    out["gloo"] = _events(prof, "gloo:")

    ap = torch.autograd.profiler.profile(record_shapes=True)
    with ap:
        r = torch.ones(6)
        dist.all_reduce(r)
    out["autograd"] = _events(ap, "braid:")

    dist.all_reduce(torch.ones(3))                        # profiler off: no record is opened
    out["recording_left"] = pg._recording
    deadline = time.monotonic() + 10
    while any(t.name == "braid-profiler" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    out["ender_threads"] = [t.name for t in threading.enumerate() if t.name == "braid-profiler"]
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def reports():
    return run_world(_worker, 2, init_pg=False, env=ENV, timeout=120)


def _by_name(events) -> dict[str, list]:
    names: dict[str, list] = {}
    for name, is_async, count, shapes in events:
        names.setdefault(name, []).append((is_async, count, shapes))
    return names


def test_calls_compute_the_same_under_the_profiler(reports):
    for r, rep in enumerate(reports):
        for key in ("sum_ok", "async_ok", "gather_ok", "bcast_ok", "split_ok"):
            assert rep[key] is True, (r, key)
        assert rep["made_before"] is False, "send/recv before any collective made braid's communicator"
        assert rep["own_work"] == "BraidWork", f"the split all_reduce did not run on braid's lanes: {rep['own_work']}"


def test_one_braid_event_per_call(reports):
    p2p = {0: "braid:send", 1: "braid:recv"}
    for r, rep in enumerate(reports):
        names = _by_name(rep["braid"])
        want = {"braid:all_reduce": 3, "braid:all_gather": 1, "braid:broadcast": 1, p2p[r]: 2}
        got = {n: sum(c for _, c, _ in evs) for n, evs in names.items()}
        assert got == want, f"rank {r}: braid's events {got}, want {want}"


def test_events_are_async_with_the_input_shapes(reports):
    shapes = {"braid:all_reduce": [[[4, 3]], [[5]], [[4096]]], "braid:all_gather": [[[2, 6]]],
              "braid:broadcast": [[[7]]], "braid:send": [[[3, 2]], [[4, 2]]], "braid:recv": [[[3, 2]], [[4, 2]]]}
    for r, rep in enumerate(reports):
        for name, evs in _by_name(rep["braid"]).items():
            assert all(is_async for is_async, _, _ in evs), f"rank {r}: {name} not asynchronous: {evs}"
            assert sorted(s for _, _, s in evs) == sorted(shapes[name]), f"rank {r}: {name} shapes {evs}"


def test_forwarded_calls_keep_the_inner_groups_events(reports):
    # the send/recv made before the communicator existed went to gloo whole: its own event stays
    p2p = {0: "gloo:send", 1: "gloo:recv"}
    for r, rep in enumerate(reports):
        gloo = _by_name(rep["gloo"])
        assert p2p[r] in gloo, f"rank {r}: no {p2p[r]} event under braid's forwarded call: {sorted(gloo)}"


def test_autograd_profiler_sees_the_event(reports):
    for r, rep in enumerate(reports):
        assert rep["autograd"] == [["braid:all_reduce", True, 1, [[6]]]], (r, rep["autograd"])


def test_nothing_left_after_profiling(reports):
    for r, rep in enumerate(reports):
        assert rep["recording_left"] is False, f"rank {r}: a record stayed open"
        assert rep["ender_threads"] == [], f"rank {r}: braid's profiler thread did not exit when idle"
