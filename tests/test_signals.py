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



@pytest.mark.parametrize("scheme", ["flags", "rising"])
def test_saying_then_waiting_is_one_batch_writes_first(driver, scheme):
    """ready_then_wait / done_then_wait: the same operations as the two calls, in the same order,
    in one batch (one graph node)."""
    world, me = 4, 1
    lay = Layout(world, 1 << 20, 64 << 10)
    make = (lambda: Flags(0, lay)) if scheme == "flags" else (lambda: Rising(0, lay, 7))
    peers = [p for p in range(world) if p != me]
    for both, parts in ((lambda sig: sig.ready_then_wait(5, me, peers, peers),
                         (lambda sig: sig.ready(5, me, peers), lambda sig: sig.wait_ready(5, peers, me))),
                        (lambda sig: sig.done_then_wait(5, me, peers, peers),
                         (lambda sig: sig.done(5, me, peers), lambda sig: sig.wait_done(5, peers, me)))):
        driver.calls.clear()
        both(make())
        assert len(driver.calls) == 1 and driver.calls[0][0] == "batch"
        merged = driver.calls[0][2]
        driver.calls.clear()
        for part in parts:
            part(make())
        apart = [op for c in driver.calls for op in (c[2] if c[0] == "batch" else [(_cuda.CU_STREAM_MEM_OP_WRITE_VALUE_32, c[2], c[3], 0)])]
        assert len(driver.calls) == 2 and merged == apart
        kinds = [op[0] for op in merged]
        first_wait = kinds.index(_cuda.CU_STREAM_MEM_OP_WAIT_VALUE_32)
        assert all(k == _cuda.CU_STREAM_MEM_OP_WRITE_VALUE_32 for k in kinds[:first_wait]) and first_wait >= 1


@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_copy_engine_program_says_and_waits_in_shared_batches(monkeypatch, world):
    """The ce lane's program: my ready goes out in the batch of the first wait, my done in the
    batch of the last waits: two stream memory operation batches fewer than one per signal."""
    layout = Layout(world, 1 << 20, 64 << 10)
    plan = _plans(world)["all_gather"]
    for me in range(world):
        calls: list = []
        monkeypatch.setattr(_cuda, "memops", lambda sh, batch: calls.append(("batch", list(batch))))
        monkeypatch.setattr(_cuda, "memcpy_async", lambda dst, src, n, sh: calls.append(("copy",)))
        lane = CeLane.__new__(CeLane)
        lane.lc = _Lc(me, world, layout)
        transfers = plan.lanes["ce"]
        peers = {t.src: (t.src + 1) << 40 for t in transfers if any(d == me for d, _, _ in t.dsts)}
        lane.emit(0, me, transfers, peers, [0] * 8, Flags(0, layout))
        batches = [c for c in calls if c[0] == "batch"]
        assert len(batches) == world                      # a wait per source; the ready and done ride along
        first, last = batches[0][1], batches[-1][1]
        assert [op[0] for op in first] == [False] * (world - 1) + [True, False]      # ready to every reader, then a take
        assert [op[0] for op in last] == [False] * (world - 1) + [True, False] * (world - 1)   # done, then every take
        assert calls[0][0] == "batch" and calls[-1][0] == "batch"

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
                     factor=1.0, sig=Flags(0, layout), slots=slots, events=[_Event() for _ in range(2 * k)])
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
    if gather:                                          # the pushed gather: every peer's last piece, once
        assert pieces == [world - 1] * world
        # one piece signal per reader after the rank's last push, whatever its piece count
        said = [sum(1 for sh, kind, _, v in ops if sh == 3 and kind == "write" and v == 1) for ops in progs]
        assert said == [world - 1] * world
    else:
        assert pieces == [0] * world


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("sizes", ["even", "uneven"])
def test_a_pulled_gather_waits_for_every_piece_of_every_peer(monkeypatch, world, sizes):
    """BRAID_CE_PUSH=0: the peers pull each reduced piece once its own flag says so."""
    from braid.envs import override
    mib = (1 << 20) // 2
    elems = [3 * mib] * world if sizes == "even" else [(3 + (d % 3) * 2) * mib + 17 * d for d in range(world)]
    with override(BRAID_CE_PUSH=0):
        progs = _reduction_programs(monkeypatch, world, elems, True, per_mb=1)
    pieces = [sum(1 for sh, kind, _, _ in ops if sh == 3 and kind == "wait") for ops in progs]
    from braid.collectives.ce_reduce import piece_elems
    from braid.planner.pieces import pieces as cut
    offs = [sum(elems[:d]) for d in range(world)]
    with override(BRAID_CE_PIECE_MB=1):
        per = piece_elems(list(zip(offs, elems)), 2)
    counts = [len(cut(n, per)) for n in elems]
    assert min(counts) > 1                              # several pieces a chunk
    assert pieces == [sum(c for p, c in enumerate(counts) if p != r) for r in range(world)]


# --- the reduction's programs run by an interpreter of three streams per rank ---------------------
# Each rank's program (stream memory operations, copies, event records and waits, reductions) is
# recorded as CeReduction.emit issues it, then run call after call by an interpreter standing in
# for the GPUs: three streams per rank move at random, a wait moves once its flag is reached and an
# event wait once the event's record ran. What it checks, per region (a piece of a chunk) of every
# rank's buffer: a peer reads my input only while I am inside the same call and before the region
# was overwritten; a reduced piece is written into a peer only while it is inside the call; every
# region holds its reduced value when a rank's call ends (then the "user" writes new input into
# all of it, as the next call's caller may). A reduction reads slots pulled in the same call.
class _RecStream:
    def __init__(self, sid, log):
        self.cuda_stream, self.log = sid, log

    def wait_event(self, ev):
        self.log.append(("ewait", self.cuda_stream, id(ev)))


def _reduction_runs(monkeypatch, world, elems, gather, per_mb, scheme, calls, push, cut=None, root=None):
    """Per rank, per call: the list of operations emit issued. `scheme`: "flags" (one program
    replayed) or "rising" (a program per call, counters raised by its sequence number); `cut`:
    names of the signal methods to leave out (negative controls); `root`: a reduce to that rank."""
    import contextlib

    import torch

    from braid.collectives import ce_reduce
    from braid.collectives.ce_reduce import CeReduction, slot_rows
    from braid.envs import override
    from braid.planner.pieces import MAX_PIECES

    layout = Layout(world, 1 << 20, 64 << 10)
    offs = [sum(elems[:d]) for d in range(world)]
    chunks = list(zip(offs, elems))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    runs, metas = [], []
    for me in range(world):
        n = sum(elems)
        inp = torch.zeros(n, dtype=torch.bfloat16)
        my_len = elems[me]
        slots = torch.zeros(slot_rows(world, me, root), my_len, dtype=torch.bfloat16) if my_len else None
        metas.append({"base": inp.data_ptr(), "nbytes": n * 2, "slot": slots.data_ptr() if slots is not None else -1,
                      "slot_bytes": slots.numel() * 2 if slots is not None else 0})
        per_call = []
        for c in range(calls if scheme == "rising" else 1):
            ops: list = []

            class Ev:
                def record(self, stream=None):
                    ops.append(("rec", stream.cuda_stream, id(self)))

            monkeypatch.setattr(torch.cuda, "Event", Ev)
            monkeypatch.setattr(_cuda, "memops", lambda sh, batch: ops.extend(
                ("wait" if w else "write", sh, addr, v) for w, addr, v in batch))
            monkeypatch.setattr(_cuda, "write_value", lambda sh, addr, v: ops.append(("write", sh, addr, v)))
            monkeypatch.setattr(_cuda, "wait_value", lambda sh, addr, v: ops.append(("wait", sh, addr, v)))
            monkeypatch.setattr(_cuda, "memcpy_async", lambda dst, src, nb, sh: ops.append(("copy", sh, dst, src, nb)))

            def red(*args, **kw):
                out = args[3] if len(args) > 3 else args[2]
                ops.append(("reduce", 2, out.data_ptr(), out.numel()))
            monkeypatch.setattr(ce_reduce, "reduce_pair", lambda x0, x1, name, out, f: red(x0, x1, name, out))
            monkeypatch.setattr(ce_reduce, "reduce_slots", lambda s, w, name, out, f: red(s, w, out))
            if scheme == "flags":
                sig = Flags(0, layout)
            else:
                sig = Rising(0, layout, c + 1, ((c + 1) * MAX_PIECES) & 0xFFFFFFFF)
            for name in cut or ():        # a signal method left out (an op builder: no operations)
                setattr(sig, name, lambda *a, **k: [])
            red_ = CeReduction.__new__(CeReduction)
            red_.lc = _Lc(me, world, layout)
            with override(BRAID_CE_PIECE_MB=per_mb, BRAID_CE_PUSH=int(push)):
                k = red_.num_pieces(chunks, 2)
                red_.emit(_RecStream(1, ops), _RecStream(2, ops), _RecStream(3, ops), inp=inp, out=inp, chunks=chunks,
                          out_offsets=offs, gather=gather, peers={p: (p + 1) << 40 for p in range(world) if p != me},
                          name="sum", factor=1.0, sig=sig, slots=slots, events=[Ev() for _ in range(2 * k)],
                          root=root)
            per_call.append(ops)
        runs.append(per_call)
    return runs, metas, chunks


def _run_reduction(runs, metas, chunks, calls, seed, per_elems, gather, lane_calls=(), root=None):
    """Run every rank's calls interleaved at random; returns (deadlock, bad, flags). Calls whose
    index is in `lane_calls` are `ce` lane programs (one stream: flag operations and pulls from a
    peer's input, ("lanecopy", 1, src rank)): checked for reading a peer inside the call only.
    `root`: a reduce to that rank (the others reduce into their last slot row and push it to the
    root; their own buffers must end the call untouched)."""
    from braid.planner.pieces import pieces

    rng = random.Random(seed)
    world = len(runs)
    esz = 2
    regions = {d: [off + a for a, _ in pieces(n, per_elems)] for d, (off, n) in enumerate(chunks)}
    state = {(r, e): ("in", 0) for r in range(world) for d in range(world) for e in regions[d]}
    slotw: dict = {}
    redw: dict = {}         # (rank, element) -> the call whose reduction wrote it into a slot row
    nrows = 1 if world == 2 else world
    mem: dict = {}
    call = [0] * world
    bad: list = []

    def prog(r):
        p = runs[r]
        return p[call[r]] if len(p) > 1 else p[0]

    def prepare(ops):
        last, deps, streams = {}, {}, {}
        for i, op in enumerate(ops):
            if op[0] == "rec":
                last[op[2]] = i
            elif op[0] == "ewait":
                deps[i] = last[op[2]]
            streams.setdefault(op[1], []).append(i)
        return deps, streams

    cur = [prepare(prog(r)) for r in range(world)]
    pos = [{s: 0 for s in cur[r][1]} for r in range(world)]
    done = [set() for _ in range(world)]

    def where(r, addr):
        m = metas[r]
        if m["base"] <= addr < m["base"] + m["nbytes"]:
            return ("mine", (addr - m["base"]) // esz)
        if m["slot"] <= addr < m["slot"] + m["slot_bytes"]:
            return ("slot", addr - m["slot"])
        q = (addr >> 40) - 1
        return ("peer", q, (addr - ((q + 1) << 40)) // esz)

    def inside(q, r):
        return call[q] == call[r] and bool(done[q])

    def reduced_row(r, off):
        """The element of r's chunk at byte `off` of its slot rows, in its reduced row."""
        return chunks[r][0] + off // esz - nrows * chunks[r][1]

    while any(c < calls for c in call):
        movable = []
        for r in range(world):
            if call[r] >= calls:
                continue
            deps, streams = cur[r]
            ops = prog(r)
            for s, idx in streams.items():
                if pos[r][s] >= len(idx):
                    continue
                i = idx[pos[r][s]]
                op = ops[i]
                if op[0] == "wait" and not _geq(mem.get(op[2], 0), op[3]):
                    continue
                if op[0] == "ewait" and deps[i] not in done[r]:
                    continue
                movable.append((r, s, i))
        if not movable:
            return True, bad, mem
        r, s, i = rng.choice(movable)
        op = prog(r)[i]
        c = call[r]
        if op[0] == "write":
            mem[op[2]] = op[3]
        elif op[0] == "copy":
            dst, src = where(r, op[2]), where(r, op[3])
            if src[0] == "peer" and dst[0] == "slot":                  # a pull of my chunk from q
                q, e = src[1], src[2]
                if not inside(q, r) or state[(q, e)] != ("in", c):
                    bad.append(("pull", r, q, e, c, call[q], state[(q, e)]))
                slotw[(r, dst[1])] = c
            elif src[0] in ("mine", "slot") and dst[0] == "peer":      # a push of my reduced piece
                q, e = dst[1], dst[2]
                ready = state[(r, src[1])] == ("out", c) if src[0] == "mine" else \
                    redw.get((r, reduced_row(r, src[1]))) == c
                if not inside(q, r) or state[(q, e)] != ("in", c) or not ready or (root is not None and q != root):
                    bad.append(("push", r, q, e, c, call[q], state[(q, e)]))
                state[(q, e)] = ("out", c)
            elif src[0] == "peer" and dst[0] == "mine":                # a gather pulling q's piece
                q, e = src[1], src[2]
                if not inside(q, r) or state[(q, e)] != ("out", c):
                    bad.append(("gather", r, q, e, c, call[q], state[(q, e)]))
                state[(r, dst[1])] = ("out", c)
        elif op[0] == "lanecopy":
            if not inside(op[2], r):
                bad.append(("lane pull", r, op[2], c, call[op[2]]))
        elif op[0] == "reduce":
            loc = where(r, op[2])
            e = loc[1] if loc[0] == "mine" else reduced_row(r, loc[1])
            my_off, my_len = chunks[r]
            a = e - my_off
            rows = [0] if world == 2 else [p for p in range(world) if p != r]
            for row in rows:
                if slotw.get((r, row * my_len * esz + a * esz)) != c:
                    bad.append(("slot", r, e, c))
            if loc[0] == "slot":          # a reduce's non-root rank: its scratch row
                redw[(r, e)] = c
            elif root is not None and r != root:
                bad.append(("reduce into a non-root tensor", r, e, c))
            else:
                if state[(r, e)] != ("in", c):
                    bad.append(("reduce", r, e, c, state[(r, e)]))
                state[(r, e)] = ("out", c)
        done[r].add(i)
        pos[r][s] += 1
        if all(pos[r][t] >= len(idx) for t, idx in cur[r][1].items()):     # the call is over
            keys = [(r, e) for d in range(world) for e in regions[d]] if gather or root is not None else \
                [(r, e) for e in regions[r]]
            want = ("in", c) if root is not None and r != root else ("out", c)
            for key in (keys if c not in lane_calls else ()):
                if state[key] != want:
                    bad.append(("unfinished", key, c, state[key]))
            for d in range(world):                                      # the caller writes anew
                for e in regions[d]:
                    state[(r, e)] = ("in", c + 1)
            call[r] += 1
            done[r] = set()
            if call[r] < calls:
                cur[r] = prepare(prog(r))
                pos[r] = {t: 0 for t in cur[r][1]}
    return False, bad, mem


def _reduction_case(monkeypatch, world, sizes, gather, scheme, push, cut=None, calls=4, seeds=12, root=None):
    mib = (1 << 20) // 2
    if sizes == "even":
        elems = [2 * mib] * world
    else:
        elems = [(1 + (d % 3)) * mib + 4096 * d for d in range(world)]
    from braid.collectives.ce_reduce import piece_elems
    from braid.envs import override
    runs, metas, chunks = _reduction_runs(monkeypatch, world, elems, gather, 1, scheme, calls, push, cut, root)
    with override(BRAID_CE_PIECE_MB=1):
        per = piece_elems(chunks, 2)
    out = []
    for seed in range(seeds):
        out.append(_run_reduction(runs, metas, chunks, calls, seed, per, gather, root=root))
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("push", [True, False])
@pytest.mark.parametrize("scheme", ["flags", "rising"])
@pytest.mark.parametrize("sizes", ["even", "uneven"])
def test_a_reduction_reads_and_writes_peers_only_inside_the_call(monkeypatch, world, push, scheme, sizes):
    """all_reduce (pushed or pulled gather) and reduce_scatter, replayed and posted call by call,
    under random interleavings of every rank's three streams: no deadlock, no read or write of a
    peer's buffer outside the call or out of order, every region reduced when a call ends, and
    (replayed) every flag back at 0."""
    for gather in ([True, False] if push else [True]):
        for deadlock, bad, mem in _reduction_case(monkeypatch, world, sizes, gather, scheme, push):
            assert not deadlock
            assert not bad, bad[:3]
            if scheme == "flags":
                assert all(v == 0 for v in mem.values())


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("push, cut", [(False, ("done_then_wait",)), (True, ("_wait_pieces_ops",))])
def test_the_interpreter_catches_a_reduction_that_ends_too_early(monkeypatch, world, push, cut):
    """Negative controls: the pulled gather without its closing handshake lets a peer read my
    buffer after my call ended; the pushed gather without its wait for the peers' last pieces
    ends a call before its output is complete. Both must be caught."""
    results = _reduction_case(monkeypatch, world, "even", True, "rising", push, cut=cut, seeds=20)
    assert any(bad for _, bad, _ in results)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("scheme", ["flags", "rising"])
@pytest.mark.parametrize("sizes", ["even", "uneven"])
@pytest.mark.parametrize("root", [0, -1])
def test_a_reduce_to_a_root_reads_and_writes_peers_only_inside_the_call(monkeypatch, world, scheme, sizes, root):
    """reduce (the all_reduce's pipeline pushing to the root alone), replayed and posted call by
    call, under random interleavings: no deadlock; a peer's input read and the root's tensor
    written only inside the call; pushes into the root only, from a row reduced in this call; the
    root's tensor all reduced when its call ends, every other rank's tensor untouched; flags back
    at 0."""
    for deadlock, bad, mem in _reduction_case(monkeypatch, world, sizes, False, scheme, True, root=root % world):
        assert not deadlock
        assert not bad, bad[:3]
        if scheme == "flags":
            assert all(v == 0 for v in mem.values())


@pytest.mark.parametrize("world", [2, 4])
def test_the_interpreter_catches_a_reduce_that_ends_too_early(monkeypatch, world):
    """Negative control: the reduce without its wait for the peers' last pieces lets the root end
    before every push came, and a non-root rank end while a peer still pulls from it."""
    results = _reduction_case(monkeypatch, world, "even", False, "rising", True, cut=("_wait_pieces_ops",),
                              seeds=20, root=0)
    assert any(bad for _, bad, _ in results)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_reduce_takes_the_copy_engines_only_where_every_rank_pushes(world):
    """Reductions.reduce_cuts for a reduce: the copy engines alone take every chunk; beside the
    host lane a page-aligned front of each; with fewer elements than ranks, or a share so small
    that some chunk's front rounds to nothing, no rank would push: the whole call goes staged.
    all_reduce keeps its cuts (an empty chunk is fine there)."""
    from types import SimpleNamespace

    import torch

    from braid.comm.reductions import Reductions
    from braid.planner.plan import chunk_bounds

    def cuts(opname, numel, shares):
        rc = SimpleNamespace(opname=opname, esz=2, numel=numel, name="sum", dev=torch.device("cuda"),
                             bounds=chunk_bounds(numel, world, 2))
        return Reductions.reduce_cuts(SimpleNamespace(world_size=world), rc, shares)

    big = cuts("reduce", 1 << 22, {"ce": 1.0})
    assert big.ce_f == 1.0 and not big.rest and all(n for _, n in big.ce_chunks)
    assert sum(n for _, n in big.ce_chunks) == 1 << 22
    mixed = cuts("reduce", 1 << 22, {"ce": 0.75, "host": 0.25})
    assert mixed.ce_f == 0.75 and mixed.rest == {"host": 0.25}
    assert all(n and (n * 2) % 4096 == 0 for _, n in mixed.ce_chunks)
    assert sum(n for _, n in mixed.ce_chunks) + sum(n for _, n in mixed.rest_chunks) == 1 << 22
    for numel, shares in ((world - 1, {"ce": 1.0}), (world * 3000, {"ce": 0.1, "host": 0.9})):
        small = cuts("reduce", numel, shares)
        assert small.ce_f == 0.0 and "ce" in small.rest and not any(n for _, n in small.ce_chunks)
        assert sum(n for _, n in small.rest_chunks) == numel
    ar = cuts("all_reduce", world - 1, {"ce": 1.0})
    assert ar.ce_f == 1.0 and not ar.rest


def test_a_pushed_all_reduce_between_other_programs_on_the_same_flags(monkeypatch):
    """Replayed programs of different ops in one order on every rank (a pushed all_reduce, an
    all_gather, a broadcast, the all_reduce again ...) share the flags: the all_reduce no longer
    ends with a handshake, so a flag one program sets must still find its reader's reset of the
    program before. No deadlock, every peer read inside its call, flags back at 0."""
    world = 3
    mib = (1 << 20) // 2
    elems = [2 * mib + 4096 * d for d in range(world)]
    red, metas, chunks = _reduction_runs(monkeypatch, world, elems, True, 1, "flags", 1, True)
    plans = _plans(world)
    lanes = {k: _record(monkeypatch, world, plans[k], lambda lay: Flags(0, lay)) for k in ("all_gather", "broadcast")}

    def lane(ops):
        return [("lanecopy", 1, o[1]) if o[0] == "copy" else (o[0], 1, o[1], o[2]) for o in ops]
    order = ["red", "all_gather", "red", "broadcast", "red", "red", "all_gather"]
    runs = [[red[r][0] if k == "red" else lane(lanes[k][r]) for k in order] for r in range(world)]
    lane_calls = {i for i, k in enumerate(order) if k != "red"}
    from braid.collectives.ce_reduce import piece_elems
    from braid.envs import override
    with override(BRAID_CE_PIECE_MB=1):
        per = piece_elems(chunks, 2)
    for seed in range(30):
        deadlock, bad, mem = _run_reduction(runs, metas, chunks, len(order), seed, per, True, lane_calls)
        assert not deadlock, seed
        assert not bad, (seed, bad[:3])
        assert all(v == 0 for v in mem.values()), seed


@pytest.mark.parametrize("drain", [False, True])
def test_a_prepared_send_and_recv_say_and_wait_in_one_batch_each(monkeypatch, drain):
    """comm/pairs.py, a synchronous call on the caller's stream: the sender's program is one
    batch (set ready, wait for done, reset it), the receiver's one batch (wait for ready, reset
    it), its copies, then done; a drain (a refused run-ahead send) leaves the copies out."""
    from types import SimpleNamespace

    import torch

    from braid.comm import pairs
    from braid.comm.pairs import PairEntry, Pairs, _Recv, _Send

    lay = Layout(2, 1 << 20, 64 << 10)
    calls: list = []
    monkeypatch.setattr(_cuda, "memops", lambda sh, batch: calls.append(("batch", sh, list(batch))))
    monkeypatch.setattr(_cuda, "memops_posted", lambda sh, arr: calls.append(      # (arrays made once: the same)
        ("batch", sh, [(m.operation == _cuda.CU_STREAM_MEM_OP_WAIT_VALUE_32, m.address, m.value) for m in arr])))
    monkeypatch.setattr(_cuda, "write_value", lambda sh, addr, v: calls.append(("write", sh, addr, v)))
    monkeypatch.setattr(_cuda, "wait_value", lambda sh, addr, v: calls.append(("wait", sh, addr, v)))
    monkeypatch.setattr(_cuda, "memcpy_async", lambda dst, src, n, sh: calls.append(("copy", sh, dst, src, n)))
    monkeypatch.setattr(pairs, "_RAW", lambda dev: 0x900)
    me = SimpleNamespace(p2p=SimpleNamespace(seg_dev_ptr=0x10000, layout=lay), dev_index=0)
    ready = 0x10000 + lay.counter("flag_p2p_ready", 0, 1)
    done = 0x10000 + lay.counter("flag_p2p_done", 0, 1)
    entry = PairEntry(None, None, {"ce": 1.0}, False, flags=True, copies=[(0, 0x7000, 64), (64, 0x8000, 32)])
    Pairs._flags(me, entry, True, 0, 1, torch.zeros(24), 0, False, _Send())
    assert calls == [("batch", 0x900, [(False, ready, 1), (True, done, 1), (False, done, 0)])]
    calls.clear()
    t = torch.zeros(24)
    Pairs._flags(me, entry, False, 0, 1, t, 0, False, _Recv(), drain=drain)
    copies = [] if drain else [("copy", 0x900, t.data_ptr(), 0x7000, 64), ("copy", 0x900, t.data_ptr() + 64, 0x8000, 32)]
    if drain:       # nothing between the two: one batch
        assert calls == [("batch", 0x900, [(True, ready, 1), (False, ready, 0), (False, done, 1)])]
    else:
        assert calls == ([("batch", 0x900, [(True, ready, 1), (False, ready, 0)])] + copies
                         + [("batch", 0x900, [(False, done, 1)])])
