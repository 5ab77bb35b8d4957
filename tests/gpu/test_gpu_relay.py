"""GPU tier: the relay lane (GPU a -> GPU b -> GPU c through b's staging buffer) in routed plans.

Needs 3 ranks (two cannot relay); with fewer GPUs the ranks share them. Run on a GPU machine:
    python3 -m pytest tests/gpu/test_gpu_relay.py -q
Every rank derives every rank's data from shared seeds, so a relayed transfer is checked against
bytes the destination computed itself; random routed all_to_all plans (ce, host and relay pieces
in one call) are checked bitwise against NCCL's all_to_all_single of the same data. The relay
buffer is 4 MiB (4 slots of 1 MiB), so the larger transfers wrap the slots many times.
"""
from __future__ import annotations

import random

import torch
import torch.distributed as dist

from gpu_world import needs, run
from test_relay import routed          # the CPU tier's random routed plans, here over ce + host

from braid.planner.plan import LocalCopy, Plan, Transfer

ENV = {"BRAID_RELAY_BUFFER_MB": "4"}
MB = 1 << 20



def _bytes(seed: int, n: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).to(device)


def _same(a, b) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _worker(rank, world, comm, dev):
    assert comm.lane("relay").available() == (True, ""), comm.lane("relay").available()
    cases = 0

    # 0 -> 1 -> 2: sizes from empty to many wraps of the 4 x 1 MiB slots, at odd offsets
    for n in (0, 1, 4097, 3 * MB + 1, 40 * MB + 3):
        data = _bytes(n, n + 5, dev)
        plan = Plan("x", world, n, {"relay": 1.0}, {"relay": [Transfer(0, 5, n, ((2, 0, 3),), via=1)]}, [])
        out = torch.full((n + 3,), 7, dtype=torch.uint8, device=dev) if rank == 2 else None
        comm.run_plan(plan, data if rank == 0 else None, [out] if rank == 2 else [])
        if rank == 2:
            torch.cuda.synchronize()
            assert _same(out[3:], data[5:]), f"0->1->2 n={n}"
            assert (out[:3] == 7).all(), f"0->1->2 n={n}: bytes before the offset"
        cases += 1

    # one plan: relayed transfers beside ce and host ones, a relay that also sends and
    # receives directly, a multicast through the relay, a local copy
    n = 6 * MB + 11
    ins = [_bytes(100 + r, n, dev) for r in range(world)]
    lanes = {"relay": [Transfer(0, 0, n, ((2, 0, 0),), via=1),
                       Transfer(2, 1, n - 1, ((0, 0, 1),), via=1),
                       Transfer(1, 0, 2 * MB, ((0, 1, 0), (2, 1, 0)), via=world - 1 if world > 3 else 0)],
             "ce": [Transfer(1, 0, n, ((2, 2, 0),)), Transfer(0, 7, MB, ((1, 0, 0),))],
             "host": [Transfer(2, 3, 3 * MB, ((1, 0, MB),)), Transfer(1, 5, MB + 1, ((0, 1, 2 * MB),))]}
    plan = Plan("mixed", world, n, {"relay": 0.5, "ce": 0.3, "host": 0.2}, lanes,
                [LocalCopy(1, 0, 100, 1, 0)])
    sizes = {0: [n, 3 * MB + 1], 1: [4 * MB, 100], 2: [n, 2 * MB, n]}.get(rank, [])
    outs = [torch.zeros(s, dtype=torch.uint8, device=dev) for s in sizes]
    comm.run_plan(plan, ins[rank], outs)
    torch.cuda.synchronize()
    if rank == 0:
        assert _same(outs[0][1:], ins[2][1:]), "relay 2->1->0"
        assert _same(outs[1][:2 * MB], ins[1][:2 * MB]), "multicast relay to 0"
        assert _same(outs[1][2 * MB:], ins[1][5: MB + 6]), "host 1->0"
    if rank == 1:
        assert _same(outs[0][:MB], ins[0][7: MB + 7]), "ce 0->1"
        assert _same(outs[0][MB:], ins[2][3: 3 * MB + 3]), "host 2->1"
        assert _same(outs[1], ins[1][:100]), "local copy"
    if rank == 2:
        assert _same(outs[0], ins[0]), "relay 0->1->2"
        assert _same(outs[1], ins[1][:2 * MB]), "multicast relay to 2"
        assert _same(outs[2], ins[1]), "ce 1->2"
    cases += 1

    # random routed all_to_all plans against NCCL's all_to_all_single; some async
    rng = random.Random(7)                    # the same plans on every rank
    for i in range(24):
        matrix = [[rng.choice([0, 1, 4097, rng.randrange(1, 8 * MB)]) for _ in range(world)] for _ in range(world)]
        plan = routed(matrix, rng, lanes=("ce", "host"), relay_p=rng.choice([0.3, 0.7, 1.0]))
        x = _bytes(1000 * i + rank, sum(matrix[rank]), dev)
        out = torch.zeros(sum(matrix[s][rank] for s in range(world)), dtype=torch.uint8, device=dev)
        ref = torch.empty_like(out)
        h = comm.run_plan(plan, x, [out], async_op=i % 2 == 1)
        if h is not None:
            h.wait()
        dist.all_to_all_single(ref, x, [matrix[s][rank] for s in range(world)], matrix[rank])
        torch.cuda.synchronize()
        assert _same(out, ref), f"routed all_to_all {i}: {matrix}"
        cases += 1

    # the last rank only relays (no tensors at all); the same plan many times in a row
    v = world - 1
    n = 5 * MB + 3
    plan = Plan("x", world, n, {"relay": 1.0},
                {"relay": [Transfer(0, 0, n, ((1, 0, 0),), via=v), Transfer(1, 0, n, ((0, 0, 0),), via=v)]}, [])
    for k in range(10):
        if rank in (0, 1):
            x = _bytes(5000 + 10 * k + rank, n, dev)
            out = torch.zeros(n, dtype=torch.uint8, device=dev)
            comm.run_plan(plan, x, [out], async_op=True).wait()
            torch.cuda.synchronize()
            assert _same(out, _bytes(5000 + 10 * k + (1 - rank), n, dev)), f"repeat {k}"
        elif rank == v:
            comm.run_plan(plan, None, [])
        else:
            comm.run_plan(plan, torch.empty(0, dtype=torch.uint8, device=dev), [])
        cases += 1
    torch.cuda.synchronize()
    print(f"rank {rank}: {cases} relay cases passed", flush=True)


@needs(3)
def test_relay_three_gpus(tmp_path):
    run(3, tmp_path, _worker, ENV)


@needs(4)
def test_relay_four_gpus(tmp_path):
    run(4, tmp_path, _worker, ENV)
