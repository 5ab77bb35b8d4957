"""The whole-or-split trial of a call shape inside a job (braid.comm.arbiter): the job's period
found in its first whole calls, its schedule (warm-up, the period's search, the quick pair, the
probe pair's rest, paired blocks of whole periods), its agreed verdict (the slowest rank's pace
decides), ties going to the native library, trials again later, every rank answering alike at
every call, and every clock mark given back once."""
import math
import random
import re
import threading
import types
from types import SimpleNamespace

import pytest

from braid.comm import arbiter as A
from braid.comm.communicator import Communicator
from braid.comm.shortcuts import Shortcuts

KEY = ("ag", 1 << 20, "bf16")


class Clock:
    """A fake clock that each call of the job advances by the pace of the mode it ran in."""

    def __init__(self):
        self.t = 1.0

    def __call__(self):
        return self.t


class Seen(list):
    """The values this rank gave at each exchange; `at`: the call (of the shape) of each."""

    def __init__(self):
        super().__init__()
        self.at = []


def run_job(split_us, whole_us, calls, peer=None, enabled=True, clock=None, extra=None, job=None,
            spy=None, key=KEY, **kw):
    """One rank's calls of one shape; the job spends split_us / whole_us between calls depending
    on the mode of the call (extra(i) more seconds after call i), or job(i, answers) seconds
    after call i where given. `peer`: a second rank's values at each exchange (a list, or a
    function of this rank's values). `spy(arb)` sees the arbiter before its first call; kw go to
    the Arbiter (block, log, builds). Returns (answers, arbiter, exchanges)."""
    clock = clock or Clock()
    seen = Seen()
    answers = []

    def exchange(values):
        seen.append(list(values))
        seen.at.append(len(answers))
        theirs = peer(values) if callable(peer) else peer
        return [list(values)] + ([list(theirs)] if theirs is not None else [])
    arb = A.Arbiter(exchange, enabled=enabled, clock=clock, **kw)
    if spy is not None:
        spy(arb)
    for i in range(calls):
        whole = arb.whole(key)
        answers.append(whole)
        if job is not None:
            clock.t += job(i, answers)
        else:
            clock.t += (whole_us if whole else split_us) * 1e-6
        clock.t += extra(i) if extra else 0.0
    return answers, arb, seen


def whole_periods(calls, period):
    return period * -(-calls // period)


def timed_modes(pairs, trial=1, period=1, block=A.BLOCK):
    """The answers (True: whole) of a trial's timed blocks, from the call that opens them: the
    quick pair, the probe pair's rest (split first in the first trial, then every other one),
    then `pairs` pairs in ORDER's order; every block a whole number of periods (the rest's two
    at least where the job has a period)."""
    q, r, length = whole_periods(A.QUICK, period), A._rest(period), whole_periods(block, period)

    def pair(n, split_first):
        return [not split_first] * n + [split_first] * n
    split_first = trial % 2 == 1
    out = pair(q, split_first) + pair(r, split_first)
    for p in range(pairs):
        out += pair(length, bool((A.ORDER >> (p % 16)) & 1))
    return out


# a job of period 1 (every interval alike), first trial:
SEG0 = A.WARM + A.DETECT + 1                    # the timed blocks open right after the period's search
PAIRS0 = SEG0 + 2 * (A.QUICK + A.REST)          # the first paired block
# the first agreement with MIN_PAIRS kept pairs (pair 0 warms up and is left out): pair 8
EARLIEST = A.CHECK * -(-(A.MIN_PAIRS + 1) // A.CHECK)
VERDICT = PAIRS0 + EARLIEST * 2 * A.BLOCK       # the first call of pair EARLIEST: the earliest verdict


def step_job(period, opens, host, comm, base=2000.0, noise=None):
    """A model job whose step holds `period` calls of the shape, the step's first at a call index
    that is `opens` modulo the period. After call i the job spends the call's host cost
    (host[whole]); after a step's last call, the step's other work (base) and its communication,
    which waits for all the step's calls (the sum of comm[whole] over them): the split's gain or
    loss shows only in the interval at the step's boundary. noise(i): a factor on each interval.
    Returns job(i, answers) for run_job, in seconds."""
    def job(i, answers):
        us = host[answers[i]]
        if (i + 1) % period == opens % period:
            us += base + sum(comm[w] for w in answers[max(0, i - period + 1):i + 1])
        return us * (noise(i) if noise else 1.0) * 1e-6
    return job


def test_schedule_warm_detect_probe_then_paired_blocks_then_the_verdict():
    got, arb, seen = run_job(100.0, 130.0, VERDICT + 50)
    assert got[:A.WARM] == [False] * A.WARM                           # warm-up: split
    assert got[A.WARM:SEG0] == [True] * (A.DETECT + 1)                # the period's search: whole
    assert got[SEG0:VERDICT] == timed_modes(EARLIEST)                 # quick, rest, pairs in ORDER's order
    assert sum(got[PAIRS0:VERDICT]) == EARLIEST * A.BLOCK             # as many whole calls as split
    assert got[VERDICT:] == [False] * 50                              # split kept: faster
    st = arb._shapes[KEY]
    assert (st.period, st.seg0, st.start) == (1, SEG0, VERDICT + 1)
    # the period's exchange, the quick pair's, the probe's, the pairs' agreements (pairs 4 and 8)
    assert seen.at == [SEG0 - 1, SEG0 + 2 * A.QUICK, PAIRS0, PAIRS0 + A.CHECK * 2 * A.BLOCK, VERDICT]
    assert seen[0] == [1, 0]
    # kept pairs at each agreement: pair 0 (the split's warm-up) is left out, so 3, not 4, at pair 4
    assert [v[0] for v in seen[3:]] == [A.CHECK - 1, EARLIEST - 1]
    assert len(arb.decisions) == 1
    _, split_us, whole_us, whole, _ = arb.decisions[0]
    assert split_us == pytest.approx(100.0, abs=0.2) and whole_us == pytest.approx(130.0, abs=0.2)
    assert whole is False


def test_a_periodic_job_times_whole_steps():
    """A step of 8 calls whose first call is at index 3 (mod 8). The split costs more host time
    per call (60 us against 50) but its calls' communication is shorter (100 us against 130),
    which shows only at the step's boundary: blocks of whole steps, opening at a step's first
    call, see the step 5% faster and keep the split."""
    P, opens = 8, 3
    q, r, length = whole_periods(A.QUICK, P), A._rest(P), whole_periods(A.BLOCK, P)
    assert (q, r, length) == (8, 16, 16)          # one step, two, and the block's 12 calls as 2 steps
    job = step_job(P, opens, host={False: 60.0, True: 50.0}, comm={False: 100.0, True: 130.0})
    seg0 = SEG0 + (opens - SEG0) % P                  # the first step's first call after the search
    verdict = seg0 + 2 * (q + r) + EARLIEST * 2 * length
    got, arb, seen = run_job(0.0, 0.0, verdict + 20, job=job)
    st = arb._shapes[KEY]
    assert seen[0] == [P, opens] and st.period == P and st.seg0 == seg0 and seg0 % P == opens
    assert got[A.WARM:seg0] == [True] * (seg0 - A.WARM)              # whole up to a step's first call
    assert got[seg0:verdict] == timed_modes(EARLIEST, period=P)
    assert seen.at[1:] == [seg0 + 2 * q, seg0 + 2 * (q + r), verdict - A.CHECK * 2 * length, verdict]
    assert got[verdict:] == [False] * 20
    _, split_us, whole_us, whole, _ = arb.decisions[0]
    assert whole is False
    assert split_us == pytest.approx((P * 60 + 2000 + P * 100) / P, abs=0.2)     # 410 us a call
    assert whole_us == pytest.approx((P * 50 + 2000 + P * 130) / P, abs=0.2)     # 430 us a call
    # the same job where the split lengthens the step's boundary: whole (at the probe: 15%)
    job = step_job(P, opens, host={False: 50.0, True: 50.0}, comm={False: 160.0, True: 100.0})
    assert A.EARLY < (P * 60.0 / (2000 + P * 150.0)) < A.QUICK_BAR
    got, arb, seen = run_job(0.0, 0.0, verdict, job=job)
    assert arb.decisions[0][3] is True and len(seen) == 3
    assert got[seg0 + 2 * (q + r):] == [True] * (verdict - seg0 - 2 * (q + r))
    assert got.count(False) == A.WARM + q + r
    # and one that loses more than the quick pair's bar: whole after WARM + q split calls
    job = step_job(P, opens, host={False: 50.0, True: 50.0}, comm={False: 400.0, True: 100.0})
    got, arb, seen = run_job(0.0, 0.0, verdict, job=job)
    assert arb.decisions[0][3] is True and len(seen) == 2 and got.count(False) == A.WARM + q


def test_blocks_of_whole_steps_see_no_difference_where_there_is_none(monkeypatch):
    """A step of 8 calls whose split and whole calls cost the same: blocks of whole steps (16
    calls) hold as many step boundaries each, every pair's log ratio is 0, and ties go whole.
    Blocks of 12 calls out of step with the job (the period's search made to find nothing)
    hold one boundary in one block of a pair and two in the other: each pair's ratio is far from
    0 whatever its modes, the difference that sent DDP's buckets wrong."""
    job = step_job(8, 5, host={False: 50.0, True: 50.0}, comm={False: 100.0, True: 100.0})
    kept = []

    def spy(arb):
        agree = arb._agree

        def recorded(key, st, pairs):
            kept.append(list(st.logs))
            agree(key, st, pairs)
        arb._agree = recorded
    _, arb, _ = run_job(0.0, 0.0, 800, job=job, spy=spy)
    assert arb._shapes[KEY].period == 8 and kept[-1]
    assert all(abs(x) < 1e-9 for x in kept[-1])
    assert arb.decisions[0][3] is True                                # a tie: whole
    kept.clear()
    monkeypatch.setattr(A, "find_period", lambda xs, max_period=A.MAX_PERIOD: (1, 0))
    _, arb, _ = run_job(0.0, 0.0, 800, job=job, spy=spy, block=12)
    assert arb._shapes[KEY].period == 1 and kept and kept[0]
    assert all(abs(x) > 0.3 for x in kept[0])


def test_each_trial_searches_the_period_again():
    """The job's period changes between trials: the next trial finds the new one."""
    jobs = [step_job(8, 0, {False: 50.0, True: 50.0}, {False: 100.0, True: 150.0}),
            step_job(4, 1, {False: 50.0, True: 50.0}, {False: 100.0, True: 150.0})]
    arb_ref = []

    def job(i, answers):
        return jobs[min(arb_ref[0]._shapes[KEY].trials, 1)](i, answers)
    periods = []

    def spy(arb):
        arb_ref.append(arb)
        find = arb._find_period

        def recorded(key, st, i):
            find(key, st, i)
            periods.append((st.period, st.seg0 % st.period, st.seg0 - i))
        arb._find_period = recorded
    _, arb, _ = run_job(0.0, 0.0, 2 * VERDICT + A.REPROBE + 200, job=job, spy=spy)
    assert [p[:2] for p in periods] == [(8, 0), (4, 1)]
    assert all(1 <= ahead <= p for p, _, ahead in periods)          # the next step's first call
    assert [d[3] for d in arb.decisions] == [False, False]


def test_the_whole_call_wins_when_the_split_slows_the_job():
    got, arb, seen = run_job(124.0, 100.0, VERDICT + 10)
    assert got[VERDICT:] == [True] * 10 and arb.decisions[0][3] is True
    # 24% slower, under the quick pair's bar: the probe saw it, whole after WARM + QUICK + REST
    # split calls and the probe's agreement
    assert got[:PAIRS0] == [False] * A.WARM + [True] * (A.DETECT + 1) + timed_modes(0)
    assert got[PAIRS0:] == [True] * (VERDICT + 10 - PAIRS0)
    assert len(seen) == 3 and seen.at[-1] == PAIRS0 and got.count(False) == A.WARM + A.QUICK + A.REST


def test_a_split_that_loses_by_more_than_the_quick_bar_goes_whole_after_the_quick_pair():
    slower = 100.0 * (1 + 2 * A.QUICK_BAR)
    got, arb, seen = run_job(slower, 100.0, VERDICT)
    quick_end = SEG0 + 2 * A.QUICK
    assert got[SEG0:quick_end] == timed_modes(0)[:2 * A.QUICK] and got[quick_end:] == [True] * (VERDICT - quick_end)
    assert len(seen) == 2 and seen.at[-1] == quick_end and got.count(False) == A.WARM + A.QUICK
    _, split_us, whole_us, whole, _ = arb.decisions[0]
    assert whole is True and split_us == pytest.approx(slower, abs=0.2) and whole_us == pytest.approx(100.0, abs=0.2)
    # a split that loses by less goes on to the rest of the probe
    got, _, seen = run_job(100.0 * (1 + A.QUICK_BAR / 2), 100.0, PAIRS0)
    assert got[quick_end:PAIRS0] == timed_modes(0)[2 * A.QUICK:] and len(seen) == 2


def test_a_split_a_little_slower_than_the_probes_bar_is_left_to_the_pairs():
    slower = 100.0 * (1 + A.EARLY / 2)
    got, arb, seen = run_job(slower, 100.0, VERDICT + 1)
    assert got[SEG0:VERDICT] == timed_modes(EARLIEST) and len(seen) == 5
    assert arb.decisions[0][3] is True and got[-1] is True


def test_the_probe_pools_both_parts_by_their_calls():
    """The split slower than the whole call by 0.8 x EARLY (under the probe's bar), but slower
    by more in the quick pair (a late call there, under the quick pair's bar): the probe pools
    both parts' paces by their calls, 1.2 x EARLY slower, and goes whole."""
    q, r = A.QUICK, A.REST
    rest, pooled = 100.0 * (1 + 0.8 * A.EARLY), 100.0 * (1 + 1.2 * A.EARLY)
    quick = ((q + r) * pooled - r * rest) / q                      # the quick pair's split pace
    assert quick < 100.0 * (1 + A.QUICK_BAR)
    late = q * (quick - rest)
    got, arb, seen = run_job(rest, 100.0, PAIRS0 + 1, extra=lambda i: late * 1e-6 if i == SEG0 else 0.0)
    assert seen.at[-1] == PAIRS0 and arb.decisions[0][3] is True
    _, split_us, whole_us, _, _ = arb.decisions[0]
    assert split_us == pytest.approx(pooled, abs=0.2) and whole_us == pytest.approx(100.0, abs=0.2)
    got, arb, seen = run_job(rest, 100.0, PAIRS0 + 1)                # the rest's pace alone: on to the pairs
    assert arb.decisions == [] and got[PAIRS0] == timed_modes(1)[2 * (q + r)]


def test_one_rank_that_saw_the_split_lose_in_the_probe_sends_every_rank_whole():
    """This rank saw the split 10% faster in the probe; its peer 1.5 x EARLY slower (under the
    quick pair's bar, over the probe's): whole at the probe's agreement."""
    loss = 1.5 * A.EARLY
    assert loss < A.QUICK_BAR
    theirs = [1, A._OFF + int(1e6 * -math.log1p(loss)), 0, int(1e7 * 100e-6 * (1 + loss)), int(1e7 * 100e-6)]
    got, arb, seen = run_job(90.0, 100.0, PAIRS0 + 5, peer=lambda mine: mine if len(mine) == 2 else theirs)
    assert len(seen) == 3 and arb.decisions[0][3] is True and got[PAIRS0:] == [True] * 5


def test_a_tie_or_a_gain_under_the_margin_goes_whole():
    for split in (100.0, 100.0 * (1 - A.MARGIN / 2)):
        got, arb, seen = run_job(split, 100.0, VERDICT + 1)
        assert got[-1] is True and arb.decisions[0][3] is True and seen.at[-1] == VERDICT, split
    got, arb, _ = run_job(100.0 * (1 - 2 * A.MARGIN), 100.0, VERDICT + 1)      # a gain over the margin
    assert got[-1] is False and arb.decisions[0][3] is False


def after_probe(values):
    """A peer that found this rank's period, saw no difference in the probe, then `values`."""
    def peer(mine):
        if len(mine) == 2:
            return mine
        if mine[0] == 1 and mine[2] == 0:
            return [1, A._OFF, 0, mine[3], mine[3]]
        return values
    return peer


def test_every_rank_must_see_the_gain():
    """This rank saw the split 10% faster; its peer, level in the probe, saw it 10% slower in the
    pairs: whole."""
    peer = after_probe([A.CHECK, A._OFF + int(1e6 * math.log(0.9)), 0, int(1e7 * 110e-6), int(1e7 * 100e-6)])
    got, arb, seen = run_job(90.0, 100.0, VERDICT + 1, peer=peer)
    _, split_us, whole_us, whole, _ = arb.decisions[0]
    assert (split_us, whole_us) == (pytest.approx(110.0, abs=0.2), pytest.approx(100.0, abs=0.2))
    assert whole is True and got[-1] is True and seen.at[-1] == VERDICT
    assert seen[-1][0] == EARLIEST - 1 and seen[-1][3] == pytest.approx(900, abs=2)   # its own pace, 0.1 us


def test_a_peer_with_too_few_pairs_delays_the_verdict():
    peer = [1, A._OFF + int(1e6 * 0.2), 0, 900, 1000]         # the peer kept one pair only
    got, arb, seen = run_job(90.0, 100.0, VERDICT + 2 * A.BLOCK, peer=lambda mine: mine if len(mine) == 2 else peer)
    assert arb.decisions == [] and len(seen) == 5             # the period, the probe's two, two of the pairs': no verdict
    assert seen[-1][0] == EARLIEST - 1                        # while this rank had enough


def test_no_verdict_after_max_pairs_goes_whole():
    peer = [1, A._OFF, 0, 1000, 1000]                         # a peer that never has enough pairs
    calls = PAIRS0 + A.MAX_PAIRS * 2 * A.BLOCK
    got, arb, seen = run_job(50.0, 100.0, calls + 5, peer=lambda mine: mine if len(mine) == 2 else peer)
    assert len(seen) == 3 + A.MAX_PAIRS // A.CHECK and seen.at[-1] == calls
    assert arb.decisions[0][3] is True and got[calls:] == [True] * 5
    assert got[SEG0:calls] == timed_modes(A.MAX_PAIRS)                 # every pair ran


def test_trials_repeat_and_can_change_the_verdict():
    clock = Clock()
    pace = {"split": 90.0, "whole": 100.0}
    arb = A.Arbiter(lambda values: [list(values)], clock=clock)
    answers = []
    start = VERDICT + 1 + A.REPROBE         # the second trial
    total = start + SEG0 + 2 * A.QUICK + 50
    for i in range(total):
        if i == start:                      # the job changes: now the split slows it
            pace = {"split": 150.0, "whole": 100.0}
        w = arb.whole("k")
        answers.append(w)
        clock.t += pace["whole" if w else "split"] * 1e-6
    assert [d[3] for d in arb.decisions] == [False, True]
    assert answers[VERDICT:start] == [False] * (start - VERDICT)      # the first verdict: split
    # the second trial: warm-up, the period's search in the last verdict's mode (split), its
    # quick pair (whole block first) sees the split lose
    quick_end = start + SEG0 + 2 * A.QUICK
    assert answers[start:start + A.WARM] == [False] * A.WARM
    assert answers[start + A.WARM:start + SEG0] == [False] * (A.DETECT + 1)
    assert answers[start + SEG0:quick_end] == timed_modes(0, trial=2)[:2 * A.QUICK]
    assert answers[start + SEG0] is True
    assert answers[quick_end:] == [True] * (total - quick_end)


def test_disabled_never_goes_whole_and_never_exchanges():
    got, arb, seen = run_job(200.0, 100.0, VERDICT + 20, enabled=False)
    assert not any(got) and seen == [] and arb.decisions == [] and not arb.trying()


def test_ranks_answer_alike_at_every_call(monkeypatch):
    """Two ranks with different paces, different noise and different periods found in their
    own calls (rank 0: steps of 8 calls, rank 1: a pattern of 4), and a real exchange between
    threads: both take rank 0's period and step, and at every call both give the same answer
    (the verdict is taken at the same call from the same agreed numbers)."""
    found: dict = {}
    find = A.find_period

    def recorded(xs, max_period=A.MAX_PERIOD):
        found.setdefault(threading.current_thread().name, []).append(find(xs, max_period))
        return found[threading.current_thread().name][-1]
    monkeypatch.setattr(A, "find_period", recorded)
    calls = 2 * 700 + A.REPROBE
    board: dict = {}
    barrier = threading.Barrier(2)
    out: dict = {}

    def rank(r, job):
        k = [0]

        def exchange(values):
            k[0] += 1
            board[(k[0], r)] = list(values)
            barrier.wait(timeout=10)
            got = [board[(k[0], q)] for q in (0, 1)]
            barrier.wait(timeout=10)
            return got
        clock = Clock()
        arb = A.Arbiter(exchange, clock=clock)
        ans = []
        for i in range(calls):
            ans.append(arb.whole(("rs", 7)))
            clock.t += job(i, ans)
        out[r] = (ans, arb.decisions, arb._shapes[("rs", 7)])
    rng0, rng1 = random.Random(1), random.Random(2)
    job0 = step_job(8, 6, {False: 40.0, True: 50.0}, {False: 80.0, True: 100.0},
                    noise=lambda i: rng0.uniform(0.97, 1.03))
    job1 = step_job(4, 1, {False: 50.0, True: 50.0}, {False: 120.0, True: 100.0}, base=1000.0,
                    noise=lambda i: rng1.uniform(0.9, 1.1))
    threads = [threading.Thread(target=rank, args=(0, job0), name="rank0"),
               threading.Thread(target=rank, args=(1, job1), name="rank1")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert set(out) == {0, 1}
    assert found["rank0"][0] == (8, (6 - A.WARM - 1) % 8) and found["rank1"][0][0] == 4       # each rank's own period
    assert out[0][2].period == out[1][2].period == 8                       # rank 0's, on both
    assert out[0][2].seg0 == out[1][2].seg0
    assert out[0][0] == out[1][0]
    assert [d[1:] for d in out[0][1]] == [d[1:] for d in out[1][1]]
    assert len(out[0][1]) == 2 and all(d[3] is True for d in out[0][1])   # rank 1 sees the split lose


def test_a_pause_inside_a_block_does_not_decide_the_trial():
    # the split is 10% faster per call, but one split block holds a pause (another model's
    # window, an evaluation) of 400 ms: its pair is left out and the split still wins
    assert not (A.ORDER >> 1) & 1                   # pair 1 runs its whole block first
    pause_at = PAIRS0 + 2 * A.BLOCK + A.BLOCK + 3   # inside pair 1's split block
    got, arb, seen = run_job(1000.0, 1100.0, VERDICT + 1, extra=lambda i: 0.4 if i == pause_at else 0.0)
    assert got[pause_at] is False
    key, split_us, whole_us, went_whole, _ = arb.decisions[-1]
    assert not went_whole and split_us == pytest.approx(1000, rel=1e-3) and whole_us == pytest.approx(1100, rel=1e-3)
    assert seen.at[-1] == VERDICT and seen[-1][0] == EARLIEST - 2     # pairs 0 and 1 left out


def _noisy_job(gain, seed, period=0, cap=3000):
    """A job whose pace varies +-20% from call to call (and, with period, a step pattern of
    `period` calls: half fast, half three times slower); the split changes the pace by `gain`.
    Runs to its first verdict."""
    rng = random.Random(seed)
    clock = Clock()
    arb = A.Arbiter(lambda v: [list(v)], clock=clock)
    for i in range(cap):
        w = arb.whole("k")
        base = 100.0 * (3.0 if period and (i % period) >= period // 2 else 1.0)
        clock.t += base * (1.0 if w else 1.0 - gain) * rng.uniform(0.8, 1.2) * 1e-6
        if arb.decisions:
            break
    return arb.decisions, arb._shapes["k"].period


def test_noise_without_a_gain_never_keeps_the_split():
    for seed in range(20):
        for period in (0, 2 * A.BLOCK, 18):
            d, found = _noisy_job(0.0, seed, period=period)
            assert d and d[0][3] is True, (seed, period)
            assert found == (period or 1), (seed, period)


def test_a_clear_gain_in_noise_keeps_the_split():
    kept = [(_noisy_job(0.15, seed)[0] or [(0, 0, 0, True)])[0][3] is False for seed in range(20)]
    assert all(kept)


class _Path(Communicator):
    """The part of a communicator that says whether its calls take part in trials."""

    def __init__(self, enabled, check=False):
        self._arbiter = A.Arbiter(lambda v: [v], enabled=enabled)
        from braid.comm.policy import SplitPolicy
        self.check = check
        self.policy = SplitPolicy(2, False, check, lambda: ["gloo"], {}, None)
        self.cleared = 0
        self._prepared = type("P", (), {"clear": lambda _self: None})()
        path = self

        class _Shortcuts:
            learn = False

            def clear(self):
                path.cleared += 1
        self.shortcuts = _Shortcuts()
        self._learn_update()

    @property
    def _learn_split(self):
        return self.shortcuts.learn


def test_fixed_shares_check_mode_and_the_op_sweep_keep_the_calibrations_verdict():
    p = _Path(enabled=True)
    assert p._learn_split
    with p.fixed_shares({"ce": 1.0}):
        assert not p._learn_split              # the calibration and --shares time what they fix
    assert p._learn_split
    with p.fixed_shares(None), p.calibrated_verdict():
        assert not p._learn_split and not p._arbiter.enabled
    assert p._learn_split and p._arbiter.enabled
    assert not _Path(enabled=True, check=True)._learn_split
    q = _Path(enabled=False)                   # BRAID_LEARN_SPLIT=0: the block does not turn it on
    with q.calibrated_verdict():
        pass
    assert not q._learn_split and not q._arbiter.enabled


def test_verdicts_kept_are_bounded_in_a_long_job():
    arb = A.Arbiter(lambda v: [list(v)], clock=Clock())
    for i in range(3 * A.KEPT + 5):
        arb._agree(("k", i), A._Shape(logs=[0.5] * A.MIN_PAIRS), A.CHECK)
    assert arb.count == 3 * A.KEPT + 5
    assert A.KEPT <= len(arb.decisions) <= 2 * A.KEPT
    assert arb.decisions[-1][0] == ("k", 3 * A.KEPT + 4)


def test_trying_while_a_trial_has_no_verdict():
    clock = Clock()
    arb = A.Arbiter(lambda values: [list(values)], clock=clock)
    assert not arb.trying()                                   # no shape yet
    calls = 0
    while arb.count == 0:
        whole = arb.whole(KEY)
        clock.t += (100.0 if whole else 130.0) * 1e-6
        calls += 1
        assert arb.trying() or arb.count == 1
        assert calls <= PAIRS0 + A.MAX_PAIRS * 2 * A.BLOCK + 1
    assert not arb.trying()                                   # the verdict: whole
    for _ in range(A.REPROBE):
        arb.whole(KEY)
    assert not arb.trying()
    arb.whole(KEY)
    assert arb.trying()                                       # the trial runs again
    assert not A.Arbiter(lambda v: [list(v)], enabled=False).trying()


def op_asks(p, n):
    """all_gather_into_tensor's own question (communicator.py) for a float32 input of n elements."""
    import torch
    return p.shortcuts.decide("ag", n, (torch.float32, 2 * n), lambda: (True, "all_gather", 4 * n, ("ag", n, torch.float32)))


def test_the_backend_asks_first_each_call_counts_once_and_whole_calls_are_forwarded():
    """Under init_process_group("braid") the backend asks (whole_all_gather) before the op's own
    path: a whole answer forwards the call to NCCL's own; a split answer is the op path's answer
    for the same call, not a second count. The answers match an arbiter asked once per call."""
    import torch
    clock, ref_clock = Clock(), Clock()

    class P(_Path):
        cuda, world_size = False, 2
        _faults = SimpleNamespace(closed=False, aborted="")     # open: the fast path's answers apply

        def __init__(self):
            super().__init__(enabled=True)
            self._arbiter = A.Arbiter(lambda v: [list(v)], clock=clock)
            self.shortcuts = Shortcuts(lambda name, nbytes: False, self._arbiter, lambda: True)
            self._learn_update()

    p = P()
    ref = A.Arbiter(lambda v: [list(v)], clock=ref_clock)
    inp, out = torch.zeros(8), torch.zeros(16)
    assert not p.whole_all_gather(out, inp)            # a shape not seen yet: the op's path decides
    p.shortcuts.ag[8] = (torch.float32, 16, False)     # the calibration splits this shape
    forwarded, said = 0, []
    for _ in range(VERDICT + 30):
        if p.whole_all_gather(out, inp):
            forwarded += 1
            whole = True
        else:
            whole = op_asks(p, 8)                               # the op's own path, same call
        want = ref.whole(("ag", 8, torch.float32))
        said.append(whole)
        assert whole == want
        for c in (clock, ref_clock):
            c.t += (150e-6 if not whole else 100e-6)            # split is slower in this job
    assert forwarded == said.count(True) and forwarded > 0 and said.count(False) > 0
    assert p._arbiter._shapes[("ag", 8, torch.float32)].n == len(said)    # one count per call
    assert ref.decisions and ref.decisions[-1][3] is True and said[-1] is True   # went whole
    # another shape's pending answer is not taken for this one
    p.shortcuts.said = ("ag", 4, torch.float32)
    n = p._arbiter._shapes[("ag", 8, torch.float32)].n
    op_asks(p, 8)
    assert p._arbiter._shapes[("ag", 8, torch.float32)].n == n + 1 and p.shortcuts.said is None


def _trial_starts(answers_len_limit, pace):
    """Call numbers where a trial began (its first warm-up split after a whole verdict), for a job
    whose split is slower (pace: us per call by mode)."""
    clock = Clock()
    arb = A.Arbiter(lambda values: [list(values)], clock=clock)
    starts = []
    for i in range(answers_len_limit):
        trying_before = arb._shapes.get("k") is not None and arb._shapes["k"].trying
        w = arb.whole("k")
        if arb._shapes["k"].trying and not trying_before:
            starts.append(i)
        clock.t += pace["whole" if w else "split"] * 1e-6
    return starts, arb


def test_a_verdict_that_repeats_is_looked_at_less_often():
    # a split a little slower than the probe's bar: the paired blocks decide, whole every time
    starts, arb = _trial_starts(60_000, {"split": 100.0 * (1 + A.EARLY / 2), "whole": 100.0})
    verdicts = [d[3] for d in arb.decisions]
    assert verdicts and all(verdicts)                        # whole every time
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    # each gap: the trial's own calls (to the verdict at pair 8) plus the interval, which
    # doubles after a repeated verdict
    assert len(gaps) >= 3
    assert gaps[0] == VERDICT + 1 + A.REPROBE
    assert gaps[1] - gaps[0] == A.REPROBE and gaps[2] - gaps[1] == 2 * A.REPROBE
    assert arb._shapes["k"].reprobe <= A.REPROBE_MAX


def test_the_probes_verdicts_keep_the_first_interval():
    """A split that loses clearly goes whole at every quick pair: each trial costs WARM + QUICK
    split calls, and the next one comes REPROBE calls later, never later than that."""
    starts, arb = _trial_starts(40_000, {"split": 150.0, "whole": 100.0})
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert len(gaps) >= 5 and set(gaps) == {SEG0 + 2 * A.QUICK + 1 + A.REPROBE}
    assert all(d[3] and d[4] == "probe" for d in arb.decisions) and arb._shapes["k"].verdicts == 0


@pytest.mark.parametrize("loss", [0.05, 0.07, 0.1, 0.15, 0.25, 0.3, 0.5, 0.75, 1.0])
def test_a_losing_split_costs_little_in_any_hundred_calls(loss):
    """A split slower than the probe's bar costs a trial WARM + QUICK + REST split calls (WARM +
    QUICK beyond the quick pair's bar), so that any 100 calls pay at most that many calls' loss
    (at most 3% for a split up to twice as slow; the period's search lies between the warm-up
    call and the timed blocks) and a long job far less. Under the probe's bar the paired blocks
    decide, at pair 8. The model clock's answers, call for call, give trial_cost's numbers."""
    calls = 3 * A.REPROBE
    worst, overall = A.trial_cost(100.0 * (1 + loss), 100.0, calls)
    if loss > A.QUICK_BAR:
        timed, full = 2 * A.QUICK, False
    elif loss > A.EARLY:
        timed, full = 2 * (A.QUICK + A.REST), False
    else:
        timed, full = VERDICT - SEG0, True
    answers, trial, reprobe = [], 0, A.REPROBE
    while len(answers) < calls:             # the job's answers: trials, each whole from its verdict
        trial += 1
        answers += [False] * A.WARM + [True] * (SEG0 - A.WARM) + timed_modes(A.MAX_PAIRS, trial)[:timed]
        if full and trial > 1:              # a full verdict repeated: the interval doubles
            reprobe = min(2 * reprobe, A.REPROBE_MAX)
        answers += [True] * (1 + reprobe)   # the verdict's call, then the interval
    answers = answers[:calls]
    in_window = max(answers[s:s + 100].count(False) for s in range(calls - 100))
    assert worst == pytest.approx(in_window * loss / 100, rel=1e-6)
    assert overall == pytest.approx(answers.count(False) * loss / calls, rel=1e-6)
    if loss > A.EARLY:
        per_trial = A.WARM + A.QUICK + (A.REST if loss <= A.QUICK_BAR else 0)
        assert answers.count(False) == trial * per_trial
        assert in_window == per_trial - (A.WARM if loss <= A.QUICK_BAR else 0)   # the warm-up call falls out
        assert worst <= 0.03 + 1e-9
    assert overall < 0.002


def test_a_changed_verdict_brings_the_first_interval_back():
    clock = Clock()
    arb = A.Arbiter(lambda values: [list(values)], clock=clock)
    pace = {"split": 150.0, "whole": 100.0}
    i = 0
    while len(arb.decisions) < 3:
        if len(arb.decisions) == 2:
            pace = {"split": 60.0, "whole": 100.0}          # the job changed: the split wins now
        w = arb.whole("k")
        clock.t += pace["whole" if w else "split"] * 1e-6
        i += 1
        assert i < 100_000
    assert [d[3] for d in arb.decisions] == [True, True, False]
    assert arb._shapes["k"].reprobe == A.REPROBE


def test_a_shape_not_called_any_more_is_not_a_trial_under_way():
    clock = Clock()
    arb = A.Arbiter(lambda values: [list(values)], clock=clock)
    for _ in range(3):                      # a set-up call's shape: its trial never finishes
        arb.whole("setup")
    assert arb.trying()
    key = "step"
    for _ in range(A.STALE + 1):            # the job's own shape, settled quickly
        w = arb.whole(key)
        clock.t += (100.0 if w else 150.0) * 1e-6
    assert arb._shapes["setup"].trying and arb.count >= 1
    assert not arb.trying()                 # the set-up shape's trial is stale
    arb.whole("setup")                      # called again: under way again
    assert arb.trying()


def test_a_shape_called_once_stops_holding_trying_soon():
    """A shape called once (a set-up call) is under way for ONCE calls of other shapes, not STALE:
    the bench's warm-up steps wait for the job's own trials, not for DDP's first broadcasts."""
    arb = A.Arbiter(lambda values: [list(values)], clock=Clock())
    arb.whole("setup")
    for _ in range(3):
        arb.whole("step")                   # the job's shape: under way
    arb._shapes["step"].trying = False      # (its verdict, say)
    assert arb.trying()                     # the set-up shape, 3 calls ago
    for _ in range(A.ONCE):
        arb.whole("step")
    assert not arb.trying() and arb._shapes["setup"].trying
    arb.whole("setup")                      # a second call: STALE applies from now on
    for _ in range(A.ONCE + 1):
        arb.whole("step")
    assert arb.trying()


def test_the_warm_up_pair_and_a_block_with_a_build_are_left_out(monkeypatch):
    """A prepared call built inside a block (another shape's first call, say) leaves its pair out:
    it is missing from the kept pairs, the log lines of its block and the next end with " built"
    (the graph's first replays follow in the next block), and with
    MIN_PAIRS kept pairs needed the verdict comes one agreement later. Pair 0 (the split's
    warm-up) is left out too: with 7 needed, pairs 1..7 decide at pair 8."""
    monkeypatch.setattr(A, "MIN_PAIRS", 2 * A.CHECK - 1)
    built_pair = 3
    build_at = PAIRS0 + built_pair * 2 * A.BLOCK + 5        # inside pair 3's first block

    def run(build):
        count, lines, kept = [0], [], []

        def spy(arb):
            agree = arb._agree

            def recorded(key, st, pairs):
                kept.append((pairs, len(st.logs)))
                agree(key, st, pairs)
            arb._agree = recorded
        got, arb, seen = run_job(100.0, 130.0, VERDICT + A.CHECK * 2 * A.BLOCK + 1, spy=spy,
                                 builds=lambda: count[0], log=lines.append,
                                 extra=lambda i: count.__setitem__(0, count[0] + (build and i == build_at)) or 0.0)
        return got, arb, seen, lines, kept
    got, arb, seen, lines, kept = run(False)
    assert kept == [(A.CHECK, A.CHECK - 1), (2 * A.CHECK, 2 * A.CHECK - 1)]
    # the verdict at VERDICT; then the kept split's watch agrees every WATCH_CHECK blocks
    assert [at for at in seen.at if at >= VERDICT] == [VERDICT, VERDICT + A.WATCH_CHECK * A.WATCH]
    assert not any(line.endswith(" built") for line in lines)
    got, arb, seen, lines, kept = run(True)
    assert kept == [(A.CHECK, A.CHECK - 2), (2 * A.CHECK, 2 * A.CHECK - 2), (3 * A.CHECK, 3 * A.CHECK - 2)]
    assert seen.at[-1] == VERDICT + A.CHECK * 2 * A.BLOCK and arb.decisions[0][3] is False
    built = [line for line in lines if line.endswith(" built")]     # its block and the next one
    assert len(built) == 2 and f" {4 + 2 * built_pair} " in built[0] and f" {5 + 2 * built_pair} " in built[1]


def test_a_probe_with_a_build_says_nothing_but_still_exchanges():
    """A split 50% slower goes whole at the quick pair; with a build in the quick pair's split
    block that pair says nothing (the exchange still carries it, gain 0), and so does the probe's
    rest (its split block replays the graphs just built for the first time): the paired blocks
    decide. A split 20% slower goes whole at the probe; with a build in the rest, the paired
    blocks decide."""
    def run(split_us, build_at):
        count = [0]
        return run_job(split_us, 100.0, VERDICT + 1, builds=lambda: count[0],
                       extra=lambda i: count.__setitem__(0, count[0] + (i == build_at)) or 0.0)
    got, arb, seen = run(150.0, SEG0)
    assert seen.at == [SEG0 - 1, SEG0 + 2 * A.QUICK, PAIRS0, PAIRS0 + A.CHECK * 2 * A.BLOCK, VERDICT]
    assert seen[1][1] == A._OFF and seen[2][1] == A._OFF
    assert arb.decisions[0][3] is True and got[VERDICT:] == [True]
    got, arb, seen = run(150.0, None)
    assert seen.at[-1] == SEG0 + 2 * A.QUICK and arb.decisions[0][3] is True
    got, arb, seen = run(120.0, SEG0 + 2 * A.QUICK + 1)
    assert seen[2][1] == A._OFF and seen.at[-1] == VERDICT and arb.decisions[0][3] is True
    got, arb, seen = run(120.0, None)
    assert seen.at[-1] == PAIRS0


@pytest.mark.parametrize("cost", [300e-6, 0.4])
def test_a_quick_pair_with_a_build_or_a_pause_is_left_out_of_the_probe(cost):
    """A split 10% faster whose quick pair's split block holds a build that costs 300 us (its
    pace 2.4 times the whole block's), or a pause of 400 ms without a build: the quick pair says
    nothing (pooled with the rest's paces it would show the split 40% slower and send it whole);
    after the pause the probe's verdict rests on its rest alone, after the build the rest says
    nothing either (its split block follows the build); the pairs keep the split."""
    count = [0]

    def extra(i):
        if i == SEG0:
            count[0] += cost < 0.1              # the build (not the pause) is counted
            return cost
        return 0.0
    got, arb, seen = run_job(90.0, 100.0, VERDICT + 1, builds=lambda: count[0], extra=extra)
    assert got[SEG0] is False                                        # in the quick pair's split block
    assert seen[1][1] == A._OFF
    if cost < 0.1:
        assert seen[2][1] == A._OFF
    else:
        assert seen[2][1] - A._OFF == pytest.approx(1e6 * math.log(100 / 90), abs=5)
    assert seen.at[-1] == VERDICT and arb.decisions[0][3] is False and got[-1] is False


class HostAheadClock:
    """A job whose host runs ahead of its GPU: the host's time between calls is the call's host
    cost (split calls cost more host time), while the GPU's time between the calls' marks is the
    step's (the split's steps are faster). span() reads the GPU's, as GpuPace does."""

    def __init__(self):
        self.host = 1.0
        self.gpu = 1.0
        self.dropped = 0

    def __call__(self):
        return (self.gpu, self.host)

    def span(self, a, b):
        return b[0] - a[0]

    def drop(self, mark):
        self.dropped += mark is not None


@pytest.mark.parametrize("gpu_pace", [True, False])
def test_the_gpus_pace_decides_where_the_host_runs_ahead(gpu_pace):
    clock = HostAheadClock()
    if not gpu_pace:                                  # the host's clock alone: the split looks slower
        clock.span = lambda a, b: b[1] - a[1]
    arb = A.Arbiter(lambda v: [list(v)], clock=clock)
    for _ in range(VERDICT + 1):
        whole = arb.whole(("ar", 1 << 24, "bf16"))
        clock.host += (40.0 if whole else 90.0) * 1e-6     # host time a call: NCCL's 40 us, the split's 90
        clock.gpu += (700.0 if whole else 620.0) * 1e-6    # GPU time between calls: the split 11% faster
    assert arb.decisions, "no verdict"
    assert arb.decisions[-1][3] is (not gpu_pace)          # kept split on the GPU's pace, whole on the host's


def test_gpu_pace_marks_are_events_on_the_callers_stream():
    calls = []

    class FakeCuda:
        capturing = False
        fail = False
        record_fails = False
        made = 0

        def stream_capturing(self, stream):
            return self.capturing

        def event_create(self, timing=False):
            assert timing
            FakeCuda.made += 1
            return 100 + FakeCuda.made

        def event_record(self, ev, stream):
            if self.record_fails:
                raise RuntimeError("record")
            calls.append(("record", ev, stream))

        def event_elapsed_s(self, a, b):
            if self.fail:
                raise RuntimeError("driver")
            return 0.25

        def event_destroy(self, ev):
            calls.append(("destroy", ev))
    pace = A.GpuPace(0)
    fake = FakeCuda()
    pace._cuda, pace._raw = fake, lambda dev: 77
    a, b = pace(), pace()
    assert calls == [("record", 101, 77), ("record", 102, 77)] and (a[0], b[0]) == (101, 102)
    assert pace.span(a, b) == 0.25 and pace._free == []                     # a span keeps its marks
    assert pace.span(a, b) == 0.25                                          # (and reads them again)
    pace.drop(a)
    assert pace._free == [101]                                              # dropped: back for reuse
    c = pace()
    assert calls[-1] == ("record", 101, 77) and FakeCuda.made == 2 and pace._free == []   # reused, none made
    pace.drop(b)
    fake.capturing = True                                                   # a capture: the host's clock
    d = pace()
    assert isinstance(d, float) and len(calls) == 3 and pace._free == [102]
    assert pace.span(c, d) == pytest.approx(d - c[1])
    pace.drop(d)                                                            # a host mark: nothing to give back
    assert pace._free == [102]
    fake.capturing = False
    fake.fail = True                                                        # a driver error: the host's too
    e, f = pace(), pace()
    assert (e[0], f[0]) == (102, 103) and pace.span(e, f) == pytest.approx(f[1] - e[1])
    fake.record_fails = True                                                # a failed record: its event goes back
    g = pace()
    assert isinstance(g, float) and pace._free == [104]
    for mark in (c, e, f):
        pace.drop(mark)
    pace.close()
    assert sorted(c[1] for c in calls if c[0] == "destroy") == [101, 102, 103, 104] and pace._free == []


def test_the_slower_clock_times_a_block_at_the_longer_of_the_gpu_s_and_the_host_s_span():
    """BRAID_TRIAL_PACE=max: a span is the GPU's where the host kept ahead of it, the host's where
    the host was the slower (a split whose host cost its GPU cannot hide in steady state)."""
    class FakeCuda:
        def event_elapsed_s(self, a, b):
            return 0.25
    gpu, slower = A.GpuPace(0), A.GpuPace(0, slower=True)
    for p in (gpu, slower):
        p._cuda = FakeCuda()
    ahead, behind = ((1, 10.0), (2, 10.1)), ((1, 10.0), (2, 10.4))      # (event, host seconds)
    assert gpu.span(*ahead) == 0.25 and gpu.span(*behind) == 0.25
    assert slower.span(*ahead) == 0.25                                      # the GPU's: it was the slower
    assert slower.span(*behind) == pytest.approx(0.4)                       # the host's: it was
    assert slower.span(10.0, 10.3) == pytest.approx(0.3)                    # host marks: the host's as before


class _Mark:
    def __init__(self, t):
        self.t = t


class CountingClock(Clock):
    """A model clock whose marks are objects of their own: it counts each mark's drops and
    notes every span that uses a mark already dropped."""

    def __init__(self):
        super().__init__()
        self.made, self.drops, self.late = [], {}, []

    def __call__(self):
        mark = _Mark(self.t)
        self.made.append(mark)
        return mark

    def span(self, a, b):
        self.late += [m for m in (a, b) if m in self.drops]
        return b.t - a.t

    def drop(self, mark):
        self.drops[mark] = self.drops.get(mark, 0) + 1


def test_every_mark_is_dropped_once():
    """Marks are GPU events on GPUs: each must go back once, whatever ends its use (the period's
    search, a block read, a verdict, a shape forgotten for newer ones, close), and none may be
    read after it went back."""
    clock = CountingClock()
    arb = A.Arbiter(lambda v: [list(v)], clock=clock)
    # the split's pace per trial: kept (pairs), lost at the quick pair, at the probe, at the pairs
    paces = [90.0, 160.0, 115.0, 101.0, 90.0]
    while True:
        st = arb._shapes.get("k")
        trial = st.trials if st else 0
        if trial == len(paces) - 1 and st.n - st.start == PAIRS0 + 3 * A.BLOCK + 3:
            break                               # the last trial stops in its paired blocks
        w = arb.whole("k")
        clock.t += (100.0 if w else paces[trial]) * 1e-6
    assert [d[3] for d in arb.decisions] == [False, True, True, True]
    assert st.open is not None and st.done                      # a block open, one ended not read
    for _ in range(5):                      # a shape in its period's search
        arb.whole("setup")
    for _ in range(SEG0 + A.QUICK + 1):     # one in its quick pair
        arb.whole("quick")
    held = [m for m in clock.made if m not in clock.drops]
    assert len(held) == 2 + 4 + 2                              # k's 2 blocks, setup's 4 calls, quick's 2 blocks
    for j in range(A.MAX_SHAPES):           # newer shapes push the oldest out
        for _ in range(3):
            arb.whole(("new", j))
    assert not {"k", "setup", "quick"} & set(arb._shapes)
    assert all(clock.drops.get(m) == 1 for m in held)           # their marks went back
    arb.close()
    assert clock.late == []
    assert len(clock.drops) == len(clock.made) and all(clock.drops[m] == 1 for m in clock.made)


def test_paired_blocks_are_read_a_block_late_but_decide_at_the_same_calls():
    """On GPUs reading a block's pace waits for its last mark: a paired block is read at the end
    of the block after it, and only the pair that ends at an agreement is read at once."""
    reads = []

    class LateClock(Clock):
        call = 0

        def __call__(self):
            return (self.call, self.t)

        def span(self, a, b):
            reads.append((b[0], self.call))       # (the call of the block's end mark, the call reading it)
            return b[1] - a[1]
    clock = LateClock()
    arb = A.Arbiter(lambda v: [list(v)], clock=clock)
    ref_got, _, _ = run_job(100.0, 130.0, VERDICT + 80)
    got = []
    for i in range(VERDICT + 80):
        clock.call = i
        w = arb.whole(KEY)
        got.append(w)
        clock.t += (130.0 if w else 100.0) * 1e-6
    assert got == ref_got and arb.decisions[0][3] is False   # the same answers, call for call
    assert [r for m, r in reads if m < SEG0] == [SEG0 - 1] * A.DETECT     # the search: read at its end
    assert [(m, r) for m, r in reads if SEG0 <= m <= PAIRS0] == \
        [(SEG0 + A.QUICK, SEG0 + 2 * A.QUICK), (SEG0 + 2 * A.QUICK,) * 2,
         (SEG0 + 2 * A.QUICK + A.REST, PAIRS0), (PAIRS0, PAIRS0)]        # the probe's: as they end
    paired = [(m, r) for m, r in reads if PAIRS0 < m <= VERDICT]
    agreements = {PAIRS0 + p * 2 * A.BLOCK for p in (A.CHECK, 2 * A.CHECK)}
    assert {(a, a) for a in agreements} <= set(paired)          # the pair ending at an agreement: at once
    late = [(m, r) for m, r in paired if m not in agreements]
    assert late and all(r == m + A.BLOCK for m, r in late)      # every other block: a block later
    # the kept split's watch: its blocks read WATCH_LAG blocks after they ended
    watched = [(m, r) for m, r in reads if m > VERDICT]
    assert watched == [(VERDICT + k * A.WATCH, VERDICT + (k + A.WATCH_LAG) * A.WATCH) for k in (2, 3, 4)]


def test_a_longer_block_and_the_block_log(tmp_path):
    """BRAID_TRIAL_BLOCK sets the paired blocks' length (the schedule and the verdict's call move
    with it); BRAID_TRIAL_LOG gets the period found and one line per timed block read, with its
    index, mode and pace."""
    block = 20
    log = A.trial_log(str(tmp_path / "trial"), 3)
    first = PAIRS0 + EARLIEST * 2 * block
    got, arb, _ = run_job(100.0, 130.0, first + 10, key=("ar", 7), block=block, log=log)
    assert got[SEG0:first] == timed_modes(EARLIEST, block=block)
    assert got[first:] == [False] * 10 and arb.decisions[-1][3] is False
    assert arb._shapes[("ar", 7)].start == first + 1
    lines = (tmp_path / "trial.3").read_text().split("\n")[:-1]
    blocks = [re.fullmatch(r"\('ar', 7\) (\d+) (split|whole) ([\d.]+)( built)?", line) for line in lines]
    others = [line for line, m in zip(lines, blocks) if m is None]
    assert len(others) <= 1 and all("period 1" in line for line in others)     # the period found
    blocks = [m for m in blocks if m]
    assert [int(m[1]) for m in blocks] == list(range(4 + 2 * EARLIEST))
    starts = [SEG0, SEG0 + A.QUICK, SEG0 + 2 * A.QUICK, SEG0 + 2 * A.QUICK + A.REST]
    starts += [PAIRS0 + j * block for j in range(2 * EARLIEST)]
    for m, start in zip(blocks, starts):
        whole = got[start]
        assert m[2] == ("whole" if whole else "split") and m[4] is None
        assert float(m[3]) == pytest.approx(130.0 if whole else 100.0, abs=0.5)
    assert A.trial_log("", 0) is None


def test_trial_block_setting_is_checked(monkeypatch):
    from braid import envs
    monkeypatch.setenv("BRAID_TRIAL_BLOCK", "48")
    assert envs.get("BRAID_TRIAL_BLOCK") == 48
    monkeypatch.setenv("BRAID_TRIAL_BLOCK", "2")
    with pytest.raises(ValueError, match="BRAID_TRIAL_BLOCK"):
        envs.get("BRAID_TRIAL_BLOCK")


def test_trial_pace_setting_is_checked(monkeypatch):
    from braid import envs
    for text, want in (("gpu", "gpu"), (" HOST", "host"), ("max", "max")):
        monkeypatch.setenv("BRAID_TRIAL_PACE", text)
        assert envs.get("BRAID_TRIAL_PACE") == want
    monkeypatch.setenv("BRAID_TRIAL_PACE", "slowest")
    with pytest.raises(ValueError, match="gpu, host or max"):
        envs.get("BRAID_TRIAL_PACE")


def _ddp_like(period, k, seed, n=A.DETECT, noise=0.03):
    """Intervals between a shape's calls in a DDP-like job: per step, `period` - 1 short ones
    (the buckets' calls back to back) and one long one (the rest of the step), at phase k."""
    rng = random.Random(seed)
    return [(3500.0 if j % period == k else 390.0) * rng.uniform(1 - noise, 1 + noise) for j in range(n)]


@pytest.mark.parametrize("period", [8, 16, 24])
def test_find_period_finds_a_step_and_its_boundary(period):
    for seed in range(10):
        k = random.Random(100 + seed).randrange(period)
        assert A.find_period(_ddp_like(period, k, seed)) == (period, k), (seed, k)


def test_find_period_finds_nothing_in_noise_or_a_constant():
    for seed in range(30):
        rng = random.Random(seed)
        assert A.find_period([100.0 * rng.uniform(0.8, 1.2) for _ in range(A.DETECT)]) == (1, 0), seed
    assert A.find_period([390.0] * A.DETECT) == (1, 0)
    assert A.find_period([390.0, 3500.0] * 2 + [390.0]) == (1, 0)       # fewer than 6: nothing
    assert A.find_period([390.0, 3500.0] * 3) == (2, 1)


def test_find_period_sees_through_one_late_call():
    for seed in range(10):
        xs = _ddp_like(8, 5, seed)
        xs[random.Random(seed).randrange(len(xs))] = 1.0e6             # a pause, a build
        assert A.find_period(xs) == (8, 5), seed


class _Queue:
    """A caller's stream in a model: each call costs the host `host` seconds and the GPU `gpu`
    seconds of work, which starts once the host has queued it and the GPU has finished what came
    before. An event recorded at a call happens when the GPU reaches that point of the stream."""

    def __init__(self):
        self.host = self.gpu_end = 1.0
        self.events: dict[int, float] = {}

    def call(self, host: float, gpu: float) -> None:
        self.host += host
        self.gpu_end = max(self.gpu_end, self.host) + gpu

    # the driver as GpuPace uses it
    def stream_capturing(self, stream):
        return False

    def event_create(self, timing=True):
        return len(self.events) + 1

    def event_record(self, ev, stream):
        self.events[ev] = max(self.gpu_end, self.host)

    def event_elapsed_s(self, a, b):
        return self.events[b] - self.events[a]


def _queued_job(pace: str, host_split: float, gpu_split: float, calls: int = VERDICT + 1):
    """A job of one shape on the model stream, timed by GpuPace (`pace` gpu or max): NCCL's whole
    call costs the host 300 us and the GPU 790; the split the host `host_split` us and the GPU
    `gpu_split`. Returns the arbiter (its decisions)."""
    q = _Queue()
    clock = A.GpuPace(0, slower=pace == "max")
    clock._cuda, clock._raw = q, lambda dev: 0
    real = A.time
    A.time = types.SimpleNamespace(perf_counter=lambda: q.host)     # the marks' host time: the model's
    try:
        arb = A.Arbiter(lambda v: [list(v)], clock=clock)
        for _ in range(calls):
            whole = arb.whole(KEY)
            q.call(300e-6, 790e-6) if whole else q.call(host_split * 1e-6, gpu_split * 1e-6)
    finally:
        A.time = real
    return arb


@pytest.mark.parametrize("pace", ["gpu", "max"])
def test_alternating_blocks_hide_a_host_bound_split_from_the_gpu_s_clock(pace):
    """DDP's defaults as measured (2 x H200): whole 300 us of host and 790 of GPU a call, the split
    860 and 700. All split, the job would run at its host's 860 us a call, all whole at the GPU's
    790: whole wins. But each split block follows a whole block whose cheap calls let the host run
    ahead, and the GPU runs the split block's work at its own 700: the GPU's clock keeps the split;
    the longer of the two clocks sees the host's 860 and sends it whole."""
    arb = _queued_job(pace, 860.0, 700.0)
    assert arb.decisions, "no verdict"
    assert arb.decisions[-1][3] is (pace == "max")      # whole on the longer clock, split (wrongly) on the GPU's


@pytest.mark.parametrize("pace", ["gpu", "max"])
def test_a_split_whose_host_keeps_ahead_is_kept_on_either_clock(pace):
    """The split's host cost under its GPU time (host 600 us, GPU 700 against whole 790): the job
    runs at its GPU's pace in either mode and the split wins; both clocks keep it."""
    arb = _queued_job(pace, 600.0, 700.0)
    assert arb.decisions and arb.decisions[-1][3] is False


def test_the_host_s_clock_leaves_out_the_trial_s_own_waits():
    """A span's read waits on the host for its last mark (here 0.5 s), an exchange of paces for
    the peers (0.4 s): the marks after them carry the host's time less those waits, so a block's
    host span holds the job's time only."""
    now = [10.0]

    class FakeCuda:
        made = 0

        def stream_capturing(self, stream):
            return False

        def event_create(self, timing=True):
            FakeCuda.made += 1
            return FakeCuda.made

        def event_record(self, ev, stream):
            pass

        def event_elapsed_s(self, a, b):
            now[0] += 0.5                       # the host waits for the GPU to reach b
            return 0.1
    pace = A.GpuPace(0, slower=True)
    pace._cuda, pace._raw = FakeCuda(), lambda dev: 0
    real = A.time
    A.time = types.SimpleNamespace(perf_counter=lambda: now[0])
    try:
        a = pace()
        now[0] += 0.2                           # the job's host time
        b = pace()
        assert pace.span(a, b) == pytest.approx(0.2)     # the host's 0.2 against the GPU's 0.1
        now[0] += 0.3
        c = pace()                              # 0.5 s of the read's wait left out
        assert c[1] - b[1] == pytest.approx(0.3)
        assert pace.span(b, c) == pytest.approx(0.3)

        def exchange(values):                   # the ranks' exchange of paces: 0.4 s waiting for a peer
            now[0] += 0.4
            return [list(values)]
        arb = A.Arbiter(exchange, clock=pace)
        now[0] += 0.1
        assert arb._swap([1, 2]) == [[1, 2]]
        d = pace()                              # the exchange's 0.4 s left out too
        assert d[1] - c[1] == pytest.approx(0.1) and pace.span(c, d) == pytest.approx(0.1)
    finally:
        A.time = real


# the watch of a kept split (Arbiter._watch): its steady pace against the trial's whole pace
WATCHED = A.WATCH_CHECK * A.WATCH           # calls from a kept split's verdict to the watch's first agreement


class _BoundedQueue(_Queue):
    """_Queue with a host that runs at most `ahead` seconds ahead of its GPU (a launch queue
    that fills, a step's sync): a job all split at host 860 us and GPU 700 a call then runs at
    its host's pace, the GPU waiting for it."""

    def __init__(self, ahead: float = 6e-3):
        super().__init__()
        self.ahead = ahead

    def call(self, host: float, gpu: float) -> None:
        self.host = max(self.host, self.gpu_end - self.ahead)
        super().call(host, gpu)


def _watched_job(host_split: float, gpu_split: float, calls: int):
    """One rank's job of one shape on the bounded model stream, timed by GpuPace: NCCL's whole
    call 300 us of host and 790 of GPU, the split `host_split` / `gpu_split`. Returns (the
    arbiter, its answers, the values it gave at each exchange)."""
    q = _BoundedQueue()
    clock = A.GpuPace(0)
    clock._cuda, clock._raw = q, lambda dev: 0
    real = A.time
    A.time = types.SimpleNamespace(perf_counter=lambda: q.host)
    answers, seen = [], []
    try:
        arb = A.Arbiter(lambda v: seen.append(list(v)) or [list(v)], clock=clock)
        for _ in range(calls):
            whole = arb.whole(KEY)
            answers.append(whole)
            q.call(300e-6, 790e-6) if whole else q.call(host_split * 1e-6, gpu_split * 1e-6)
    finally:
        A.time = real
    return arb, answers, seen


def test_the_watch_sends_a_host_bound_split_whole():
    """The GPU's clock keeps a split whose host is slower than the whole call's GPU: the trial's
    alternating blocks hide it (each split block starts with the GPU behind its host). Kept
    split, the job runs at its host's 860 us a call against the trial's whole 790, the GPU
    waiting for the host (once the backlog the trial's whole blocks left has drained): the watch
    sees it at one of its first three agreements and sends the shape whole from that call on,
    with the paces in its verdict."""
    arb, answers, _ = _watched_job(860.0, 700.0, VERDICT + 1 + 4 * WATCHED)
    assert [d[3] for d in arb.decisions] == [False, True], arb.decisions
    _, split_us, whole_us, _, by = arb.decisions[1]
    assert arb.decisions[0][4] == "trial" and by == "watch"
    assert whole_us == pytest.approx(790.0, rel=0.02) and 1.05 * whole_us < split_us <= 861.0
    assert answers[VERDICT] is False                                  # the trial's verdict: split
    back = answers.index(True, VERDICT)
    assert back - VERDICT in (WATCHED, 2 * WATCHED, 3 * WATCHED)       # at an agreement's call
    assert not any(answers[VERDICT:back]) and all(answers[back:])      # split until then, whole after
    st = arb._shapes[KEY]
    assert st.whole and not st.trying and st.base == 0.0 and st.wmark is None and st.wdone == []
    # the watch's verdict keeps the trial's interval: the next trial comes REPROBE calls after
    # the trial's verdict, not after the watch's
    assert st.start == VERDICT + 1 and st.reprobe == A.REPROBE


def test_the_watch_off_keeps_a_host_bound_split_to_the_next_trial():
    """BRAID_TRIAL_WATCH=0 (Arbiter(watch=False)): the kept split stays split, nothing exchanged
    after the trial's verdict."""
    clock = Clock()
    seen = []
    arb = A.Arbiter(lambda v: seen.append(list(v)) or [list(v)], clock=clock, watch=False)
    answers = []
    for i in range(VERDICT + 1 + 3 * WATCHED):
        w = arb.whole("k")
        answers.append(w)
        if i == VERDICT:
            done = len(seen)
        clock.t += (100.0 if w else (80.0 if i <= VERDICT else 120.0)) * 1e-6
    assert [d[3] for d in arb.decisions] == [False] and not any(answers[VERDICT:])
    assert len(seen) == done and arb._shapes["k"].base == 0.0


def test_the_watch_keeps_a_split_that_stays_faster():
    """A split whose host keeps ahead of its GPU (host 600 us, GPU 700, whole 790): kept, and
    the watch leaves it kept up to the next trial, agreeing every WATCH_CHECK blocks."""
    arb, answers, seen = _watched_job(600.0, 700.0, VERDICT + A.REPROBE)
    assert [d[3] for d in arb.decisions] == [False]
    st = arb._shapes[KEY]
    assert not st.trying and not st.whole and not any(answers[VERDICT:])
    assert st.base == pytest.approx(790e-6, rel=0.02)
    assert len(st.wlogs) == A.WATCH_KEEP and all(x == pytest.approx(math.log(790 / 700), rel=0.02) for x in st.wlogs)
    before = len(_watched_job(600.0, 700.0, VERDICT + 1)[2])             # the trial's exchanges
    assert len(seen) - before == (A.REPROBE - 1) // WATCHED             # then one every WATCHED calls


@pytest.mark.parametrize("seed", range(10))
def test_the_watch_does_not_give_up_a_gain_for_noise(seed):
    """A job whose pace varies +-20% from call to call and whose split gains 15%: kept at every
    trial, and watched between them without a whole verdict."""
    rng = random.Random(seed)
    clock = Clock()
    arb = A.Arbiter(lambda v: [list(v)], clock=clock)
    for _ in range(VERDICT + 2 * A.REPROBE):
        w = arb.whole("k")
        clock.t += 100.0 * (1.0 if w else 0.85) * rng.uniform(0.8, 1.2) * 1e-6
    assert arb.decisions and all(d[3] is False for d in arb.decisions), arb.decisions


def test_the_watch_leaves_out_builds_and_pauses():
    """Watched blocks with a prepared call built in them, or a pause (an evaluation) of more
    than PAIR_RATIO blocks' time, do not count: a kept split stays kept through them."""
    clock = Clock()
    count = [0]
    arb = A.Arbiter(lambda v: [list(v)], clock=clock, builds=lambda: count[0])
    for i in range(VERDICT + 1 + 6 * WATCHED):
        w = arb.whole("k")
        clock.t += (100.0 if w else 80.0) * 1e-6
        if i > VERDICT and (i - VERDICT) % 40 == 0:
            count[0] += 1                   # a build (another shape's first call) every 40 calls,
            clock.t += 1e-3                 # which takes a millisecond
        if i > VERDICT and (i - VERDICT) % 100 == 0:
            clock.t += 0.5                  # a pause of half a second
    assert [d[3] for d in arb.decisions] == [False]
    st = arb._shapes["k"]
    assert st.wlogs and all(x == pytest.approx(math.log(100.0 / 80.0), rel=1e-6) for x in st.wlogs)


def test_one_rank_s_slow_steady_split_sends_every_rank_whole():
    """The watch's agreement: a peer whose kept split now runs 20% slower than its trial's whole
    pace sends the shape whole on this rank too, at the same call; a peer that saw its split
    stay faster leaves it kept."""
    def peer_report(slow, box):
        def peer(values):
            st = box[0]._shapes.get("k") if box else None
            if st is not None and st.base and not st.trying and not st.whole:    # the watch's agreement
                pace = values[4] * (1.2 if slow else 0.8)
                mean = math.log(values[4] / pace)
                return [A.WATCH_KEEP, A._OFF + int(1e6 * mean), 1000, int(pace), values[4]]
            return list(values)
        return peer
    for slow in (True, False):
        box = []
        answers, arb, seen = run_job(80.0, 100.0, VERDICT + 1 + 2 * WATCHED, peer=peer_report(slow, box),
                                     spy=box.append, key="k")
        assert arb.decisions[0][3] is False
        if slow:
            assert [d[3] for d in arb.decisions] == [False, True]
            assert not any(answers[VERDICT:VERDICT + WATCHED]) and all(answers[VERDICT + WATCHED:])
        else:
            assert [d[3] for d in arb.decisions] == [False] and not any(answers[VERDICT:])


def test_the_watch_leaves_a_small_steady_loss_to_the_next_trial():
    """Kept split, the job changes: the split now runs 1% slower than the trial's whole pace (a
    loss inside MARGIN) and stays kept; 10% slower, it goes whole at the watch's first agreement."""
    for slower, whole_after in ((1.01, False), (1.10, True)):
        clock = Clock()
        arb = A.Arbiter(lambda v: [list(v)], clock=clock)
        answers = []
        for i in range(VERDICT + 1 + 2 * WATCHED):
            w = arb.whole("k")
            answers.append(w)
            split = 80.0 if i <= VERDICT else 100.0 * slower
            clock.t += (100.0 if w else split) * 1e-6
        assert arb.decisions[0][3] is False
        assert [d[3] for d in arb.decisions[1:]] == ([True] if whole_after else [])
        if whole_after:
            assert answers.index(True, VERDICT) == VERDICT + WATCHED
