"""Prepared calls (comm/prepared.py) on the CPU lanes in real 2- and 3-rank worlds.

A repeated split collective is agreed once and then taken from the cache with one round of
words; these tests count the cache's builds and hits and check every output against data each
rank derives from seeds (an independent reference):
- a repeat hits; a new size, dtype, root, op, calibration, fixed shares or balancer move builds;
- 1,000 mixed repeated calls (every cached op, odd sizes, several dtypes) are bitwise right, with
  the cache holding fewer entries than shapes (evictions in the same order on every rank);
- a rank that changes its call alone still gets the mismatch error on every rank;
- BRAID_PREPARED=0 builds nothing and gives the same results.
"""
from __future__ import annotations

import hashlib

import pytest
import torch

from conftest import run_world

ENV = {"BRAID_CALIBRATE": "off", "BRAID_LANES": "gloo,shm"}
SPLIT = {"gloo": 0.5, "shm": 0.5}


def _seed(*key) -> int:
    return int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:8], "little") >> 1


def _data(key, numel: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(_seed(*key))
    if dtype.is_floating_point:
        return (torch.rand(numel, generator=g) * 4 - 2).to(dtype)
    return torch.randint(-50, 50, (numel,), generator=g).to(dtype)


def _call(comm, op: str, key, numel: int, dtype, rank: int, w: int, root: int = 0) -> bool:
    """Run one op on fresh data; True when the output equals the reference."""
    xs = [_data((key, r), numel, dtype) for r in range(w)]
    if op == "all_gather":
        out = torch.full((numel * w,), 7, dtype=dtype)
        comm.all_gather_into_tensor(out, xs[rank].clone())
        return torch.equal(out, torch.cat(xs))
    if op == "all_gather_list":
        outs = [torch.full((numel,), 7, dtype=dtype) for _ in range(w)]
        comm.all_gather(outs, xs[rank].clone())
        return all(torch.equal(o, x) for o, x in zip(outs, xs))
    if op == "broadcast":
        t = xs[rank].clone()
        comm.broadcast(t, root)
        return torch.equal(t, xs[root])
    ref = xs[0].double()
    for x in xs[1:]:
        ref = ref + x.double()
    if op == "all_reduce":
        t = xs[rank].clone()
        comm.all_reduce(t)
        return torch.allclose(t.double(), ref, atol=1e-5) if dtype.is_floating_point else torch.equal(t.double(), ref)
    if op == "reduce_scatter":
        full = torch.cat([_data((key, r, "rs"), numel * w, dtype) for r in range(w)]).view(w, -1)
        out = torch.empty(numel, dtype=dtype)
        comm.reduce_scatter_tensor(out, full[rank].clone())
        want = full.double().sum(0)[rank * numel:(rank + 1) * numel]
        return torch.allclose(out.double(), want, atol=1e-5) if dtype.is_floating_point else torch.equal(out.double(), want)
    raise AssertionError(op)


def _cache_rules(rank: int, w: int) -> dict:
    import braid
    comm = braid.init()
    prep = comm._prepared
    steps, ok = [], []

    def step(name, op="all_gather", numel=70_001, dtype=torch.float32, root=0):
        before = dict(prep.stats)
        ok.append(_call(comm, op, (name, len(steps)), numel, dtype, rank, w, root))
        steps.append((name, prep.stats["built"] - before["built"], prep.stats["hits"] - before["hits"]))

    with comm.fixed_shares(SPLIT):
        step("first")
        step("repeat")
        step("repeat again")
        step("new size", numel=70_003)
        step("back to the first size")
        step("new dtype", dtype=torch.float64)
        step("all_gather into a list", op="all_gather_list")
        step("broadcast root 0", op="broadcast")
        step("broadcast root 1", op="broadcast", root=1)
        step("broadcast root 1 again", op="broadcast", root=1)
        step("all_reduce", op="all_reduce")
        step("all_reduce again", op="all_reduce")
        step("reduce_scatter", op="reduce_scatter", numel=30_011)
        step("reduce_scatter again", op="reduce_scatter", numel=30_011)
        comm.set_calibration({})               # a new calibration drops every entry
        step("after a new calibration")
    with comm.fixed_shares({"gloo": 0.25, "shm": 0.75}):
        step("other fixed shares")
        step("other fixed shares again")
    return {"steps": steps, "ok": ok, "entries": len(prep.entries)}


def test_cache_hits_and_rebuilds():
    res = run_world(_cache_rules, 2, env=ENV)
    assert res[0]["steps"] == res[1]["steps"]          # every rank took the same branch
    assert all(res[0]["ok"]) and all(res[1]["ok"])
    got = {name: (built, hits) for name, built, hits in res[0]["steps"]}
    assert got["first"] == (1, 0)
    assert got["repeat"] == (0, 1) and got["repeat again"] == (0, 1)
    assert got["new size"] == (1, 0)
    assert got["back to the first size"] == (0, 1)
    assert got["new dtype"] == (1, 0)
    assert got["all_gather into a list"] == (1, 0)
    assert got["broadcast root 0"] == (1, 0) and got["broadcast root 1"] == (1, 0)
    assert got["broadcast root 1 again"] == (0, 1)
    assert got["all_reduce again"] == (0, 1) and got["reduce_scatter again"] == (0, 1)
    assert got["after a new calibration"] == (1, 0)
    assert got["other fixed shares"] == (1, 0) and got["other fixed shares again"] == (0, 1)


OPS = ("all_gather", "all_gather_list", "broadcast", "all_reduce", "reduce_scatter")


def _mixed(rank: int, w: int, calls: int, seed: int) -> dict:
    import braid
    comm = braid.init()
    g = torch.Generator().manual_seed(seed)          # the same sequence on every rank
    sizes = (1, 3, 4097, 65_537, 300_007)
    dtypes = (torch.float32, torch.float64, torch.int32, torch.bfloat16)
    pick = lambda seq: seq[int(torch.randint(len(seq), (1,), generator=g))]     # noqa: E731
    shapes = []           # a training loop's few shapes, called in a random order
    for _ in range(12):
        op, numel, dtype, root = pick(OPS), pick(sizes), pick(dtypes), int(torch.randint(w, (1,), generator=g))
        if op in ("all_reduce", "reduce_scatter") and dtype == torch.bfloat16:
            dtype = torch.float32           # bf16 sums are checked on GPUs, bitwise
        shapes.append((op, numel, dtype, root))
    wrong = []
    with comm.fixed_shares(SPLIT):
        for i in range(calls):
            op, numel, dtype, root = pick(shapes)
            if not _call(comm, op, ("mixed", seed, i), numel, dtype, rank, w, root):
                wrong.append((i, op, numel, str(dtype)))
    return {"wrong": wrong, "stats": dict(comm._prepared.stats), "entries": len(comm._prepared.entries)}


def test_thousand_mixed_repeated_calls_bitwise_right():
    res = run_world(_mixed, 2, 1000, 7, env=dict(ENV, BRAID_PREPARED_MAX="8"), timeout=600)
    for r in res:
        assert r["wrong"] == []
    assert res[0]["stats"] == res[1]["stats"]
    st = res[0]["stats"]
    assert st["hits"] > 300                  # 12 shapes in 1,000 calls, 8 entries kept: many repeats
    assert st["built"] > 12                  # and evictions made some shapes build again
    assert st["built"] + st["hits"] <= 1000  # calls gloo takes whole (tiny ones) skip the cache
    assert res[0]["entries"] <= 8


def test_three_ranks_mixed():
    res = run_world(_mixed, 3, 150, 11, env=ENV, timeout=300)
    for r in res:
        assert r["wrong"] == []
    assert res[0]["stats"] == res[1]["stats"] == res[2]["stats"]
    assert res[0]["stats"]["hits"] > 0


def _disagree(rank: int, w: int) -> dict:
    import braid
    from braid.errors import PeerMismatchError
    comm = braid.init()
    with comm.fixed_shares(SPLIT):
        for i in range(3):
            assert _call(comm, "all_gather", ("d", i), 50_000, torch.float32, rank, w)
        # the cached shape again on rank 0, another dtype on rank 1: both ranks must raise
        x = torch.ones(50_000, dtype=torch.float32 if rank == 0 else torch.float64)
        out = torch.empty(50_000 * w, dtype=x.dtype)
        try:
            comm.all_gather_into_tensor(out, x)
        except PeerMismatchError as exc:
            msg = str(exc)
        else:
            msg = ""
        ok = _call(comm, "all_gather", ("d", 9), 50_000, torch.float32, rank, w)   # still in step
    return {"msg": msg, "ok": ok}


def test_a_rank_that_changes_its_call_alone_gets_the_mismatch_error():
    res = run_world(_disagree, 2, env=ENV)
    for r in res:
        assert "dtype" in r["msg"], r
        assert r["ok"]


def _off(rank: int, w: int) -> dict:
    import braid
    comm = braid.init()
    with comm.fixed_shares(SPLIT):
        ok = [_call(comm, op, ("off", op, i), 20_011, torch.float32, rank, w) for op in OPS for i in range(3)]
    return {"ok": ok, "stats": dict(comm._prepared.stats)}


def test_prepared_off_builds_nothing():
    res = run_world(_off, 2, env=dict(ENV, BRAID_PREPARED="0"))
    for r in res:
        assert all(r["ok"])
        assert r["stats"]["built"] == 0 and r["stats"]["hits"] == 0


@pytest.mark.parametrize("world", [2])
def test_balancer_move_rebuilds(world):
    """A share move (the balancer, at a call every rank agrees on) changes the words: the next
    call builds a new entry; every rank moves and builds at the same call."""
    res = run_world(_moves, world, env=ENV, timeout=300)
    assert res[0] == res[1]
    versions, built = res[0]["versions"], res[0]["built"]
    moved = [i for i in range(1, len(versions)) if versions[i] != versions[i - 1]]
    assert moved, "the slow lane made the balancer move"
    for i in moved:                      # the call after a move agrees and builds again
        if i + 1 < len(built):
            assert built[i + 1] == 1, (i, built)


def _moves(rank: int, w: int) -> dict:
    import braid
    comm = braid.init()
    versions, built = [], []
    numel = 1 << 20
    for call in range(30):
        comm.slowdown = {"shm": 4.0} if call >= 4 else {}
        before = comm._prepared.stats["built"]
        x = _data(("mv", call, rank), numel)
        out = torch.empty(numel * w)
        comm.all_gather_into_tensor(out, x)
        built.append(comm._prepared.stats["built"] - before)
        versions.append(comm.balancer.version)
    return {"versions": versions, "built": built}


def test_what_cannot_be_captured_says_why_and_what_to_do():
    """A split over several lanes names them and the setting that makes the call capturable; the
    copy engines' staged path (a reduce of fewer elements than ranks) says that and points to NCCL."""
    from braid.comm.prepared import not_capturable
    from braid.errors import MisuseError
    split = not_capturable("all_gather", {"ce": 0.5, "host": 0.5})
    assert isinstance(split, MisuseError)
    assert "['ce', 'host']" in str(split) and "fixed_shares({'ce': 1.0})" in str(split)
    staged = not_capturable("reduce", {"ce": 1.0})
    assert "fewer elements than ranks" in str(staged) and "fixed_shares({'nccl': 1.0})" in str(staged)
    # NCCL itself must have run the call once before a capture takes it (its first run connects)
    assert "once outside the captured region" in str(staged)
    from braid.comm.prepared import posted_not_capturable
    for how in ("uneven", "full", "routed"):
        msg = str(posted_not_capturable("all_to_all_single", {"ce": 1.0}, how))
        assert "once outside the captured region" in msg and "split sizes are all equal can" in msg, msg
        assert "cannot be captured" in msg
    assert "outside the captured region" in str(posted_not_capturable("all_reduce", {"ce": 1.0}, "plan"))


def test_a_move_of_one_shape_leaves_another_shapes_entry():
    """The balancer's version is not in the word: a split whose shares did not move (a broadcast
    on shares fixed for its op alone) keeps its entry (a hit, nothing built) while the balancer
    moves an all_gather's shares, call after call."""
    res = run_world(_two_shapes, 2, env=ENV, timeout=300)
    assert res[0] == res[1]
    moves = [i for i in range(1, len(res[0])) if res[0][i]["version"] != res[0][i - 1]["version"]]
    assert len(moves) >= 2, "the slowed all_gather made the balancer move"
    assert all([tuple(x) for x in r["b_shares"]] == sorted(SPLIT.items()) for r in res[0]), res[0][:3]
    assert res[0][0]["b_built"] == 1 and all(r["b_built"] == 0 for r in res[0][1:]), res[0]


def _two_shapes(rank: int, w: int) -> list:
    import braid
    comm = braid.init()
    rows = []
    with comm.fixed_shares(SPLIT, op="broadcast"):
        for call in range(30):
            comm.slowdown = {"shm": 4.0} if call >= 4 else {}     # the all_gather's lanes are slowed
            x = _data(("a", call, rank), 1 << 20)
            out = torch.empty((1 << 20) * w)
            comm.all_gather_into_tensor(out, x)
            comm.slowdown = {}
            before = comm._prepared.stats["built"]
            t = _data(("b", call, rank), 1 << 20)
            comm.broadcast(t, 0)
            assert torch.equal(t, _data(("b", call, 0), 1 << 20))
            rows.append({"version": comm.balancer.version, "b_built": comm._prepared.stats["built"] - before,
                         "b_shares": sorted(comm.last_handle.shares.items())})
    return rows
