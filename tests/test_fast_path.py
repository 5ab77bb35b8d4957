"""The small-message path's cached answers (CPU tier: the path itself needs CUDA tensors and NCCL,
exercised by the GPU tier and the bench; here: what is cached, and when it is forgotten)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from conftest import run_world


def _worker(rank, w):
    import braid
    comm = braid.init()
    x = torch.randn(1000)
    # CPU tensors never take the fast path: nothing cached, the full path runs (and is right)
    t = x.clone()
    comm.all_reduce(t)
    assert torch.equal(t, x), "world of one all_reduce must leave the tensor unchanged"
    assert not any(comm._fast_ar.values()) and not comm._fast_ag
    # an answer is stored with the call shape's facts and never True on a CPU communicator
    ent = comm._fast_put(comm._fast_ar, 1000, (torch.float32, dist.ReduceOp.SUM), True)
    assert ent == (torch.float32, dist.ReduceOp.SUM, False)
    comm.cuda = True                      # pretend, to see what a GPU communicator would keep
    ent = comm._fast_put(comm._fast_ar, 1000, (torch.float32, dist.ReduceOp.SUM), True)
    assert ent[-1] is True and comm._fast_ar[1000] is ent
    forgotten = []
    # fixed shares: forgotten on entry and on exit
    with comm.fixed_shares({"shm": 1.0}):
        forgotten.append(not comm._fast_ar)
        comm._fast_put(comm._fast_rs, 8, (torch.float32, dist.ReduceOp.SUM, 2), True)
    forgotten.append(not comm._fast_rs)
    # a new calibration
    comm._fast_put(comm._fast_ag, 8, (torch.float32, 8), True)
    comm.set_calibration({})
    forgotten.append(not comm._fast_ag)
    # the table is bounded
    for n in range(1100):
        comm._fast_put(comm._fast_bc, n, (torch.float32, 0), True)
    forgotten.append(len(comm._fast_bc) <= 1025)
    comm.cuda = False
    braid.close()
    forgotten.append(not comm._fast_bc)
    # after close, nothing is answered True again
    forgotten.append(comm._fast_put(comm._fast_a2a, 4, (torch.float32, 4, 4), True)[-1] is False)
    return forgotten


def test_fast_path_answers_are_forgotten_when_they_may_change():
    assert run_world(_worker, 1) == [[True] * 6]


def _verdict_worker(rank, w):
    """The calibration's measured verdict per size bucket overrides the model's split: the split
    (True), the native lane alone (False), or a named lane alone."""
    import braid
    comm = braid.init()
    lane = {"latency_us": 5.0, "bw_gbps": 10.0, "floor_us": 5.0}
    comm.set_calibration({f"all_gather/{w}": {"shm": lane, "gloo": lane},
                          f"all_gather/{w}/pays": {"20": "shm", "22": False, "24": True}})
    lanes = ["shm", "gloo"]
    got = [comm.shares_for("all_gather", n, lanes) for n in (1 << 20, 1 << 22, 1 << 24)]
    # a verdict naming a lane that is not usable here falls back to the native lane
    comm.set_calibration({f"all_gather/{w}": {"shm": lane, "gloo": lane},
                          f"all_gather/{w}/pays": {"20": "ce"}})
    got.append(comm.shares_for("all_gather", 1 << 20, lanes))
    braid.close()
    return got


def test_measured_verdict_picks_split_native_or_a_lane_alone():
    (alone, native, split, fallback), = run_world(_verdict_worker, 1)
    assert alone == {"shm": 1.0}
    assert native == {"gloo": 1.0}
    assert set(split) == {"shm", "gloo"} and abs(sum(split.values()) - 1.0) < 1e-9
    assert fallback == {"gloo": 1.0}
