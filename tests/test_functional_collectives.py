"""torch's functional collectives on backend "braid" (CPU, 2 and 3 ranks): DTensor, FSDP2's whole
state dict, tensor parallelism and compiled code call them, and for a Python process group they
reach its coalesced methods (`allgather_into_tensor_coalesced`, `reduce_scatter_tensor_coalesced`),
which gloo's and NCCL's backend objects do not offer. Checked against references built from every
rank's seeded data (no zeros, odd sizes, several dtypes); a small FSDP2 model trained on braid and
on gloo must give the same whole state dict bit for bit; a step of collectives compiled with
torch.compile (which traces dist.* into functional collectives) must give eager's bits; and DTensor
over a 2 x 2 mesh made on braid's default group (subgroups for its dimensions) gives back its data.
"""
from __future__ import annotations

import hashlib
import warnings

import pytest
import torch

from conftest import run_world

ENV = {"CUDA_VISIBLE_DEVICES": "", "BRAID_MIN_SPLIT_KB": "1"}
DTYPES = [torch.float32, torch.bfloat16, torch.int64]


def _data(key, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Seeded, no zeros: small integers (exact sums in every dtype here)."""
    seed = int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:8], "little") >> 1
    g = torch.Generator().manual_seed(seed)
    v = torch.randint(1, 40, (n,), generator=g) * (torch.randint(0, 2, (n,), generator=g) * 2 - 1)
    return v.to(dtype)


def _funcol_worker(rank: int, w: int) -> list:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import braid  # noqa: F401
    warnings.filterwarnings("ignore", category=FutureWarning)
    dist.init_process_group("braid", rank=rank, world_size=w)
    group = dist.group.WORLD
    wrong = []
    for k, (dtype, n) in enumerate((d, n) for d in DTYPES for n in (3 * w, 1001 * w, 40_003 * w)):
        xs = [_data(("x", k, r), n, dtype) for r in range(w)]
        ys = [_data(("y", k, r), 2 * n, dtype) for r in range(w)]
        ref_sum_x, ref_sum_y = sum(x.double() for x in xs), sum(y.double() for y in ys)
        m, m2 = n // w, 2 * n // w
        got = {
            "all_gather_tensor": funcol.wait_tensor(funcol.all_gather_tensor(xs[rank].clone(), 0, group)),
            "reduce_scatter_tensor": funcol.wait_tensor(funcol.reduce_scatter_tensor(xs[rank].clone(), "sum", 0,
                                                                                     group)),
            "all_reduce": funcol.wait_tensor(funcol.all_reduce(xs[rank].clone(), "sum", group)),
        }
        both = funcol.all_gather_into_tensor_coalesced([xs[rank].clone(), ys[rank].clone()], group)
        got["all_gather_coalesced[0]"], got["all_gather_coalesced[1]"] = (funcol.wait_tensor(t) for t in both)
        both = funcol.reduce_scatter_tensor_coalesced([xs[rank].clone(), ys[rank].clone()], "sum", [0, 0], group)
        got["reduce_scatter_coalesced[0]"], got["reduce_scatter_coalesced[1]"] = (funcol.wait_tensor(t) for t in both)
        want = {
            "all_gather_tensor": torch.cat(xs),
            "reduce_scatter_tensor": ref_sum_x[rank * m:(rank + 1) * m].to(dtype),
            "all_reduce": ref_sum_x.to(dtype),
            "all_gather_coalesced[0]": torch.cat(xs),
            "all_gather_coalesced[1]": torch.cat(ys),
            "reduce_scatter_coalesced[0]": ref_sum_x[rank * m:(rank + 1) * m].to(dtype),
            "reduce_scatter_coalesced[1]": ref_sum_y[rank * m2:(rank + 1) * m2].to(dtype),
        }
        for name, ref in want.items():
            if got[name].dtype != dtype or not torch.equal(got[name], ref):
                wrong.append(f"{name} {dtype} {n}")
    dist.destroy_process_group()
    return wrong


@pytest.mark.parametrize("world", [2, 3])
def test_functional_collectives_match_references(world):
    for rank, wrong in enumerate(run_world(_funcol_worker, world, env=ENV, init_pg=False)):
        assert not wrong, f"rank {rank}: wrong results: {wrong[:6]}"


def _fsdp2_worker(rank: int, w: int, backend: str) -> dict:
    import torch.distributed as dist
    import braid  # noqa: F401
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    dist.init_process_group(backend, rank=rank, world_size=w)
    mesh = init_device_mesh("cpu", (w,))
    torch.manual_seed(11)
    model = torch.nn.Sequential(torch.nn.Linear(7, 33), torch.nn.GELU(), torch.nn.Linear(33, 5))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(4):
        loss = model(torch.randn(9, 7, generator=g)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    out = {k: v.detach().contiguous().view(torch.uint8).numpy().tobytes().hex() for k, v in state.items()}
    calls = 0
    if backend == "braid":
        pg = dist.distributed_c10d._get_default_group()
        calls = int(getattr(getattr(pg, "_comm", None), "ncalls", 0) or 0)
    dist.destroy_process_group()
    return {"state": out, "calls": calls}


def test_fsdp2_whole_state_dict_equals_gloo():
    """FSDP2 on CPU: sharded training (its all_gathers and reduce_scatters), then the whole state
    dict (DTensor's functional all_gather): braid's bits equal gloo's on every rank."""
    ref = run_world(_fsdp2_worker, 2, "gloo", env=ENV, init_pg=False)
    got = run_world(_fsdp2_worker, 2, "braid", env=ENV, init_pg=False)
    for rank in range(2):
        assert got[rank]["calls"] > 0, f"rank {rank}: no call reached braid's communicator"
        assert sorted(got[rank]["state"]) == sorted(ref[rank]["state"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
        assert got[rank]["state"] == ref[rank]["state"], f"rank {rank}: braid's weights differ from gloo's"
    assert got[0]["state"] == got[1]["state"]


def _compiled_worker(rank: int, w: int) -> list:
    import torch.distributed as dist
    import braid  # noqa: F401
    warnings.filterwarnings("ignore")
    dist.init_process_group("braid", rank=rank, world_size=w)

    def step(x):
        y = x * 2 + 1
        dist.all_reduce(y)
        gathered = torch.empty(w * y.numel(), dtype=y.dtype)
        dist.all_gather_into_tensor(gathered, y)
        part = torch.empty(gathered.numel() // w, dtype=y.dtype)
        dist.reduce_scatter_tensor(part, gathered)
        return part - 3

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    wrong = []
    for k, n in enumerate((5, 1003, 65_537)):
        x = _data(("compiled", k, rank), n, torch.float32)
        got, want = compiled(x.clone()), step(x.clone())
        xs = [_data(("compiled", k, r), n, torch.float32).double() * 2 + 1 for r in range(w)]
        ref = (sum(xs) * w - 3).to(torch.float32)         # all_reduce, gather, then every rank's copy summed
        if not (torch.equal(got, want) and torch.equal(got, ref)):
            wrong.append(n)
    dist.destroy_process_group()
    return wrong


def test_compiled_collectives_match_eager_and_reference():
    """torch.compile traces dist.* collectives into functional ones (which reach braid's
    coalesced methods): the compiled step gives eager's bits and the reference's."""
    for rank, wrong in enumerate(run_world(_compiled_worker, 2, env=ENV, init_pg=False, timeout=240)):
        assert not wrong, f"rank {rank}: compiled results wrong at sizes {wrong}"


def _mesh_worker(rank: int, w: int) -> list:
    import torch.distributed as dist
    import braid  # noqa: F401
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    warnings.filterwarnings("ignore")
    dist.init_process_group("braid", rank=rank, world_size=w)
    mesh = init_device_mesh("cpu", (2, w // 2), mesh_dim_names=("dp", "tp"))
    wrong = []
    for k, (rows, cols) in enumerate(((4, 6), (10, 14), (34, 18))):
        x = _data(("mesh", k), rows * cols, torch.float32).view(rows, cols)     # the same on every rank
        d = distribute_tensor(x, mesh, [Shard(0), Shard(1)])
        if not torch.equal(d.redistribute(mesh, [Replicate(), Replicate()]).to_local(), x):
            wrong.append(f"gather back {rows}x{cols}")
        t = distribute_tensor(x, mesh, [Replicate(), Shard(0)])
        if float((t * 3).sum().full_tensor()) != float(x.double().sum() * 3):
            wrong.append(f"sum {rows}x{cols}")
        if not torch.equal(d.redistribute(mesh, [Shard(1), Shard(0)]).full_tensor(), x):
            wrong.append(f"reshard {rows}x{cols}")
    dist.destroy_process_group()
    return wrong


def test_dtensor_on_a_two_dimensional_mesh():
    """DTensor over a 2 x 2 mesh made on braid's default group (its dimensions are subgroups):
    gathering, a reduction and a change of sharding give back the tensor every rank started from."""
    for rank, wrong in enumerate(run_world(_mesh_worker, 4, env=ENV, init_pg=False, timeout=240)):
        assert not wrong, f"rank {rank}: {wrong}"
