"""The small-message path's cached answers: what is cached, and when it is forgotten. On GPUs the
path calls NCCL's backend (GPU tier and bench); on a CPU communicator it calls gloo's own group
when the calibration gives gloo the whole call."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from conftest import run_world


def _worker(rank, w):
    import braid
    comm = braid.init()
    x = torch.randn(1000)
    # a world of one rank has nothing to split: the call is the native library's, whole (the
    # answer is cached True), and leaves the tensor as it was
    t = x.clone()
    comm.all_reduce(t)
    assert torch.equal(t, x), "world of one all_reduce must leave the tensor unchanged"
    assert comm.shortcuts.ar[1000] == (torch.float32, dist.ReduceOp.SUM, True) and not comm.shortcuts.ag
    # an answer is stored with the call shape's facts (CPU communicators too: gloo's own call)
    ent = comm.shortcuts.put("ar", 1000, (torch.float32, dist.ReduceOp.SUM), True)
    assert ent == (torch.float32, dist.ReduceOp.SUM, True)
    comm.cuda = True                      # pretend, to see what a GPU communicator would keep
    ent = comm.shortcuts.put("ar", 1000, (torch.float32, dist.ReduceOp.SUM), True)
    assert ent[-1] is True and comm.shortcuts.ar[1000] is ent
    forgotten = []
    # fixed shares: forgotten on entry and on exit
    with comm.fixed_shares({"shm": 1.0}):
        forgotten.append(not comm.shortcuts.ar)
        comm.shortcuts.put("rs", 8, (torch.float32, dist.ReduceOp.SUM, 2), True)
    forgotten.append(not comm.shortcuts.rs)
    # a new calibration
    comm.shortcuts.put("ag", 8, (torch.float32, 8), True)
    comm.set_calibration({})
    forgotten.append(not comm.shortcuts.ag)
    # the table is bounded
    for n in range(1100):
        comm.shortcuts.put("bc", n, (torch.float32, 0), True)
    forgotten.append(len(comm.shortcuts.bc) <= 1025)
    comm.cuda = False
    braid.close()
    forgotten.append(not comm.shortcuts.bc)
    # after close, nothing is answered True again
    forgotten.append(comm.shortcuts.put("a2a", 4, (torch.float32, 4, 4), True)[-1] is False)
    return forgotten


def test_fast_path_answers_are_forgotten_when_they_may_change():
    assert run_world(_worker, 1) == [[True] * 6]


def _verdict_worker(rank, w):
    """The calibration's measured verdict per size bucket overrides the model's split: the split
    (True), the native lane alone (False), or a named lane alone."""
    import braid
    comm = braid.init()
    lane = {"latency_us": 5.0, "bw_gbps": 10.0, "floor_us": 5.0}
    comm.set_calibration({f"all_gather/{w}": {"shm": lane, "gloo": lane},
                          f"all_gather/{w}/pays": {"20": "shm", "22": False, "24": True}})
    lanes = ["shm", "gloo"]
    got = [comm.shares_for("all_gather", n, lanes) for n in (1 << 20, 1 << 22, 1 << 24)]
    # a verdict naming a lane that is not usable here falls back to the native lane
    comm.set_calibration({f"all_gather/{w}": {"shm": lane, "gloo": lane},
                          f"all_gather/{w}/pays": {"20": "ce"}})
    got.append(comm.shares_for("all_gather", 1 << 20, lanes))
    braid.close()
    return got


def test_measured_verdict_picks_split_native_or_a_lane_alone():
    (alone, native, split, fallback), = run_world(_verdict_worker, 1)
    assert alone == {"shm": 1.0}
    assert native == {"gloo": 1.0}
    assert set(split) == {"shm", "gloo"} and abs(sum(split.values()) - 1.0) < 1e-9
    assert fallback == {"gloo": 1.0}


def _repeat_worker(rank, w):
    """Collectives through the descriptor exchange on CPU lanes (fixed split shares, uneven
    all_to_all): a call repeating the last one on every rank takes one digest round, anything new on
    any rank the full exchange; every result checked against the expected data."""
    import braid
    comm = braid.init()
    seg = comm.segment
    steps, ok = [], []
    with comm.fixed_shares({"shm": 0.5, "gloo": 0.5}):
        for n in (50001, 50001, 50001, 70001, 70001):
            x = torch.arange(n, dtype=torch.float32) + 1000 * rank
            out = torch.empty(w * n)
            before = seg.coll_seq + seg.redo_seq     # both channels (the build exchange takes the second)
            comm.all_gather_into_tensor(out, x)
            steps.append(seg.coll_seq + seg.redo_seq - before)
            ok.append(torch.equal(out, torch.cat([torch.arange(n, dtype=torch.float32) + 1000 * r for r in range(w)])))
        # two shapes in turn (a training loop's buckets): each remembered after its first exchange
        for n in (30001, 40001, 30001, 40001):
            x = torch.arange(n, dtype=torch.float32) - rank
            out = torch.empty(w * n)
            before = seg.coll_seq + seg.redo_seq     # both channels (the build exchange takes the second)
            comm.all_gather_into_tensor(out, x)
            steps.append(seg.coll_seq + seg.redo_seq - before)
            ok.append(torch.equal(out, torch.cat([torch.arange(n, dtype=torch.float32) - r for r in range(w)])))
    # uneven all_to_all: rank r sends (r + 1) * 1000 + d rows to rank d; in the third call only the
    # last rank changes what it sends itself, so only its descriptor differs
    for call in range(4):
        mat = [[(s + 1) * 1000 + d + (500 if call >= 2 and s == d == w - 1 else 0) for d in range(w)] for s in range(w)]
        ins, outs = mat[rank], [mat[s][rank] for s in range(w)]
        x = torch.cat([torch.full((ins[d],), float(100 * rank + d)) for d in range(w)])
        y = torch.empty(sum(outs))
        before = seg.coll_seq + seg.redo_seq     # both channels (the build exchange takes the second)
        comm.all_to_all_single(y, x, outs, ins)
        steps.append(seg.coll_seq + seg.redo_seq - before)
        ok.append(torch.equal(y, torch.cat([torch.full((outs[s],), float(100 * s + rank)) for s in range(w)])))
    braid.close()
    return steps, ok


def test_a_repeated_call_reuses_the_last_exchange_on_every_rank():
    res = run_world(_repeat_worker, 3)
    for rank, (steps, ok) in enumerate(res):
        assert all(ok), (rank, ok)
        # all_gather: new, repeat, repeat, new size, repeat; two sizes in turn: new, new, then both
        # remembered; all_to_all: new, repeat, one rank changed, repeat
        assert steps == [2, 1, 1, 2, 1, 2, 2, 1, 1, 2, 1, 2, 1], (rank, steps)


def _values_worker(rank, w):
    """The two-number agreement that precedes a small uneven all_to_all on GPUs: every rank gets
    every rank's values in rank order, interleaved with descriptor exchanges on the same sequence;
    a rank that made a different call is named."""
    import braid
    from braid.errors import PeerMismatchError
    comm = braid.init()
    seg = comm.segment
    out = []
    for k in range(5):
        got = seg.exchange_values([rank * 10 + k, 7 ** (rank + k)], "probe")
        out.append(got == [[r * 10 + k, 7 ** (r + k)] for r in range(w)])
        descs = seg.exchange_collective({"op": "probe", "k": k, "rank": rank}, list(range(w)))
        out.append([d["rank"] for d in descs] == list(range(w)) and {d["k"] for d in descs} == {k})
    # a rank that knows the outcome posts without waiting; the others still read its values, and
    # the descriptor exchange after it pairs up on every rank
    # (many rounds, a different rank not waiting each time: a rank that does not wait must not
    # overwrite a descriptor a slower peer is still reading)
    for i in range(40):
        skip = i % w
        got = seg.exchange_values([rank + 100, i], "probe", wait=rank != skip)
        out.append(got is None if rank == skip else got == [[r + 100, i] for r in range(w)])
        descs = seg.exchange_collective({"op": "probe", "rank": rank, "i": i}, list(range(w)))
        out.append([d["rank"] for d in descs] == list(range(w)) and {d.get("i") for d in descs} == {i})
    # rank 0 agrees on one number, the others on two: a clear error on the ranks that read it
    err = None
    try:
        seg.exchange_values([1] if rank == 0 else [1, 2], "probe")
    except PeerMismatchError as e:
        err = str(e)
    braid.close()
    return out, err


def _alone_worker(rank, w):
    """A lane measured faster alone in a size's own bucket replaces the native lane the model keeps
    there, for any op whose table names it; nowhere else."""
    import braid
    comm = braid.init()
    fast = {"latency_us": 5.0, "bw_gbps": 10.0, "floor_us": 5.0}
    slow = {"latency_us": 5000.0, "bw_gbps": 1.0, "floor_us": 5000.0}      # the model never picks it
    lanes = ["shm", "gloo"]
    got = []
    for op in ("all_reduce", "all_gather"):
        comm.set_calibration({f"{op}/{w}": {"shm": slow, "gloo": fast}, f"{op}/{w}/pays": {"24": "shm", "22": False}})
        got.append([comm.shares_for(op, n, lanes) for n in (1 << 24, (1 << 24) + 4096, 1 << 23, 1 << 22, 1 << 25)])
    braid.close()
    return got


def test_a_lane_alone_replaces_the_native_one_only_in_its_measured_bucket():
    (red, other), = run_world(_alone_worker, 1)
    shm, gloo = {"shm": 1.0}, {"gloo": 1.0}
    assert red == [shm, shm, gloo, gloo, gloo]
    assert other == red


def test_calibration_times_the_copy_engines_alone_where_the_model_keeps_nccl(monkeypatch):
    """split_pays on a reduction: where the model keeps NCCL alone but the copy engines alone come
    within ALONE_CHECK of it, both are timed and the faster named; sizes where the model splits
    are timed as before; hopeless sizes are not timed at all."""
    import contextlib
    from braid import calibrate, workloads
    from braid.planner.model import LaneCost
    timed_at = []

    class FakeComm:
        cuda = True
        now = None

        def split_rule(self, op, costs, n):
            return {"nccl": 0.9, "host": 0.1} if n >= 1 << 30 else {"nccl": 1.0}

        @contextlib.contextmanager
        def fixed_shares(self, shares, timed=False):
            self.now, self.timed = dict(shares), timed
            yield

    class Load:
        def __init__(self, n):
            self.nbytes, self.braid = n, lambda: None

    comm = FakeComm()
    comm.last_handle = None                                   # no lane times: shares stay the model's
    monkeypatch.setattr(calibrate, "_max_over_ranks", lambda c, values: values)
    speed = {"nccl": 1.0, "ce": 0.8, "host": 5.0}           # us per MiB, per lane alone

    def fake_time(c, fn, iters, warm):
        timed_at.append((c.now_n, tuple(sorted(c.now))))
        if len(c.now) > 1:
            return 0.95 * speed["nccl"] * c.now_n / (1 << 20)
        return speed[next(iter(c.now))] * c.now_n / (1 << 20)
    monkeypatch.setattr(calibrate, "time_call", fake_time)

    def make(c, op, n, dt):
        c.now_n = n
        return Load(n)
    monkeypatch.setattr(workloads, "make", make)
    # ce's line: within 1.5x of NCCL's from 256 MiB up (its fixed cost 100 us), not below
    costs = {"nccl": LaneCost(10.0, 1000.0), "ce": LaneCost(100.0, 1100.0), "host": LaneCost(100.0, 50.0)}
    got = calibrate.split_pays(comm, "reduce_scatter", costs)
    assert got == {"28": "ce", "30": "ce"}, got
    sizes = sorted({n for n, _ in timed_at})
    assert sizes == [256 << 20, 1 << 30], sizes
    assert ((1 << 30), ("host", "nccl")) in timed_at          # the model's split still timed at 1 GiB
    # a data-movement op: the copy engines alone are timed the same way (a repeated call on them
    # costs the host what NCCL's does), and win where they measure faster
    timed_at.clear()
    assert calibrate.split_pays(comm, "all_gather", costs) == {"28": "ce", "30": "ce"}
    assert ((1 << 28), ("ce",)) in timed_at and ((1 << 28), ("nccl",)) in timed_at
    # broadcast beyond 2 ranks (a star from the root): never the copy engines alone
    timed_at.clear()
    comm.world_size = 4
    assert calibrate.split_pays(comm, "broadcast", costs) == {"30": {"nccl": 0.9, "host": 0.1}}
    assert all(lanes != ("ce",) for _, lanes in timed_at)


def test_calibration_balances_the_split_before_timing_it(monkeypatch):
    """split_pays runs FlexLink's stage 1 at each size it times a split: lane times move the shares
    to equal finish (the model gave the slow host lane too much), the split is timed with those
    shares, and when it wins the verdict is the balanced shares, which shares_for then uses."""
    import contextlib
    from braid import calibrate, workloads
    from braid.planner.balancer import spread
    from braid.planner.model import LaneCost

    def lane_us(shares):        # ce: 1000 us for the whole op + 50; host: 10x slower + 200
        return {"ce": shares.get("ce", 0) * 1000 + 50, "host": shares.get("host", 0) * 10000 + 200}

    class Handle:
        def __init__(self, shares):
            self.t = {k: v for k, v in lane_us(shares).items() if k in shares}

        def lane_times_us(self):
            return dict(self.t)

    class FakeComm:
        cuda = True
        now = None
        last_handle = None

        def split_rule(self, op, costs, n):
            return {"ce": 0.905, "host": 0.095}

        @contextlib.contextmanager
        def fixed_shares(self, shares, timed=False):
            self.now, self.timed = dict(shares), timed
            yield

    comm = FakeComm()
    used = []

    class Load:
        participates = True

        def __init__(self, n):
            self.nbytes = n

        def braid(self):            # a split replays a program that times nothing unless asked
            comm.last_handle = Handle(comm.now if comm.timed or len(comm.now) < 2 else {})

    def fake_time(c, fn, iters, warm):
        used.append(dict(c.now))
        if len(c.now) > 1:
            return max(lane_us(c.now).values())
        return {"nccl": 1400.0, "ce": 1100.0}[next(iter(c.now))]
    monkeypatch.setattr(calibrate, "time_call", fake_time)
    monkeypatch.setattr(calibrate, "_max_over_ranks", lambda c, values: values)
    monkeypatch.setattr(workloads, "make", lambda c, op, n, dt: Load(n))
    costs = {"nccl": LaneCost(10.0, 1000.0), "ce": LaneCost(50.0, 1000.0), "host": LaneCost(200.0, 100.0)}
    record: dict = {}
    got = calibrate.split_pays(comm, "reduce_scatter", costs, record=record)
    assert set(got) == {"20", "22", "24", "26", "28", "30"}
    # the table keeps what was timed: the balanced split and each lane alone, per bucket
    assert record["30"]["split_shares"] == got["30"] and record["30"]["ce"] == 1100.0
    assert record["30"]["nccl"] == 1400.0 and record["30"]["split"] < (1 - calibrate.SPLIT_MARGIN) * 1100.0
    for verdict in got.values():
        assert isinstance(verdict, dict) and set(verdict) == {"ce", "host"}
        assert abs(sum(verdict.values()) - 1) < 1e-3
        assert spread(lane_us(verdict)) <= calibrate.BALANCE_SPREAD        # the lanes finish together
        assert abs(verdict["host"] - 850 / 11000) < 0.01                   # equal finish: 0.077
    # the split was timed with the balanced shares, never with the model's
    assert {"ce": 0.905, "host": 0.095} not in [u for u in used if len(u) > 1]
    # an unbalanced model split would have lost to the copy engines alone (1147 us vs 1100)
    assert max(lane_us({"ce": 0.905, "host": 0.095}).values()) > 1100 > max(lane_us(got["30"]).values())


def test_shares_for_uses_the_balanced_verdict():
    """A calibration table whose verdict is the balanced shares: the op starts from them; the
    buckets around it keep their own verdicts."""
    from braid.comm.policy import SplitPolicy
    from braid.planner.model import LaneCost
    c = SplitPolicy(2, True, False, lambda: ["ce", "host", "nccl"], {}, None)
    c.adapt, c.digest = False, "t"
    costs = {"nccl": LaneCost(30.0, 500.0), "ce": LaneCost(80.0, 600.0), "host": LaneCost(230.0, 70.0)}
    c.calib = {"reduce_scatter/2": costs}
    c.pays = {"reduce_scatter/2": {30: {"ce": 0.92, "host": 0.08}, 28: "ce", 26: False}}
    lanes = ["ce", "host", "nccl"]
    model = c.split_rule("reduce_scatter", costs, 1 << 30)
    assert len(model) > 1 and model != {"ce": 0.92, "host": 0.08}
    assert c.shares_for("reduce_scatter", 1 << 30, lanes) == {"ce": 0.92, "host": 0.08}
    assert c.shares_for("reduce_scatter", 3 << 29, lanes) == {"ce": 0.92, "host": 0.08}   # nearest bucket
    assert c.shares_for("reduce_scatter", 1 << 28, lanes) == {"ce": 1.0}
    assert c.split_verdict("reduce_scatter", 1 << 26, exact=True) is False


def test_a_lane_measured_alone_replaces_nccl_in_its_buckets_and_between_them():
    """The model keeps NCCL alone for a data-movement op; the calibration measured the copy engines
    alone faster at 4 and 16 MiB and NCCL at 1 MiB: the copy engines take 4-31 MiB (the 8 MiB
    bucket lies between two "ce" verdicts), NCCL keeps 1-2 MiB (between "ce" and False) and every
    size past the last measured bucket."""
    from braid.comm.policy import SplitPolicy
    from braid.planner.model import LaneCost
    c = SplitPolicy(2, True, False, lambda: ["ce", "host", "nccl"], {}, None)
    c.adapt, c.digest = False, "t"
    costs = {"nccl": LaneCost(10.0, 320.0), "ce": LaneCost(40.0, 330.0), "host": LaneCost(230.0, 20.0)}
    c.calib = {"all_gather/2": costs}
    c.pays = {"all_gather/2": {20: False, 22: "ce", 24: "ce"}}
    lanes = ["ce", "host", "nccl"]
    want = {1 << 20: "nccl", 3 << 20: "nccl", 4 << 20: "ce", 8 << 20: "ce", 12 << 20: "ce",
            16 << 20: "ce", 31 << 20: "ce", 32 << 20: "nccl", 64 << 20: "nccl"}
    for n, lane in want.items():
        assert c.split_rule("all_gather", costs, n) == {"nccl": 1.0}, n      # the model alone: NCCL
        assert c.shares_for("all_gather", n, lanes) == {lane: 1.0}, n
    # without the copy engines among the lanes (BRAID_LANES), the verdict cannot apply
    assert c.shares_for("all_gather", 8 << 20, ["host", "nccl"]) == {"nccl": 1.0}


def _split_values_worker(rank, w):
    """post_values / read_values with the caller's own work between them (a sleep of a different
    length on every rank and round), in turn with non-waiting posts and descriptor exchanges."""
    import time
    import braid
    comm = braid.init()
    seg = comm.segment
    out = []
    for i in range(30):
        tok = seg.post_values([rank, i, 3 * rank + i])
        time.sleep(((rank * 7 + i * 3) % 5) * 0.0004)
        out.append(seg.read_values(tok, "probe") == [[r, i, 3 * r + i] for r in range(w)])
        if i % 3 == 0:
            got = seg.exchange_values([i], "probe", wait=rank != i % w)
            out.append(got is None if rank == i % w else got == [[i]] * w)
        descs = seg.exchange_collective({"op": "probe", "rank": rank, "i": i}, list(range(w)))
        out.append([d["rank"] for d in descs] == list(range(w)) and {d["i"] for d in descs} == {i})
    braid.close()
    return out


def _small_run_worker(rank, w):
    """The uneven all_to_all's agreement (UnevenAgreement.small) over a scripted sequence of
    each rank's largest demand, with descriptor exchanges where the real call would make them."""
    import braid
    comm = braid.init()
    big_at = {5: 2, 22: 1, 24: 0}          # call -> the rank with a demand over 1 MiB
    out = []
    for i in range(26):
        big = (2 << 20) if big_at.get(i) == rank else 1000 + i
        small = comm.uneven.small(big, "all_to_all_single")
        out.append(small)
        if not small:                       # the general path: a descriptor exchange
            comm.segment.exchange_collective({"op": "probe", "i": i}, list(range(w)))
        if i == 22:                         # another collective between two uneven calls
            descs = comm.segment.exchange_collective({"op": "other", "rank": rank}, list(range(w)))
            out.append([d["rank"] for d in descs] == list(range(w)))
    braid.close()
    return out


def test_small_uneven_calls_read_their_agreement_late_after_a_run():
    """16 small calls in a row, then each call's agreement is read at the next: a large demand in
    that mode runs once as NCCL's whole call on every rank (call 22), and the ranks wait again
    from the next call (23, then 24 sees its large demand at once)."""
    from braid.comm import SMALL_RUN
    assert SMALL_RUN == 16
    res = run_world(_small_run_worker, 3)
    want = [True] * 5 + [False] + [True] * 16 + [True, True] + [True, False, True]   # call 22, then the check
    for rank, out in enumerate(res):
        assert out == want, (rank, out)


def _defer_stress_worker(rank, w):
    """Random large demands (the same script on every rank, from one seed), random host jitter per
    rank, and now and then another collective's descriptor exchange, over 240 uneven calls."""
    import random
    import time
    import braid
    comm = braid.init()
    script = random.Random(7)
    jitter = random.Random(100 + rank)
    out = []
    for i in range(240):
        who = script.randrange(w) if script.random() < 0.04 else None
        other = script.random() < 0.03
        big = (2 << 20) if who == rank else 1000 + i
        small = comm.uneven.small(big, "all_to_all_single")
        out.append(("call", small))
        if not small:
            descs = comm.segment.exchange_collective({"op": "probe", "i": i}, list(range(w)))
            out.append(("desc", {d["i"] for d in descs} == {i}))
        if other:
            descs = comm.segment.exchange_collective({"op": "other", "i": i}, list(range(w)))
            out.append(("desc", {d["i"] for d in descs} == {i}))
        if jitter.random() < 0.2:
            time.sleep(jitter.random() * 0.002)
    braid.close()
    return out


def test_deferred_agreement_under_jitter_keeps_every_rank_in_step():
    """Every rank takes the same decision at every call, whatever the drift between them, and
    every descriptor read is the one posted for that exchange (no slot reused too early)."""
    res = run_world(_defer_stress_worker, 3)
    assert all(out == res[0] for out in res), [sum(1 for a, b in zip(o, res[0]) if a != b) for o in res]
    assert all(ok for kind, ok in res[0] if kind == "desc")
    assert [ok for kind, ok in res[0] if kind == "call"].count(False) >= 3    # large demands seen


def test_values_posted_early_and_read_late_stay_in_step():
    res = run_world(_split_values_worker, 3)
    for rank, out in enumerate(res):
        assert len(out) == 70 and all(out), (rank, out)


def test_exchange_values_agrees_in_rank_order_and_names_a_mismatch():
    w = 3
    res = run_world(_values_worker, w)
    for rank, (out, err) in enumerate(res):
        assert all(out), (rank, out)
        assert err is not None and "different call" in err, (rank, err)


def test_options_for_direct_calls_are_built_once_per_shape():
    """The fast path calls the NCCL backend with torch's own options objects: one per (kind, op,
    root, async), with the reduction, the root and the async flag set as torch.distributed would."""
    from braid.comm.library import LibraryCalls
    c = LibraryCalls(True, None, None, None)
    a = c.opts("allreduce", False, op=dist.ReduceOp.MAX)
    assert a is c.opts("allreduce", False, op=dist.ReduceOp.MAX)
    assert a is not c.opts("allreduce", True, op=dist.ReduceOp.MAX)
    assert a.reduceOp == dist.ReduceOp.MAX
    if hasattr(a, "asyncOp"):
        assert a.asyncOp is False and c.opts("allreduce", True, op=dist.ReduceOp.MAX).asyncOp is True
    b = c.opts("broadcast", False, root=2)
    r = c.opts("reduce", True, op=dist.ReduceOp.SUM, root=1)
    assert (b.rootRank, b.rootTensor) == (2, 0) and (r.rootRank, r.reduceOp) == (1, dist.ReduceOp.SUM)
    assert type(c.opts("alltoall", False)).__name__ == "AllToAllOptions"


def _cpu_fast_worker(rank, w):
    """Small calls on a CPU communicator that gloo takes whole (here: BRAID_LANES=gloo) go to gloo's
    own group through the fast path: each op's answer is cached True, its result equals a reference
    built from every rank's data, and an average (gloo has none) stays on the full path."""
    import braid
    comm = braid.init()
    n = 1001 * w                                   # odd per-rank pieces
    data = [torch.randn(n, generator=torch.Generator().manual_seed(100 + r)) for r in range(w)]
    x = data[rank]
    t = x.clone()
    comm.all_reduce(t)
    ok = [torch.allclose(t, sum(data), atol=1e-5)]
    t = x.clone()
    comm.all_reduce(t, op=dist.ReduceOp.MAX)
    ok.append(torch.equal(t, torch.stack(data).amax(0)))
    t = x.clone()
    comm.broadcast(t, src=w - 1)
    ok.append(torch.equal(t, data[w - 1]))
    out = torch.empty(n * w)
    comm.all_gather_into_tensor(out, x)
    ok.append(torch.equal(out, torch.cat(data)))
    out = torch.empty(n)
    comm.all_to_all_single(out, x)
    piece = n // w
    ok.append(torch.equal(out, torch.cat([d[rank * piece:(rank + 1) * piece] for d in data])))
    out = torch.empty(piece)
    comm.reduce_scatter_tensor(out, x)
    ok.append(torch.allclose(out, sum(data)[rank * piece:(rank + 1) * piece], atol=1e-5))
    t = x.clone()
    comm.all_reduce(t, op=dist.ReduceOp.AVG)
    ok.append(torch.allclose(t, sum(data) / w, atol=1e-5) and comm.shortcuts.ar[n][-1] is False)
    cached = [True, comm.shortcuts.bc[n][-1], comm.shortcuts.ag[n][-1], comm.shortcuts.a2a[n][-1],
              comm.shortcuts.rs[n][-1]]
    # a ring of large async sends and receives posted before a fast collective: neither stalls
    # the other, and every byte arrives
    m = 1 << 20
    src = torch.full((m,), float(rank) + 0.25)
    got = torch.empty(m)
    hs = [comm.send(src, (rank + 1) % w, async_op=True), comm.recv(got, (rank - 1) % w, async_op=True)]
    t = x.clone()
    comm.all_reduce(t)
    ok.append(torch.allclose(t, sum(data), atol=1e-5) and comm.shortcuts.ar[n][-1] is True)
    for h in hs:
        if h is not None:
            h.wait()
    ok.append(torch.equal(got, torch.full((m,), float((rank - 1) % w) + 0.25)))
    return ok, cached


def test_small_cpu_calls_take_gloos_own_call():
    for ok, cached in run_world(_cpu_fast_worker, 3, env={"BRAID_LANES": "gloo"}):
        assert all(ok), ok
        assert all(cached), cached


@pytest.mark.parametrize("split_us, margin, want", [(1020.0, None, "ce"), (990.0, None, "split"), (1300.0, None, "ce"),
                                                     (1020.0, "0", "split"), (990.0, "10", "ce")])
def test_a_split_must_beat_the_fastest_lane_by_the_margin(monkeypatch, split_us, margin, want):
    """split_pays: a split over several lanes that measured within SPLIT_MARGIN (5%,
    BRAID_SPLIT_MARGIN_PCT) of the fastest single lane (here the copy engines, 1050 us) leaves the
    call to that lane; beyond it, the split's balanced shares are the verdict."""
    import contextlib
    from braid import calibrate, workloads
    from braid.planner.model import LaneCost

    class FakeComm:
        cuda, now, last_handle = True, None, None

        def split_rule(self, op, costs, n):
            return {"ce": 0.9, "host": 0.1}

        @contextlib.contextmanager
        def fixed_shares(self, shares, timed=False):
            self.now = dict(shares)
            yield

    class Load:
        participates = True

        def __init__(self, n):
            self.nbytes, self.braid = n, lambda: None

    if margin is not None:
        monkeypatch.setenv("BRAID_SPLIT_MARGIN_PCT", margin)
    comm = FakeComm()
    alone = {"nccl": 1400.0, "ce": 1050.0}
    monkeypatch.setattr(calibrate, "time_call",
                        lambda c, fn, iters, warm: split_us if len(c.now) > 1 else alone[next(iter(c.now))])
    monkeypatch.setattr(calibrate, "_max_over_ranks", lambda c, values: values)
    monkeypatch.setattr(workloads, "make", lambda c, op, n, dt: Load(n))
    costs = {"nccl": LaneCost(10.0, 1000.0), "ce": LaneCost(50.0, 1000.0), "host": LaneCost(200.0, 100.0)}
    got = calibrate.split_pays(comm, "reduce_scatter", costs)
    assert got and all((v == "ce") if want == "ce" else isinstance(v, dict) for v in got.values()), got
