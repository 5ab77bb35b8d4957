"""A call's exchanges that come before the ledger counts it: the prepared call's round on its fast
path and the whole-or-split trials' agreement. While such an exchange waits, the call must be
counted: a peer still at the previous call, which it took whole, then reads as late, not as a
different call (CallLedger.check_peer raised PeerMismatchError for it: a rank replaying a prepared
all_reduce in DDP's set-up while its peer was still leaving an uneven all_to_all NCCL took whole,
1 H200 shared by 2 ranks, 2026-11-26). After the exchange the count is what the call's own path
makes it: one more on a hit, unchanged on a miss (the full path counts the call itself).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from braid.comm import callpath
from braid.comm.callpath import CallPath
from braid.comm.communicator import Communicator
from braid.comm.ledger import CallLedger
from braid.comm.prepared import Ticket


class _Segment:
    """Records the caller's call count at each wait; answers with `words` per rank."""

    def __init__(self, comm, words):
        self.comm, self.words, self.seen = comm, words, []

    def post_values(self, values):
        return (1, len(values))

    def read_values(self, token, what):
        self.seen.append((what, self.comm.ledger.ncalls))
        return [[w] + [0] * (token[1] - 1) for w in self.words]

    def exchange_values(self, values, what):
        self.seen.append((what, self.comm.ledger.ncalls))
        return [list(values)]


def _ledger():
    led = CallLedger(0, True, None)
    led.count(("all_to_all_single", 64000, "torch.float32", "whole"))
    led.ncalls = 81
    return led


def _comm(words, key):
    entry = object()
    tk = Ticket(base=5, bal=0, key=key, entry=entry, op="all_reduce",
                ledger=("all_reduce", 4096, "torch.float32", "split"), lanes=["ce"])
    prep = SimpleNamespace(
        tickets={"t": tk}, enabled=True, stats={"round_us": 0.0}, fast=None,
        finish_word=lambda base, inp, lanes: 7,
        get=lambda k: entry if k == key else None,
        launch=lambda e, stream, async_op, tensors: "replayed")
    comm = SimpleNamespace(
        prepared=prep, rounds=None, pending=[],
        faults=SimpleNamespace(closed=False, aborted=False, watchdog=None, give_up=lambda exc: None),
        policy=SimpleNamespace(balancer=SimpleNamespace(version=0), pending={}),
        ce=SimpleNamespace(stream=None), ledger=_ledger(), round=None)
    comm.segment = _Segment(comm, words)
    for name in ("_ticket", "ticket_word", "replay_agreed"):
        setattr(comm, name, getattr(CallPath, name).__get__(comm))
    return comm


@pytest.fixture(autouse=True)
def _not_capturing(monkeypatch):
    monkeypatch.setattr(callpath, "_capturing", lambda: False)


def test_a_replay_counts_its_call_while_its_round_waits():
    comm = _comm(words=[7, 7], key=(7, 7))
    assert CallPath.fast_prepared(comm, "t", None, (), False) == "replayed"
    assert comm.segment.seen == [("all_reduce", 82)]      # counted while waiting: the peer at 81 is late
    assert comm.ledger.ncalls == 82 and comm.ledger.last_call[0] == "all_reduce"


def test_a_round_that_misses_leaves_the_count_to_the_full_path():
    comm = _comm(words=[7, 9], key=(7, 7))                  # the peer's word differs: a miss
    assert CallPath.fast_prepared(comm, "t", None, (), False) is None
    assert comm.segment.seen == [("all_reduce", 82)]
    assert comm.ledger.ncalls == 81 and comm.round == (7, [[7, 0, 0, 0, 0, 0, 0], [9, 0, 0, 0, 0, 0, 0]])


def test_the_trials_agreement_counts_the_call_it_belongs_to():
    comm = SimpleNamespace(ledger=_ledger())
    comm.segment = _Segment(comm, [])
    assert Communicator._trial_exchange(comm, [3, 4]) == [[3, 4]]
    assert comm.segment.seen == [("whole-or-split trial", 82)]
    assert comm.ledger.ncalls == 81                         # the op's own path counts it after

    def fail(values, what):
        raise RuntimeError("peer gone")
    comm.segment.exchange_values = fail
    with pytest.raises(RuntimeError):
        Communicator._trial_exchange(comm, [1])
    assert comm.ledger.ncalls == 81


def test_a_round_another_agreement_carried_replays_without_one_of_its_own(monkeypatch):
    """An all_to_all with equal split sizes: the copy engines' round carried each rank's word
    (comm/uneven.py, Even); where each is the program's, the launch follows with no second round,
    and the call keeps the count the agreement gave it."""
    comm = _comm(words=[], key=(7, 7))
    tk, word = comm.ticket_word("t", None)
    assert tk is comm.prepared.tickets["t"] and word == 7
    assert comm.ticket_word("other", None) == (None, 0)                # nothing prepared for it
    assert comm.replay_agreed(tk, [7, 7], None, (), False) == "replayed"
    assert comm.segment.seen == [] and comm.ledger.ncalls == 81 and comm.ledger.last_call[0] == "all_reduce"
    assert comm.replay_agreed(tk, [7, 0], None, (), False) is None       # a rank without it: no launch
    assert comm.replay_agreed(tk, [7], None, (), False) is None
    comm.policy.balancer.version = 1                                     # a balancer move: none
    assert comm.ticket_word("t", None) == (None, 0)
    comm.policy.balancer.version = 0
    comm.rounds = object()                                               # a rounds thread: its own replay
    assert comm.ticket_word("t", None) == (None, 0)
    comm.rounds = None
    monkeypatch.setattr(callpath, "_capturing", lambda: True)          # a capture takes the full path
    assert comm.ticket_word("t", None) == (None, 0)
