"""The whole-or-split trial of a call shape inside a job (braid.comm.arbiter): its schedule, its
agreed verdict (the slowest rank's pace decides), ties going to the native library, trials again
later, and every rank answering alike at every call."""
import math
import random
import threading

import pytest

from braid.comm import arbiter as A
from braid.comm.callpath import CallPath
from braid.comm.shortcuts import Shortcuts


class Clock:
    """A fake clock that each call of the job advances by the pace of the mode it ran in."""

    def __init__(self):
        self.t = 1.0

    def __call__(self):
        return self.t


def run_job(split_us, whole_us, calls, peer=None, enabled=True, clock=None, extra=None):
    """One rank's calls of one shape; the job spends split_us / whole_us between calls depending
    on the mode of the call (extra(i) more seconds after call i). `peer`: a second rank's values
    at each exchange (a list, or a function of this rank's values). Returns (answers, arbiter,
    exchanges)."""
    clock = clock or Clock()
    seen = []

    def exchange(values):
        seen.append(list(values))
        theirs = peer(values) if callable(peer) else peer
        return [list(values)] + ([list(theirs)] if theirs is not None else [])
    arb = A.Arbiter(exchange, enabled=enabled, clock=clock)
    answers = []
    for i in range(calls):
        whole = arb.whole(("ag", 1 << 20, "bf16"))
        answers.append(whole)
        clock.t += (whole_us if whole else split_us) * 1e-6 + (extra(i) if extra else 0.0)
    return answers, arb, seen


FIRST = A.START + A.CHECK * 2 * A.BLOCK         # calls up to the first agreement of the paired blocks


def quick_modes(trial=1):
    """The quick pair's answers (True: whole) in the trial-th trial of a shape."""
    split_first = trial % 2 == 1
    return ([False] * A.QUICK + [True] * A.QUICK) if split_first else ([True] * A.QUICK + [False] * A.QUICK)


def probe_modes(trial=1):
    """The probe pair's answers (True: whole) in the trial-th trial of a shape: its quick pair,
    then the rest of each block in the same order."""
    split_first = trial % 2 == 1
    rest = ([False] * A.REST + [True] * A.REST) if split_first else ([True] * A.REST + [False] * A.REST)
    return quick_modes(trial) + rest


def after_probe(values):
    """A peer that saw no difference in the probe, then `values`' own numbers."""
    return lambda mine: [1, A._OFF, 0, mine[3], mine[3]] if mine[0] == 1 and mine[2] == 0 else values


def expected_modes(pairs):
    """The trial's answers (True: whole) for its first `pairs` pairs, from ORDER."""
    out = []
    for p in range(pairs):
        split_first = bool((A.ORDER >> p) & 1)
        blocks = [False, True] if split_first else [True, False]
        for whole in blocks:
            out += [whole] * A.BLOCK
    return out


def test_schedule_warm_then_paired_blocks_then_the_verdict():
    got, arb, seen = run_job(100.0, 130.0, FIRST + 50)
    assert got[:A.WARM] == [False] * A.WARM                           # warm-up: split
    assert got[A.WARM:A.START] == probe_modes()                       # the probe pair
    assert got[A.START:FIRST] == expected_modes(A.CHECK)              # blocks in ORDER's order
    assert sum(got[A.START:FIRST]) == A.CHECK * A.BLOCK               # as many whole calls as split
    assert got[FIRST:] == [False] * 50                                # split kept: faster
    assert len(seen) == 3 and len(arb.decisions) == 1                 # the quick pair's, the probe's, the pairs' agreements
    _, split_us, whole_us, whole = arb.decisions[0]
    assert split_us == pytest.approx(100.0, abs=0.2) and whole_us == pytest.approx(130.0, abs=0.2)
    assert whole is False


def test_the_whole_call_wins_when_the_split_slows_the_job():
    got, arb, seen = run_job(124.0, 100.0, FIRST + 10)
    assert got[FIRST:] == [True] * 10 and arb.decisions[0][3] is True
    # 24% slower, under the quick pair's bar: the probe saw it, whole after WARM + PROBE split
    # calls and two agreements (the quick pair's, the probe's)
    assert got[:A.START] == [False] * A.WARM + probe_modes() and got[A.START:] == [True] * (FIRST + 10 - A.START)
    assert len(seen) == 2 and sum(not w for w in got) == A.WARM + A.PROBE


def test_a_split_that_loses_by_more_than_the_quick_bar_goes_whole_after_the_quick_pair():
    slower = 100.0 * (1 + 2 * A.QUICK_BAR)
    got, arb, seen = run_job(slower, 100.0, FIRST)
    quick_end = A.WARM + 2 * A.QUICK
    assert got[:quick_end] == [False] * A.WARM + quick_modes() and got[quick_end:] == [True] * (FIRST - quick_end)
    assert len(seen) == 1 and sum(not w for w in got) == A.WARM + A.QUICK
    _, split_us, whole_us, whole = arb.decisions[0]
    assert whole is True and split_us == pytest.approx(slower, abs=0.2) and whole_us == pytest.approx(100.0, abs=0.2)
    # a split that loses by less goes on to the rest of the probe
    got, _, seen = run_job(100.0 * (1 + A.QUICK_BAR / 2), 100.0, A.START)
    assert got[quick_end:A.START] == probe_modes()[2 * A.QUICK:] and len(seen) == 2


def test_a_split_a_little_slower_than_the_probes_bar_is_left_to_the_pairs():
    slower = 100.0 * (1 + A.EARLY / 2)
    got, arb, seen = run_job(slower, 100.0, FIRST + 1)
    assert got[A.START:FIRST] == expected_modes(A.CHECK) and len(seen) == 3
    assert arb.decisions[0][3] is True and got[-1] is True


def test_one_rank_that_saw_the_split_lose_in_the_probe_sends_every_rank_whole():
    """This rank saw the split 10% faster in the probe; its peer 10% slower (under the quick
    pair's bar, over the probe's): whole at the probe's agreement."""
    peer = [1, A._OFF + int(1e6 * math.log(0.9)), 0, int(1e7 * 110e-6), int(1e7 * 100e-6)]
    got, arb, seen = run_job(90.0, 100.0, A.START + 5, peer=peer)
    assert len(seen) == 2 and arb.decisions[0][3] is True and got[A.START:] == [True] * 5


def test_a_tie_or_a_gain_under_the_margin_goes_whole():
    for split in (100.0, 100.0 * (1 - A.MARGIN / 2)):
        got, arb, _ = run_job(split, 100.0, FIRST + 1)
        assert got[-1] is True and arb.decisions[0][3] is True, split


def test_every_rank_must_see_the_gain():
    """This rank saw the split 10% faster; its peer, level in the probe, saw it 10% slower in the
    pairs: whole."""
    peer = after_probe([A.CHECK, A._OFF + int(1e6 * math.log(0.9)), 0, int(1e7 * 110e-6), int(1e7 * 100e-6)])
    got, arb, seen = run_job(90.0, 100.0, FIRST + 1, peer=peer)
    _, split_us, whole_us, whole = arb.decisions[0]
    assert (split_us, whole_us) == (pytest.approx(110.0, abs=0.2), pytest.approx(100.0, abs=0.2))
    assert whole is True and got[-1] is True
    assert seen[2][0] == A.CHECK and seen[2][3] == pytest.approx(900, abs=2)   # its own pace, 0.1 us


def test_a_peer_with_too_few_pairs_delays_the_verdict():
    peer = [1, A._OFF + int(1e6 * 0.2), 0, 900, 1000]         # the peer kept one pair only
    got, arb, seen = run_job(90.0, 100.0, FIRST + 2 * A.BLOCK, peer=peer)
    assert arb.decisions == [] and len(seen) == 3             # the quick pair, the probe, the pairs: no verdict yet


def test_no_verdict_after_max_pairs_goes_whole():
    peer = [1, A._OFF, 0, 1000, 1000]                         # a peer that never has enough pairs
    calls = A.START + A.MAX_PAIRS * 2 * A.BLOCK
    got, arb, seen = run_job(50.0, 100.0, calls + 5, peer=peer)
    assert len(seen) == 2 + A.MAX_PAIRS // A.CHECK
    assert arb.decisions[0][3] is True and got[calls:] == [True] * 5


def test_trials_repeat_and_can_change_the_verdict():
    clock = Clock()
    pace = {"split": 90.0, "whole": 100.0}
    arb = A.Arbiter(lambda values: [list(values)], clock=clock)
    answers = []
    total = 2 * FIRST + A.REPROBE + 5
    for i in range(total):
        if i == FIRST + A.REPROBE:          # the job changes: now the split slows it
            pace = {"split": 150.0, "whole": 100.0}
        w = arb.whole("k")
        answers.append(w)
        clock.t += pace["whole" if w else "split"] * 1e-6
    assert [d[3] for d in arb.decisions] == [False, True]
    start = FIRST + A.REPROBE                # the second trial: its quick pair (whole block first) sees the split lose
    quick_end = start + A.WARM + 2 * A.QUICK
    assert answers[start:start + A.WARM] == [False] * A.WARM
    assert answers[start + A.WARM:quick_end] == quick_modes(2)
    assert answers[quick_end:] == [True] * (total - quick_end)


def test_disabled_never_goes_whole_and_never_exchanges():
    got, arb, seen = run_job(200.0, 100.0, FIRST + 20, enabled=False)
    assert not any(got) and seen == [] and arb.decisions == []


def test_ranks_answer_alike_at_every_call():
    """Two ranks with different paces and a real exchange between threads: at every call both
    give the same answer (the verdict is taken at the same call from the same agreed numbers)."""
    calls = FIRST + A.REPROBE + FIRST + 30
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
    assert len(out[0][1]) == 2 and all(d[3] is True for d in out[0][1])   # rank 1 sees the split lose


def test_a_pause_inside_a_block_does_not_decide_the_trial():
    # the split is 10% faster per call, but one split block holds a pause (another model's
    # window, an evaluation) of 400 ms: its pair is left out and the split still wins
    pause_at = A.START + 3          # inside the first pair's split block (ORDER bit 0 is set)
    assert A.ORDER & 1
    got, arb, _ = run_job(1000.0, 1100.0, FIRST + A.BLOCK * 8 + 1, extra=lambda i: 0.4 if i == pause_at else 0.0)
    key, split_us, whole_us, went_whole = arb.decisions[-1]
    assert not went_whole and split_us == pytest.approx(1000, rel=1e-3) and whole_us == pytest.approx(1100, rel=1e-3)


def _noisy_job(gain, seed, calls=A.START + A.MAX_PAIRS * 2 * A.BLOCK + 1, period=0):
    """A job whose pace varies +-20% from call to call (and, with period, a step pattern of
    `period` calls: half fast, half three times slower); the split changes the pace by `gain`."""
    rng = random.Random(seed)
    clock = Clock()
    arb = A.Arbiter(lambda v: [list(v)], clock=clock)
    for i in range(calls):
        w = arb.whole("k")
        base = 100.0 * (3.0 if period and (i % period) >= period // 2 else 1.0)
        clock.t += base * (1.0 if w else 1.0 - gain) * rng.uniform(0.8, 1.2) * 1e-6
    return arb.decisions


def test_noise_without_a_gain_never_keeps_the_split():
    for seed in range(20):
        for period in (0, 2 * A.BLOCK, 18):
            d = _noisy_job(0.0, seed, period=period)
            assert d and d[0][3] is True, (seed, period)


def test_a_clear_gain_in_noise_keeps_the_split():
    kept = [(_noisy_job(0.15, seed) or [(0, 0, 0, True)])[0][3] is False for seed in range(20)]
    assert all(kept)


class _Path(CallPath):
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
    key = ("ag", 1 << 20, "bf16")
    calls = 0
    while arb.count == 0:
        whole = arb.whole(key)
        clock.t += (100.0 if whole else 130.0) * 1e-6
        calls += 1
        assert arb.trying() or arb.count == 1
        assert calls < A.START + A.MAX_PAIRS * 2 * A.BLOCK + 1
    assert not arb.trying()                                   # the verdict: whole
    for _ in range(A.REPROBE + 1):
        arb.whole(key)
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
        cuda, closed, aborted, world_size = False, False, False, 2

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
    for _ in range(A.START + 2 * A.CHECK * 2 * A.BLOCK + 30):
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
    assert forwarded == said.count(True) and forwarded > 0
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
    starts, last_trying = [], True
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
    # each gap: the trial's own calls plus the interval, which doubles after a repeated verdict
    assert len(gaps) >= 3
    assert gaps[1] - gaps[0] == A.REPROBE and gaps[2] - gaps[1] == 2 * A.REPROBE
    assert arb._shapes["k"].reprobe <= A.REPROBE_MAX


def test_the_probes_verdicts_keep_the_first_interval():
    """A split that loses clearly goes whole at every quick pair: each trial costs WARM + QUICK
    split calls, and the next one comes REPROBE calls later, never later than that."""
    starts, arb = _trial_starts(40_000, {"split": 150.0, "whole": 100.0})
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert len(gaps) >= 5 and set(gaps) == {A.WARM + 2 * A.QUICK + A.REPROBE}
    assert all(d[3] for d in arb.decisions) and arb._shapes["k"].verdicts == 0


@pytest.mark.parametrize("loss", [0.07, 0.1, 0.25, 0.3, 0.5, 0.75, 1.0])
def test_a_losing_split_costs_little_in_any_hundred_calls(loss):
    """A split slower than the probe's bar: at most WARM + PROBE split calls per trial (WARM +
    QUICK beyond the quick pair's bar), so any 100 calls pay that many calls' loss (at most 3%
    for a split up to twice as slow) and a long job far less."""
    worst, overall = A.trial_cost(100.0 * (1 + loss), 100.0, 3 * A.REPROBE)
    split_calls = A.WARM + (A.QUICK if loss > A.QUICK_BAR else A.PROBE)
    assert worst == pytest.approx(split_calls * loss / 100, rel=1e-6)
    assert worst <= 0.03 + 1e-9 and overall < 0.002


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
    for _ in range(600):
        whole = arb.whole(("ar", 1 << 24, "bf16"))
        clock.host += (40.0 if whole else 90.0) * 1e-6     # host time a call: NCCL's 40 us, the split's 90
        clock.gpu += (700.0 if whole else 620.0) * 1e-6    # GPU time between calls: the split 11% faster
    assert arb.decisions, "no verdict"
    assert arb.decisions[-1][3] is (not gpu_pace)          # kept split on the GPU's pace, whole on the host's


def test_gpu_pace_marks_are_events_on_the_callers_stream(monkeypatch):
    calls = []

    class FakeCuda:
        capturing = False
        fail = False
        made = 0

        def stream_capturing(self, stream):
            return self.capturing

        def event_create(self, timing=False):
            assert timing
            FakeCuda.made += 1
            return 100 + FakeCuda.made

        def event_record(self, ev, stream):
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
    assert calls == [("record", 101, 77), ("record", 102, 77)]
    assert pace.span(a, b) == 0.25 and sorted(pace._free) == [101, 102]     # events go back for reuse
    c = pace()
    assert calls[-1] == ("record", 102, 77)                                 # reused, none made
    fake.capturing = True                                                   # a capture: the host's clock
    d = pace()
    assert isinstance(d, float) and len(calls) == 3
    assert pace.span(c, d) == pytest.approx(d - c[1]) and pace._free == [101, 102]
    fake.capturing = False
    fake.fail = True                                                        # a driver error: the host's too
    e, f = pace(), pace()
    assert pace.span(e, f) == pytest.approx(f[1] - e[1])
    pace.close()
    assert sorted(c[1] for c in calls if c[0] == "destroy") == [101, 102] and pace._free == []


def test_marks_held_by_unfinished_blocks_go_back_at_close():
    clock = HostAheadClock()
    arb = A.Arbiter(lambda v: [list(v)], clock=clock)
    for i in range(A.START + A.BLOCK + 3):       # into the second paired block: one held, one open
        arb.whole(("ar", 1, "bf16"))
    st = arb._shapes[("ar", 1, "bf16")]
    assert st.first is not None and st.held is not None
    arb.close()
    assert clock.dropped == 3 and st.first is None and st.held is None


def test_paired_blocks_are_read_a_block_late_but_decide_at_the_same_calls():
    """On GPUs reading a block's pace waits for its last mark: a paired block is read at the end
    of the block after it, and only the pair that ends at an agreement is read at once."""
    reads = []

    class LateClock(Clock):
        call = 0

        def __call__(self):
            return (self.call, self.t)

        def span(self, a, b):
            reads.append((b[0], self.call))       # (the call of the block's last mark, the call reading it)
            return b[1] - a[1]
    clock = LateClock()
    arb = A.Arbiter(lambda v: [list(v)], clock=clock)
    ref_got, _, _ = run_job(100.0, 130.0, FIRST + 50)        # the plain clock: every block read at its end
    got = []
    for i in range(FIRST + 50):
        clock.call = i
        w = arb.whole(("ag", 1 << 20, "bf16"))
        got.append(w)
        clock.t += (130.0 if w else 100.0) * 1e-6
    assert got == ref_got and arb.decisions[0][3] is False   # the same answers, call for call
    paired = [(m, r) for m, r in reads if m >= A.START]
    agreement = A.START + A.CHECK * 2 * A.BLOCK - 1
    assert (agreement, agreement) in paired                   # the pair ending at the agreement: at once
    late = [(m, r) for m, r in paired if m != agreement]
    assert late and all(r == m + A.BLOCK for m, r in late)    # every other block: a block later


@pytest.mark.parametrize("settle", [0, 1])
def test_settle_leaves_the_cost_of_a_switch_out_of_the_pace(settle):
    """A job where the first split call after whole calls pays a one-off wait (the ranks' hosts
    meeting again) and split calls are otherwise 8% faster: the plain pace sees a loss, the
    pace without each block's first interval sees the gain."""
    clock = Clock()
    arb = A.Arbiter(lambda v: [list(v)], clock=clock, settle=settle)
    prev = True
    for _ in range(2 * A.REPROBE + 1200):          # the second trial (whole blocks first) too
        whole = arb.whole(("ar", 1 << 26, "bf16"))
        clock.t += (700.0 if whole else 644.0) * 1e-6
        if prev and not whole:
            clock.t += 3000e-6                  # the switch's one-off wait, in the interval after the call
        prev = whole
    assert len(arb.decisions) >= 2
    assert all(d[3] is (settle == 0) for d in arb.decisions)    # settle 1: split kept; 0: sent whole


def test_settle_leaves_small_blocks_whole():
    arb = A.Arbiter(lambda v: [list(v)], clock=Clock(), settle=1)
    assert arb._skip(A.QUICK) == 0 and arb._skip(A.REST) == 1 and arb._skip(A.BLOCK) == 1
    assert A.Arbiter(lambda v: [list(v)], clock=Clock(), settle=3)._skip(A.REST) == 0


def test_a_longer_block_and_the_block_log(tmp_path):
    """BRAID_TRIAL_BLOCK sets the paired blocks' length (the schedule and the verdict's call move
    with it); BRAID_TRIAL_LOG gets one line per paired block read, with its mode and pace."""
    block = 20
    log = A.trial_log(str(tmp_path / "trial"), 3)
    clock = Clock()
    arb = A.Arbiter(lambda values: [list(values)], clock=clock, block=block, log=log)
    got = []
    first = A.START + A.CHECK * 2 * block
    for i in range(first + 10):
        whole = arb.whole(("ar", 7))
        got.append(whole)
        clock.t += (100.0 if not whole else 130.0) * 1e-6
    modes = []
    for p in range(A.CHECK):
        pair = [False, True] if (A.ORDER >> p) & 1 else [True, False]
        for whole in pair:
            modes += [whole] * block
    assert got[A.START:first] == modes
    assert got[first:] == [False] * 10 and arb.decisions[-1][3] is False
    lines = (tmp_path / "trial.3").read_text().split("\n")[:-1]
    assert len(lines) == 2 * A.CHECK
    for line, whole in zip(lines, modes[::block]):
        mode, pace = line.split()[-2:]
        assert mode == ("whole" if whole else "split")
        assert float(pace) == pytest.approx(130.0 if whole else 100.0, abs=0.5)
    assert A.trial_log("", 0) is None


def test_trial_block_setting_is_checked(monkeypatch):
    from braid import envs
    monkeypatch.setenv("BRAID_TRIAL_BLOCK", "48")
    assert envs.get("BRAID_TRIAL_BLOCK") == 48
    monkeypatch.setenv("BRAID_TRIAL_BLOCK", "2")
    with pytest.raises(ValueError, match="BRAID_TRIAL_BLOCK"):
        envs.get("BRAID_TRIAL_BLOCK")
