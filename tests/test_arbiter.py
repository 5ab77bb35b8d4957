"""The whole-or-split trial of a call shape inside a job (braid.comm.arbiter): its schedule, its
agreed verdict (the slowest rank's pace decides), ties going to the native library, trials again
later, and every rank answering alike at every call."""
import threading

import pytest

from braid.comm import arbiter as A


class Clock:
    """A fake clock that each call of the job advances by the pace of the mode it ran in."""

    def __init__(self):
        self.t = 1.0

    def __call__(self):
        return self.t


def run_job(split_us, whole_us, calls, peer=None, enabled=True, clock=None):
    """One rank's calls of one shape; the job spends split_us / whole_us between calls depending
    on the mode of the call. Returns (answers, arbiter, exchanges)."""
    clock = clock or Clock()
    seen = []

    def exchange(values):
        seen.append(list(values))
        return [list(values)] + ([list(peer)] if peer is not None else [])
    arb = A.Arbiter(exchange, enabled=enabled, clock=clock)
    answers = []
    for _ in range(calls):
        whole = arb.whole(("ag", 1 << 20, "bf16"))
        answers.append(whole)
        clock.t += (whole_us if whole else split_us) * 1e-6
    return answers, arb, seen


def test_schedule_warm_split_whole_then_the_verdict():
    trial = A.WARM + 2 * A.PHASE
    got, arb, seen = run_job(100.0, 130.0, trial + 50)
    assert got[:A.WARM + A.PHASE] == [False] * (A.WARM + A.PHASE)           # warm-up and split phase
    assert got[A.WARM + A.PHASE:trial] == [True] * A.PHASE                  # whole phase
    assert got[trial:] == [False] * 50                                      # split kept: faster
    assert len(seen) == 1 and len(arb.decisions) == 1
    _, split_us, whole_us, whole = arb.decisions[0]
    assert split_us == pytest.approx(100.0, abs=0.2) and whole_us == pytest.approx(130.0, abs=0.2)
    assert whole is False


def test_the_whole_call_wins_when_the_split_slows_the_job():
    trial = A.WARM + 2 * A.PHASE
    got, arb, _ = run_job(124.0, 100.0, trial + 10)
    assert got[trial:] == [True] * 10 and arb.decisions[0][3] is True


def test_a_tie_or_a_gain_under_the_margin_goes_whole():
    trial = A.WARM + 2 * A.PHASE
    for split in (100.0, 100.0 * (1 - A.MARGIN / 2)):
        got, arb, _ = run_job(split, 100.0, trial + 1)
        assert got[-1] is True, split


def test_the_slowest_rank_decides():
    """This rank saw the split faster; its peer saw it slower: the peer's pace (the max) rules."""
    trial = A.WARM + 2 * A.PHASE
    peer = [int(1e7 * 150e-6), int(1e7 * 110e-6)]      # peer: split 150 us, whole 110 us per call
    got, arb, seen = run_job(90.0, 100.0, trial + 1, peer=peer)
    _, split_us, whole_us, whole = arb.decisions[0]
    assert (split_us, whole_us) == (pytest.approx(150.0, abs=0.2), pytest.approx(110.0, abs=0.2))
    assert whole is True and got[-1] is True
    assert seen[0][0] == pytest.approx(900, abs=2)     # its own mean went out in 0.1 us units


def test_trials_repeat_and_can_change_the_verdict():
    trial = A.WARM + 2 * A.PHASE
    clock = Clock()
    pace = {"split": 90.0, "whole": 100.0}

    def exchange(values):
        return [list(values)]
    arb = A.Arbiter(exchange, clock=clock)
    answers = []
    total = 2 * (trial + A.REPROBE) + 5
    for i in range(total):
        if i == trial + A.REPROBE:          # the job changes: now the split slows it
            pace = {"split": 150.0, "whole": 100.0}
        w = arb.whole("k")
        answers.append(w)
        clock.t += pace["whole" if w else "split"] * 1e-6
    assert [d[3] for d in arb.decisions] == [False, True]
    start = trial + A.REPROBE                # the second trial: warm-up keeps the old verdict
    assert answers[start:start + A.WARM] == [False] * A.WARM
    assert answers[start + A.WARM + A.PHASE:start + trial] == [True] * A.PHASE
    assert answers[-1] is True


def test_disabled_never_goes_whole_and_never_exchanges():
    got, arb, seen = run_job(200.0, 100.0, A.WARM + 2 * A.PHASE + 20, enabled=False)
    assert not any(got) and seen == [] and arb.decisions == []


def test_ranks_answer_alike_at_every_call():
    """Two ranks with different paces and a real exchange between threads: at every call both
    give the same answer (the verdict is taken at the same call from the same agreed numbers)."""
    trial = A.WARM + 2 * A.PHASE
    calls = trial + A.REPROBE + trial + 30
    board: dict = {}
    barrier = threading.Barrier(2)
    out: dict = {}

    def rank(r, split_us, whole_us):
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
        for _ in range(calls):
            w = arb.whole(("rs", 7))
            ans.append(w)
            clock.t += (whole_us if w else split_us) * 1e-6
        out[r] = (ans, arb.decisions)
    threads = [threading.Thread(target=rank, args=(0, 80.0, 100.0)),
               threading.Thread(target=rank, args=(1, 120.0, 100.0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out[0][0] == out[1][0]
    assert [d[1:] for d in out[0][1]] == [d[1:] for d in out[1][1]]
    assert all(d[3] is True for d in out[0][1])          # rank 1's slower split pace rules
