"""The host lane's captured programs (lanes/host.py `programs`), run on the CPU.

Each rank's two programs (producer, consumer) for a collective's host share are built from the
same plan the GPU would run, then executed by a small interpreter standing in for the GPUs: one
flat memory holds the node segment (flags and graph-ring slots) and every rank's input and
outputs, each stream runs its program's operations in order, a wait blocks until its flag is
set, copies move real bytes, and the streams are interleaved at random. A rank's call ends when
both its streams finished the program; its outputs are checked then and its input refilled with
fresh bytes for its next call, while its peers may still be in the call before (as replays on
two GPUs may be). Checked for every world size, op and interleaving, calls after calls:
- no stream waits forever;
- every rank's outputs hold exactly the bytes the plan's host transfers deliver, from this call's
  inputs (a slot read too early or overwritten too soon shows as wrong bytes);
- after the last call every flag is back at 0 (what lets the same program run again);
- an abort (every flag set far above 1) releases a rank whose peer never comes.
Negative controls: without the waits for a slot's readers (or without the tail), the checks
catch the corruption or the flags left set.

Also here: which split reductions one program holds, when a balanced split is posted rather than
replayed, and the stream wiring of the programs (fake streams and events record the order of
the stream operations a capture turns into graph edges): the host lane's two programs beside the
stream that forks them, a moving call's program, a split reduction's program.
"""
from __future__ import annotations

import random

import pytest

from braid.lanes.host import graph_programs
from braid.node import GRAPH_SLOTS, Layout
from braid.planner.plan import (all_gather_movement, all_to_all_movement, broadcast_movement, gather_chunks,
                                reduce_scatter_chunks, split)

CHUNK = 4096


def _plans(world: int, n: int) -> dict:
    matrix = [[((s * 7 + d * 3 + 1) % 5) * 1000 + 8 for d in range(world)] for s in range(world)]
    out = {
        "all_gather": split(all_gather_movement(world, n, False), {"host": 1.0}, n),
        "all_gather_list": split(all_gather_movement(world, n, True), {"host": 1.0}, n),
        "broadcast": split(broadcast_movement(world, n, world - 1), {"host": 1.0}, n),
        "all_to_all": split(all_to_all_movement(matrix), {"host": 1.0}, sum(map(sum, matrix))),
        "all_gather_mixed": split(all_gather_movement(world, n, False), {"ce": 0.5, "host": 0.5}, n,
                                  min_split=1024),
    }
    # a staged reduction's two phases (comm/reductions.py reduce_program): every rank's chunk d
    # into rank d's slots (buffer 1), then each rank's reduced chunk to every rank or to a root
    chunks = [(d * (n // world), n // world - 8 * d) for d in range(world)]
    out["reduce_scatter_chunks"] = split(reduce_scatter_chunks(world, chunks), {"host": 1.0}, n)
    out["gather_chunks"] = split(gather_chunks(world, chunks, None), {"host": 1.0}, n)
    out["gather_to_root"] = split(gather_chunks(world, chunks, world - 1), {"host": 1.0}, n)
    return out


class _World:
    """The flat memory of every rank's buffers and the segment, and each rank's two programs."""

    def __init__(self, world: int, plan, drop=None):
        self.world = world
        self.layout = lay = Layout(world, 1 << 16, CHUNK, graph_rings=True)
        assert lay.graph_rings[0].slot_bytes == CHUNK
        self.transfers = plan.lanes.get("host", [])
        in_bytes = max([t.src_off + t.nbytes for t in self.transfers] + [1])
        nbufs = 1 + max([b for t in self.transfers for _, b, _ in t.dsts] + [0])
        out_bytes = max([off + t.nbytes for t in self.transfers for _, _, off in t.dsts] + [1])
        base = lay.total_bytes
        self.inp, self.outs = [], []
        for r in range(world):
            self.inp.append(base)
            base += in_bytes
            self.outs.append([base + b * out_bytes for b in range(nbufs)])
            base += nbufs * out_bytes
        self.in_bytes = in_bytes
        self.mem = bytearray(base)
        self.flags: dict[int, int] = {}
        self.progs = []
        for r in range(world):
            prod, cons = graph_programs(lay, r, self.transfers, self.inp[r], self.outs[r], 0, 0)
            if drop is not None:
                prod = drop(prod)
            self.progs.append([self._flat(prod), self._flat(cons)])

    @staticmethod
    def _flat(prog: list) -> list:
        """A batch runs its operations in order, as the driver does: one step each."""
        out = []
        for op in prog:
            if op[0] == "ops":
                out += [("wait" if w else "write", addr, v) for w, addr, v in op[1]]
            else:
                out.append(op)
        return out

    def fill(self, rank: int, rng: random.Random) -> bytes:
        data = bytes(rng.getrandbits(8) for _ in range(self.in_bytes))
        self.mem[self.inp[rank]: self.inp[rank] + self.in_bytes] = data
        return data

    def expected(self, rank: int, inputs: list[bytes]) -> list[tuple[int, bytes]]:
        """(address, bytes) the host transfers deliver to `rank`."""
        want = []
        for t in self.transfers:
            for d, b, off in t.dsts:
                if d == rank:
                    want.append((self.outs[rank][b] + off, inputs[t.src][t.src_off: t.src_off + t.nbytes]))
        return want

    def run(self, calls: int, seed: int, absent: int | None = None, abort_at: int | None = None) -> dict:
        rng = random.Random(seed)
        live = [r for r in range(self.world) if r != absent]
        inputs: list[list[bytes]] = [[b""] * self.world for _ in range(calls)]
        for r in live:
            inputs[0][r] = self.fill(r, rng)
        streams = [(r, s) for r in live for s in (0, 1) if self.progs[r][s]]
        pc = {k: 0 for k in streams}
        call = {k: 0 for k in streams}

        def rank_call(r: int) -> int:
            return min(call[k] for k in streams if k[0] == r)
        wrong, steps, aborted = [], 0, False
        while any(call[k] < calls for k in streams):
            movable = []
            for k in streams:
                r, s = k
                if call[k] >= calls or call[k] > rank_call(r):
                    continue            # a rank's next call starts when all its streams ended this one
                op = self.progs[r][s][pc[k]]
                if op[0] != "wait" or self.flags.get(op[1], 0) >= op[2]:
                    movable.append(k)
            if not movable:
                return {"deadlock": True, "wrong": wrong, "call": call}
            k = rng.choice(movable)
            r, s = k
            op = self.progs[r][s][pc[k]]
            if op[0] == "write":
                if not aborted:
                    self.flags[op[1]] = op[2]
            elif op[0] == "copy":
                _, dst, src, n = op
                self.mem[dst: dst + n] = self.mem[src: src + n]
            pc[k] += 1
            if pc[k] == len(self.progs[r][s]):
                pc[k] = 0
                call[k] += 1
                if all(call[j] == call[k] for j in streams if j[0] == r):      # rank r ended a call
                    done = call[k] - 1
                    for addr, data in self.expected(r, inputs[done]):
                        if bytes(self.mem[addr: addr + len(data)]) != data:
                            wrong.append((r, done, addr))
                            break
                    if call[k] < calls:
                        inputs[call[k]][r] = self.fill(r, rng)
            steps += 1
            if abort_at is not None and steps >= abort_at:
                aborted = True
            if aborted:
                for p in self.progs:
                    for prog in p:
                        for o in prog:
                            if o[0] != "copy":
                                self.flags[o[1]] = 0x40000000
        return {"deadlock": False, "wrong": wrong, "call": call}


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("op", ["all_gather", "all_gather_list", "broadcast", "all_to_all", "all_gather_mixed",
                                "reduce_scatter_chunks", "gather_chunks", "gather_to_root"])
def test_host_programs_move_the_right_bytes_call_after_call(world, op):
    n = CHUNK * (3 * GRAPH_SLOTS) + 4096 * 3 + 512       # more chunks than slots, and a short last one
    plan = _plans(world, n)[op]
    assert plan.lanes.get("host")
    for seed in range(4 if world < 8 else 2):
        w = _World(world, plan)
        res = w.run(calls=4, seed=seed)
        assert not res["deadlock"], (op, world, seed, res["call"])
        assert not res["wrong"], (op, world, seed, res["wrong"][:3])
        assert not any(w.flags.values()), "a flag was left set after the last call"


def test_the_programs_use_their_own_ring_and_flags():
    """Graph rings sit apart from the posted calls' rings; the flags lie below `pid` (released by
    an abort) and every address a program names is inside the segment."""
    world = 3
    lay = Layout(world, 1 << 16, CHUNK, graph_rings=True)
    plan = _plans(world, 10 * CHUNK)["all_gather"]
    coll = [(g.offset, g.offset + g.num_slots * g.slot_bytes) for g in lay.coll_rings]
    graph = [(g.offset, g.offset + g.num_slots * g.slot_bytes) for g in lay.graph_rings]
    assert all(b <= c or d <= a for a, b in graph for c, d in coll)
    limit = 4096 + lay.counter_base["pid"] * 64
    first = 4096 + lay.counter_base["flag_ready"] * 64
    for r in range(world):
        for prog in graph_programs(lay, r, plan.lanes["host"], 10 ** 9, [2 * 10 ** 9], 0, 0):
            for op in prog:
                if op[0] == "ops":
                    assert all(first <= a < limit for _, a, _ in op[1])
                else:
                    _, dst, src, _n = op
                    slot = src if src < lay.total_bytes else dst
                    assert any(a <= slot < b for a, b in graph)
    assert not Layout(world, 1 << 16, CHUNK).graph_rings          # CPU communicators: none


def _without_free_waits(prog: list) -> list:
    """The producer without its waits for the readers of a slot's previous use (nor the tail):
    only its settings of "full" (to 1) are kept."""
    out = []
    for op in prog:
        if op[0] == "ops":
            kept = [(w, a, v) for w, a, v in op[1] if not w and v == 1]
            if kept:
                out.append(("ops", kept))
        else:
            out.append(op)
    return out


def test_negative_control_without_the_readers_waits():
    """A producer that reuses slots without waiting for their readers corrupts some call's bytes
    or leaves flags set: the checks above can fail."""
    plan = _plans(2, CHUNK * 4 * GRAPH_SLOTS)["all_gather"]
    caught = 0
    for seed in range(10):
        w = _World(2, plan, drop=_without_free_waits)
        res = w.run(calls=3, seed=seed)
        caught += bool(res["deadlock"] or res["wrong"] or any(w.flags.values()))
    assert caught >= 5, caught


def test_an_abort_releases_a_rank_whose_peer_never_comes():
    plan = _plans(2, CHUNK * 6)["all_gather"]
    w = _World(2, plan)
    res = w.run(calls=1, seed=0, absent=1)
    assert res["deadlock"]                                # rank 0 waits for rank 1 forever...
    w = _World(2, plan)
    res = w.run(calls=1, seed=0, absent=1, abort_at=5)
    assert not res["deadlock"]                            # ...until an abort releases it


def test_a_balanced_split_is_posted_at_its_first_calls_and_now_and_then():
    """A split over several lanes that the balancer moves is posted (timed) at its first calls and
    every SAMPLE_EVERY-th, replayed between; fixed shares, one lane and captures always replay."""
    from types import SimpleNamespace

    from braid.comm.exchange import Exchange
    from braid.comm.prepared import SAMPLE_EVERY, SAMPLE_FIRST, Entry

    class _Policy:
        adapt, fixed, lane_timing = True, None, False

        def fixed_for(self, op):
            return self.fixed

    def posted(shares, n=3 * SAMPLE_EVERY, capturing=False, fixed=None, adapt=True, timing=False):
        pol = _Policy()
        pol.fixed, pol.adapt, pol.lane_timing = fixed, adapt, timing
        ex = SimpleNamespace(policy=pol, sample_counts={})
        ex.balanced = lambda op, e: Exchange.balanced(ex, op, e)
        entry = Entry(None, None, shares, ["ce", "host"], 1 << 20, native=False)
        return [i + 1 for i in range(n) if Exchange.sampled(ex, "all_gather", entry, capturing)]

    mixed = {"ce": 0.7, "host": 0.3}
    got = posted(mixed)
    assert got == list(range(1, SAMPLE_FIRST + 1)) + [SAMPLE_EVERY, 2 * SAMPLE_EVERY, 3 * SAMPLE_EVERY]
    assert posted({"ce": 1.0}) == []
    assert posted(mixed, fixed=mixed) == []
    assert posted(mixed, adapt=False) == []
    # fixed_shares(..., timed=True), the calibration's balancing: every call of a split posts
    assert posted(mixed, n=20, fixed=mixed, timing=True) == list(range(1, 21))
    assert posted({"ce": 1.0}, n=5, fixed={"ce": 1.0}, timing=True) == []
    assert posted(mixed, n=5, fixed=mixed, timing=True, capturing=True) == []
    assert posted(mixed, capturing=True) == []
    # the count is the shape's, not its entry's: the entries a balancer's moves build anew (other
    # shares, the same lanes) go on from it; another size or lane set counts on its own
    ex = SimpleNamespace(policy=_Policy(), sample_counts={})
    ex.balanced = lambda op, e: Exchange.balanced(ex, op, e)
    seen = []
    for i in range(2 * SAMPLE_EVERY):
        entry = Entry(None, None, {"ce": 0.7 - i / 1000, "host": 0.3 + i / 1000}, ["ce", "host"], 1 << 20,
                      native=False)         # a move at every call: a new entry each time
        seen.append(Exchange.sampled(ex, "all_gather", entry, False))
    assert [i + 1 for i, s in enumerate(seen) if s] == list(range(1, SAMPLE_FIRST + 1)) + [SAMPLE_EVERY, 2 * SAMPLE_EVERY]
    other = Entry(None, None, mixed, ["ce", "host"], 1 << 21, native=False)
    assert Exchange.sampled(ex, "all_gather", other, False)                   # its own first call


def test_which_split_reductions_one_program_holds():
    """NCCL's all_reduce prefix, the copy engines' pipelined share and the host lane's staged
    rest go in one program; NCCL as a staged lane, or a reduce whose chunks the copy engines
    cannot all take, stay posted."""
    import torch

    from braid.comm.reductions import Reductions, _ReduceCall
    from braid.planner.plan import chunk_bounds

    red = Reductions.__new__(Reductions)
    red.world_size = 4
    dev = torch.device("cuda")

    def call(opname: str, numel: int) -> _ReduceCall:
        return _ReduceCall(opname, None, None, None, 0 if opname == "reduce" else None, "sum", 1.0, None, None,
                           numel, 4, chunk_bounds(numel, 4, 4), dev)

    ar = call("all_reduce", 1 << 20)
    assert red.graphable(ar, {"ce": 0.7, "host": 0.3})
    assert red.graphable(ar, {"host": 1.0})
    assert red.graphable(ar, {"ce": 1.0})
    assert red.graphable(ar, {"nccl": 0.7, "host": 0.3})              # NCCL's prefix, captured
    assert red.graphable(ar, {"nccl": 0.5, "ce": 0.5})
    assert not red.graphable(call("reduce_scatter", 1 << 20), {"nccl": 0.5, "host": 0.5})   # NCCL staged
    assert red.graphable(call("reduce_scatter", 1 << 20), {"ce": 0.5, "host": 0.5})
    assert red.graphable(call("reduce", 1 << 20), {"ce": 0.5, "host": 0.5})
    assert not red.graphable(call("reduce", 3), {"ce": 0.5, "host": 0.5})   # fewer elements than ranks
    assert not red.graphable(call("reduce", 3), {"ce": 1.0})                 # the copy engines' staged path
    assert red.graphable(call("reduce", 4), {"ce": 1.0})


class _Log:
    """Stream operations in the order they are made (what a capture turns into graph edges)."""

    def __init__(self):
        self.ops: list = []


class _Event:
    log: _Log = None
    count = 0

    def __init__(self, *a, **k):
        _Event.count += 1
        self.name = f"e{_Event.count}"
        self.at = None

    def record(self, stream):
        self.at = stream.name
        self.log.ops.append(("record", stream.name, self.name))


class _Stream:
    def __init__(self, name: str, log: _Log):
        self.name, self.log = name, log
        self.cuda_stream = name

    def wait_event(self, ev):
        self.log.ops.append(("wait", self.name, ev.name))


def test_the_host_programs_run_beside_the_stream_that_forks_them(monkeypatch):
    """HostLane.beside: both programs start after what `stream` holds so far (an event recorded
    there, waited by the producer's and the consumer's streams), run on their own streams, and
    join(s) makes `s` wait for both ends; every event stays alive in `keep`. The copy engines'
    part of a call, posted on `stream` between beside() and join(), does not wait for the host
    lane's part (two branches of one graph)."""
    from braid.lanes import _cuda
    from braid.lanes import host as host_mod

    log = _Log()
    _Event.log = log
    monkeypatch.setattr(host_mod.torch.cuda, "Event", _Event)
    monkeypatch.setattr(_cuda, "memops", lambda sh, batch: log.ops.append(("memops", sh, len(batch))))
    monkeypatch.setattr(_cuda, "memcpy_async", lambda dst, src, n, sh: log.ops.append(("copy", sh, n)))
    lane = host_mod.HostLane.__new__(host_mod.HostLane)
    lane.produce_stream, lane.consume_stream = _Stream("prod", log), _Stream("cons", log)
    caller = _Stream("caller", log)
    prod = [("ops", [(True, 64, 1), (False, 64, 0)]), ("copy", 1, 2, 3)]
    cons = [("ops", [(True, 128, 1)]), ("copy", 4, 5, 6), ("ops", [(False, 128, 1)])]
    keep: list = []
    join = lane.beside(caller, (prod, cons), keep)
    log.ops.append(("copy", "caller", 99))              # the copy engines' part, beside
    join(caller)
    ops = log.ops
    fork = ops[0]
    assert fork[:2] == ("record", "caller")
    assert ("wait", "prod", fork[2]) in ops and ("wait", "cons", fork[2]) in ops
    first_work = {s: next(i for i, o in enumerate(ops) if o[0] in ("memops", "copy") and o[1] == s) for s in ("prod", "cons")}
    assert all(ops.index(("wait", s, fork[2])) < first_work[s] for s in ("prod", "cons"))
    assert [o for o in ops if o[1] == "prod" and o[0] in ("memops", "copy")] == [("memops", "prod", 2), ("copy", "prod", 3)]
    assert [o for o in ops if o[1] == "cons" and o[0] in ("memops", "copy")] == \
        [("memops", "cons", 1), ("copy", "cons", 6), ("memops", "cons", 1)]
    ce_at = ops.index(("copy", "caller", 99))
    ends = [o for o in ops if o[0] == "record" and o[1] in ("prod", "cons")]
    assert {o[1] for o in ends} == {"prod", "cons"}
    for _, s, ev in ends:                                # recorded after each stream's last work...
        last = max(i for i, o in enumerate(ops) if o[1] == s and o[0] in ("memops", "copy"))
        assert ops.index(("record", s, ev)) > last
        assert ops.index(("wait", "caller", ev)) > ce_at    # ...and waited by the caller after its own part
    assert not any(o[0] == "wait" and o[1] == "caller" for o in ops[:ce_at])   # the ce part waits for nothing
    assert len(keep) == 3 and all(isinstance(k, _Event) for k in keep)


def test_a_moving_calls_program_runs_the_host_lane_beside_the_copy_engines(monkeypatch):
    """Exchange.program for an all_gather on ce + host: the host lane's programs fork from the
    program's stream before the copy engines' pulls are posted there, carry this rank's host
    transfers (staged through its graph ring), and are joined only after the pulls."""
    from types import SimpleNamespace

    from braid.comm import exchange as ex_mod
    from braid.comm.exchange import Exchange
    from braid.comm.prepared import Entry
    from braid.lanes import _cuda
    from braid.lanes import host as host_mod

    log = _Log()
    _Event.log = log
    for mod in (host_mod, ex_mod):
        monkeypatch.setattr(mod.torch.cuda, "Event", _Event)
    monkeypatch.setattr(_cuda, "memops", lambda sh, batch: log.ops.append(("memops", sh, len(batch))))
    monkeypatch.setattr(_cuda, "memcpy_async", lambda dst, src, n, sh: log.ops.append(("copy", sh, n)))
    world, me, n = 2, 0, 12 * CHUNK
    lay = Layout(world, 1 << 16, CHUNK, graph_rings=True)
    plan = split(all_gather_movement(world, n, False), {"ce": 0.5, "host": 0.5}, n, min_split=1024)
    assert plan.lanes["ce"] and plan.lanes["host"]

    class _Ce:
        def peer_ptrs(self, transfers, me, descs):
            return {t.src: 1 << 40 for t in transfers}

        def emit(self, sh, me, transfers, peers, out_ptrs, sig):
            log.ops.append(("pulls", sh, len([t for t in transfers if any(d == me for d, _, _ in t.dsts)])))

    lane = host_mod.HostLane.__new__(host_mod.HostLane)
    lane.lc = SimpleNamespace(layout=lay, seg_dev_ptr=0, segment=SimpleNamespace(address=0))
    lane.produce_stream, lane.consume_stream = _Stream("prod", log), _Stream("cons", log)
    ex = Exchange.__new__(Exchange)
    ex.seg_dev_ptr, ex.layout, ex.rank, ex.lanes = 0, lay, me, {"ce": _Ce(), "host": lane}
    entry = Entry([{}, {}], plan, {"ce": 0.5, "host": 0.5}, ["ce", "host"], n, native=False)
    inp = SimpleNamespace(data_ptr=lambda: 1 << 30, numel=lambda: n)
    out = SimpleNamespace(data_ptr=lambda: 1 << 31)
    keep: list = []
    ex.program(entry, inp, [out], None)(_Stream("cap", log), (_Stream("red", log), _Stream("side", log)), keep)
    ops = log.ops
    pulls = ops.index(("pulls", "cap", 1))
    fork = ops.index(next(o for o in ops if o[0] == "record" and o[1] == "cap"))
    assert fork < pulls
    staged = sum(o[2] for o in ops if o[0] == "copy" and o[1] == "prod")
    assert staged == sum(t.nbytes for t in plan.lanes["host"] if t.src == me)      # this rank's host share, staged
    read = sum(o[2] for o in ops if o[0] == "copy" and o[1] == "cons")
    assert read == sum(t.nbytes for t in plan.lanes["host"] if t.src != me)
    host_ends = [o[2] for o in ops if o[0] == "record" and o[1] in ("prod", "cons")]
    assert len(host_ends) == 2
    assert all(ops.index(("wait", "cap", e)) > pulls for e in host_ends)    # joined after the pulls
    assert not any(o[0] == "wait" and o[1] == "cap" and o[2] in host_ends for o in ops[:pulls])


def test_a_split_reductions_program_holds_nccl_the_copy_engines_and_the_host_lane(monkeypatch):
    """Reductions.reduce_program for an all_reduce on nccl + ce + host (2 ranks): NCCL's own
    all_reduce of the prefix on braid's NCCL stream, the copy engines' pipelined share on the
    program's stream, and the host lane's staged rest on the op stream (its reduce-scatter
    phase, this rank's reduction, its gather phase, in that order), each forked from the
    program's stream before the copy engines' work and joined into it after."""
    import contextlib
    from types import SimpleNamespace

    import torch

    from braid.comm import reductions as red_mod
    from braid.comm.exchange import Exchange
    from braid.comm.reductions import Reductions, _ReduceCall
    from braid.lanes import _cuda
    from braid.lanes import host as host_mod
    from braid.planner.plan import chunk_bounds

    log = _Log()
    _Event.log = log
    for mod in (host_mod, red_mod):
        monkeypatch.setattr(mod.torch.cuda, "Event", _Event)
    cur = ["cap"]

    @contextlib.contextmanager
    def on(stream):
        was, cur[0] = cur[0], stream.name
        try:
            yield
        finally:
            cur[0] = was
    monkeypatch.setattr(red_mod.torch.cuda, "stream", on)
    monkeypatch.setattr(_cuda, "memops", lambda sh, batch: log.ops.append(("memops", sh, len(batch))))
    monkeypatch.setattr(_cuda, "memcpy_async", lambda dst, src, n, sh: log.ops.append(("copy", sh, n)))
    monkeypatch.setattr(red_mod, "reduce_slots", lambda slots, w, name, out, factor=1.0:
                        log.ops.append(("reduce", cur[0], out.numel())))
    monkeypatch.setattr(red_mod.dist, "all_reduce", lambda t, op=None, group=None:
                        log.ops.append(("nccl", cur[0], t.numel())))

    class _CeRed:
        def peer_ptrs(self, descs):
            return {1: 1 << 40}

        def num_pieces(self, chunks, esz):
            return 2

        def emit(self, ps, rs, gs, **kw):
            log.ops.append(("ce_reduction", ps.name, kw["chunks"][0][1]))

    world, me, numel = 2, 0, 1 << 20
    lay = Layout(world, 1 << 16, CHUNK, graph_rings=True)
    lane = host_mod.HostLane.__new__(host_mod.HostLane)
    lane.lc = SimpleNamespace(layout=lay, seg_dev_ptr=0, segment=SimpleNamespace(address=0))
    lane.produce_stream, lane.consume_stream = _Stream("prod", log), _Stream("cons", log)
    ex = Exchange.__new__(Exchange)
    ex.lanes, ex.plans = {"host": lane}, {}
    red = Reductions.__new__(Reductions)
    red.world_size, red.rank, red.exchange, red.nccl_group = world, me, ex, "nccl-group"
    red.gpu = SimpleNamespace(ce=lambda: _CeRed(), op_stream=lambda: _Stream("op", log),
                              nccl_stream=lambda: _Stream("nccl", log))
    out = torch.arange(numel, dtype=torch.float32)
    ib = out.view(torch.uint8)
    rc = _ReduceCall("all_reduce", out, out, None, None, "sum", 1.0, ib, ib, numel, 4,
                     chunk_bounds(numel, world, 4), torch.device("cuda"))
    empty = torch.empty                 # the program's slots: host memory here
    monkeypatch.setattr(red_mod.torch, "empty", lambda *a, device=None, **k: empty(*a, **k))
    shares = {"nccl": 0.3, "ce": 0.4, "host": 0.3}
    assert red.graphable(rc, shares)
    cuts = red.reduce_cuts(rc, shares)
    assert cuts.base and cuts.ce_f > 0 and set(cuts.rest) == {"host"}
    keep: list = []
    red.reduce_program(rc, [{}, {}], shares, None)(_Stream("cap", log), (_Stream("red", log), _Stream("gat", log)), keep)
    ops = log.ops
    assert ("nccl", "nccl", cuts.base) in ops                               # NCCL's prefix on its stream
    ce_at = next(i for i, o in enumerate(ops) if o[0] == "ce_reduction")
    assert ops[ce_at][1] == "cap"
    forks = {o[2] for o in ops[:ce_at] if o[0] == "record" and o[1] == "cap"}
    assert any(("wait", "nccl", e) in ops for e in forks) and any(("wait", "op", e) in ops for e in forks)
    seq = [o for o in ops if o[1] == "op" and o[0] in ("reduce", "copy", "wait")]
    red_at = next(i for i, o in enumerate(seq) if o[0] == "reduce")
    assert seq[red_at] == ("reduce", "op", cuts.rest_chunks[me][1])         # this rank's staged chunk
    # the op stream waits for the host lane's first phase before reducing, and its second after
    assert sum(1 for o in seq[:red_at] if o[0] == "wait") >= 3 and sum(1 for o in seq[red_at:] if o[0] == "wait") >= 2
    ends = [[o[2] for o in ops if o[0] == "record" and o[1] == s][-1] for s in ("op", "nccl")]   # each one's last
    assert ends and all(ops.index(("wait", "cap", e)) > ce_at for e in ends)   # joined after the copy engines' part
    staged = sum(o[2] for o in ops if o[0] == "copy" and o[1] == "prod")
    n_other = cuts.rest_chunks[1][1] * 4
    n_mine = cuts.rest_chunks[me][1] * 4
    assert staged == n_other + n_mine            # phase 1: my part of the peer's chunk; phase 2: my reduced chunk


def test_the_segment_is_fitted_to_dev_shm_with_its_graph_rings(monkeypatch):
    """A GPU communicator's segment holds the graph rings too: where /dev/shm is small, the host
    buffer is shrunk until the whole segment, graph rings included, fits (a segment written past
    /dev/shm's end kills the process with SIGBUS instead of an error)."""
    import os
    from types import SimpleNamespace

    from braid.comm import communicator as comm_mod

    world, budget, chunk = 4, 64 << 20, 4 << 20
    plain = Layout(world, budget, chunk, graph_rings=False).total_bytes
    graphs = Layout(world, budget, chunk, graph_rings=True).total_bytes
    assert graphs - plain >= world * GRAPH_SLOTS * chunk
    free = int(plain / 0.9) + 4096          # room for the plain segment, not for the graph rings
    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(f_bavail=free // 4096, f_frsize=4096))
    assert comm_mod._fit_shm(world, budget, chunk, graph=False) == (budget, 0)
    fitted, _ = comm_mod._fit_shm(world, budget, chunk, graph=True)
    assert fitted < budget
    assert Layout(world, fitted, chunk, graph_rings=True).total_bytes <= free * 0.9


@pytest.mark.parametrize("seed", range(12))
def test_random_plans_move_the_right_bytes(seed):
    """Random worlds, uneven all_to_all matrices (zeros included) and random host shares beside
    the copy engines: the host programs deliver every byte, call after call, and leave the flags
    at rest."""
    rng = random.Random(1000 + seed)
    world = rng.randint(2, 5)
    matrix = [[rng.choice((0, 1, 7, 4096, 5000, 3 * CHUNK + 11, 9 * CHUNK)) for _ in range(world)]
              for _ in range(world)]
    total = sum(map(sum, matrix))
    host = rng.choice((0.2, 0.5, 1.0))
    shares = {"host": 1.0} if host == 1.0 else {"ce": 1.0 - host, "host": host}
    plan = split(all_to_all_movement(matrix), shares, max(total, 1), min_split=256)
    assert plan.lanes.get("host")
    w = _World(world, plan)
    res = w.run(calls=3, seed=seed)
    assert not res["deadlock"], (world, matrix, shares)
    assert not res["wrong"], (world, matrix, shares, res["wrong"][:3])
    assert not any(w.flags.values())
