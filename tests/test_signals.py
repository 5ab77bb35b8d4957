"""The copy-engine lane's cross-rank ordering, replayed on the CPU (lanes/signals.py).

Each rank's GPU program for a collective is recorded (the driver calls `CeLane.emit` makes: flag
writes, flag waits, copies) and then run by a small interpreter standing in for the GPUs: every
rank runs its program call after call on its own stream, waits block until their flag reaches the
value (>= as the GPU compares, cyclic in 32 bits), and the interleaving of the ranks is random.
Checked for every world size, op and interleaving:
- no rank waits forever (the interpreter always finds a rank that can move);
- every copy from a peer's input happens while that peer is inside the same call (it announced
  its input for this call and has not finished the call): nothing is read too early or too late;
- after every call all flags are back at 0 (what lets a captured program run again);
- an abort (every flag set far above 1) releases ranks whose peer never comes.
A negative control proves the checks can fail: the eager scheme's rising sequence number, frozen
as a graph would capture it, lets the second replay read a peer's input before it is ready.
"""
from __future__ import annotations

import random

import pytest

from braid.lanes import _cuda
from braid.lanes.ce import CeLane
from braid.lanes.signals import Flags, Rising
from braid.node import Layout
from braid.planner.plan import all_gather_movement, all_to_all_movement, broadcast_movement, split


class _Lc:
    def __init__(self, rank: int, world: int, layout: Layout):
        self.rank, self.world_size, self.layout, self.seg_dev_ptr = rank, world, layout, 0


def _record(monkeypatch, world: int, plan, make_sig):
    """Each rank's program: a list of ("write", addr, v) / ("wait", addr, v) / ("copy", src rank)."""
    layout = Layout(world, 1 << 20, 64 << 10)
    progs = []
    for me in range(world):
        ops: list = []
        monkeypatch.setattr(_cuda, "write_value", lambda sh, addr, v: ops.append(("write", addr, v)))
        monkeypatch.setattr(_cuda, "wait_value", lambda sh, addr, v: ops.append(("wait", addr, v)))
        lane = CeLane.__new__(CeLane)
        lane.lc = _Lc(me, world, layout)
        transfers = plan.lanes["ce"]
        peers = {t.src: (t.src + 1) << 40 for t in transfers if any(d == me for d, _, _ in t.dsts)}
        monkeypatch.setattr(_cuda, "memcpy_async",
                            lambda dst, src, n, sh: ops.append(("copy", (src >> 40) - 1)))
        lane.emit(0, me, transfers, peers, [0] * 8, make_sig(layout))
        progs.append(ops)
    return progs


def _geq(value: int, target: int) -> bool:
    return ((value - target) & 0xFFFFFFFF) < 0x80000000


def _run(progs: list, calls: int, seed: int, abort_at: int | None = None, absent: int | None = None) -> dict:
    """Run every rank's program `calls` times, interleaved at random. `absent`: a rank that never
    runs; `abort_at`: after that many steps every flag is set to 0x40000000 (and kept there)."""
    rng = random.Random(seed)
    world = len(progs)
    mem: dict[int, int] = {}
    pc = [0] * world
    call = [0] * world
    ready = [-1] * world               # the last call whose input each rank announced
    bad, steps, aborted = [], 0, False
    live = [r for r in range(world) if r != absent]
    while any(call[r] < calls for r in live):
        movable = []
        for r in live:
            if call[r] >= calls:
                continue
            op = progs[r][pc[r]]
            if op[0] != "wait" or _geq(mem.get(op[1], 0), op[2]):
                movable.append(r)
        if not movable:
            return {"deadlock": True, "bad": bad, "mem": mem, "call": call}
        r = rng.choice(movable)
        op = progs[r][pc[r]]
        if op[0] == "write":
            if not aborted:
                mem[op[1]] = op[2]
            if pc[r] == 0 or all(o[0] != "copy" for o in progs[r][:pc[r]]):
                ready[r] = call[r]         # writes before the first copy announce this call's input
        elif op[0] == "copy":
            src = op[1]
            if not aborted and (ready[src] != call[r] or call[src] != call[r]):
                bad.append((r, src, call[r], ready[src], call[src]))
        pc[r] += 1
        if pc[r] == len(progs[r]):
            pc[r] = 0
            call[r] += 1
        steps += 1
        if abort_at is not None and steps >= abort_at and not aborted:
            aborted = True
        if aborted:
            for addr in list(mem) + [op[1] for p in progs for op in p if op[0] != "copy"]:
                mem[addr] = 0x40000000
    return {"deadlock": False, "bad": bad, "mem": mem, "call": call}


def _plans(world: int):
    n = 1 << 20
    matrix = [[(s * 7 + d * 3 + 1) * 4096 for d in range(world)] for s in range(world)]
    return {
        "all_gather": split(all_gather_movement(world, n, False), {"ce": 1.0}, n),
        "all_gather_list": split(all_gather_movement(world, n, True), {"ce": 1.0}, n),
        "broadcast": split(broadcast_movement(world, n, world - 1), {"ce": 1.0}, n),
        "all_to_all": split(all_to_all_movement(matrix), {"ce": 1.0}, n),
    }


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_flags_replay_right_under_any_interleaving(monkeypatch, world):
    for name, plan in _plans(world).items():
        progs = _record(monkeypatch, world, plan, lambda lay: Flags(0, lay))
        for seed in range(20):
            res = _run(progs, calls=6, seed=seed)
            assert not res["deadlock"], (name, world, seed, res["call"])
            assert not res["bad"], (name, world, seed, res["bad"][:3])
            assert all(v == 0 for v in res["mem"].values()), (name, world, seed)   # ready to run again


def test_programs_of_different_calls_interleave_right(monkeypatch):
    """One rank-order sequence of different programs (an all_gather, then a broadcast, then an
    all_to_all, repeated) on the same flags: each rank runs them in the same order."""
    world = 4
    plans = _plans(world)
    parts = [_record(monkeypatch, world, plans[k], lambda lay: Flags(0, lay)) for k in ("all_gather", "broadcast", "all_to_all")]
    progs = [parts[0][r] + parts[1][r] + parts[2][r] for r in range(world)]
    for seed in range(30):
        res = _run(progs, calls=4, seed=seed)
        assert not res["deadlock"] and all(v == 0 for v in res["mem"].values())


def test_a_rising_sequence_frozen_in_a_graph_breaks_the_second_replay(monkeypatch):
    """The negative control: the eager scheme with its sequence number captured once. The first
    replay is right; later ones pass waits they should not (a peer's input read too early)."""
    world = 3
    plan = _plans(world)["all_gather"]
    progs = _record(monkeypatch, world, plan, lambda lay: Rising(0, lay, 1))
    broken = 0
    for seed in range(20):
        res = _run(progs, calls=4, seed=seed)
        broken += bool(res["bad"]) or res["deadlock"]
    assert broken > 0


def test_abort_releases_a_rank_whose_peer_never_comes(monkeypatch):
    world = 3
    progs = _record(monkeypatch, world, _plans(world)["all_gather"], lambda lay: Flags(0, lay))
    res = _run(progs, calls=3, seed=1, absent=2)
    assert res["deadlock"]                               # without the abort: stuck for good
    res = _run(progs, calls=3, seed=1, absent=2, abort_at=5)
    assert not res["deadlock"] and res["call"][0] == 3 and res["call"][1] == 3
