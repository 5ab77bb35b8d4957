"""A multi-node world on GPUs: 2 GPUs as 2 pretend nodes of 1 rank (and 4 as 2 x 2), every call in
node steps plus rail steps on NCCL (BRAID_FAKE_NODES, BRAID_HIER=1), checked against references
built locally from every rank's seeded input. Data movement is compared bit for bit; sums use
values whose sums are exact in any order (quarter steps in float32), so they are compared bit
for bit too."""
from __future__ import annotations

import torch

from gpu_world import needs, run

ENV = {"BRAID_HIER": "1", "BRAID_HIER_MIN_BYTES": "0"}


def _data(seed, rank, n, dtype, dev):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype.is_floating_point:
        return (torch.randint(-40, 41, (n,), generator=g).to(torch.float64) / 4).to(dtype).to(dev)
    return torch.randint(-1000, 1000, (n,), generator=g, dtype=torch.int64).to(dtype).to(dev)


def _body(rank, world, comm, dev):
    import torch.distributed as dist

    import braid
    from braid.comm.hier import HierHandle
    assert comm.hier is not None and comm.hier.rail_lib == "nccl"
    seed = 3
    for n in (5, 4099, 1 << 20):
        for dtype in (torch.float32, torch.bfloat16, torch.int32):
            seed += 1
            ins = [_data(seed, r, n, dtype, dev) for r in range(world)]
            t = ins[rank].clone()
            braid.all_reduce(t)
            assert isinstance(comm.last_handle, HierHandle)
            assert torch.equal(t, torch.stack(ins).sum(0, dtype=dtype)), f"all_reduce {dtype} n={n}"
            t = ins[rank].clone()
            braid.all_reduce(t, op=dist.ReduceOp.MAX)
            assert torch.equal(t, torch.stack(ins).max(0).values), f"all_reduce max {dtype} n={n}"
            out = torch.empty(n * world, dtype=dtype, device=dev)
            braid.all_gather_into_tensor(out, ins[rank])
            assert torch.equal(out, torch.cat(ins)), f"all_gather {dtype} n={n}"
            big = [_data(seed + 7, r, n * world, dtype, dev) for r in range(world)]
            o = torch.empty(n, dtype=dtype, device=dev)
            braid.reduce_scatter_tensor(o, big[rank].clone())
            want = torch.stack(big).sum(0, dtype=dtype)[rank * n:(rank + 1) * n]
            assert torch.equal(o, want), f"reduce_scatter {dtype} n={n}"
            for root in range(world):
                t = ins[rank].clone()
                braid.broadcast(t, src=root)
                assert torch.equal(t, ins[root]), f"broadcast root {root} {dtype} n={n}"
            o = torch.empty(n * world, dtype=dtype, device=dev)
            braid.all_to_all_single(o, big[rank])
            want = torch.cat([big[s][rank * n:(rank + 1) * n] for s in range(world)])
            assert torch.equal(o, want), f"all_to_all_single {dtype} n={n}"
    torch.cuda.synchronize()


@needs(2)
def test_two_gpus_as_two_nodes(tmp_path):
    run(2, tmp_path, _body, dict(ENV, BRAID_FAKE_NODES="2"))


@needs(4)
def test_four_gpus_as_two_nodes_of_two(tmp_path):
    run(4, tmp_path, _body, dict(ENV, BRAID_FAKE_NODES="2"))
