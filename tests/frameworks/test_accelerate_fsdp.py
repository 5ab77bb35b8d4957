"""Hugging Face accelerate with FSDP (torch's `fully_shard`, accelerate's `fsdp_version=2`) on
backend braid, 2 ranks on GPUs, against the same seeded run on NCCL (tests/frameworks/_fw.py).

What a user writes:

    import braid, torch.distributed as dist
    dist.init_process_group("braid")
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))

On CPU accelerate leaves the FSDP plugin unused (its state says MULTI_CPU, a DDP run: see
test_accelerate.py), so this module runs with BRAID_FW_DEVICE=cuda only. The run trains a small
MLP sharded over both ranks for 2 epochs (FSDP's all_gather of the weights before each forward
and backward, its reduce_scatter of the gradients), averages the loss over the ranks each step and
gathers the whole weights at the end. With 2 ranks every reduction adds two values, so the losses
and the weights must equal the NCCL run's bit for bit.
"""
from __future__ import annotations

import datetime

import pytest

from conftest import run_world
from _fw import (BACKENDS, DEVICE, FW_ENV, REF, assert_same_tensors, braid_paths, encode, encode_state,
                 end_accelerate_run, free_ports, rank_env, report_paths, require)

WORLD = 2
EPOCHS = 2


def _worker(rank: int, w: int, ports: list[int]) -> dict:
    import warnings

    import torch
    import torch.distributed as dist
    import braid  # noqa: F401  registers the backend "braid"
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader, TensorDataset

    warnings.filterwarnings("ignore")
    out: dict = {}
    for backend, port in zip(BACKENDS, ports):
        rank_env(rank, w, port)
        dist.init_process_group(backend, rank=rank, world_size=w, timeout=datetime.timedelta(seconds=60))
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="no_wrap",
                                                state_dict_type="FULL_STATE_DICT")
        acc = Accelerator(fsdp_plugin=plugin)
        res: dict = {"backend": dist.get_backend(), "distributed_type": str(acc.distributed_type)}
        set_seed(4321)
        g = torch.Generator().manual_seed(9)
        x = torch.randn(160, 12, generator=g)
        y = (x @ torch.randn(12, 1, generator=g)).sin() + 0.05 * torch.randn(160, 1, generator=g)
        model = torch.nn.Sequential(torch.nn.Linear(12, 48), torch.nn.GELU(), torch.nn.Linear(48, 48),
                                    torch.nn.GELU(), torch.nn.Linear(48, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
        train = DataLoader(TensorDataset(x, y), batch_size=10, shuffle=True)
        model, opt, train = acc.prepare(model, opt, train)
        losses = []
        for _ in range(EPOCHS):
            model.train()
            for xb, yb in train:
                loss = torch.nn.functional.mse_loss(model(xb), yb)
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
                losses.append(acc.reduce(loss.detach(), reduction="mean"))
        res["losses"] = encode(torch.stack(losses))
        res["steps"] = len(losses)
        res["weights"] = encode_state(acc.get_state_dict(model))     # the whole weights (rank 0 at least)
        res["braid"] = braid_paths()
        out[backend] = res
        acc.wait_for_everyone()
        end_accelerate_run()
    return out


@pytest.fixture(scope="module")
def runs():
    require("accelerate")
    if DEVICE != "cuda":
        pytest.skip("accelerate runs FSDP on GPUs only (on CPU it leaves the plugin unused): "
                    "BRAID_FW_DEVICE=cuda runs it")
    out = run_world(_worker, WORLD, free_ports(len(BACKENDS)), init_pg=False, env=FW_ENV, timeout=240)
    report_paths("accelerate FSDP", out)
    return out


def test_runs_fsdp_on_braid(runs):
    for r, res in enumerate(runs):
        assert res["braid"]["backend"] == "braid" and res[REF]["backend"] == REF, r
        assert res["braid"]["distributed_type"] == res[REF]["distributed_type"] == "DistributedType.FSDP", r
        assert res["braid"]["braid"]["built"] > 0, f"rank {r}: no call took braid's split path: {res['braid']['braid']}"


def test_losses_equal_reference(runs):
    for r, res in enumerate(runs):
        assert res["braid"]["steps"] == res[REF]["steps"] > 0, r
        assert res["braid"]["losses"] == res[REF]["losses"], f"rank {r}: the averaged losses differ"
    assert runs[0]["braid"]["losses"] == runs[1]["braid"]["losses"], "the ranks' averaged losses differ"


def test_final_weights_equal_reference(runs):
    assert runs[0]["braid"]["weights"], "rank 0 got no gathered weights"
    for r, res in enumerate(runs):
        assert_same_tensors(res["braid"]["weights"], res[REF]["weights"], f"rank {r}: braid vs {REF} FSDP weights")
