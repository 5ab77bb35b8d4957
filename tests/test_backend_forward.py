"""The braid backend's forwarding path: a call that braid's Communicator gives the native library
whole goes from `dist.*` straight to the inner gloo/NCCL group and returns that library's own Work
(its future, its stream semantics). The first call of a shape takes the full path, which stores the
answer; a repeat of the shape forwards; a changed size, dtype, op or root asks again. Checked over
1,000 mixed calls (whole and split, fresh buffers every call) against references built from every
rank's seeded data.
"""
from __future__ import annotations

import datetime
import hashlib
import random

import torch

from conftest import run_world

ENV = {"BRAID_MIN_SPLIT_KB": "64", "CUDA_VISIBLE_DEVICES": ""}
SMALL = [5, 77, 1001, 4099]            # elements: at most 32 KiB in the dtypes below
LARGE = [100_003, 131_075]             # elements: at least 195 KiB
# lane costs that give gloo every call up to 32 KiB whole and braid's shm lane (alone or in a
# split) every call from 195 KiB: gloo 10 us + 1 GB/s, shm 100 us + 10 GB/s
LANE_COSTS = {"gloo": {"latency_us": 10.0, "bw_gbps": 1.0, "floor_us": 10.0},
              "shm": {"latency_us": 100.0, "bw_gbps": 10.0, "floor_us": 100.0}}
CALIBRATED_OPS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all_single"]
DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.float64]


def _data(key, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Seeded, no zeros: small integers (exact sums in every dtype here)."""
    seed = int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:8], "little") >> 1
    g = torch.Generator().manual_seed(seed)
    v = torch.randint(1, 60, (n,), generator=g) * (torch.randint(0, 2, (n,), generator=g) * 2 - 1)
    return v.to(dtype)


def _one_call(rank: int, w: int, k: int, op: str, n: int, dtype: torch.dtype):
    """Make call k and return (the Work, a check to run after waiting)."""
    import torch.distributed as dist
    mine = _data((k, rank), n, dtype)
    every = [_data((k, r), n, dtype) for r in range(w)]
    if op == "all_reduce":
        t = mine.clone()
        work = dist.all_reduce(t, async_op=True)
        want = torch.stack([e.double() for e in every]).sum(0).to(dtype)
        return work, lambda: torch.equal(t, want)
    if op == "all_gather":
        out = torch.empty(n * w, dtype=dtype)
        work = dist.all_gather_into_tensor(out, mine, async_op=True)
        return work, lambda: torch.equal(out, torch.cat(every))
    if op == "reduce_scatter":
        per = n
        inp = torch.cat([_data((k, rank, d), per, dtype) for d in range(w)])
        out = torch.empty(per, dtype=dtype)
        work = dist.reduce_scatter_tensor(out, inp, async_op=True)
        want = torch.stack([_data((k, r, rank), per, dtype).double() for r in range(w)]).sum(0).to(dtype)
        return work, lambda: torch.equal(out, want)
    if op == "broadcast":
        root = k % w
        t = mine.clone()
        work = dist.broadcast(t, src=root, async_op=True)
        return work, lambda: torch.equal(t, every[root])
    if op == "all_to_all":
        inp = torch.cat([_data((k, rank, d), n, dtype) for d in range(w)])
        out = torch.empty_like(inp)
        work = dist.all_to_all_single(out, inp, async_op=True)
        return work, lambda: torch.equal(out, torch.cat([_data((k, s, rank), n, dtype) for s in range(w)]))
    raise ValueError(op)


def _forward_worker(rank: int, w: int, calls: int):
    import torch.distributed as dist
    import braid  # noqa: F401  registers the backend
    from braid.backend import BraidWork
    dist.init_process_group("braid", rank=rank, world_size=w, timeout=datetime.timedelta(seconds=60))
    pg = dist.distributed_c10d._get_default_group()
    pg.ensure_communicator().set_calibration({f"{op}/{w}": dict(LANE_COSTS) for op in CALIBRATED_OPS})
    rng = random.Random(1234)               # the same call sequence on every rank
    ops = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"]
    seen: dict = {}
    wrong, forwarded, braid_works, first_full = [], 0, 0, 0
    for k in range(calls):
        op = rng.choice(ops)
        n = rng.choice(SMALL if rng.random() < 0.85 else LARGE)
        # as in a training loop, a call shape mostly keeps its dtype; now and then it changes
        dtype = DTYPES[(ops.index(op) + n) % len(DTYPES)] if rng.random() < 0.9 else rng.choice(DTYPES)
        work, check = _one_call(rank, w, k, op, n, dtype)
        small = n in SMALL
        # braid keeps one answer per op and element count (a loop's buckets keep their dtype):
        # a call repeats when its op and count last came with the same dtype (and root)
        shape, facts = (op, n), (dtype, k % w if op == "broadcast" else 0)
        repeat = seen.get(shape) == facts
        if isinstance(work, BraidWork):
            braid_works += 1
            if small and not repeat:
                first_full += 1
            elif small:
                wrong.append(f"call {k}: repeated whole {shape, facts} took the full path")
        else:
            forwarded += 1
            if not small:
                wrong.append(f"call {k}: split-size {shape, facts} was forwarded whole")
            if not repeat:
                wrong.append(f"call {k}: {shape, facts} was forwarded before the full path asked")
        seen[shape] = facts
        work.wait()
        if not check():
            wrong.append(f"call {k}: {shape} wrong result")
    comm = pg._comm
    dist.barrier()
    dist.destroy_process_group()
    return {"wrong": wrong[:10], "forwarded": forwarded, "braid": braid_works, "first_full": first_full,
            "closed": comm.closed}


def test_repeated_whole_calls_forward_and_stay_right():
    reports = run_world(_forward_worker, 2, 1000, init_pg=False, env=ENV, timeout=240)
    for rep in reports:
        assert rep["wrong"] == [], rep["wrong"]
        # most calls are repeats of a small shape: they were forwarded; every first call of a
        # shape and every large call took braid's full path
        assert rep["forwarded"] > 500, rep
        assert rep["first_full"] > 0 and rep["braid"] >= rep["first_full"], rep
        assert rep["closed"]
    assert reports[0]["forwarded"] == reports[1]["forwarded"]     # the same decisions on every rank


# the hand-off (backend.py's _look): once every call of a window went whole, the group's
# single-tensor all_reduce / all-gather / reduce-scatter of the shapes seen go to the inner group
HAND_ENV = dict(ENV, BRAID_HANDOFF="16")
HAND_OPS = ["all_reduce", "all_gather", "reduce_scatter"]


def _handoff_worker(rank: int, w: int, split_every: int):
    import torch.distributed as dist
    import braid  # noqa: F401  registers the backend
    from braid.backend import BraidWork
    dist.init_process_group("braid", rank=rank, world_size=w, timeout=datetime.timedelta(seconds=60))
    pg = dist.distributed_c10d._get_default_group()
    comm = pg.ensure_communicator()
    comm.set_calibration({f"{op}/{w}": dict(LANE_COSTS) for op in CALIBRATED_OPS})
    rng = random.Random(99)
    wrong, k = [], 0

    def call(op, n, dtype=torch.float32):
        nonlocal k
        work, check = _one_call(rank, w, k, op, n, dtype)
        k += 1
        work.wait()
        if not check():
            wrong.append(f"call {k}: {op} {n} {dtype} wrong")
        return work

    # a job of small calls (each shape keeps its dtype), with a split-size call every `split_every`;
    # handing_off(): before a call with no hand-off yet, is one on its way?
    coming = []
    for i in range(200):
        if not pg._handed:
            coming.append(pg.handing_off())
        if split_every and i % split_every == split_every - 1:
            call("all_reduce", LARGE[0])
        else:
            op = rng.choice(HAND_OPS)
            call(op, rng.choice(SMALL[:3]), DTYPES[HAND_OPS.index(op)])
    handed = sorted(pg._handed)
    bound = sorted(name for name in handed if name in pg.__dict__)
    calls = comm.ledger.ncalls
    out = {"handed": handed, "bound": bound, "coming": any(coming), "coming_end": pg.handing_off()}
    if handed:
        # a handed-off shape: the inner group's own Work, counted as a whole call
        work = call("all_gather", SMALL[0], DTYPES[1])
        out["inner_work"] = not isinstance(work, BraidWork)
        out["counted"] = comm.ledger.ncalls - calls
        # shapes the hand-off did not see: a new size (whole), a split size, another dtype
        out["new_size"] = isinstance(call("all_gather", SMALL[3], DTYPES[1]), BraidWork)
        out["split_size"] = isinstance(call("reduce_scatter", LARGE[1]), BraidWork)
        out["other_dtype"] = isinstance(call("all_reduce", SMALL[0], torch.float64), BraidWork)
        # fixed shares give the methods back: every call is braid's again
        with comm.fixed_shares({"shm": 1.0}):
            out["inside"] = (sorted(pg._handed), sorted(n for n in handed if n in pg.__dict__),
                             isinstance(call("all_gather", SMALL[0], DTYPES[1]), BraidWork))
        for i in range(60):           # and the job goes on: handed off again after a window
            op = HAND_OPS[i % 3]
            call(op, SMALL[i % 3], DTYPES[i % 3])
        out["again"] = sorted(pg._handed)
    out["calls"] = comm.ledger.ncalls
    out["wrong"] = wrong[:10]
    dist.barrier()
    dist.destroy_process_group()
    out["after_close"] = sorted(name for name in pg.__dict__ if name in pg._handed or name.startswith("_allg"))
    return out


def test_hand_off_after_a_window_of_whole_calls():
    for w in (2, 3):
        reports = run_world(_handoff_worker, w, 0, init_pg=False, env=HAND_ENV, timeout=240)
        for rep in reports:
            assert rep["wrong"] == [], rep["wrong"]
            assert "allreduce" in rep["handed"] and len(rep["handed"]) == 3, rep
            assert rep["bound"] == rep["handed"], rep
            # the hand-off was seen coming before it came, and nothing is coming once it is in place
            assert rep["coming"] and not rep["coming_end"], rep
            assert rep["inner_work"] and rep["counted"] == 1, rep
            assert rep["new_size"] and rep["split_size"] and rep["other_dtype"], rep
            assert list(rep["inside"]) == [[], [], True], rep
            assert rep["again"] == rep["handed"], rep
            assert rep["after_close"] == [], rep
        # every rank handed off at the same call and counted the same calls
        assert len({(tuple(r["handed"]), r["calls"]) for r in reports}) == 1, reports


def test_no_hand_off_while_some_calls_split_or_when_off():
    for env, split_every in ((HAND_ENV, 10), (dict(HAND_ENV, BRAID_HANDOFF="0"), 0)):
        reports = run_world(_handoff_worker, 2, split_every, init_pg=False, env=env, timeout=240)
        for rep in reports:
            assert rep["wrong"] == [], rep["wrong"]
            assert rep["handed"] == [] and rep["bound"] == [], rep
            # the last call split (or hand-offs are off): none on its way
            assert not rep["coming_end"], rep
        if env["BRAID_HANDOFF"] == "0":
            assert not any(r["coming"] for r in reports), reports


def _handoff_abort_worker(rank: int, w: int):
    import torch.distributed as dist
    import braid  # noqa: F401  registers the backend
    from braid.errors import BraidError
    dist.init_process_group("braid", rank=rank, world_size=w, timeout=datetime.timedelta(seconds=60))
    pg = dist.distributed_c10d._get_default_group()
    comm = pg.ensure_communicator()
    comm.set_calibration({f"{op}/{w}": dict(LANE_COSTS) for op in CALIBRATED_OPS})
    for k in range(120):
        op = HAND_OPS[k % 3]
        work, check = _one_call(rank, w, k, op, SMALL[k % 3], DTYPES[k % 3])
        work.wait()
        assert check()
    handed = list(pg._handed)
    dist.barrier()
    comm.abort("stopping on purpose")           # every rank, as a job that gives up would
    after = list(pg._handed), sorted(n for n in handed if n in pg.__dict__)
    try:
        t = _data((0, rank), SMALL[0], DTYPES[0])
        dist.all_reduce(t)                      # a handed-off shape: braid's path again, which refuses
        raised = ""
    except BraidError as exc:
        raised = type(exc).__name__
    return {"handed": handed, "after": after, "raised": raised}


def test_an_abort_gives_the_handed_off_methods_back():
    reports = run_world(_handoff_abort_worker, 2, init_pg=False, env=HAND_ENV, timeout=240)
    for rep in reports:
        assert len(rep["handed"]) == 3, rep
        assert list(rep["after"]) == [[], []], rep
        assert rep["raised"], rep
