"""GPU tier: the faults of tests/test_faults_cpu.py on CUDA tensors; every surviving rank raises a
braid error within BRAID_TIMEOUT_S + 5 s (or braid decides to end it, exit code 70, within 5 s more:
its NCCL abort did not release it; the process's exit can take seconds after that decision, the
driver's teardown), nothing is left in /dev/shm.

The same loop (all_reduce on even calls, all_gather_into_tensor on odd ones, sizes differing per
call) over an NCCL default group, with a calibration that gives NCCL small calls whole, the copy
engines alone the middle ones (the loop's 600 KB calls, the prepared path) and a split of NCCL,
copy engines and host staging the large ones (the 16 MB call a killed rank leaves in flight).
Scenarios beyond the CPU file's:
- boundary: rank 1's call is small enough for NCCL's own all_reduce, rank 0's splits: rank 1 sits
  in NCCL (its check waits on the stream) until the abort that follows rank 0's PeerMismatchError
  releases it, long before NCCL's own 10-minute timeout;
- abort_async: a rank posts a 16 MB split all_gather async, calls abort() and waits on it: it and
  its peers raise;
- *_nodes: 2 pretend nodes (BRAID_FAKE_NODES=2, node and rail steps on every call); with ranks
  sharing a GPU each has an NCCL host id of its own, so the rail steps cross NCCL's network
  transport, as between real hosts.
Ranks share the GPUs where there are fewer (gpu_world.py)."""
from __future__ import annotations

import datetime

import pytest

from gpu_world import BASE_ENV, needs, start_rank
from test_faults_cpu import NODES_ENV, SCENARIOS, TIMEOUT_S, _fault_worker, _run, check_survivors
from test_gpu_fuzz import GPU_LANES

ABORT_EXIT_S = 3.0
ENV = dict(BASE_ENV, BRAID_TIMEOUT_S=str(TIMEOUT_S), BRAID_MIN_SPLIT_KB="1", BRAID_ABORT_EXIT_S=str(ABORT_EXIT_S))
# a survivor that sits in an NCCL kernel waiting for a dead or absent peer, where NCCL's abort
# does not return (seen with ranks sharing a GPU, NCCL 2.28), is ended by braid (exit code 70)
ENDED = {0, 70}
GPU_SCENARIOS = dict(SCENARIOS)
GPU_SCENARIOS["abort_async"] = (2, 0, 3, [0, 1], {"LaneFailureError", "BraidTimeoutError", "PeerMismatchError"}, {})
GPU_SCENARIOS["dtype_nodes"] = (4, 3, 4, [0, 1, 2, 3], {"PeerMismatchError"}, {})


def _gpu_worker(rank, w, scenario, faulty, fault_at, survivors, folder):
    import time

    import torch.distributed as dist

    from braid.comm import ledger
    from test_faults_cpu import _write
    end = ledger._end_process

    def noted_end(r, why, limit):
        # when braid decided to end this process: the exit itself can take seconds more (the
        # driver tears down a context whose NCCL kernels still wait), which the parent sees
        _write(folder, f"ended{rank}", {"t": time.time()})
        end(r, why, limit)

    ledger._end_process = noted_end
    dev = start_rank(rank, w)
    dist.init_process_group("nccl", rank=rank, world_size=w, timeout=datetime.timedelta(seconds=120))
    _fault_worker(rank, w, scenario, faulty, fault_at, survivors, folder, dev=dev, lanes=GPU_LANES)


@needs(2)
@pytest.mark.parametrize("scenario", [
    "kill", "exit0", "raise", "skip", "dtype", "dtype_whole", "boundary", "abort_async", "kill_nodes",
    "raise_nodes",
    "dtype_nodes",
])
def test_gpu_survivors_raise_in_time(scenario, capsys):
    env = dict(ENV, **NODES_ENV) if scenario.endswith("_nodes") else ENV
    if scenario == "dtype_nodes":       # node and rail steps on NCCL whole check under BRAID_CHECK only
        env = dict(env, BRAID_CHECK="1")
    survivors = GPU_SCENARIOS[scenario][3]
    res = _run(scenario, worker=_gpu_worker, env=env, init_pg=False, scenarios=GPU_SCENARIOS,
               allowed_exit={r: ENDED for r in survivors})
    check_survivors(scenario, res, capsys, GPU_SCENARIOS, what="gpu fault", ended_by_braid=ABORT_EXIT_S + 2.0)
