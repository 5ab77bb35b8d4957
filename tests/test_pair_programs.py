"""A prepared send/recv's programs with the host lane's share (lanes/host.py pair_programs), run on
the CPU.

A GPU communicator runs a repeated send/recv over the copy engines, the host lane or both as
programs on the pair flags: the sender's (set ready, stage its host share through the direction's
graph ring, take done) and the receiver's two (take ready, pull the copy engines' share, set
done; beside it, take each staged slot, copy it out, free it). Here those programs, built from the
plan the GPU would run, execute in a small interpreter standing in for the GPUs: one flat memory
holds the node segment and every rank's input and output, each stream runs its program in order,
a wait blocks until its flag is set, copies move real bytes, and the streams of every rank and
direction are interleaved at random, calls after calls (a rank's next call starts once all its
streams ended the last one; its peers may still be in theirs). Checked: no stream waits forever,
every receiver gets exactly the sender's bytes of that call, every flag is back at 0 at the end
(what lets the same programs run again), a drain leaves the pair at rest, an abort releases a
sender whose receiver never comes. A negative control shows the checks can fail.
"""
from __future__ import annotations

import random

import pytest

from braid.lanes.host import graph_programs, pair_programs
from braid.node import GRAPH_SLOTS, Layout
from braid.planner.plan import p2p_movement, split
from test_host_graph import _World, _without_free_waits

_flat = _World._flat          # a batch of flag operations runs one step each, in order

CHUNK = 4096
RELEASE = 0x40000000


class _Pairs:
    """Directions (src, dst) of one world, each with its shares: the flat memory and every side's
    programs (a rank's streams: its send stream per direction it sends on, its receive stream and
    the stream beside it per direction it receives on)."""

    def __init__(self, world: int, directions: list[tuple[int, int]], shares: dict[str, float], n: int,
                 drain: bool = False, edit=None):
        self.world, self.n = world, n
        self.layout = lay = Layout(world, 1 << 17, CHUNK, graph_rings=True)
        assert lay.pair_graph_rings[directions[0]].slot_bytes == CHUNK
        base = lay.total_bytes
        self.inp, self.out = {}, {}
        for d in directions:
            self.inp[d], self.out[d] = base, base + n
            base += 2 * n
        self.mem = bytearray(base)
        self.flags: dict[int, int] = {}
        self.directions, self.drain = directions, drain
        self.streams: dict[tuple, list] = {}      # (rank, name) -> flat program
        for src, dst in directions:
            plan = split(p2p_movement(world, src, dst, n), shares, n, min_split=1024)
            ce = "ce" in shares
            ready = lay.counter("flag_p2p_ready", src, dst) if ce else 0
            done = lay.counter("flag_p2p_done", src, dst) if ce else 0
            host = plan.lanes.get("host", [])
            mine = (lambda me: graph_programs(lay, me, host, 0, [0], 0, 0, pair=(src, dst)) if host  # noqa: E731
                    else ([], []))
            progs = (mine(src)[0], mine(dst)[1])         # the sender's producer, the receiver's consumer
            copies = tuple((off, self.inp[(src, dst)] + t.src_off, t.nbytes)
                           for t in plan.lanes.get("ce", []) for _, _, off in t.dsts)
            send = pair_programs(True, self.inp[(src, dst)], ready, done, (), progs[0])
            recv = pair_programs(False, self.out[(src, dst)], ready, done, copies, progs[1], drain)
            if edit is not None:
                send = [edit(p) for p in send]
            for i, p in enumerate(send):
                self.streams[(src, "send", dst, i)] = _flat(p)
            for i, p in enumerate(recv):
                self.streams[(dst, "recv", src, i)] = _flat(p)

    def run(self, calls: int, seed: int, absent: int | None = None, abort_at: int | None = None) -> dict:
        rng = random.Random(seed)
        keys = [k for k in self.streams if k[0] != absent and self.streams[k]]
        pc = {k: 0 for k in keys}
        call = {k: 0 for k in keys}
        sent: list[dict] = [{} for _ in range(calls)]

        def fill(c: int, rank: int) -> None:
            for (s, d), addr in self.inp.items():
                if s == rank:
                    data = bytes(rng.getrandbits(8) for _ in range(self.n))
                    self.mem[addr: addr + self.n] = data
                    sent[c][(s, d)] = data

        ranks = sorted({k[0] for k in keys})
        for r in ranks:
            fill(0, r)

        def rank_call(r: int) -> int:
            return min(call[k] for k in keys if k[0] == r)
        wrong, steps, aborted = [], 0, False
        while any(call[k] < calls for k in keys):
            movable = []
            for k in keys:
                if call[k] >= calls or call[k] > rank_call(k[0]):
                    continue
                op = self.streams[k][pc[k]]
                if op[0] != "wait" or self.flags.get(op[1], 0) >= op[2]:
                    movable.append(k)
            if not movable:
                return {"deadlock": True, "wrong": wrong, "call": call}
            k = rng.choice(movable)
            op = self.streams[k][pc[k]]
            if op[0] == "write":
                if not aborted:
                    self.flags[op[1]] = op[2]
            elif op[0] == "copy":
                _, dst, src, nb = op
                self.mem[dst: dst + nb] = self.mem[src: src + nb]
            pc[k] += 1
            if pc[k] == len(self.streams[k]):
                pc[k] = 0
                call[k] += 1
                r = k[0]
                if all(call[j] == call[k] for j in keys if j[0] == r):       # rank r ended a call
                    done = call[k] - 1
                    if not self.drain:
                        for (s, d), addr in self.out.items():
                            if d == r and s != absent and bytes(self.mem[addr: addr + self.n]) != sent[done][(s, d)]:
                                wrong.append((s, d, done))
                    if call[k] < calls:
                        fill(call[k], r)
            steps += 1
            if abort_at is not None and steps >= abort_at:
                aborted = True
            if aborted:
                for prog in self.streams.values():
                    for o in prog:
                        if o[0] != "copy":
                            self.flags[o[1]] = RELEASE
        return {"deadlock": False, "wrong": wrong, "call": call}


N = CHUNK * (2 * GRAPH_SLOTS + 1) + 700       # more chunks than slots, a short last one
SHARES = {"ce+host": {"ce": 0.5, "host": 0.5}, "host": {"host": 1.0}, "ce": {"ce": 1.0},
          "ce.9+host.1": {"ce": 0.9, "host": 0.1}}


@pytest.mark.parametrize("shares", sorted(SHARES))
@pytest.mark.parametrize("case", ["one way", "both ways", "ring of 4", "all pairs of 3"])
def test_send_recv_programs_move_the_right_bytes_call_after_call(case, shares):
    world, dirs = {"one way": (2, [(0, 1)]), "both ways": (2, [(0, 1), (1, 0)]),
                   "ring of 4": (4, [(r, (r + 1) % 4) for r in range(4)]),
                   "all pairs of 3": (3, [(s, d) for s in range(3) for d in range(3) if s != d])}[case]
    for seed in range(3):
        p = _Pairs(world, dirs, SHARES[shares], N)
        res = p.run(calls=4, seed=seed)
        assert not res["deadlock"], (case, shares, seed, res["call"])
        assert not res["wrong"], (case, shares, seed, res["wrong"][:3])
        assert not any(p.flags.values()), "a flag was left set after the last call"


def test_the_programs_split_as_the_shares_say():
    """The copy engines' share is pulled by the receiver, the host lane's staged by the sender:
    the sender's program copies only the host share's bytes, the receiver's main program only
    the copy engines'."""
    p = _Pairs(2, [(0, 1)], {"ce": 0.75, "host": 0.25}, 64 * CHUNK)
    send, recv, beside = (p.streams[(0, "send", 1, 0)], p.streams[(1, "recv", 0, 0)], p.streams[(1, "recv", 0, 1)])
    moved = lambda prog: sum(op[3] for op in prog if op[0] == "copy")     # noqa: E731
    assert moved(send) == moved(beside) == 16 * CHUNK
    assert moved(recv) == 48 * CHUNK
    assert send[0] == ("write", p.layout.counter("flag_p2p_ready", 0, 1), 1)       # the pull may start at once
    host_only = _Pairs(2, [(0, 1)], {"host": 1.0}, 8 * CHUNK)
    assert len([k for k in host_only.streams if k[1] == "recv"]) == 1                # no copy engines: one program
    assert not any(op[1] == host_only.layout.counter("flag_p2p_ready", 0, 1)
                   for prog in host_only.streams.values() for op in prog)


def test_the_pair_rings_and_flags_stand_apart():
    """Each direction's graph ring is its own (no byte shared with another direction's, the
    collective graph rings or the posted rings) and its flags lie below `pid` (an abort releases
    them)."""
    world = 3
    lay = Layout(world, 1 << 17, CHUNK, graph_rings=True)
    spans = [(g.offset, g.offset + g.num_slots * g.slot_bytes)
             for g in (list(lay.pair_graph_rings.values()) + lay.graph_rings + lay.coll_rings
                       + list(lay.pair_rings.values()))]
    spans.sort()
    assert all(b <= c for (_, b), (c, _) in zip(spans, spans[1:]))
    assert len(lay.pair_graph_rings) == world * (world - 1)
    limit = 4096 + lay.counter_base["pid"] * 64
    addrs = {lay.pair_flag(f, s, d, k) for f in ("flag_pair_full", "flag_pair_free")
             for (s, d) in lay.pair_graph_rings for k in range(GRAPH_SLOTS)}
    assert len(addrs) == 2 * world * (world - 1) * GRAPH_SLOTS and max(addrs) < limit
    assert not Layout(world, 1 << 17, CHUNK).pair_graph_rings        # CPU communicators: none


def test_a_drain_leaves_the_pair_at_rest():
    """A receiver that refuses a send that ran ahead takes every hand-off and copies nothing: the
    sender's program ends and the flags are at rest for the next call."""
    for shares in ("ce+host", "host"):
        p = _Pairs(2, [(0, 1)], SHARES[shares], N, drain=True)
        res = p.run(calls=2, seed=1)
        assert not res["deadlock"] and not any(p.flags.values())
        assert not any(op[0] == "copy" for k, prog in p.streams.items() if k[1] == "recv" for op in prog)


def test_negative_control_without_the_senders_waits_for_its_reader():
    caught = 0
    for seed in range(10):
        p = _Pairs(2, [(0, 1)], {"host": 1.0}, N, edit=_without_free_waits)       # no waits for the slot's reader
        res = p.run(calls=3, seed=seed)
        caught += bool(res["deadlock"] or res["wrong"] or any(p.flags.values()))
    assert caught >= 5, caught


def test_an_abort_releases_a_sender_whose_receiver_never_comes():
    p = _Pairs(2, [(0, 1)], SHARES["ce+host"], N)
    assert p.run(calls=1, seed=0, absent=1)["deadlock"]
    p = _Pairs(2, [(0, 1)], SHARES["ce+host"], N)
    assert not p.run(calls=1, seed=0, absent=1, abort_at=4)["deadlock"]


def test_the_receivers_host_share_runs_beside_its_pulls(monkeypatch):
    """comm/pairs.py, a synchronous receive with both shares on the caller's stream: the host
    share's program goes on the stream beside, forked from the caller's stream before the pulls
    and joined into it after them; the sender's one program stays on the caller's stream, its
    flag operations batched (ready first, the tail's takes and done's in one batch at the end)."""
    from types import SimpleNamespace

    import torch

    from braid.comm import pairs
    from braid.comm.pairs import PairEntry, Pairs, _Recv, _Send
    from braid.lanes import _cuda

    lay = Layout(2, 1 << 17, CHUNK, graph_rings=True)
    calls: list = []
    monkeypatch.setattr(_cuda, "memops", lambda sh, batch: calls.append(("batch", sh, list(batch))))
    monkeypatch.setattr(_cuda, "memops_posted", lambda sh, arr: calls.append(
        ("batch", sh, [(m.operation == _cuda.CU_STREAM_MEM_OP_WAIT_VALUE_32, m.address, m.value) for m in arr])))
    monkeypatch.setattr(_cuda, "memcpy_async", lambda dst, src, n, sh: calls.append(("copy", sh, dst, src, n)))
    monkeypatch.setattr(_cuda, "event_record", lambda ev, sh: calls.append(("record", ev, sh)))
    monkeypatch.setattr(_cuda, "stream_wait_event", lambda sh, ev: calls.append(("wait", sh, ev)))
    monkeypatch.setattr(pairs, "_RAW", lambda dev: 0x900)
    events = iter(range(1, 100))
    me = SimpleNamespace(p2p=SimpleNamespace(seg_dev_ptr=0, layout=lay), dev_index=0,
                         beside_stream=lambda: SimpleNamespace(cuda_stream=0xB00),
                         take_event=lambda: next(events), give_event=lambda ev: None)
    shares = {"ce": 0.5, "host": 0.5}
    n = 6 * CHUNK
    plan = split(p2p_movement(2, 0, 1, n), shares, n, min_split=1024)
    prod = graph_programs(lay, 0, plan.lanes["host"], 0, [0], 0, 0, pair=(0, 1))[0]
    cons = graph_programs(lay, 1, plan.lanes["host"], 0, [0], 0, 0, pair=(0, 1))[1]
    copies = [(0, 0x7000, 3 * CHUNK)]
    t = torch.zeros(n // 4)
    Pairs._flags(me, PairEntry(None, plan, shares, False, flags=True, copies=copies, host=cons), False, 0, 1, t, 0,
                 False, _Recv())
    kinds = [(c[0], c[1] if c[0] != "record" else c[2]) for c in calls]
    fork, join = kinds.index(("record", 0x900)), kinds.index(("record", 0xB00))
    assert calls[fork + 1] == ("wait", 0xB00, calls[fork][1])            # the stream beside waits for the caller's
    pulls = [i for i, c in enumerate(calls) if c[0] == "copy" and c[1] == 0x900]
    staged = [i for i, c in enumerate(calls) if c[0] == "copy" and c[1] == 0xB00]
    assert pulls and staged and fork < min(staged) and max(pulls) < join
    assert calls[join + 1] == ("wait", 0x900, calls[join][1]) and join + 2 == len(calls)     # joined at the end
    assert [c[4] for i, c in enumerate(calls) if i in pulls] == [3 * CHUNK]
    assert sum(calls[i][4] for i in staged) == 3 * CHUNK
    assert all(calls[i][2] >= t.data_ptr() for i in staged)                # into this call's output
    calls.clear()
    Pairs._flags(me, PairEntry(None, plan, shares, False, flags=True, host=prod), True, 0, 1, t, 0, False, _Send())
    assert {c[1] for c in calls} == {0x900} and not any(c[0] in ("record", "wait") for c in calls)
    assert calls[0] == ("batch", 0x900, [(False, lay.counter("flag_p2p_ready", 0, 1), 1)])
    last = calls[-1][2]
    assert last[-2:] == [(True, lay.counter("flag_p2p_done", 0, 1), 1), (False, lay.counter("flag_p2p_done", 0, 1), 0)]
    assert any(a == lay.pair_flag("flag_pair_free", 0, 1, 0) for _, a, _ in last)       # the tail, same batch
    assert all(c[3] >= t.data_ptr() for c in calls if c[0] == "copy")         # staged from this call's input


def test_the_posted_form_makes_the_same_driver_calls(monkeypatch):
    """A prepared send/recv posts its programs in posted_form (each batch of flag operations made
    once as the driver's array): run_program of that form makes the driver calls run_program of
    the program makes, batches and single operations alike, with batching on and off."""
    import ctypes

    from braid.lanes import _cuda
    from braid.lanes.host import posted_form, run_program

    class Lib:
        def __init__(self):
            self.calls = []

        def cuStreamBatchMemOp_v2(self, stream, n, arr, flags):
            arr = ctypes.cast(arr, ctypes.POINTER(_cuda.MemOp))
            self.calls.append(("batch", stream, flags, tuple((arr[i].operation, arr[i].address, arr[i].value,
                                                              arr[i].flags) for i in range(n))))
            return 0

        def cuStreamWaitValue32_v2(self, stream, addr, value, flags):
            self.calls.append(("wait", stream, addr, value, flags))
            return 0

        def cuStreamWriteValue32_v2(self, stream, addr, value, flags):
            self.calls.append(("write", stream, addr, value, flags))
            return 0

        def cuMemcpyAsync(self, dst, src, n, stream):
            self.calls.append(("copy", dst, src, n, stream))
            return 0
    fake = Lib()
    monkeypatch.setattr(_cuda, "lib", lambda: fake)
    layout = Layout(2, 1 << 17, CHUNK, graph_rings=True)
    base, n = 1 << 40, 3 * CHUNK + 5
    staged = split(p2p_movement(2, 0, 1, n), {"ce": 0.5, "host": 0.5}, n, min_split=1024).lanes["host"]
    for batching in (True, False):
        monkeypatch.setattr(_cuda, "batched", lambda b=batching: b)
        for sending in (True, False):
            both = graph_programs(layout, 0 if sending else 1, staged, 0, [0], base, base, pair=(0, 1))
            for host in ([], both[0] if sending else both[1]):
                progs = pair_programs(sending, 0x5000, base + 64, base + 128, ((0, 0x9000, 77),), host)
                assert progs
                for prog in progs:
                    fake.calls.clear()
                    run_program(0x11, prog)
                    want = list(fake.calls)
                    fake.calls.clear()
                    run_program(0x11, posted_form(prog))
                    assert fake.calls == want and want, (batching, sending, prog)
                    kinds = {c[0] for c in want}
                    assert ("batch" in kinds) == (batching and any(op[0] == "ops" and len(op[1]) > 1 for op in prog))
