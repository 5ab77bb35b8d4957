"""The uneven all_to_all's cheap agreement on GPUs: is a call with split sizes NCCL's own, whole,
or the copy engines' alone, or a balanced call (every rank's split sizes equal: the prepared path
of a call without split sizes), or the full path's (the router, a split over several lanes)?

Each rank knows only its row and column of the traffic matrix. Rather than exchanging JSON
descriptors per call (4 x H200, 1 MiB hot: ~400 us per call, NCCL ~45), the ranks post a few
numbers through the node segment and decide alike from what every rank posted. What must advance
alike on every rank lives here and nowhere else: the run of calls agreed small (after SMALL_RUN
of them a round is read one call late), two ranks' count and running hash of the calls each
decided alone (checked every PAIR_CHECK-th call), and the receive column a late read checks.

Rejected: keeping these counters on the communicator beside the ops that read them (a fake
communicator in a test had to carry every one, and nothing said which must stay in step).
"""
from __future__ import annotations

import zlib
from typing import NamedTuple

from ..errors import LaneFailureError, PeerMismatchError
from .a2av import check_columns, matrix_of

ROUTE_MIN_BYTES = 1 << 20    # NIMBLE: multipath off at or below 1 MB

PAIR_MUL = 1_000_003          # the running hash of two ranks' calls decided alone (pair_whole)
MASK61 = (1 << 61) - 1
PAIR_CHECK = 64              # two ranks: every PAIR_CHECK-th uneven call NCCL takes whole still agrees in a round
SMALL_RUN = 16               # agreed-small uneven calls in a row after which their agreement is read one call late
# The copy engines' round ends with this value, so that it carries 6 + w values: never as many as
# a prepared call's word round (1 + len(prepared.NO_OBS) = 7) or the small calls' round (1). A
# segment round tells calls apart by their counts (node.read_values): with 5 + w values, two ranks
# where one made a balanced all_to_all and the other an uneven one would read each other's values
# as their own round's.
ROUND_TAG = 0xA2A5


def round_len(world: int) -> int:
    """The values of the copy engines' round: big, input word, agreement, row (world), prepared
    word, pair hash, ROUND_TAG."""
    return 6 + world


class Even(NamedTuple):
    """The round's verdict for a matrix whose entries are all equal, not NCCL's whole: the call is
    a balanced one (torch's functional all_to_all_single and DTensor pass equal split sizes where
    the user gave none) and takes the prepared path of a call without split sizes, which replays
    one program and can be captured in a CUDA graph; the full path posts its lanes every call,
    whose rising counters a captured graph would freeze. `words`: every rank's prepared word for
    that balanced call (0 where a rank has none), which the round carried: where each is the one
    the program was built with, the round was the replay's round too (Routing.all_to_all_single)."""
    words: tuple


def even(matrix: list[list[int]]) -> bool:
    """Every pair (a rank with itself too) carries the same bytes, more than none: the matrix of a
    call without split sizes."""
    first = matrix[0][0] if matrix and matrix[0] else 0
    return first > 0 and all(v == first for row in matrix for v in row)


def skewed(matrix: list[list[int]]) -> bool:
    """A matrix the router may plan (NIMBLE's rule): some pair carries more than ROUTE_MIN_BYTES
    and at least 1.5x the mean of the pairs between different ranks."""
    w = len(matrix)
    off = [matrix[s][d] for s in range(w) for d in range(w) if s != d]
    return bool(off) and max(off) > ROUTE_MIN_BYTES and max(off) >= 1.5 * sum(off) / len(off)


class UnevenAgreement:
    """One communicator's agreement of uneven all_to_all calls.

    `segment`: the node segment (its value rounds); `policy`: the split policy; `ledger`: the call
    ledger (a call two ranks decide alone is counted here); `lanes_here()`, `routing()`: the lanes
    for the communicator's device and BRAID_ROUTE's mode now; `check_open()`, `give_up(exc)`,
    `abort_native(why, wait)`: the communicator's own (a closed communicator refuses; a mismatch
    marks the segment and aborts NCCL's calls that may wait for bytes that never come);
    `ce_min`: the bytes from which the copy engines take an uneven call.
    """

    def __init__(self, rank: int, world_size: int, segment, policy, ledger, lanes_here, routing,
                 check_open, give_up, abort_native, ce_min: int):
        self.rank, self.world_size, self.segment = rank, world_size, segment
        self.policy, self.ledger, self._lanes_here, self._routing = policy, ledger, lanes_here, routing
        self._check_open, self._give_up, self._abort_native = check_open, give_up, abort_native
        self.ce_min = ce_min
        self.small_run = 0       # calls in a row agreed small (small, round)
        self.pair_calls = 0      # two ranks' uneven calls decided alone (pair_whole)
        self.pair_hash = 0       # ... and the running hash of their sizes since the last round
        self.recv = None         # bytes this rank expected from each rank in a round read one call late
        self._memo = None        # (what decides its shares, their stable hash): agreement()

    def pair_whole(self, sent: int, received: int) -> bool:
        """Two ranks: both know every byte that crosses between them (what this rank sends is what
        its peer receives), so both can tell alone, alike, that an uneven call is NCCL's own, whole:
        its larger direction is below half of BRAID_A2AV_CE_MIN_MB (a balanced call moving as
        much is below the size from which the copy engines take uneven calls). Such a call costs
        NCCL's call and a few Python steps: the round before it held each call in lockstep with
        the peer and took 20-40 us of Python (2 x H200: the MoE exchange at 1-16 MiB ran at
        0.46-0.86 of NCCL's speed with nothing but NCCL's own call after the round). Every
        PAIR_CHECK-th such call still takes the round, which checks the split sizes across
        ranks, and a running hash of every call's two directions since the last check (the same
        on both ranks when they agreed): split sizes that disagreed in any of those calls raise
        PeerMismatchError on both ranks at the check (NCCL's own call with them may have hung
        until then; the error aborts it)."""
        if self.policy.fixed is not None or 2 * max(sent, received) >= self.ce_min:
            return False
        self.pair_calls += 1
        if self.pair_calls % PAIR_CHECK == 0:
            return False
        self._check_open()
        a, b = (sent, received) if self.rank == 0 else (received, sent)     # rank 0's view on both
        self.pair_hash = ((self.pair_hash * PAIR_MUL + a) * PAIR_MUL + b) & MASK61
        self.ledger.ncalls += 1                   # in the ledger (the caller passes counted=True on)
        return True

    def small(self, big: int, op: str) -> bool:
        """The agreement before an uneven all_to_all on GPUs: does no rank have a demand (to or
        from another rank) over ROUTE_MIN_BYTES? Then the call is NCCL's own, whole.

        Every rank posts its largest demand in the node segment and reads all (a rank whose own
        demand is larger knows the answer and does not wait). That read holds each rank's call
        until the slowest rank has posted: for calls of a few tens of microseconds this lockstep
        was the larger part of braid's cost (4 x H200, 1 MiB hot: ~50 us per call against NCCL's
        ~40). So after SMALL_RUN calls in a row agreed small, the ranks take the next calls as
        small without waiting, and read each call's values at the next call (a peer has long
        posted them by then). When those values show a large demand, that one call has already
        run as NCCL's whole (correct, only not routed) and the ranks go back to waiting from the
        next call. Every step depends only on values every rank read, so all ranks switch at the
        same call."""
        seg = self.segment
        last = seg.settle()
        if last is not None and max(last)[0] > ROUTE_MIN_BYTES:
            self.small_run = 0
        token = seg.post_values([big])
        if self.small_run >= SMALL_RUN:
            seg.defer(token, op)
            return True
        if big > ROUTE_MIN_BYTES:
            self.small_run = 0
            return False
        small = max(seg.read_values(token, op))[0] <= ROUTE_MIN_BYTES
        self.small_run = self.small_run + 1 if small else 0
        return small

    def round(self, op: str, big: int, values: list[int], recv: list[int]) -> tuple[bool, bool, tuple | None]:
        """The uneven call's round where the copy engines may take it: every rank posts its
        largest demand, its input's word, the agreement value, its row of the matrix and its
        prepared word for the call as a balanced one (0 if none; `values` is all but the
        demand), and reads every rank's; all decide alike (verdict). As for small calls (small), after
        SMALL_RUN calls in a row that went to NCCL whole the ranks take the next ones whole
        without waiting and read each call's values at the next call; values that say
        otherwise (or split sizes that disagree: PeerMismatchError, one call late) end that
        from the next call on. Returns (agreed, small, lean) as Routing.a2av_agree does."""
        seg = self.segment
        self.settle(op)
        # then the hash of the calls two ranks decided alone since the last round, and the tag
        token = seg.post_values([big] + values + [self.pair_hash, ROUND_TAG])
        self.pair_hash = 0
        if self.small_run >= SMALL_RUN:
            seg.defer(token, op)
            self.recv = recv
            return True, True, None
        return self.read(token, recv, op)

    def round_native(self, fast, op: str, big: int, values: list[int], recv: list[int], inp: int):
        """round() with its post, read and checks in one native call (native_rounds.FastCalls
        uneven_round; `values` as round() takes them but for the input's word, made there from
        `inp`), where the round is not read one call late. Where the call is the copy engines'
        (their native posting reads the matrix from the round's slots) it decides here from what
        the native call returned; anything else (a late peer, a check that failed, another
        verdict) reads the round in Python (read), as round() would. None: not this way (nothing
        posted)."""
        if self.small_run >= SMALL_RUN:
            return None
        seg = self.segment
        self.settle(op)
        vals = [big, 0, *values, self.pair_hash, ROUND_TAG]
        seq = seg.next_seq()
        code = fast.uneven_round(seq, vals, 1, inp, recv)
        if code == fast.UR_ID_ERR:      # nothing posted
            seg.coll_seq -= 1
            raise LaneFailureError(f"{op}: the driver could not tell the input's allocation "
                                   f"(cuPointerGetAttribute: {fast.rc.value})")
        self.pair_hash = 0
        token = (seq, len(vals))
        if code == fast.UR_OK and self._copy_engines(fast.ur_out):
            self.small_run = 0
            return True, False, (None, tuple(fast.ur_out[3:3 + self.world_size]), token)
        return self.read(token, recv, op)

    def _copy_engines(self, out) -> bool:
        """From the native round's [largest demand, size, even, ...] (its checks held): is the
        verdict the copy engines' alone? The same as verdict() says 'ce', else False."""
        policy = self.policy
        if policy.fixed is None and out[0] <= ROUTE_MIN_BYTES:
            return False
        # another lane, or even (a balanced call: verdict() says how)
        return set(self.shares_at(out[1], self._lanes_here())) == {"ce"} and not out[2]

    def shares_at(self, size: int, lanes: list[str]) -> dict[str, float]:
        """The shares of an uneven call of this size (its matrix's largest row or column): the
        policy's, but NCCL's below ce_min where the copy engines alone would take it (posted
        every call, they lose there), unless the shares are fixed."""
        policy = self.policy
        shares = policy.shares_for("all_to_all_single", size, lanes)
        if policy.fixed is None and "nccl" in lanes and set(shares) == {"ce"} and size < self.ce_min:
            return {"nccl": 1.0}
        return shares

    def settle(self, op: str) -> None:
        """Before a round: the checks of the last round read one call late, if one was."""
        last = self.segment.settle()
        if last is not None:
            if len(last[0]) != round_len(self.world_size):    # a round of the small-call agreement
                if max(last)[0] > ROUTE_MIN_BYTES:
                    self.small_run = 0
            else:
                self._pair_check(last, op)
                if [g[3 + self.rank] for g in last] != self.recv:
                    self._mismatch(last, self.recv, op)
                if self.verdict(last)[0] != "nccl":
                    self.small_run = 0

    def read(self, token: tuple, recv: list[int], op: str) -> tuple[bool, bool, tuple | None]:
        """The rest of a round this rank posted (`token`; round, or the native call of an
        all_to_all with equal split sizes that did not launch): every rank's values, their
        checks and the verdict, as round returns them."""
        got = self.segment.read_values(token, op)
        self._pair_check(got, op)
        if [g[3 + self.rank] for g in got] != recv:
            self._mismatch(got, recv, op)
        verdict, lean = self.verdict(got)
        self.small_run = self.small_run + 1 if verdict == "nccl" else 0
        if verdict == "ce":             # the copy engines' posting reads the matrix from this round
            lean = (*lean, token)
        return True, verdict == "nccl", lean

    def even_values(self, big: int, row: list[int], words) -> list[int] | None:
        """The values this rank posts in the round of an all_to_all whose split sizes are all
        equal here (`row`: its bytes to each rank; `words`: every rank's word for the balanced
        call's program), with 0 for its input's word and its own prepared word, and 0 for the
        pair hash, where the verdict of a round in which every rank posted them is the balanced
        call's (Even): the native call may then launch the program on seeing them all (see
        Routing.a2a_even). None where that round's verdict would be another."""
        w = self.world_size
        agree = self.agreement()
        got = [[big, 1, agree, *row, k, 0, ROUND_TAG] for k in words]
        if len(got) != w or self.verdict(got)[0] != "even":
            return None
        return [big, 0, agree, *row, 0, 0, ROUND_TAG]

    def _pair_check(self, got, op) -> None:
        """The round's hashes of the calls decided alone since the last one must be equal."""
        if len({g[-2] for g in got}) > 1:
            exc = PeerMismatchError(
                f"{op}: the ranks' split sizes disagreed in one of the last {PAIR_CHECK} uneven calls "
                f"(each rank's input split sizes toward the other must equal the other's output split "
                f"sizes from it)")
            # NCCL's own call with those sizes may still sit on the GPU, waiting for bytes that
            # never come: abort NCCL on this rank (on a thread of its own: NCCL's abort of such a
            # call may not return, and then the watchdog ends the process after
            # BRAID_ABORT_EXIT_S, as for a dead peer), and mark the abort for the peer's watchdog
            exc.peers_left_waiting = True
            self._abort_native(str(exc), wait=False)
            self._give_up(exc)
            raise exc

    def _mismatch(self, got, recv, op) -> None:
        try:
            check_columns(matrix_of(got, self.world_size), self.rank, recv, op)
        except PeerMismatchError as exc:
            self._give_up(exc)
            raise

    def verdict(self, got) -> tuple[str, tuple | None]:
        """From every rank's values of the round, the same on every rank: ('nccl', None): NCCL
        whole; ('even', Even(words)): every entry of the matrix the same, not NCCL's whole: a
        balanced call; ('ce', (matrix, words)): the copy engines alone (read() adds the round's
        token: their native posting reads the matrix from its slots); ('full', None): the full path
        (the router may plan it, or a split over several lanes, or the ranks' calibrations or
        shares differ and the full path says how)."""
        w, policy = self.world_size, self.policy
        if policy.fixed is None and max(g[0] for g in got) <= ROUTE_MIN_BYTES:
            return "nccl", None
        agree = got[0][2]
        for g in got:
            if g[2] != agree:
                return "full", None
        matrix = matrix_of(got, w)
        size = max(max(map(sum, matrix)), max(map(sum, zip(*matrix))))
        shares = self.shares_at(size, self._lanes_here())
        if not policy.native_ok(shares) and even(matrix):
            return "even", Even(tuple(g[-3] for g in got))
        if set(shares) == {"ce"}:
            return "ce", (matrix, tuple(g[1] for g in got))
        # two ranks have no relays: the router could only move the hot pair's bytes between the
        # lanes the shares already weigh, so their calls go by the shares
        if (self._routing() != "off" and w > 2 and skewed(matrix)) or not policy.native_ok(shares):
            return "full", None
        return "nccl", None

    def agreement(self) -> int:
        """What decides an uneven call's shares (calibration, balancer, fixed shares) as one
        number that is the same on every rank that agrees: a stable hash (Python's own hash of
        a string differs between processes), kept until one of them changes."""
        policy = self.policy
        key = (policy.digest, policy.balancer.version, repr(policy.fixed) if policy.fixed else "")
        memo = self._memo
        if memo is None or memo[0] != key:
            memo = self._memo = (key, zlib.crc32(repr(key).encode()))
        return memo[1]
