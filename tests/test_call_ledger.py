"""Faults that used to end in a hang or a vague timeout, on CPU worlds.

- Ranks whose calls differ across the whole-call / split boundary (rank 1's all_gather small
  enough for gloo's own call, rank 0's large enough for braid's lanes): rank 0 used to wait
  BRAID_TIMEOUT_S and say the peer "did not make the matching call". Now it reads rank 1's
  published call ledger and raises PeerMismatchError naming both calls within about a second;
  rank 1, waiting for gloo's call in steps, raises at rank 0's abort mark (tests/test_faults_cpu.py
  times both sides).
- `braid.abort()` on one rank: a peer waiting for it in an exchange raises at once, naming the
  cause, and its communicator refuses further calls.
- A peer that simply never comes: the timeout names what each rank last did.
"""
from __future__ import annotations

import time

import pytest
import torch

from conftest import run_world, stay_away

# gloo takes calls up to a few KiB whole; larger ones go to braid's shm lane (alone or split)
LANE_COSTS = {"gloo": {"latency_us": 10.0, "bw_gbps": 1.0, "floor_us": 10.0},
              "shm": {"latency_us": 100.0, "bw_gbps": 10.0, "floor_us": 100.0}}
ENV = {"BRAID_MIN_SPLIT_KB": "64", "BRAID_TIMEOUT_S": "60"}


def _comm(w: int):
    import braid
    comm = braid.init()
    comm.set_calibration({f"{op}/{w}": dict(LANE_COSTS) for op in ("all_gather", "all_reduce")})
    return comm


def _boundary_worker(rank: int, w: int):
    comm = _comm(w)
    for k in range(3):                          # in step first: the ledgers count the same calls
        x = torch.full((1000,), float(rank + k))
        out = torch.empty(1000 * w)
        comm.all_gather_into_tensor(out, x)
    n = 100_003 if rank == 0 else 1000          # rank 0: braid's lanes; rank 1: gloo whole
    x = torch.ones(n)
    out = torch.empty(n * w)
    t0 = time.monotonic()
    try:
        comm.all_gather_into_tensor(out, x)
        return {"raised": None, "after_s": time.monotonic() - t0}
    except Exception as exc:                     # noqa: BLE001  the point of the test
        return {"raised": type(exc).__name__, "msg": str(exc), "after_s": time.monotonic() - t0}


def test_mismatch_across_the_whole_call_boundary_names_both_calls_in_time():
    res = run_world(_boundary_worker, 2, init_pg=True, env=ENV, timeout=90)
    r0, r1 = res
    assert r0["raised"] == "PeerMismatchError", r0
    assert r0["after_s"] < 10, r0                # the ledger, not BRAID_TIMEOUT_S (60 s)
    msg = r0["msg"]
    assert "call #4" in msg and "400012 bytes" in msg and "4000 bytes" in msg, msg
    assert "taken whole by gloo" in msg and "braid's lanes" in msg, msg
    # rank 1 waits for gloo's call in steps and reads rank 0's abort mark: a braid error in time
    assert r1["raised"] == "PeerMismatchError" and "rank 0 aborted" in r1["msg"], r1
    assert r1["after_s"] < 10, r1


def _abort_worker(rank: int, w: int):
    import braid
    from braid.errors import LaneFailureError
    comm = _comm(w)
    x = torch.ones(100_003)                      # a split call: starts with an exchange
    out = torch.empty(100_003 * w)
    comm.all_gather_into_tensor(out, x)
    if rank == 0:
        time.sleep(1.0)                          # rank 1 is waiting in the next exchange by now
        braid.abort("stopping on purpose")
        with pytest.raises(LaneFailureError, match="aborted"):
            comm.all_gather_into_tensor(out, x)
        return {"ok": True}
    t0 = time.monotonic()
    try:
        comm.all_gather_into_tensor(out, x)
        return {"raised": None}
    except LaneFailureError as exc:
        took, msg = time.monotonic() - t0, str(exc)
    time.sleep(0.5)                              # the watchdog marks the communicator broken too
    try:
        comm.all_reduce(torch.ones(8))
        later = None
    except LaneFailureError as exc2:
        later = str(exc2)
    return {"raised": "LaneFailureError", "msg": msg, "after_s": took, "later": later}


def test_abort_reaches_a_peer_waiting_in_an_exchange():
    r0, r1 = run_world(_abort_worker, 2, init_pg=True, env=ENV, timeout=90)
    assert r0 == {"ok": True}
    assert r1["raised"] == "LaneFailureError", r1
    assert r1["msg"].startswith("rank 0 aborted: ") and "stopping on purpose" in r1["msg"], r1
    assert r1["after_s"] < 5, r1                 # at once, not after BRAID_TIMEOUT_S (60 s)
    assert r1["later"] is not None and "rank 0 aborted" in r1["later"], r1


def _late_worker(rank: int, w: int, flag: str):
    from braid.errors import BraidTimeoutError
    comm = _comm(w)
    x = torch.ones(100_003)
    out = torch.empty(100_003 * w)
    comm.all_gather_into_tensor(out, x)
    if rank == 1:
        # never makes the second call within the limit: away until rank 0 has its answer (or 6 s)
        stay_away(flag, 6)
        return {"slept": True}
    try:
        comm.all_gather_into_tensor(out, x)
        return {"raised": None}
    except BraidTimeoutError as exc:
        return {"raised": "BraidTimeoutError", "msg": str(exc)}
    finally:
        open(flag, "w").close()


def test_timeout_says_what_each_rank_did(tmp_path):
    r0, _ = run_world(_late_worker, 2, str(tmp_path / "answered"), init_pg=True, env=dict(ENV, BRAID_TIMEOUT_S="2"),
                      timeout=60)
    assert r0["raised"] == "BraidTimeoutError", r0
    msg = r0["msg"]
    assert "rank 0 call #2 is all_gather of 400012 bytes" in msg, msg
    assert "rank 1's latest call #1 is all_gather of 400012 bytes" in msg, msg
