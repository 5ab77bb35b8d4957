"""Whole or split, learned in the job: a split that wins alone can lose inside a training step.

The calibration times each op alone, calls back to back. Inside a job a split call costs more than
its GPU time: every prepared call starts with a round of words between ranks, and the rank that
arrives first waits on the host for the last. Where the job is bound by its CPU (FSDP2's hooks,
say), that wait stalls the rank's next launches: on 2 x H100 (2026-11-25, `braid bench --workload
fsdp`) the round took 124 us per call inside FSDP2 steps against 6-12 us back to back, and the
copy engines' split, faster than NCCL alone by 4-13% at those sizes, made the step 7-15% slower.

So, for a call shape the calibration splits, the job itself decides, from its own pace. Per shape
(op and arguments, as the op's fast path keys them), counted in calls that every rank makes alike:

- the first WARM calls split (the prepared call is built);
- the next PHASE calls split, the PHASE after them go to the native library whole, and this rank
  sums the time between consecutive calls of the shape in each phase (the job's pace: the other
  work of its steps is the same in both phases);
- at the next call every rank posts its two means and all take the slowest rank's: the split is
  kept only where its pace beat the whole call's by MARGIN, else the shape goes whole;
- every REPROBE calls the phases run again (the job may change, the machine may drift).

Only asynchronous calls take part (the backend's, and the frameworks': DDP, FSDP2); a synchronous
call keeps the calibration's verdict. The counts advance on the op's fast path, which every rank
takes for contiguous tensors on its own device; a rank whose call leaves that path (a
non-contiguous tensor) while its peers stay would disagree with them, and the round of words then
raises on every rank (PeerMismatchError or BraidTimeoutError), as any disagreement does.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

WARM = 16           # split calls before timing (the prepared call is built in the first)
PHASE = 48          # calls timed per side
MARGIN = 0.02       # the split must beat the whole call's pace by this fraction to be kept
REPROBE = 4096      # calls between two trials of the same shape
MAX_SHAPES = 256    # shapes followed at once (the oldest is forgotten: it starts over)


@dataclass
class _Shape:
    n: int = 0                  # calls of this shape so far (the same on every rank)
    start: int = 0              # call number where the current trial began
    whole: bool = False         # the verdict between trials
    last: float = 0.0           # this rank's clock at the previous call (0: none in this phase)
    sums: list = field(default_factory=lambda: [0.0, 0.0])   # seconds between calls: split, whole
    counts: list = field(default_factory=lambda: [0, 0])


class Arbiter:
    """Per call shape: split or whole now (the same answer on every rank, at the same call)."""

    def __init__(self, exchange, enabled: bool = True, clock=time.perf_counter):
        self._exchange = exchange           # values -> every rank's values (a node-segment round)
        self.enabled = enabled
        self._clock = clock
        self._shapes: dict = {}
        self.decisions: list[tuple] = []    # (shape, split us, whole us, whole?) of each trial

    def whole(self, key) -> bool:
        """Call once per asynchronous call of a split shape, before it is posted: True when this
        call goes to the native library whole."""
        if not self.enabled:
            return False
        st = self._shapes.get(key)
        if st is None:
            if len(self._shapes) >= MAX_SHAPES:
                self._shapes.pop(next(iter(self._shapes)))
            st = self._shapes[key] = _Shape()
        c = st.n - st.start
        if c >= WARM + 2 * PHASE + REPROBE:         # a new trial of the same shape
            st.start, c = st.n, 0
        st.n += 1
        if c < WARM:
            return st.whole
        if c < WARM + 2 * PHASE:
            side = 0 if c < WARM + PHASE else 1
            now = self._clock()
            if st.last and c != WARM + PHASE:        # an interval inside one phase
                st.sums[side] += now - st.last
                st.counts[side] += 1
            st.last = now
            return side == 1
        if c == WARM + 2 * PHASE:
            mine = [int(1e7 * s / max(k, 1)) for s, k in zip(st.sums, st.counts)]   # 0.1 us
            got = self._exchange(mine)
            split_us, whole_us = (max(g[i] for g in got) / 10.0 for i in (0, 1))
            st.whole = not split_us < whole_us * (1.0 - MARGIN)
            self.decisions.append((key, split_us, whole_us, st.whole))
            st.last, st.sums, st.counts = 0.0, [0.0, 0.0], [0, 0]
        return st.whole

