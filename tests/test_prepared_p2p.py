"""Prepared send/recv (comm/p2p.py, PreparedP2P) on the CPU lanes in real 2- and 3-rank worlds.

A split send/recv posts one word per side; the pair's key finds the entry both ranks built at
the first call of that shape, and a miss makes both exchange full descriptors on the second
channel of the direction's mailbox. These tests count each rank's builds and hits and check every
message against data both ranks derive from seeds:
- a repeat hits; a new size, dtype, share or calibration builds; each direction has its own cache;
- 1,000 mixed calls (both directions, blocking and async, recv posted first or last, sizes that
  change, a cache smaller than the shapes in use) arrive bitwise right, and the two ranks of a
  direction keep the same entries;
- a size or dtype mismatch raises PeerMismatchError on both ranks, and the pair goes on after it;
- BRAID_PREPARED=0 builds nothing and delivers the same bytes.
"""
from __future__ import annotations

import torch

from conftest import run_world
from test_prepared_cpu import SPLIT, _data      # seeded data every rank can rebuild

ENV = {"BRAID_CALIBRATE": "off", "BRAID_LANES": "gloo,shm", "BRAID_CPU_SHM": "0"}


def _one(comm, rank: int, src: int, dst: int, key, numel: int, dtype) -> bool | None:
    """rank src sends to dst; True/False on the receiver (right or not), None elsewhere."""
    if rank == src:
        comm.send(_data(key, numel, dtype), dst)
        return None
    if rank == dst:
        out = torch.full((numel,), 3, dtype=dtype)
        comm.recv(out, src)
        return torch.equal(out, _data(key, numel, dtype))
    return None


def _rules(rank: int, w: int) -> dict:
    import braid
    comm = braid.init()
    st = comm._prepared.stats
    steps, ok = [], []

    def step(name, src=0, dst=1, numel=60_001, dtype=torch.float32):
        b, h = st["p2p_built"], st["p2p_hits"]
        r = _one(comm, rank, src, dst, (name, len(steps)), numel, dtype)
        if r is not None:
            ok.append(r)
        steps.append((name, st["p2p_built"] - b, st["p2p_hits"] - h))

    with comm.fixed_shares(SPLIT):
        step("first")
        step("repeat")
        step("repeat again")
        step("new size", numel=60_003)
        step("back to the first size")
        step("new dtype", dtype=torch.float64)
        step("other direction", src=1, dst=0)
        step("other direction again", src=1, dst=0)
        step("first direction again")
        comm.set_calibration({})               # a new calibration: every entry goes
        step("after a new calibration")
        step("after a new calibration, again")
    with comm.fixed_shares({"gloo": 0.25, "shm": 0.75}):
        step("other shares")
        step("other shares again")
    pairs = comm._p2p.pairs
    return {"steps": steps, "ok": ok, "sends": {p: len(s.table) for p, s in pairs.sends.items()},
            "recvs": {p: len(s.slots) for p, s in pairs.recvs.items()}}


def test_send_recv_cache_hits_and_rebuilds():
    res = run_world(_rules, 2, env=ENV)
    assert res[0]["steps"] == res[1]["steps"]          # both ranks took the same branch every time
    assert res[0]["ok"] + res[1]["ok"] and all(res[0]["ok"] + res[1]["ok"])
    got = {name: (built, hits) for name, built, hits in res[0]["steps"]}
    assert got["first"] == (1, 0)
    assert got["repeat"] == (0, 1) and got["repeat again"] == (0, 1)
    assert got["new size"] == (1, 0) and got["back to the first size"] == (0, 1)
    assert got["new dtype"] == (1, 0)
    assert got["other direction"] == (1, 0) and got["other direction again"] == (0, 1)
    assert got["first direction again"] == (0, 1)
    assert got["after a new calibration"] == (1, 0) and got["after a new calibration, again"] == (0, 1)
    assert got["other shares"] == (1, 0) and got["other shares again"] == (0, 1)
    # rank 0 sends to rank 1 and back: each keeps the entries of the direction it sends on, the
    # receiver as many as its sender
    assert res[0]["sends"] == {"1": res[1]["recvs"]["0"]} and res[1]["sends"] == {"0": res[0]["recvs"]["1"]}


def _mixed(rank: int, w: int, calls: int, seed: int) -> dict:
    import braid
    comm = braid.init()
    g = torch.Generator().manual_seed(seed)          # the same sequence on every rank
    pick = lambda seq: seq[int(torch.randint(len(seq), (1,), generator=g))]     # noqa: E731
    sizes = (1, 5, 4099, 65_537, 200_003)
    dtypes = (torch.float32, torch.float64, torch.int32, torch.bfloat16, torch.uint8)
    pairs = [(s, d) for s in range(w) for d in range(w) if s != d]
    shapes = [(pick(sizes), pick(dtypes)) for _ in range(6)]
    wrong, i = [], 0
    with comm.fixed_shares(SPLIT):
        while i < calls:
            kind = int(torch.randint(3, (1,), generator=g))
            numel, dtype = pick(shapes)
            if kind == 0:                      # one blocking send/recv
                src, dst = pick(pairs)
                if _one(comm, rank, src, dst, ("m", seed, i), numel, dtype) is False:
                    wrong.append((i, src, dst, numel, str(dtype)))
                i += 1
                continue
            # a ring shift, isend and irecv on every rank, the recv posted first or last
            shift = 1 + int(torch.randint(w - 1, (1,), generator=g))
            recv_first = kind == 1
            nxt, prv = (rank + shift) % w, (rank - shift) % w
            x = _data(("m", seed, i, rank), numel, dtype)
            out = torch.full((numel,), 9, dtype=dtype)
            if recv_first:
                hs = [comm.recv(out, prv, async_op=True), comm.send(x, nxt, async_op=True)]
            else:
                hs = [comm.send(x, nxt, async_op=True), comm.recv(out, prv, async_op=True)]
            for h in hs:
                h.wait()
            if not torch.equal(out, _data(("m", seed, i, prv), numel, dtype)):
                wrong.append((i, "shift", shift, numel, str(dtype)))
            i += 1
    pairs = comm._p2p.pairs
    return {"wrong": wrong, "stats": dict(comm._prepared.stats),
            "ids": {p: sorted(e for e, _ in s.table.values()) for p, s in pairs.sends.items()},
            "slots": {p: sorted(s.slots) for p, s in pairs.recvs.items()}}


def test_thousand_mixed_send_recv_bitwise_right():
    res = run_world(_mixed, 2, 1000, 5, env=dict(ENV, BRAID_PREPARED_MAX="4"), timeout=600)
    for r in res:
        assert r["wrong"] == []
    st = res[0]["stats"]
    assert st["p2p_hits"] > 500                 # 6 shapes, 4 entries per direction: mostly repeats
    assert st["p2p_built"] > 12                 # and evictions made some shapes build again
    assert res[0]["stats"]["p2p_hits"] == res[1]["stats"]["p2p_hits"]
    # the sender's ids are what its receiver holds (entries are built only where the sender says)
    assert set(res[0]["ids"]["1"]) <= set(res[1]["slots"]["0"]) and len(res[0]["ids"]["1"]) <= 4
    assert set(res[1]["ids"]["0"]) <= set(res[0]["slots"]["1"]) and len(res[1]["ids"]["0"]) <= 4


def test_three_ranks_mixed_send_recv():
    res = run_world(_mixed, 3, 200, 13, env=ENV, timeout=300)
    for r in res:
        assert r["wrong"] == []
    assert res[0]["stats"]["p2p_hits"] > 0
    for s in range(3):
        for d in range(3):
            if s != d and str(d) in res[s]["ids"]:
                assert set(res[s]["ids"][str(d)]) <= set(res[d]["slots"][str(s)])


def _disagree(rank: int, w: int) -> dict:
    import braid
    from braid.errors import PeerMismatchError
    comm = braid.init()
    msgs = []
    with comm.fixed_shares(SPLIT):
        for i in range(3):
            assert _one(comm, rank, 0, 1, ("d", i), 50_000, torch.float32) in (None, True)
        for numel, dtype in ((50_001, torch.float32), (50_000, torch.float64)):
            # the cached shape on rank 0, another size (then dtype) on rank 1: both must raise
            try:
                if rank == 0:
                    comm.send(torch.ones(50_000), 1)
                else:
                    comm.recv(torch.empty(numel, dtype=dtype), 0)
            except PeerMismatchError as exc:
                msgs.append(str(exc))
            else:
                msgs.append("")
        ok = _one(comm, rank, 0, 1, ("d", 9), 50_000, torch.float32)       # the pair goes on
    return {"msgs": msgs, "ok": ok}


def test_a_mismatched_send_recv_raises_on_both_ranks():
    res = run_world(_disagree, 2, env=ENV)
    for r in res:
        assert "sent 200000 bytes of torch.float32" in r["msgs"][0] and "200004 bytes" in r["msgs"][0], r
        assert "400000 bytes of torch.float64" in r["msgs"][1], r
    assert res[1]["ok"] is True


def _off(rank: int, w: int) -> dict:
    import braid
    comm = braid.init()
    with comm.fixed_shares(SPLIT):
        ok = [_one(comm, rank, i % 2, 1 - i % 2, ("off", i), 20_011, torch.float32) for i in range(6)]
    return {"ok": [o for o in ok if o is not None], "stats": dict(comm._prepared.stats)}


def test_prepared_off_send_recv_builds_nothing():
    res = run_world(_off, 2, env=dict(ENV, BRAID_PREPARED="0"))
    for r in res:
        assert r["ok"] and all(r["ok"])
        assert r["stats"]["p2p_built"] == 0 and r["stats"]["p2p_hits"] == 0


def _overdue(rank: int, w: int) -> dict:
    """A send that ran ahead and that the receiver never reads (put in by hand: on CPU lanes no
    send runs ahead): the watchdog gives up after BRAID_TIMEOUT_S, and both ranks' next calls
    raise a braid error naming it."""
    import time
    import braid
    from braid.errors import BraidError
    comm = braid.init()
    t = torch.ones(10)
    comm.all_reduce(t)
    if rank == 0:
        comm._p2p.pairs.ahead[1] = 1_000_000
    errors = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < 20 and len(errors) < 1:
        try:
            comm.all_reduce(t)
        except BraidError as exc:
            errors.append(str(exc))
        time.sleep(0.05)
    return {"errors": errors, "after": time.monotonic() - t0}


def test_a_send_nobody_receives_ends_in_an_error_on_every_rank():
    res = run_world(_overdue, 2, env=dict(ENV, BRAID_TIMEOUT_S="2"), timeout=60)
    for r in res:
        assert r["errors"], r
        assert "send #1 to rank 1" in r["errors"][0] and "did not post its matching recv" in r["errors"][0], r
        assert r["after"] < 10, r
