"""The uneven all_to_all's round on GPUs (comm/uneven.py, UnevenAgreement.round / verdict), run on
fake ranks in threads over a fake node segment: every rank decides alike at every call; after
SMALL_RUN calls in a row that went to NCCL whole the round is read one call late (no rank waits),
a call that belongs to the copy engines ends that at the next call, split sizes that disagree
raise PeerMismatchError on every rank (one call late when the round was deferred), and ranks
whose calibrations differ take the full path. The GPU part (the copy engines' pulls) runs in
tests/gpu/test_gpu_uneven_a2a.py."""
from __future__ import annotations

import threading

import pytest

from braid.comm import uneven as U
from braid.comm.ledger import CallLedger
from braid.errors import PeerMismatchError

MiB = 1 << 20


class Board:
    """The node segment's value rounds, shared by the fake ranks of one process."""

    def __init__(self, world):
        self.world, self.posts, self.cv = world, {}, threading.Condition()


class Seg:
    def __init__(self, board, rank):
        self.b, self.rank, self.seq, self.deferred, self.reads, self.defers = board, rank, 0, None, 0, 0

    def post_values(self, values):
        self._settle()
        self.seq += 1
        with self.b.cv:
            self.b.posts[(self.rank, self.seq)] = list(values)
            self.b.cv.notify_all()
        return self.seq

    def read_values(self, token, what):
        self.reads += 1
        with self.b.cv:
            ok = self.b.cv.wait_for(lambda: all((r, token) in self.b.posts for r in range(self.b.world)), 10)
            assert ok, f"rank {self.rank} waited for round {token}"
            return [list(self.b.posts[(r, token)]) for r in range(self.b.world)]

    def defer(self, token, what):
        self.deferred = token
        self.defers += 1

    def _settle(self):
        if self.deferred is not None:
            token, self.deferred = self.deferred, None
            self.late = self.read_values(token, "late")

    def settle(self):
        self.late = None
        self._settle()
        return self.late


class _Policy:
    """Just what the round asks of the split policy: the copy engines from 64 MiB, else NCCL."""

    def __init__(self, digest):
        self.fixed, self.digest = None, digest
        self.balancer = type("B", (), {"version": 0})()

    def shares_for(self, op, size, lanes):
        return {"ce": 1.0} if size >= 64 * MiB else {"nccl": 1.0}

    def native_ok(self, shares):
        return set(shares) == {"nccl"}


class Rank:
    """One fake rank: its agreement (the real one) over the fake segment, with a policy that
    gives the copy engines 64 MiB and more, and records of what it gave up and aborted."""

    def __init__(self, board, rank, agree_digest="calib", policy=None):
        self.rank, self.world_size = rank, board.world
        self.segment = Seg(board, rank)
        self.ledger = CallLedger(rank, True, None)
        self.gave_up, self.aborted_native = [], []
        self.uneven = U.UnevenAgreement(
            rank, board.world, self.segment, policy or _Policy(agree_digest), self.ledger, lambda: ["ce", "nccl", "host"],
            lambda: "auto", lambda: None, self.gave_up.append, lambda why, wait=True: self.aborted_native.append(why),
            32 * MiB)

    def call(self, matrix):
        """One uneven call with this matrix (bytes; rows: senders): (small, lean?)."""
        small, lean = self.verdict(matrix)
        return small, lean is not None

    def verdict(self, matrix, pword=None):
        """One uneven call with this matrix: (small, lean) as the round returns them; `pword`:
        this rank's prepared word for the balanced call (default 7000 + rank)."""
        me, w = self.rank, self.world_size
        row, recv = list(matrix[me]), [matrix[s][me] for s in range(w)]
        big = max([v for d, v in enumerate(row) if d != me] + [v for s, v in enumerate(recv) if s != me])
        pword = 7000 + me if pword is None else pword
        _, small, lean = self.uneven.round("all_to_all_single", big,
                                           [1000 + me, self.uneven.agreement()] + row + [pword], recv)
        return small, lean


def world(n, body, **kw):
    board = Board(n)
    ranks = [Rank(board, r, **kw) for r in range(n)]
    out, errs = [None] * n, [None] * n

    def run(r):
        try:
            out[r] = body(ranks[r])
        except BaseException as exc:         # noqa: BLE001 - reported below
            errs[r] = exc
    ts = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    return ranks, out, errs


def m2(a, b):
    """Two ranks: rank 0 sends a bytes to rank 1, rank 1 sends b to rank 0 (and 1 MiB to itself)."""
    return [[MiB, a], [b, MiB]]


def test_nccl_calls_stop_waiting_after_a_run_and_a_copy_engine_call_ends_it():
    seq = [m2(8 * MiB, 3 * MiB)] * 30 + [m2(80 * MiB, 70 * MiB)] + [m2(80 * MiB, 70 * MiB)] * 3

    def body(rk):
        return [rk.call(m) for m in seq], rk.segment.defers
    ranks, out, errs = world(2, body)
    assert errs == [None, None], errs
    (a, defers0), (b, defers1) = out
    assert a == b                                        # every rank decided alike at every call
    assert all(small and not lean for small, lean in a[:U.SMALL_RUN]), a[:U.SMALL_RUN]
    assert all(small for small, _ in a[U.SMALL_RUN:31])   # deferred: NCCL whole, the ce call too
    assert a[31:] == [(False, True)] * 3                 # read late, then the copy engines again
    # calls SMALL_RUN..30 did not wait for the peers' values: read at the next call
    assert defers0 == defers1 == 31 - U.SMALL_RUN


def test_split_sizes_that_disagree_raise_on_every_rank_also_one_call_late():
    def body(rk):
        for _ in range(U.SMALL_RUN + 2):
            rk.call(m2(8 * MiB, 3 * MiB))
        bad = m2(8 * MiB, 3 * MiB) if rk.rank == 0 else m2(9 * MiB, 4 * MiB)   # both sides disagree
        rk.call(bad)                                     # deferred: NCCL's call already went
        with pytest.raises(PeerMismatchError, match="split sizes disagree"):
            rk.call(m2(8 * MiB, 3 * MiB))
        return len(rk.gave_up)
    _, out, errs = world(2, body)
    assert errs == [None, None], errs
    assert out == [1, 1]


def test_split_sizes_that_disagree_raise_at_once_before_the_run():
    def body(rk):
        bad = m2(8 * MiB, 3 * MiB) if rk.rank == 0 else m2(9 * MiB, 4 * MiB)
        with pytest.raises(PeerMismatchError):
            rk.call(bad)
        return len(rk.gave_up)
    _, out, errs = world(2, body)
    assert errs == [None, None] and out == [1, 1], errs


def test_a_mismatch_one_side_sees_raises_there_and_gives_up():
    """Rank 1 sends what rank 0 does not expect; rank 1's own column agrees. Rank 0 raises and
    gives up (its abort mark is what ends rank 1's wait in a real world)."""
    def body(rk):
        bad = m2(8 * MiB, 3 * MiB) if rk.rank == 0 else m2(8 * MiB, 4 * MiB)
        if rk.rank == 0:
            with pytest.raises(PeerMismatchError, match="rank 1 sends 4194304 bytes to rank 0"):
                rk.call(bad)
        else:
            rk.call(bad)
        return len(rk.gave_up)
    _, out, errs = world(2, body)
    assert errs == [None, None] and out == [1, 0], errs


def test_ranks_whose_calibrations_differ_take_the_full_path():
    board = Board(2)
    ranks = [Rank(board, 0, agree_digest="a"), Rank(board, 1, agree_digest="b")]
    got = [None, None]

    def run(r):
        got[r] = ranks[r].call(m2(80 * MiB, 70 * MiB))
    ts = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10)
    assert got == [(False, False), (False, False)]       # neither NCCL whole nor the copy engines


def test_small_demands_and_four_ranks_decide_alike():
    def body(rk):
        res = []
        for i in range(40):
            n = 4
            big = 80 * MiB if i % 7 == 3 else 2 * MiB
            m = [[(big if (s + d + i) % 3 == 0 else MiB) for d in range(n)] for s in range(n)]
            res.append(rk.call(m))
        return res
    _, out, errs = world(4, body)
    assert errs == [None] * 4, errs
    assert out[0] == out[1] == out[2] == out[3]


def test_skewed_is_the_routers_rule():
    assert U.skewed([[0, 3 * MiB, MiB], [MiB, 0, MiB], [MiB, MiB, 0]])            # 3 MiB >= 1.5 x 1.33 MiB
    assert not U.skewed([[0, 2 * MiB, 2 * MiB], [2 * MiB, 0, 2 * MiB], [2 * MiB, 2 * MiB, 0]])  # balanced
    assert not U.skewed([[0, MiB], [0, 0]])                                        # not over 1 MiB
    assert not U.skewed([[5]])                                                     # one rank: no pairs


def test_two_ranks_tell_alone_that_small_uneven_calls_are_nccls_and_still_check_every_so_often():
    """Two ranks: what rank 0 sends is what rank 1 receives, so each can tell alone, alike, that a
    call is NCCL's whole (no round); every PAIR_CHECK-th such call takes the round; a call that
    may belong to the copy engines, or fixed shares, always does."""
    board = Board(2)
    ranks = [Rank(board, r) for r in range(2)]
    for rk in ranks:
        rk.uneven.pair_calls, rk.ledger.ncalls = 0, 0
    seq = [(3 * MiB, 7 * MiB), (15 * MiB, MiB), (16 * MiB, 0), (0, 40 * MiB)] * (U.PAIR_CHECK // 2)
    said = [[], []]
    for m01, m10 in seq:
        for r, rk in enumerate(ranks):
            sent, received = (m01, m10) if r == 0 else (m10, m01)
            said[r].append(rk.uneven.pair_whole(sent, received))
    assert said[0] == said[1]                                  # alike, with no word exchanged
    small = [2 * max(p) < 32 * MiB for p in seq]
    assert not any(w for w, s in zip(said[0], small) if not s)  # 16 MiB one way: not decided alone
    n_small = sum(small)
    assert said[0].count(True) == n_small - n_small // U.PAIR_CHECK   # every PAIR_CHECK-th: the round
    assert ranks[0].ledger.ncalls == said[0].count(True)               # in the ledger
    ranks[0].uneven.policy.fixed = {"nccl": 1.0}
    assert not ranks[0].uneven.pair_whole(MiB, MiB)                  # fixed shares: the round decides


def _pair_world(views):
    """Two fake ranks making uneven calls the way _a2av_agree does: alone when pair_whole says
    so, else the round. views[r][i]: (sent, received) of rank r's call i. Returns (errors, rounds)."""
    def body(rk):
        rk.uneven.pair_calls, rk.ledger.ncalls = 0, 0
        rounds = 0
        for sent, received in views[rk.rank]:
            if rk.uneven.pair_whole(sent, received):
                continue
            me = rk.rank
            m = [[MiB, 0], [0, MiB]]
            m[me][1 - me], m[1 - me][me] = sent, received
            rk.call(m)
            rounds += 1
        return rounds
    ranks, out, errs = world(2, body)
    return errs, out, ranks


def test_two_ranks_that_agreed_alone_pass_the_check():
    calls = [(3 * MiB + i, 2 * MiB - i) for i in range(3 * U.PAIR_CHECK)]
    views = [calls, [(b, a) for a, b in calls]]               # rank 1 sends what rank 0 receives
    errs, rounds, _ = _pair_world(views)
    assert errs == [None, None], errs
    assert rounds == [3, 3]                                   # one round per PAIR_CHECK calls


def test_split_sizes_that_disagreed_in_a_call_decided_alone_raise_at_the_check_on_both_ranks():
    calls = [(3 * MiB + i, 2 * MiB - i) for i in range(2 * U.PAIR_CHECK)]
    theirs = [(b, a) for a, b in calls]
    theirs[10] = (theirs[10][0] + 4096, theirs[10][1])      # one call, one direction, off by a page
    errs, _, ranks = _pair_world([calls, theirs])
    assert all(isinstance(e, PeerMismatchError) for e in errs), errs
    assert all("disagreed in one of the last" in str(e) for e in errs)
    assert all(len(rk.gave_up) == 1 for rk in ranks)         # each gave up (the peer's watchdog aborts)
    assert all(len(rk.aborted_native) == 1 for rk in ranks)  # and aborted its own NCCL calls


class _SplitPolicy(_Policy):
    """Fixed shares over the copy engines and the host lane (a split the full path would post)."""

    def __init__(self, shares):
        super().__init__("calib")
        self.fixed, self.shares = {"*": shares}, shares

    def shares_for(self, op, size, lanes):
        return dict(self.shares)


def test_equal_split_sizes_over_several_lanes_are_a_balanced_call():
    """torch's functional all_to_all_single passes equal split sizes where the user gave none: a
    matrix whose entries are all equal, split over several lanes, is a balanced call on every rank
    (the prepared path, which a CUDA graph can capture), not the full path or the copy engines'
    uneven path, which post every call; a matrix with one entry off is not."""
    even = [[4 * MiB] * 3 for _ in range(3)]
    off = [row[:] for row in even]
    off[2][1] += 4096

    def body(rk):
        return [rk.verdict(m) for m in (even, off, even)]
    words = U.Even((7000, 7001, 7002))        # every rank's prepared word, carried by the round
    for shares, want in (({"ce": 0.5, "host": 0.5}, [(False, words), (False, None), (False, words)]),
                         ({"nccl": 0.5, "ce": 0.5}, [(False, words), (False, None), (False, words)])):
        # (one entry off: the full path, lean None)
        board = Board(3)
        ranks = [Rank(board, r, policy=_SplitPolicy(shares)) for r in range(3)]
        out = [None] * 3
        ts = [threading.Thread(target=lambda r=r: out.__setitem__(r, body(ranks[r]))) for r in range(3)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        assert out == [want] * 3, (shares, out)
    board = Board(2)
    ranks = [Rank(board, r, policy=_SplitPolicy({"ce": 1.0})) for r in range(2)]
    out = [None] * 2
    skew = [[4 * MiB, 5 * MiB], [4 * MiB, 4 * MiB]]
    ts = [threading.Thread(target=lambda r=r: out.__setitem__(r, [ranks[r].verdict([[4 * MiB] * 2] * 2, 5 - 5 * r),
                                                                  ranks[r].verdict(skew)])) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    for (small, lean), (small2, lean2) in out:
        assert small is False and lean == U.Even((5, 0)), out    # the copy engines alone, even (rank 1: no word)
        assert small2 is False and lean2 is not None and not isinstance(lean2, U.Even), out    # uneven: their own path


def test_even_is_every_entry_the_same_and_more_than_none():
    assert U.even([[5, 5], [5, 5]])
    assert not U.even([[5, 5], [5, 6]])
    assert not U.even([[0, 0], [0, 0]])
    assert U.even([[7]]) and not U.even([])
