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
The copy engines' reduction (three streams per rank) is checked by its flags' bookkeeping: every
flag waited for is set once by another rank and reset right after the wait, for every world size,
even and uneven chunks (ranks with different piece counts), all_reduce and reduce_scatter. The
operations of one step go to the driver as one batch (_cuda.memops), checked against a stand-in.
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
        # a batch runs its operations in order, as the driver does (one graph node)
        monkeypatch.setattr(_cuda, "memops", lambda sh, batch: ops.extend(
            ("wait" if w else "write", addr, v) for w, addr, v in batch))
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


class _FakeDriver:
    """Stands in for libcuda: records every stream memory operation it is given."""

    def __init__(self):
        self.calls: list = []

    def cuStreamBatchMemOp_v2(self, stream, count, arr, flags):
        self.calls.append(("batch", stream, [(m.operation, m.address, m.value, m.flags) for m in arr[:count]], flags))
        return 0

    def cuStreamWaitValue32_v2(self, stream, addr, value, flags):
        self.calls.append(("wait", stream, addr, value))
        return 0

    def cuStreamWriteValue32_v2(self, stream, addr, value, flags):
        self.calls.append(("write", stream, addr, value))
        return 0


@pytest.fixture
def driver(monkeypatch):
    fake = _FakeDriver()
    monkeypatch.setattr(_cuda, "lib", lambda: fake)
    monkeypatch.setattr(_cuda, "batched", lambda: True)
    return fake


def test_a_batch_packs_waits_and_writes_in_order(driver):
    _cuda.memops(7, [(True, 0x1000, 1), (False, 0x1000, 0), (False, 0x2004, (1 << 32) + 5)])
    assert driver.calls == [("batch", 7, [(_cuda.CU_STREAM_MEM_OP_WAIT_VALUE_32, 0x1000, 1, _cuda.CU_STREAM_WAIT_VALUE_GEQ),
                                          (_cuda.CU_STREAM_MEM_OP_WRITE_VALUE_32, 0x1000, 0, 0),
                                          (_cuda.CU_STREAM_MEM_OP_WRITE_VALUE_32, 0x2004, 5, 0)], 0)]


def test_a_single_operation_and_long_batches(driver):
    _cuda.memops(3, [(False, 0x40, 9)])
    assert driver.calls == [("write", 3, 0x40, 9)]
    driver.calls.clear()
    ops = [(i % 2 == 0, 0x100 + 4 * i, i) for i in range(600)]
    _cuda.memops(3, ops)
    sizes = [len(c[2]) for c in driver.calls]
    assert sizes == [255, 255, 90]                        # the driver takes fewer than 256 at once
    flat = [op for c in driver.calls for op in c[2]]
    assert [(a, v) for _, a, v, _ in flat] == [(a, v) for _, a, v in ops]


def test_batching_off_posts_one_operation_at_a_time(driver, monkeypatch):
    monkeypatch.setattr(_cuda, "batched", lambda: False)
    _cuda.memops(3, [(True, 0x10, 1), (False, 0x10, 0)])
    assert driver.calls == [("wait", 3, 0x10, 1), ("write", 3, 0x10, 0)]


@pytest.mark.parametrize("world", [2, 4, 8])
def test_each_step_of_a_replayed_program_is_one_batch(driver, world):
    """The flags of every peer, and each wait with its reset, go in one batch (one graph node)."""
    lay = Layout(world, 1 << 20, 64 << 10)
    sig, me = Flags(0, lay), 1
    peers = [p for p in range(world) if p != me]
    write = _cuda.CU_STREAM_MEM_OP_WRITE_VALUE_32
    for step in (lambda: sig.ready(5, me, peers), lambda: sig.done(5, me, peers),
                 lambda: sig.piece(5, me, 2, peers)):
        driver.calls.clear()
        step()
        assert len(driver.calls) == 1               # one node (a lone write: the plain call)
        kind, _, *rest = driver.calls[0]
        ops = rest[0] if kind == "batch" else [(write, rest[0], rest[1], 0)]
        assert [(o[0], o[2]) for o in ops] == [(write, 1)] * len(peers)
        assert len({o[1] for o in ops}) == len(peers)                    # a flag per reader
    for step in (lambda: sig.wait_ready(5, peers, me), lambda: sig.wait_done(5, peers, me),
                 lambda: sig.wait_piece(5, peers, me, 2)):
        driver.calls.clear()
        step()
        assert len(driver.calls) == 1 and driver.calls[0][0] == "batch"
        ops = driver.calls[0][2]
        assert [(o[0], o[2]) for o in ops] == [(_cuda.CU_STREAM_MEM_OP_WAIT_VALUE_32, 1),
                                               (_cuda.CU_STREAM_MEM_OP_WRITE_VALUE_32, 0)] * len(peers)
        assert [o[1] for o in ops[0::2]] == [o[1] for o in ops[1::2]]     # each reset is of the flag waited for
    driver.calls.clear()
    sig.wait_done(5, [], me)
    sig.ready(5, me, [])
    assert driver.calls == []


# --- the copy engines' reduction (collectives/ce_reduce.py) under the replay-safe flags ----------
class _Stream:
    def __init__(self, sid):
        self.cuda_stream = sid

    def wait_event(self, ev):
        pass


class _Event:
    def record(self, stream=None):
        pass


def _reduction_programs(monkeypatch, world: int, chunk_elems: list[int], gather: bool, per_mb: int):
    """Each rank's flag operations (stream, kind, address, value) for one all_reduce (gather) or
    reduce_scatter: chunk d of `chunk_elems[d]` bfloat16 elements, pieces of `per_mb` MiB."""
    import contextlib

    import torch

    from braid.collectives import ce_reduce
    from braid.collectives.ce_reduce import CeReduction
    from braid.envs import override

    layout = Layout(world, 1 << 20, 64 << 10)
    offs = [sum(chunk_elems[:d]) for d in range(world)]
    chunks = list(zip(offs, chunk_elems))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    progs = []
    for me in range(world):
        ops: list = []
        monkeypatch.setattr(_cuda, "memops", lambda sh, batch: ops.extend(
            (sh, "wait" if w else "write", addr, v) for w, addr, v in batch))
        monkeypatch.setattr(_cuda, "write_value", lambda sh, addr, v: ops.append((sh, "write", addr, v)))
        monkeypatch.setattr(_cuda, "wait_value", lambda sh, addr, v: ops.append((sh, "wait", addr, v)))
        monkeypatch.setattr(_cuda, "memcpy_async", lambda dst, src, n, sh: ops.append((sh, "copy", src >> 40, n)))
        monkeypatch.setattr(ce_reduce, "reduce_pair", lambda *a, **k: None)
        monkeypatch.setattr(ce_reduce, "reduce_slots", lambda *a, **k: None)
        red = CeReduction.__new__(CeReduction)
        red.lc = _Lc(me, world, layout)
        n = sum(chunk_elems)
        inp = torch.zeros(n, dtype=torch.bfloat16)
        my_len = chunk_elems[me]
        slots = torch.zeros(1 if world == 2 else world, my_len, dtype=torch.bfloat16) if my_len else None
        with override(BRAID_CE_PIECE_MB=per_mb):
            k = red.num_pieces(chunks, 2)
            red.emit(_Stream(1), _Stream(2), _Stream(3), inp=inp, out=inp, chunks=chunks, out_offsets=offs,
                     gather=gather, peers={p: (p + 1) << 40 for p in range(world) if p != me}, name="sum",
                     factor=1.0, sig=Flags(0, layout), slots=slots, events=[_Event() for _ in range(k)])
        progs.append(ops)
    return progs


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("gather", [True, False])
@pytest.mark.parametrize("sizes", ["even", "uneven"])
def test_a_replayed_reduction_sets_every_flag_it_waits_for_once(monkeypatch, world, gather, sizes):
    """Per call, every flag a rank waits for is set once by one other rank, and each wait is
    followed on the same stream by its reset: after the call every flag is 0 again (the program
    can run again) and no wait is left without its write (a hang). Chunks of different lengths
    give ranks different piece counts: the gather waits only for the pieces a peer has."""
    mib = (1 << 20) // 2                                # bf16 elements per MiB
    if sizes == "even":
        elems = [3 * mib] * world
    else:
        elems = [(3 + (d % 3) * 2) * mib + 17 * d for d in range(world)]
    progs = _reduction_programs(monkeypatch, world, elems, gather, per_mb=1)
    sets, waits = {}, {}
    for r, ops in enumerate(progs):
        for i, (sh, kind, addr, v) in enumerate(ops):
            if kind == "write" and v == 1:
                sets.setdefault(addr, []).append(r)
            elif kind == "wait":
                waits.setdefault(addr, []).append(r)
                nxt = ops[i + 1]
                assert nxt[:3] == (sh, "write", addr) and nxt[3] == 0, (r, ops[i:i + 2])   # its reset
    assert set(sets) == set(waits), (set(sets) ^ set(waits))
    for addr in sets:
        assert len(sets[addr]) == 1 and len(waits[addr]) == 1 and sets[addr] != waits[addr], addr
    pieces = [sum(1 for sh, kind, _, _ in ops if sh == 3 and kind == "wait") for ops in progs]
    if gather:                                          # every peer's every piece, once
        from braid.collectives.ce_reduce import piece_elems
        from braid.envs import override
        from braid.planner.pieces import pieces as cut
        offs = [sum(elems[:d]) for d in range(world)]
        with override(BRAID_CE_PIECE_MB=1):
            per = piece_elems(list(zip(offs, elems)), 2)
        counts = [len(cut(n, per)) for n in elems]
        assert pieces == [sum(c for p, c in enumerate(counts) if p != r) for r in range(world)]
    else:
        assert pieces == [0] * world
