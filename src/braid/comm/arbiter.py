"""Whole or split, learned in the job: a split that wins alone can lose inside a training step.

The calibration times each op alone, calls back to back. Inside a job a split call costs more than
its GPU time: every prepared call starts with a round of words between ranks, and the rank that
arrives first waits on the host for the last. Where the job is bound by its CPU (FSDP2's hooks,
say), that wait stalls the rank's next launches: on 2 x H100 (2026-11-25, `braid bench --workload
fsdp`) the round took 124 us per call inside FSDP2 steps against 6-12 us back to back, and the
copy engines' split, faster than NCCL alone by 4-13% at those sizes, made the step 7-15% slower.

So, for a call shape the calibration splits, the job itself decides, from its own pace. Per shape
(op and arguments, as the op's fast path keys them), counted in calls that every rank makes alike:

- the first WARM calls split (the first builds the prepared call);
- DETECT calls timed one by one (whole in a shape's first trial, in the last verdict's mode in
  later ones): the job's period, its calls of the shape per step, and the call that opens a step
  are found in them (`find_period`: the step's boundary is the longest interval, where a DDP step
  waits for its gradients' all-reduces), and every rank takes rank 0's. The timed blocks that
  follow open at a step's first call and span whole periods: a block then holds each kind of
  interval of the step as often as the other mode's block, and a step's calls all run in one mode.
  Blocks of a fixed length out of step with the job timed different parts of its step: DDP's 8
  buckets a step in blocks of 12 calls made the first block of every pair 30-60% slower whatever
  its mode, and blocks of 8 calls that began mid-step timed each step's wait for the other mode's
  calls (2 x H200, 2026-11-27). A job with no period (or one longer than MAX_PERIOD) gets period 1;
- a block's pace is the time from its first call to the next block's first call over its calls;
- then a probe pair: a quick pair of QUICK calls of each mode (whole periods; split first in every
  other trial) and an agreement: a split slower by more than QUICK_BAR on some rank goes whole at
  once; then REST calls of each mode (whole periods, two at least where the job has a period) and
  an agreement: a split slower by more than EARLY, the two parts' paces pooled, goes whole. A
  split that loses then costs its trial WARM + q or WARM + q + r split calls (on a job of period
  1: 3 or 7 calls, at most 3% of any 100 calls for any loss) against the REPROBE calls between
  trials; a probe can be wrong on a noisy step, so its verdict never lengthens that interval;
- otherwise pairs of blocks of BLOCK calls at least (BRAID_TRIAL_BLOCK; whole periods), one block
  split and one whole, in an order fixed per pair (ORDER); each rank keeps, per pair, the log of
  the whole block's pace over the split one's. Left out: each trial's first pair (its split calls
  warm up after the whole ones), a pair with a block in which a prepared call was built or that
  follows a split block that built one (the graphs' first replays: DDP's first split block after
  its buckets' builds ran 10-25% slower), and a pair whose two paces differ more than PAIR_RATIO
  times (a pause: an evaluation, another model's window in `braid bench`). A probe pair with such
  a block says nothing (its agreement still runs: every rank exchanges at the same calls);
- every CHECK pairs the ranks agree (one exchange of a few integers): the split is kept once every
  rank's mean gain, less its 95% margin of error (Student's t for its count of pairs times the
  standard error), beats MARGIN; the shape goes whole once one rank's gain plus that margin stays
  under MARGIN (the slowest rank sets the job's pace), or
  after MAX_PAIRS pairs without a verdict (ties go to the native library);
- while a verdict keeps the split, the watch times the job's own pace in blocks of whole periods
  and, every WATCH_CHECK blocks, the ranks agree: a split that now runs slower than the trial's
  whole pace by more than MARGIN (beyond its blocks' 95% margin of error) on some rank goes whole
  (`_watch`: alternating blocks can hide a host-bound split from the GPU's clock);
- REPROBE calls after a verdict the trial runs again (the job may change, the machine may drift);
  each full trial that repeats the last full trial's verdict doubles that interval, up to
  REPROBE_MAX.

A block's paces are read one block late (its last mark has then long happened on the GPU); the
period's search, the probe's two agreements and every CHECK pairs' agreement read at once (the
host waits there for the GPU to reach the current call: a few times a trial).

A trial whose shape has not been called for STALE calls of any shape (ONCE calls where it was
called once: a shape of a job's set-up, DDP's first broadcast of its weights, say) does not count
as under way (`trying`).

A step of a CPU-bound job (FSDP2's) varies 10-20% from one step to the next: one phase of each
mode, as first built, could not tell a 5% difference from that noise, and kept a split that slowed
FSDP2's steps by 14% on 2 x H100 (2026-11-25). Paired blocks see the same drift, and the test waits
until the difference stands out of the noise.

Every GPU call of the four ops' fast paths takes part, synchronous or not (FSDP2's all-gathers and
reduce-scatters are synchronous calls on its own streams); fixed shares, check mode and the op
sweep of `braid bench` keep the calibration's verdict (`CallPath.calibrated_verdict`). The counts
advance on the op's fast path, which every rank takes for contiguous tensors on its own device; a
rank whose call leaves that path (a non-contiguous tensor) while its peers stay would disagree with
them, and the round of words then raises on every rank (PeerMismatchError or BraidTimeoutError), as
any disagreement does.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

WARM = 1            # split calls before any timing (the first builds the prepared call)
DETECT = 96         # whole calls then timed one by one: the job's period is found in them
MAX_PERIOD = 32     # the longest period looked for (DETECT holds three of it)
QUICK = 2           # calls (at least; whole periods) per block of the quick pair
QUICK_BAR = 0.3     # the quick pair: a split this much slower on some rank goes whole at once
REST = 4            # calls (at least; whole periods, two at least) per block of the probe pair after the quick pair
EARLY = 0.05        # the probe: a split this much slower on some rank goes whole at once
BLOCK = 12          # calls (at least; whole periods) per paired block (BRAID_TRIAL_BLOCK)
ORDER = 0b1001_1010_1111_0001   # bit p: pair p runs its split block first
CHECK = 4           # pairs between two agreements
MIN_PAIRS = 4       # kept pairs each rank needs before a verdict
MAX_PAIRS = 16      # pairs without a verdict: the shape goes whole
MARGIN = 0.02       # the split must beat the whole call's pace by this fraction to be kept
PAIR_RATIO = 3.0    # a pair whose two paces differ more holds a pause: left out
REPROBE = 4096      # calls between a verdict and the next trial of the same shape (at first)
REPROBE_MAX = 1 << 16   # ... doubled by every trial that repeats the last verdict, up to this
WATCH = BLOCK        # calls (at least; whole periods) per block the watch times while a split is kept
WATCH_CHECK = 8      # watched blocks between two agreements of the watch
WATCH_KEEP = 16      # the latest watched blocks a rank's test uses
WATCH_LAG = 2        # a watched block is read this many blocks after it ended (its marks long run on the GPU)
STALE = 4096        # calls of any shape after which a shape's unfinished trial is not under way
ONCE = 64           # ... for a shape called once so far (a set-up call's)
MAX_SHAPES = 256    # shapes followed at once (the oldest is forgotten: it starts over)
KEPT = 256          # verdicts kept for the bench's report (Arbiter.decisions)
_OFF = 1 << 40      # signed values travel offset (the exchange carries non-negative integers)


def _whole_periods(calls: int, period: int) -> int:
    """The fewest calls, a whole number of periods, that are at least `calls`."""
    return period * -(-calls // period)


def _rest(period: int) -> int:
    """Calls per block of the probe pair's rest: REST at least, and two periods where the job
    has one (a single step of DDP's varied by up to 35% on the copy engines, 2 x H200)."""
    return _whole_periods(REST, period) if period == 1 else _whole_periods(max(REST, 2 * period), period)


def find_period(xs: list, max_period: int = MAX_PERIOD) -> tuple[int, int]:
    """The period of a job's calls from the times between consecutive calls of one shape:
    (period, k) where the intervals xs[j] with j % period == k are the longest on average (the
    step's boundary: the call after them opens the step), or (1, 0) where no period stands out.
    A period explains the intervals where its phases' means account for most of their spread
    (adjusted for the phases' count, so that a multiple of the period does not win by
    over-fitting); the shortest period within 90% of the best one's fit is taken. Intervals
    are clipped at twice their 90th percentile first, so that one late call (a build, a pause)
    does not hide the pattern."""
    n = len(xs)
    if n < 6:
        return 1, 0
    top = 2.0 * sorted(xs)[min(n - 1, (9 * n) // 10)]
    v = [min(x, top) for x in xs]
    mean = sum(v) / n
    sst = sum((x - mean) ** 2 for x in v)
    if sst <= 0.0:
        return 1, 0
    fits = []
    for p in range(2, min(max_period, n // 3) + 1):
        means = []
        ssw = 0.0
        for k in range(p):
            cls = v[k::p]
            m = sum(cls) / len(cls)
            means.append(m)
            ssw += sum((x - m) ** 2 for x in cls)
        fit = 1.0 - (ssw / (n - p)) / (sst / (n - 1))
        fits.append((fit, p, max(range(p), key=means.__getitem__)))
    if not fits:
        return 1, 0
    best = max(f[0] for f in fits)
    if best < 0.5:
        return 1, 0
    fit, p, k = next(f for f in fits if f[0] >= 0.9 * best)
    return p, k


@dataclass
class _Shape:
    n: int = 0                  # calls of this shape so far (the same on every rank)
    start: int = 0              # call number where the current trial (or verdict) began
    trying: bool = True
    whole: bool = True          # the verdict between trials (whole before the first)
    marks: list = field(default_factory=list)    # the period's search: a mark at each call
    period: int = 1             # the job's period in calls of this shape (agreed)
    seg0: int = -1              # call number where the trial's timed blocks begin (-1: not known yet)
    open: tuple | None = None   # the block under way: (first mark, split?, builds at the last split block's start, index, calls)
    split_built: int = -1       # builds() at the start of the trial's last split block (-1: none yet)
    done: list = field(default_factory=list)     # ended blocks not read yet: (first, end, split, clean, index, calls)
    pair: list = field(default_factory=lambda: [0.0, 0.0])   # paces just read: split, whole
    clean: list = field(default_factory=lambda: [True, True])  # ... no prepared call built in them
    quick: list | None = None   # the quick pair's paces where they said something (pooled into the probe's)
    logs: list = field(default_factory=list)                  # log(whole / split) of kept pairs
    sums: list = field(default_factory=lambda: [0.0, 0.0])   # kept pairs' paces summed: split, whole
    reprobe: int = REPROBE      # calls from a verdict to the next trial
    verdicts: int = 0           # full trials' verdicts so far (the first never doubles the interval)
    full: bool = False          # the last full trial's verdict
    trials: int = 0             # trials begun (the probe's order alternates with it)
    seen: int = 0               # the arbiter's call count at this shape's last call
    base: float = 0.0           # the watch: this rank's whole pace in the trial that kept the split (0: none)
    wmark: tuple | None = None  # ... the watched block under way: (first mark, builds at its start)
    wdone: list = field(default_factory=list)    # ... ended blocks not read yet: (first, end, clean)
    wcalls: int = 0             # ... calls per watched block (whole periods), set with base
    wlogs: list = field(default_factory=list)    # ... log(base / pace) of the latest read blocks


# Student's t, two-sided 95%, by degrees of freedom (pairs - 1); 2.0 beyond the table
_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23,
        11: 2.20, 12: 2.18, 13: 2.16, 14: 2.14, 15: 2.13}


def _t95(pairs: int) -> float:
    return _T95.get(pairs - 1, 12.71 if pairs < 2 else 2.0)


def _stats(logs: list) -> tuple[float, float]:
    """(mean, standard error) of the kept pairs' log ratios."""
    n = len(logs)
    mean = sum(logs) / n if n else 0.0
    if n < 2:
        return mean, 1.0
    var = sum((x - mean) ** 2 for x in logs) / (n - 1)
    return mean, math.sqrt(var / n)


class Arbiter:
    """Per call shape: split or whole now (the same answer on every rank, at the same call)."""

    def __init__(self, exchange, enabled: bool = True, clock=time.perf_counter, block: int = BLOCK,
                 log=None, builds=None, watch: bool = True):
        self._exchange = exchange           # values -> every rank's values (a node-segment round)
        self.enabled = enabled
        self.watch = watch                  # kept splits are watched (_watch; BRAID_TRIAL_WATCH)
        self.block = block                  # calls per paired block, at least (BRAID_TRIAL_BLOCK)
        # log(line): each timed block's pace as it is read (BRAID_TRIAL_LOG), else None
        self._log = log
        # builds(): prepared calls built so far; a block after a split block that built one is
        # left out (with its own builds: _open)
        self._builds = builds or (lambda: 0)
        # clock() makes a mark, clock.span(a, b) the seconds between two (a plain clock: b - a);
        # on GPUs the marks are events on the caller's stream (GpuPace), clock.drop(a) frees one
        self._clock = clock
        self._span = getattr(clock, "span", None) or (lambda a, b: b - a)
        self._drop = getattr(clock, "drop", None) or (lambda a: None)
        # clock.hold(s): s seconds of the host's were the trial's own (an exchange's wait), not the job's
        self._hold = getattr(clock, "hold", None)
        self._shapes: dict = {}
        # (shape, split us, whole us, whole?, by: "probe", "trial" or "watch"): the last KEPT verdicts
        self.decisions: list[tuple] = []
        self.count = 0                      # verdicts so far
        self.calls = 0                      # calls of every shape so far

    def _swap(self, values):
        """self._exchange(values), its host time told to a clock that keeps the trial's own time
        out of the host's side of its spans (GpuPace.hold)."""
        if self._hold is None:
            return self._exchange(values)
        t0 = time.perf_counter()
        try:
            return self._exchange(values)
        finally:
            self._hold(time.perf_counter() - t0)

    def trying(self) -> bool:
        """True while some shape's trial (split against whole) has no verdict yet, among the
        shapes called in the last STALE calls (ONCE calls for a shape called once: DDP's
        broadcasts of its weights when it is made held the bench's warm-up steps to their limit)."""
        return self.enabled and any(st.trying and self.calls - st.seen <= (STALE if st.n > 1 else ONCE)
                                    for st in self._shapes.values())

    def whole(self, key) -> bool:
        """Call once per call of a split shape, before it is posted: True when this call goes to
        the native library whole."""
        if not self.enabled:
            return False
        st = self._shapes.get(key)
        if st is None:
            if len(self._shapes) >= MAX_SHAPES:
                self._release(self._shapes.pop(next(iter(self._shapes))))
            st = self._shapes[key] = _Shape()
        i = st.n
        c = i - st.start
        st.n += 1
        self.calls += 1
        st.seen = self.calls
        if not st.trying:
            if c < st.reprobe:
                if st.base and (c + 1) % st.wcalls == 0:    # a kept split's watched block begins
                    self._watch(key, st, (c + 1) // st.wcalls)   # (may send it whole from here)
                return st.whole
            self._unwatch(st)
            st.start, st.trying, st.seg0, st.split_built, c = i, True, -1, -1, 0   # a new trial of the shape
            st.trials += 1
        if c < WARM:
            return False
        if c <= WARM + DETECT:              # calls each marked: the job's period
            st.marks.append(self._clock())
            if c == WARM + DETECT:
                self._find_period(key, st, i)
            return st.whole                 # (whole in a first trial, else the last verdict's mode)
        if i < st.seg0:                     # so up to the first call of the job's step
            return st.whole
        split = self._timed(key, st, i - st.seg0)
        return st.whole if not st.trying else not split

    def settled_whole(self, key) -> bool:
        """Does this shape's last verdict send it whole, with no trial of it under way?"""
        st = self._shapes.get(key)
        return st is not None and self.enabled and not st.trying and st.whole

    def close(self) -> None:
        """Give every mark still held back to the clock (before the clock's own close)."""
        for st in self._shapes.values():
            self._release(st)

    def _release(self, st: _Shape) -> None:
        """Drop the shape's marks (the ended blocks' first marks and the open block's: each
        ended block's end is the first mark of the block after it)."""
        for mark in st.marks:
            self._drop(mark)
        for blk in st.done:
            self._drop(blk[0])
        if st.open is not None:         # (set whenever a block has ended: the last one's end)
            self._drop(st.open[0])
        st.marks, st.open, st.done = [], None, []
        self._unwatch(st)

    def _unwatch(self, st: _Shape) -> None:
        """End the watch of a kept split: its marks given back, its blocks forgotten."""
        for blk in st.wdone:
            self._drop(blk[0])
        if st.wmark is not None:
            self._drop(st.wmark[0])
        st.base, st.wmark, st.wdone, st.wlogs = 0.0, None, [], []

    def _watch(self, key, st: _Shape, k: int) -> None:
        """Watched block k begins (at call k * st.wcalls since the verdict that kept the split, the
        verdict's call being 0, a step's first). Blocks are whole periods, each paced as the
        trial's (the time from its first call to the next block's first, over its calls), read
        WATCH_LAG blocks late (so that reading a GPU mark seldom waits for the GPU, and a host that
        runs ahead of its GPU keeps a block or two of its lead where it waits). Every WATCH_CHECK
        blocks the ranks agree, and where on some rank the split's pace now exceeds the whole pace
        its trial measured by more than MARGIN, beyond the 95% margin of error of its latest
        blocks, the shape goes whole from this call.

        Why: a trial alternates split and whole blocks, and a split block that follows a whole
        one starts with the GPU behind its host (the whole calls let the host run ahead), so the
        GPU's clock times the split at the GPU's speed even where the job, all split, runs at its
        host's slower pace. DDP on 2 x H200 (2026-11-27) kept splits timed at 676-691 us a call
        against 778-794 whole, and ran 1.12-1.16x NCCL in most runs; in others the same verdict
        ran 0.89-0.91x, its host 6.9-7.0 ms a step against a GPU's 5.6. Kept split, the job's own
        pace shows which: the watch compares it with the whole pace the trial measured. Its
        verdict keeps the trial's interval to the next trial (which, where it keeps the split
        again, doubles it: a job that stays host-bound is tried less and less often)."""
        mark, built = self._clock(), self._builds()
        if st.wmark is not None:
            first, since = st.wmark
            st.wdone.append((first, mark, since == built))
        st.wmark = (mark, built)
        self._watch_read(st, len(st.wdone) - WATCH_LAG)
        if k % WATCH_CHECK:
            return
        n = len(st.wlogs)
        mean, se = _stats(st.wlogs)
        pace = sum(st.base / math.exp(x) for x in st.wlogs) / n if n else 0.0     # the blocks' mean pace
        got = self._swap([n, _OFF + int(1e6 * mean), int(1e6 * min(se, 1.0)), int(1e7 * pace), int(1e7 * st.base)])
        bar = -math.log1p(MARGIN)
        if any(g[0] >= MIN_PAIRS and (g[1] - _OFF + _t95(g[0]) * g[2]) / 1e6 < bar for g in got):
            if self._log is not None:
                self._log(f"{key} watch: the kept split runs slower than the trial's whole pace: whole")
            self._verdict(key, st, True, got, watch=True)

    def _watch_read(self, st: _Shape, count: int) -> None:
        """Read the first `count` ended watched blocks: a block in which a prepared call was
        built, or whose pace differs from the trial's whole pace more than PAIR_RATIO times (a
        pause), is left out; the latest WATCH_KEEP are kept."""
        for _ in range(max(0, count)):
            first, end, clean = st.wdone.pop(0)
            pace = self._span(first, end) / st.wcalls
            self._drop(first)           # (its end is the next block's first mark)
            if not clean or pace <= 0 or max(pace, st.base) > PAIR_RATIO * min(pace, st.base):
                continue
            st.wlogs.append(math.log(st.base / pace))
            if len(st.wlogs) > WATCH_KEEP:
                st.wlogs.pop(0)

    def _find_period(self, key, st: _Shape, i: int) -> None:
        """At call i, the last of the period's search: the ranks agree on rank 0's period and
        on the call that opens a step, and the timed blocks begin at the next such call (every
        block then spans whole steps of the job, so that a step's calls are all in one mode and
        each block holds as many of each kind of interval: blocks of a length out of step with
        the job timed different parts of its step, DDP's 8 buckets a step in blocks of 12 calls
        showed the first block of each pair 30-60% slower whatever its mode, 2 x H200,
        2026-11-27)."""
        marks, st.marks = st.marks, []
        xs = [self._span(a, b) for a, b in zip(marks, marks[1:])]
        for mark in marks:
            self._drop(mark)
        period, k = find_period(xs)
        first = i - DETECT                  # the call of the first mark: xs[j] ends at call first + j + 1
        mine = [period, (first + k + 1) % period]
        got = self._swap(mine)
        period, phase = got[0][0], got[0][1]
        st.period = max(1, period)
        st.seg0 = i + 1 + (phase - (i + 1)) % st.period
        if self._log is not None:
            self._log(f"{key} period {st.period} found {mine[0]} from call {st.seg0}")

    def _timed(self, key, st: _Shape, d: int) -> bool:
        """Call d of the trial's timed blocks (d = 0 opens a step): True where it runs split.
        The quick pair (blocks of q calls), the rest of the probe pair (r calls each), then pairs
        of blocks of `length` calls; every length a whole number of the job's periods. A block's
        pace is the time from its first call to the next block's first call over its calls."""
        period, first = st.period, st.trials % 2 == 0
        q, r = _whole_periods(QUICK, period), _rest(period)
        if d < 2 * q:
            k, pos = divmod(d, q)
            split, calls = (k == 0) == first, q
        elif d < 2 * (q + r):
            k, pos = divmod(d - 2 * q, r)
            split, calls = (k == 0) == first, r
            k += 2
        else:
            calls = _whole_periods(self.block, period)
            p, j = divmod(d - 2 * (q + r), 2 * calls)
            k, pos = divmod(j, calls)
            split = (k == 0) == bool((ORDER >> (p % 16)) & 1)
            k += 4 + 2 * p
        if pos == 0:
            self._open(key, st, k, split, calls, q, r)
        return split

    def _open(self, key, st: _Shape, k: int, split: bool, calls: int, q: int, r: int) -> None:
        """Block k begins (0, 1: the quick pair; 2, 3: the probe pair's rest; 4 + 2p, 5 + 2p:
        pair p): its mark, and the block before it ends here. The quick pair and the probe pair
        are read and agreed on as they end; a paired block is read one block later (by then its
        last call has long happened on the GPU: no wait for it there), except that the pair that
        ends at an agreement (every CHECK pairs) is read at once."""
        mark, built = self._clock(), self._builds()
        if st.open is not None:
            # clean: no prepared call built since the start of the last split block before it
            # (builds happen in split blocks, and the graphs' first replays in the next split
            # block: DDP's first split block after its 8 buckets' builds ran 10-25% slower)
            first, was_split, since, idx, n = st.open
            st.done.append((first, mark, was_split, since == built, idx, n))
        since = st.split_built if st.split_built >= 0 else built
        if split:
            st.split_built = built
        st.open = (mark, split, since, k, calls)
        if k == 2:
            self._read(key, st, len(st.done))
            st.quick = list(st.pair) if self._telling(st) else None
            self._probe_done(key, st, QUICK_BAR)
        elif k == 4:
            self._read(key, st, len(st.done))
            if st.quick is not None and self._telling(st):
                # both parts' paces, pooled by their calls (a quick pair that held a build or a
                # pause is left out: DDP's first split calls build its buckets' prepared calls)
                st.pair = [(a * q + b * r) / (q + r) for a, b in zip(st.quick, st.pair)]
            self._probe_done(key, st, EARLY)
        elif k > 4:
            p = (k - 4) // 2                # pairs ended before block k
            if k % 2 == 0 and p % CHECK == 0:
                self._read(key, st, len(st.done))
                self._agree(key, st, p)
            else:
                self._read(key, st, len(st.done) - 1)

    def _read(self, key, st: _Shape, count: int) -> None:
        """Read the first `count` ended blocks' paces into st.pair (a paired block's pair is
        kept or left out once its second block is read)."""
        for _ in range(max(0, count)):
            first, end, split, clean, idx, calls = st.done.pop(0)
            pace = self._span(first, end) / calls
            self._drop(first)           # (its end is the next block's first mark)
            st.pair[0 if split else 1] = pace
            st.clean[0 if split else 1] = clean
            if self._log is not None:
                self._log(f"{key} {idx} {'split' if split else 'whole'} {pace * 1e6:.1f}"
                          + ("" if clean else " built"))
            if idx >= 4 and idx % 2 == 1:
                self._pair_done(st, (idx - 4) // 2)

    def _probe_done(self, key, st: _Shape, bar: float) -> None:
        """The quick pair's or the probe pair's agreement: a split slower by more than `bar` on
        some rank goes whole now, after WARM + q or WARM + q + r split calls (a split that loses
        costs a trial that few calls); otherwise the probe goes on, then the paired blocks
        decide. A probe that holds a pause or a build says nothing. Its whole verdict never
        lengthens the interval to the next trial (one short pair can be wrong)."""
        s, w = st.pair
        gain = math.log(w / s) if self._telling(st) else 0.0
        got = self._swap([1, _OFF + int(1e6 * gain), 0, int(1e7 * s), int(1e7 * w)])
        st.pair, st.clean = [0.0, 0.0], [True, True]
        if min(g[1] - _OFF for g in got) / 1e6 >= -math.log1p(bar):
            return                                           # not clearly slower: on to the next part
        self._verdict(key, st, True, got, probe=True)

    @staticmethod
    def _telling(st: _Shape) -> bool:
        """The paces just read say something: both timed, no prepared call built in either, and
        within PAIR_RATIO of each other (else a pause fell in one)."""
        s, w = st.pair
        return all(st.clean) and s > 0 and w > 0 and max(s, w) <= PAIR_RATIO * min(s, w)

    @staticmethod
    def _pair_done(st: _Shape, p: int) -> None:
        """Pair p read: kept unless it is the trial's first (its split calls warm up: the
        lanes' first use after the whole calls), a prepared call was built in it, or it holds a
        pause (its paces differ more than PAIR_RATIO times)."""
        s, w = st.pair
        if p > 0 and Arbiter._telling(st):
            st.logs.append(math.log(w / s))
            st.sums[0] += s
            st.sums[1] += w
        st.pair, st.clean = [0.0, 0.0], [True, True]

    def _agree(self, key, st: _Shape, pairs: int) -> None:
        n = len(st.logs)
        mean, se = _stats(st.logs)
        mine = [n, _OFF + int(1e6 * mean), int(1e6 * min(se, 1.0)),
                int(1e7 * st.sums[0] / max(n, 1)), int(1e7 * st.sums[1] / max(n, 1))]
        got = self._swap(mine)
        least = min(g[0] for g in got)
        lows = [(g[1] - _OFF - _t95(g[0]) * g[2]) / 1e6 for g in got]
        highs = [(g[1] - _OFF + _t95(g[0]) * g[2]) / 1e6 for g in got]
        bar = math.log1p(MARGIN)
        if least >= MIN_PAIRS and min(lows) > bar:
            whole = False
        elif (least >= MIN_PAIRS and min(highs) < bar) or pairs >= MAX_PAIRS:
            whole = True
        else:
            return                                           # not clear yet: more pairs
        self._verdict(key, st, whole, got)

    def _verdict(self, key, st: _Shape, whole: bool, got: list, probe: bool = False, watch: bool = False) -> None:
        split_us, whole_us = (max(g[i] for g in got) / 10.0 for i in (3, 4))
        # a split kept: this rank's whole pace in the trial, which the watch compares with (_watch)
        base = st.sums[1] / len(st.logs) if not whole and st.logs and self.watch else 0.0
        # a watch's verdict keeps the interval the trial set (a repeated split doubled it) and the
        # trial's count; otherwise the next trial counts from the call after this one (a verdict
        # comes at a block's first call)
        if not watch:
            if not probe and st.verdicts and whole == st.full:
                st.reprobe = min(2 * st.reprobe, REPROBE_MAX)      # the same again: look less often
            else:
                st.reprobe = REPROBE
            if not probe:
                st.verdicts, st.full = st.verdicts + 1, whole
            st.start = st.n
        st.whole, st.trying = whole, False
        st.logs, st.sums = [], [0.0, 0.0]
        self._release(st)
        st.base, st.wcalls = base, _whole_periods(WATCH, st.period)
        self.decisions.append((key, split_us, whole_us, whole, "watch" if watch else "probe" if probe else "trial"))
        self.count += 1
        if len(self.decisions) > 2 * KEPT:          # a long job: the list must not grow without end
            del self.decisions[:-KEPT]


class GpuPace:
    """The trials' clock on GPUs: a mark is a timing event recorded on the caller's current
    stream, and a block's pace the GPU's time between its first and last marks. A job whose host
    runs ahead of its GPU (DDP's steps: the host queues a step's work milliseconds before the GPU
    runs it) shows its speed on the GPU, not in its host's time between calls: there a split
    call's extra host time looked like a loss (the probe sent DDP's buckets whole, split/whole
    host pace 850/307 and 1076/758 us, 2 x H200, 2026-11-27, while the copy engines ran its steps
    1.11-1.13x faster). A host-bound job's GPU waits for its host, so its GPU pace is the host's.
    Reading a span waits for the block's last mark to happen on the GPU (a paired block is read
    at the end of the block after it, when that mark has usually happened). Where events cannot
    be used (a capturing stream, a driver error) the mark is the host's clock.

    `slower` (BRAID_TRIAL_PACE=max): a span is the longer of the GPU's and the host's. A job runs
    in steady state at the pace of the slower of its host and its GPU, and alternating blocks
    hide a host-bound mode from the GPU's clock: a split block that follows a whole one starts
    with the GPU behind its host (the whole calls let the host run ahead), and the GPU then runs
    the block's work at its own speed. DDP's defaults on 2 x H200 kept a split at GPU paces of
    717/793 us a call whose steps then ran 0.91 of NCCL's, its host 6.9 ms a step against the
    GPU's 5.6 (2026-11-27). The host's clock leaves out the trial's own waits: inside span()
    (reading a span waits for its last mark) and the ranks' exchanges of paces (hold())."""

    def __init__(self, device_index: int, slower: bool = False):
        from ..lanes import _cuda
        from .prepared import _RAW
        self._cuda, self._raw, self._dev = _cuda, _RAW, device_index
        self._free: list[int] = []
        self._slower = slower
        self._held = 0.0        # seconds the host waited inside span(): not the job's own time

    def __call__(self):
        now = time.perf_counter() - self._held
        cu = self._cuda
        try:
            stream = self._raw(self._dev)
            if cu.stream_capturing(stream):
                return now
            ev = self._free.pop() if self._free else cu.event_create(timing=True)
        except Exception:          # noqa: BLE001 (the host's clock instead)
            return now
        try:
            cu.event_record(ev, stream)
        except Exception:          # noqa: BLE001
            self._free.append(ev)
            return now
        return (ev, now)

    def hold(self, seconds: float) -> None:
        """`seconds` of the host's time were the trial's own (the ranks' exchange of paces)."""
        self._held += seconds

    def span(self, a, b) -> float:
        if isinstance(a, tuple) and isinstance(b, tuple):
            t0 = time.perf_counter()
            try:
                s = self._cuda.event_elapsed_s(a[0], b[0])     # waits for b on the host
            except Exception:      # noqa: BLE001
                s = b[1] - a[1]
            self._held += time.perf_counter() - t0
            if self._slower:
                s = max(s, b[1] - a[1])
        else:
            s = (b[1] if isinstance(b, tuple) else b) - (a[1] if isinstance(a, tuple) else a)
        return s

    def drop(self, mark) -> None:
        if isinstance(mark, tuple):
            self._free.append(mark[0])

    def close(self) -> None:
        for ev in self._free:
            try:
                self._cuda.event_destroy(ev)
            except Exception:      # noqa: BLE001
                pass
        self._free = []


def trial_log(path: str, rank: int):
    """A log(line) that appends a line to `path`.`rank` (BRAID_TRIAL_LOG), or None for no path."""
    if not path:
        return None
    name = f"{path}.{rank}"

    def log(line: str) -> None:
        with open(name, "a") as f:
            f.write(line + "\n")
    return log


def trial_cost(split_us: float, whole_us: float, calls: int, window: int = 100) -> tuple[float, float]:
    """What the schedule costs a job on a model clock: one rank, `calls` calls of one shape that
    take split_us split and whole_us whole. Returns the largest extra time of any `window`
    consecutive calls against taking every call whole, and the extra time over the whole job, both
    as fractions of the all-whole time (negative where the split wins)."""
    t = [1.0]
    arb = Arbiter(lambda values: [list(values)], clock=lambda: t[0])
    extra = []
    for _ in range(calls):
        whole = arb.whole("shape")
        t[0] += (whole_us if whole else split_us) * 1e-6
        extra.append(0.0 if whole else split_us - whole_us)
    run = sum(extra[:window])
    worst = run
    for i in range(window, calls):
        run += extra[i] - extra[i - window]
        worst = max(worst, run)
    return worst / (window * whole_us), sum(extra) / (calls * whole_us)
