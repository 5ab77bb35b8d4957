"""GPU tier: skewed all_to_all_single through the router (BRAID_ROUTE=on: per-pair mixes of the
ce and host lanes), bitwise against NCCL's all_to_all_single on the same inputs."""
from __future__ import annotations

import random

import torch
import torch.distributed as dist

from gpu_world import needs, run
from test_gpu_collectives import _same

ENV = {"BRAID_ROUTE": "on"}


def _worker(rank, world, comm, dev):
    rng = random.Random(7)               # the same matrices on every rank
    for case in range(8):
        hot = rng.randrange(world)
        h = rng.choice([0.4, 0.7, 0.9, 1.0])
        dtype = rng.choice([torch.bfloat16, torch.float32, torch.int8])
        total = rng.choice([3 << 20, 40 << 20, 200 << 20]) + rng.randrange(1, 5000)
        esz = torch.empty((), dtype=dtype).element_size()
        mat = [[0] * world for _ in range(world)]
        for s in range(world):
            for d in range(world):
                share = h if d == hot else (1 - h) / max(world - 1, 1)
                mat[s][d] = int(total * share / esz) + rng.randrange(0, 3)
        ins = mat[rank]
        outs = [mat[s][rank] for s in range(world)]
        g = torch.Generator().manual_seed(case * 100 + rank)
        x = (torch.randn(sum(ins), generator=g) * 50).to(dtype).to(dev)
        got = torch.full((sum(outs),), 3, dtype=dtype, device=dev)
        ref = torch.empty_like(got)
        comm.all_to_all_single(got, x, outs, ins)
        dist.all_to_all_single(ref, x, outs, ins)
        torch.cuda.synchronize()
        assert _same(got, ref), f"routed all_to_all case {case} (hot {hot}, h {h}, {dtype}) differs from NCCL"
        lanes = sorted(comm.last_handle.plan.lanes) if comm.last_handle.plan is not None else ["native"]
        if rank == 0:
            print(f"case {case}: hot {hot} h {h} {dtype} {total >> 20} MiB/rank lanes {lanes}", flush=True)


@needs(2)
def test_routed_all_to_all_two_gpus(tmp_path):
    run(2, tmp_path, _worker, ENV)


@needs(4)
def test_routed_all_to_all_four_gpus(tmp_path):
    run(4, tmp_path, _worker, ENV)
