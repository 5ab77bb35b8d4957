"""The fault paths a GPU world takes that a CPU world cannot reach (GPU runs of them:
tests/gpu/test_gpu_faults.py), checked piece by piece with stand-ins:
- a mismatch read after a peer's abort reports the abort (on GPUs the abort pushes the peer's
  counters far ahead, which ends waits with a read of no real post);
- after a watchdog gave up, flags are kept released, and the process is ended (exit code 70) only
  when NCCL's abort has not returned, or a call is still inside a step, BRAID_ABORT_EXIT_S later.
"""
from __future__ import annotations

import threading
import time

import pytest

from braid import envs
from braid.comm import ledger
from braid.errors import LaneFailureError, PeerMismatchError


class _Segment:
    """What the ledger's fault paths read of a node segment."""

    def __init__(self, aborted_by=None):
        self.closed = False
        self.aborted_by = aborted_by
        self.marked = []
        self.releases = 0

    def raise_if_peer_aborted(self):
        if self.aborted_by is not None:
            raise LaneFailureError(f"rank {self.aborted_by} aborted: injected")

    def mark_aborted(self, kind, text):
        self.marked.append((kind, text))

    def release_flags(self):
        self.releases += 1


class _Faults(ledger.Faults):
    def __init__(self, segment):
        self.segment = segment


def test_a_mismatch_read_after_a_peers_abort_reports_the_abort():
    seg = _Segment(aborted_by=2)
    with pytest.raises(LaneFailureError, match="rank 2 aborted"):
        _Faults(seg).give_up(PeerMismatchError("rank 2 made a different call at collective #7"))
    assert seg.marked == []


def test_a_mismatch_without_an_abort_is_marked_as_before():
    seg = _Segment()
    exc = PeerMismatchError("ranks 0 and 1 made different calls")
    exc.peers_left_waiting = True
    _Faults(seg).give_up(exc)                      # no abort anywhere: the mismatch is marked
    assert [k for k, _ in seg.marked] == [1]
    _Faults(seg).give_up(PeerMismatchError("ranks disagree on dtype"))    # every rank saw it: not marked
    assert len(seg.marked) == 1


def _keep(seg, busy, monkeypatch, limit="0.3", run_s=1.0):
    """Run keep_released for `run_s` seconds; the process ends it would have made, as a list."""
    ended = []

    def end(rank, why, lim):
        ended.append((rank, why, lim))
        raise SystemExit          # what os._exit would have done: leave the loop

    monkeypatch.setattr(ledger, "_end_process", end)
    stop = threading.Event()
    threading.Timer(run_s, stop.set).start()
    with envs.override(BRAID_ABORT_EXIT_S=limit):
        try:
            ledger.keep_released(seg, stop, 3, "rank 1 has exited", 0.05, busy=busy)
        except SystemExit:
            pass
    stop.set()
    return ended


def test_flags_stay_released_and_nothing_ends_when_nccl_let_go(monkeypatch):
    seg = _Segment()
    assert _keep(seg, lambda: False, monkeypatch) == []
    assert seg.releases >= 5


def test_a_call_still_inside_a_step_ends_the_process_after_the_limit(monkeypatch):
    t0 = time.monotonic()
    ended = _keep(_Segment(), lambda: True, monkeypatch, run_s=5.0)
    assert ended == [(3, "rank 1 has exited", 0.3)]
    assert 0.3 <= time.monotonic() - t0 < 3.0


def test_an_nccl_abort_that_does_not_return_ends_the_process(monkeypatch):
    hold = threading.Event()
    stuck = threading.Thread(target=hold.wait, name="braid-nccl-abort", daemon=True)
    stuck.start()
    try:
        assert ledger._nccl_abort_stuck()
        assert len(_keep(_Segment(), None, monkeypatch, run_s=5.0)) == 1
    finally:
        hold.set()
        stuck.join()
    assert not ledger._nccl_abort_stuck()


def test_zero_never_ends_the_process(monkeypatch):
    assert _keep(None, lambda: True, monkeypatch, limit="0", run_s=0.6) == []
