"""The watchdog's rule for a peer that stays behind (comm/ledger.py, `_Watchdog.late_peer`): on
GPUs a call NCCL takes whole posts nothing in the node segment, so a rank that made it waits on its
GPU for a peer that may never come; once a peer's published count of calls stayed below this
rank's for BRAID_TIMEOUT_S, the watchdog gives up, naming the peer. Checked with a stand-in
segment and explicit times."""
from __future__ import annotations

from braid.comm.ledger import _Watchdog


class _Segment:
    def __init__(self):
        self.calls: dict[int, int | None] = {}

    def status(self, rank):
        c = self.calls.get(rank)
        if c is None:
            return None
        return {"calls": c, "time": 0.0, "op": "all_reduce", "dtype": "float32", "path": "whole", "nbytes": 4096}


def _watchdog(rank=0, world=3, late_after=5.0):
    w = _Watchdog.__new__(_Watchdog)      # no thread: the rule alone
    w._segment, w._rank, w._world, w._late_after, w._behind = _Segment(), rank, world, late_after, {}
    return w


def test_a_peer_behind_for_longer_than_the_limit_is_named():
    w = _watchdog()
    w._segment.calls = {1: 7, 2: 6}
    assert w.late_peer(7, 100.0) == ""          # rank 2 behind from now on
    assert w.late_peer(7, 104.9) == ""
    why = w.late_peer(7, 105.2)
    assert why.startswith("rank 2 has not made call #7 for 5 s while rank 0 made 7 calls"), why
    assert "its latest is call #6, all_reduce of 4096 bytes of float32" in why
    assert "rank 1" not in why.split(";")[0]


def test_the_clock_restarts_when_the_peer_moves_and_not_when_this_rank_does():
    w = _watchdog(world=2)
    w._segment.calls = {1: 3}
    assert w.late_peer(4, 0.0) == ""
    assert w.late_peer(6, 4.0) == ""            # this rank went on: the peer is still at call 3
    assert w.late_peer(6, 5.5) != ""
    w = _watchdog(world=2)
    w._segment.calls = {1: 3}
    assert w.late_peer(4, 0.0) == ""
    w._segment.calls = {1: 4}                   # caught up: no longer behind
    assert w.late_peer(4, 4.0) == ""
    assert w.late_peer(5, 6.0) == ""            # behind again from here
    assert w.late_peer(5, 10.9) == ""
    assert "rank 1 has not made call #5" in w.late_peer(5, 11.1)


def test_peers_level_or_ahead_and_a_peer_that_published_nothing():
    w = _watchdog(rank=1, world=3)
    w._segment.calls = {0: 9, 2: 12}            # level and ahead: never late
    assert all(w.late_peer(9, t) == "" for t in (0.0, 50.0, 500.0))
    w = _watchdog(rank=1, world=2)
    w._segment.calls = {}                       # rank 0 never published a call
    assert w.late_peer(2, 0.0) == ""
    assert "rank 0 has not made call #1" in w.late_peer(2, 6.0) and "it has made no call yet" in w.late_peer(2, 6.0)
