"""Hugging Face accelerate on backend braid: the same seeded run as on the reference backend, 2 ranks
(gloo on CPU; NCCL with BRAID_FW_DEVICE=cuda, tests/frameworks/_fw.py).

What a user writes: make the process group first, then let accelerate find it:

    import braid, torch.distributed as dist
    dist.init_process_group("braid")          # accelerate would otherwise make a gloo group on CPU
    accelerator = Accelerator(cpu=True)

(On CPU accelerate names its backend "gloo" whatever the default group is: `state.backend` is a
label it picks itself, docs/frameworks.md.) The run prepares a small MLP, an optimizer and two
data loaders, trains 2 epochs, evaluates with `gather_for_metrics` (50 samples over 2 ranks with
batch 8: the last batch is padded, and gather_for_metrics must drop the padding), and calls
`gather`, `reduce` (sum, mean), `pad_across_processes` and `save_state`/`load_state`. With 2 ranks
every reduction adds two values, the same float in either order: the weights and every gathered
or reduced value must equal the reference run's bit for bit.
"""
from __future__ import annotations

import datetime
import os

import pytest

from conftest import run_world
from _fw import (BACKENDS, DEVICE, FW_ENV, REF, assert_same_tensors, braid_paths, encode, encode_state,
                 end_accelerate_run, free_ports, rank_env, report_paths, require)

WORLD = 2
EPOCHS = 2
N_EVAL = 50


def _worker(rank: int, w: int, ports: list[int], workdir: str) -> dict:
    import warnings

    import torch
    import torch.distributed as dist
    import braid  # noqa: F401  registers the backend "braid"
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader, TensorDataset

    warnings.filterwarnings("ignore")
    out: dict = {}
    for backend, port in zip(BACKENDS, ports):
        rank_env(rank, w, port)
        dist.init_process_group(backend, rank=rank, world_size=w, timeout=datetime.timedelta(seconds=60))
        acc = Accelerator(cpu=DEVICE == "cpu")
        dev = acc.device
        res: dict = {"backend": dist.get_backend(), "accelerate_backend": acc.state.backend,
                     "num_processes": acc.num_processes, "process_index": acc.process_index}
        set_seed(1234)
        g = torch.Generator().manual_seed(5)
        x = torch.randn(200, 6, generator=g)
        y = (x @ torch.randn(6, 1, generator=g)).tanh() + 0.05 * torch.randn(200, 1, generator=g)
        model = torch.nn.Sequential(torch.nn.Linear(6, 24), torch.nn.GELU(), torch.nn.Linear(24, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        train = DataLoader(TensorDataset(x[:150], y[:150]), batch_size=10, shuffle=True)
        evals = DataLoader(TensorDataset(x[150:150 + N_EVAL], y[150:150 + N_EVAL]), batch_size=8)
        model, opt, train, evals = acc.prepare(model, opt, train, evals)
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
        # evaluation: every sample once, in order, on every rank
        model.eval()
        preds, targets = [], []
        with torch.no_grad():
            for xb, yb in evals:
                p, t = acc.gather_for_metrics((model(xb), yb))
                preds.append(p)
                targets.append(t)
        preds, targets = torch.cat(preds), torch.cat(targets)
        res["eval_preds"] = encode(preds)
        res["eval_targets"] = encode(targets)
        res["eval_n"] = int(preds.shape[0])
        # the utilities on their own
        mine = torch.arange(3, dtype=torch.float32, device=dev) + 10 * rank
        res["gather"] = encode(acc.gather(mine))
        res["gather_int"] = encode(acc.gather(torch.tensor([rank, -rank], dtype=torch.int64, device=dev)))
        res["reduce_sum"] = encode(acc.reduce(mine.clone(), reduction="sum"))
        res["reduce_mean"] = encode(acc.reduce(mine.clone(), reduction="mean"))
        ragged = torch.full((2 + 3 * rank, 2), float(rank + 1), device=dev)
        padded = acc.pad_across_processes(ragged, dim=0, pad_index=-1)
        res["padded"] = encode(padded)
        res["padded_first"] = encode(acc.pad_across_processes(ragged, dim=0, pad_index=-1, pad_first=True))
        res["padded_gathered"] = encode(acc.gather(padded))
        # checkpoint: save, disturb the weights and the optimizer, load, compare
        unwrapped = acc.unwrap_model(model)
        before = {k: v.clone() for k, v in unwrapped.state_dict().items()}
        ckpt = os.path.join(workdir, backend, "ckpt")
        acc.save_state(ckpt)
        acc.wait_for_everyone()
        with torch.no_grad():
            for p in unwrapped.parameters():
                p.add_(1.0)
        opt.zero_grad()
        acc.load_state(ckpt)
        after = unwrapped.state_dict()
        res["load_state_restored"] = all(torch.equal(before[k], after[k]) for k in before)
        res["weights"] = encode_state(after)
        res["braid"] = braid_paths()
        out[backend] = res
        acc.wait_for_everyone()
        end_accelerate_run()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    require("accelerate")
    workdir = str(tmp_path_factory.mktemp("accelerate"))
    out = run_world(_worker, WORLD, free_ports(len(BACKENDS)), workdir, init_pg=False, env=FW_ENV, timeout=240)
    report_paths("accelerate", out)
    return out


def test_runs_on_braid(runs):
    for r, res in enumerate(runs):
        assert res["braid"]["backend"] == "braid" and res[REF]["backend"] == REF, r
        assert res["braid"]["num_processes"] == WORLD and res["braid"]["process_index"] == r
        assert res["braid"]["braid"]["calls"] > 0, f"rank {r}: no call reached braid's communicator"
        # split calls on braid's own lanes (the CPU lanes; on GPUs the copy engines, steered there)
        assert res["braid"]["braid"]["built"] > 0, f"rank {r}: no call took braid's split path: {res['braid']['braid']}"


def test_final_weights_equal_reference(runs):
    for r, res in enumerate(runs):
        assert_same_tensors(res["braid"]["weights"], res[REF]["weights"], f"rank {r}: braid vs {REF} weights")
        assert_same_tensors({"losses": res["braid"]["losses"]}, {"losses": res[REF]["losses"]},
                            f"rank {r}: reduced training losses")
    assert_same_tensors(runs[1]["braid"]["weights"], runs[0]["braid"]["weights"], "rank 1 vs rank 0 (braid)")


def test_gather_for_metrics_drops_padding(runs):
    for r, res in enumerate(runs):
        assert res["braid"]["eval_n"] == N_EVAL, f"rank {r}: gather_for_metrics gave {res['braid']['eval_n']} samples"
        for key in ("eval_preds", "eval_targets"):
            assert_same_tensors({key: res["braid"][key]}, {key: res[REF][key]}, f"rank {r}: {key}")


def test_gather_reduce_pad(runs):
    import torch
    from _fw import decode
    for r, res in enumerate(runs):
        b = res["braid"]
        assert decode(b["gather"]).tolist() == [0.0, 1.0, 2.0, 10.0, 11.0, 12.0]
        assert decode(b["gather_int"]).tolist() == [0, 0, 1, -1]
        assert decode(b["reduce_sum"]).tolist() == [10.0, 12.0, 14.0]
        assert decode(b["reduce_mean"]).tolist() == [5.0, 6.0, 7.0]
        padded = decode(b["padded"])
        assert padded.shape == (5, 2), padded.shape          # the longest rank's length
        n = 2 + 3 * r
        assert torch.equal(padded[:n], torch.full((n, 2), float(r + 1))) and bool((padded[n:] == -1).all())
        first = decode(b["padded_first"])
        assert bool((first[: 5 - n] == -1).all()) and bool((first[5 - n:] == r + 1).all())
        assert decode(b["padded_gathered"]).shape == (10, 2)
        for key in ("gather", "gather_int", "reduce_sum", "reduce_mean", "padded", "padded_first", "padded_gathered"):
            assert b[key] == res[REF][key], f"rank {r}: {key} differs from {REF}"


def test_save_and_load_state(runs):
    for r, res in enumerate(runs):
        assert res["braid"]["load_state_restored"], f"rank {r}: load_state did not restore the saved weights"
        assert res[REF]["load_state_restored"], r
