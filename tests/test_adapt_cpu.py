"""Stage 2 of the balancer in a real 2-rank world on the CPU lanes (gloo + shm).

Every rank runs the same sequence of all_gather_into_tensor calls of 8 MiB float32 per rank under
the default (model) shares, with the shm lane made 4x slower (`comm.slowdown`, the LaneRun test
hook) for calls SLOW_FROM..SLOW_TO-1, and records the shares each call ran under. The lanes'
times on a small shared machine are noisy, so the assertions compare shares, never times:

- every rank recorded the same share history (the balancer's inputs are agreed through the call
  descriptors, so every rank makes the same moves);
- shm loses share while it is slow and wins share back after it recovers;
- every output is right (checked against data every rank derives locally from a seed);
- with `comm.adapt = False` the shares stay the model's through the same slowdown;
- shares fixed for one op only must not stop the adaptation of the others.

All three scenarios run in one spawned world (start-up dominates); the tests read its results.
"""
from __future__ import annotations

import hashlib

import pytest
import torch

from conftest import run_world

NUMEL = 2 << 20              # float32 elements per rank: 8 MiB
CALLS = 48                   # 24 calls after the slowdown: the balancer moves at most every 5 calls
SLOW_FROM, SLOW_TO = 8, 24   # shm 4x slower in calls 8..23
SLOW = {"shm": 4.0}
OTHER_CALLS = 16             # the op-specific fixed-shares scenario: shm slow in every call
ENV = {"BRAID_CALIBRATE": "off", "BRAID_HOST_BUFFER_MB": "2"}


def _seed(*key) -> int:
    return int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:8], "little") >> 1


# Drawing 8 MiB of fresh random data for every rank in every call was a third of each rank's time.
# Each (scenario, rank) draws one pool; call k's input is the window of it that starts 7 * k in,
# so no two calls of a rank have equal inputs (a lane that handed back an earlier call's data, or
# another rank's, still gives a wrong output).
STEP = 7
_POOLS: dict = {}


def _data(key, numel: int) -> torch.Tensor:
    """The input of (scenario, call, rank): a view of that scenario's and rank's pool."""
    name, call, rank = key
    pool = _POOLS.get((name, rank, numel))
    if pool is None:
        g = torch.Generator().manual_seed(_seed(name, rank, numel))
        # never the poison value
        pool = _POOLS[(name, rank, numel)] = torch.rand(numel + STEP * CALLS, generator=g) * 3 + 0.5
    assert 0 <= call <= CALLS, call
    return pool[STEP * call:STEP * call + numel]


def _scenario(comm, rank: int, w: int, name: str, adapt: bool, numel: int = NUMEL, calls: int = CALLS,
              slow_from: int = SLOW_FROM, slow_to: int = SLOW_TO) -> dict:
    comm.adapt = adapt
    out = torch.empty(w * numel, dtype=torch.float32)
    shares, versions, times, wrong = [], [], [], []
    for call in range(calls):
        comm.slowdown = dict(SLOW) if slow_from <= call < slow_to else {}
        inputs = [_data((name, call, r), numel) for r in range(w)]
        x = inputs[rank].clone()
        out.fill_(-1.0)
        comm.all_gather_into_tensor(out, x)
        h = comm.last_handle
        shares.append(h.shares)
        versions.append(comm.balancer.version)
        times.append({k: round(v) for k, v in h.lane_times_us().items()})
        if not torch.equal(out, torch.cat(inputs)) or not torch.equal(x, inputs[rank]):
            wrong.append(call)
    comm.slowdown = {}
    return {"shares": shares, "versions": versions, "lane_us": times, "wrong": wrong,
            "model": comm.shares_for("all_gather", numel * 4, comm.lanes_for(torch.device("cpu")))
            if not adapt else None}


def _adapt_worker(rank, w):
    import braid
    comm = braid.init()
    assert set(comm.lanes_for(torch.device("cpu"))) == {"gloo", "shm"}, comm.unavailable
    adapted = _scenario(comm, rank, w, "adapt", adapt=True)
    frozen = _scenario(comm, rank, w, "frozen", adapt=False)
    # shares fixed for broadcast only; all_gather (4 MiB: a bucket of its own, seeded from the
    # model) should still adapt to a shm that is 4x slower in every call
    with comm.fixed_shares({"gloo": 1.0}, op="broadcast"):
        other_fixed = _scenario(comm, rank, w, "other-op-fixed", adapt=True, numel=NUMEL // 2, calls=OTHER_CALLS,
                                slow_from=0, slow_to=OTHER_CALLS)
    return {"adapt": adapted, "frozen": frozen, "other_fixed": other_fixed}


@pytest.fixture(scope="module")
def world():
    return run_world(_adapt_worker, 2, env=ENV, timeout=120)


def _fmt(history) -> str:
    return "\n".join(f"  {i:2d} {'slow ' if SLOW_FROM <= i < SLOW_TO else '     '}"
                     + " ".join(f"{k}={v:.3f}" for k, v in sorted(s.items())) for i, s in enumerate(history))


def test_shm_loses_share_while_slow_and_wins_it_back(world):
    runs = [r["adapt"] for r in world]
    hist = runs[0]["shares"]
    msg = "shares per call (rank 0):\n" + _fmt(hist) + f"\nlane times (rank 0): {runs[0]['lane_us']}"
    # the model splits 8 MiB over both CPU lanes
    assert set(hist[0]) == {"gloo", "shm"}, msg
    # every rank ran every call under the same shares, and saw the same balancer version
    for r, run in enumerate(runs[1:], 1):
        assert run["shares"] == hist, f"rank {r} differs\n" + msg + "\nrank %d:\n%s" % (r, _fmt(run["shares"]))
        assert run["versions"] == runs[0]["versions"], (r, run["versions"], runs[0]["versions"])
    for call, s in enumerate(hist):
        assert set(s) == {"gloo", "shm"} and abs(sum(s.values()) - 1.0) < 1e-9, (call, s)
    shm = [s["shm"] for s in hist]
    assert shm[SLOW_TO - 1] < shm[SLOW_FROM - 1], msg           # lost share while 4x slower
    assert shm[-1] > shm[SLOW_TO], msg                          # won share back once recovered
    assert runs[0]["versions"][-1] > runs[0]["versions"][SLOW_FROM - 1], msg   # the balancer moved
    for r, run in enumerate(runs):
        assert not run["wrong"], f"rank {r}: wrong output at calls {run['wrong']}"


def test_adapt_off_keeps_the_model_shares(world):
    runs = [r["frozen"] for r in world]
    for r, run in enumerate(runs):
        hist = run["shares"]
        assert set(hist[0]) == {"gloo", "shm"}, hist[0]
        assert all(s == hist[0] for s in hist), f"rank {r}: shares moved with adapt off\n" + _fmt(hist)
        assert hist[0] == run["model"], (hist[0], run["model"])
        assert run["versions"][0] == run["versions"][-1], run["versions"]
        assert not run["wrong"], f"rank {r}: wrong output at calls {run['wrong']}"
    assert runs[0]["shares"] == runs[1]["shares"]
    # the frozen shares are the model's, i.e. the ones the adaptive run started from
    assert runs[0]["shares"][0] == world[0]["adapt"]["shares"][0]


def test_shares_fixed_for_another_op_do_not_stop_adaptation(world):
    runs = [r["other_fixed"] for r in world]
    for r, run in enumerate(runs):
        assert not run["wrong"], f"rank {r}: wrong output at calls {run['wrong']}"
    hist = runs[0]["shares"]
    assert set(hist[0]) == {"gloo", "shm"}, hist[0]
    assert runs[1]["shares"] == hist
    # shm is 4x slower in every call: by the end it must have lost share (the balancer moves
    # after 3 observations, then every 5 calls)
    assert hist[-1]["shm"] < hist[0]["shm"], "all_gather's shares never moved:\n" + _fmt(hist)
    assert runs[0]["versions"][-1] > runs[0]["versions"][0]
