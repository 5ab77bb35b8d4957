"""PyTorch Lightning DDP on backend braid: the same seeded run as on the reference backend, 2 ranks
(gloo on CPU; NCCL with BRAID_FW_DEVICE=cuda, tests/frameworks/_fw.py).

The only change a Lightning user makes: `import braid` and
`Trainer(strategy=DDPStrategy(process_group_backend="braid"))` (or `FSDPStrategy(...)`, on GPUs:
torch's FSDP needs an accelerator and Lightning gives it none on CPU).

The run trains a small regression MLP for 2 epochs with a validation loop after each, logs the
training loss per step and per epoch and the validation loss and sample count per epoch, all
with `sync_dist=True`. Lightning treats the backends differently in two places this run crosses
(docs/frameworks.md): its mean over ranks is AVG on braid but SUM plus a division on gloo (the
epoch means also average the int64 batch-size count, an integer AVG on braid), and
`Trainer.validate` runs under `torch.inference_mode` on braid but `torch.no_grad` on gloo (the
validation inside `fit` uses no_grad on both). With 2
ranks both give the same floats, so the final weights and every logged value must be equal bit
for bit to the reference run's.
"""
from __future__ import annotations

import os

import pytest

from conftest import run_world
from _fw import (BACKENDS, DEVICE, FW_ENV, REF, assert_same_tensors, braid_paths, encode_state, free_ports,
                 layout, rank_env, report_paths, require)

WORLD = 2
EPOCHS = 2


def _worker(rank: int, w: int, ports: list[int], logdir: str, strategy: str = "ddp") -> dict:
    import warnings

    import torch
    import torch.distributed as dist
    import braid  # noqa: F401  registers the backend "braid"
    import lightning as L
    from lightning.pytorch.loggers.logger import Logger
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    warnings.filterwarnings("ignore")

    class Recorder(Logger):
        """Keeps every logged (step, metrics) in memory, on every rank."""

        def __init__(self):
            super().__init__()
            self.rows: list = []

        @property
        def name(self):
            return "recorder"

        @property
        def version(self):
            return 0

        def log_hyperparams(self, *args, **kwargs):
            pass

        def log_metrics(self, metrics, step=None):
            self.rows.append([step, {k: float(v) for k, v in sorted(metrics.items())}])

    class Regressor(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
            self.seen: dict = {}

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("loss", loss, on_step=True, on_epoch=True, sync_dist=True)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("val_loss", loss, on_epoch=True, sync_dist=True)
            self.log("val_n", float(x.shape[0]), on_epoch=True, sync_dist=True, reduce_fx="sum")
            self.seen["inference_mode"] = torch.is_inference_mode_enabled()
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    out: dict = {}
    for backend, port in zip(BACKENDS, ports):
        rank_env(rank, w, port)
        L.seed_everything(20261125, workers=True, verbose=False)
        g = torch.Generator().manual_seed(7)
        x = torch.randn(200, 8, generator=g)
        y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(200, 1, generator=g)
        train = DataLoader(TensorDataset(x[:150], y[:150]), batch_size=16)
        val = DataLoader(TensorDataset(x[150:], y[150:]), batch_size=8)   # 25 per rank: a short last batch
        model = Regressor()
        rec = Recorder()
        devices, nodes = layout(w)
        strat = (DDPStrategy(process_group_backend=backend) if strategy == "ddp" else
                 FSDPStrategy(process_group_backend=backend, state_dict_type="full"))
        trainer = L.Trainer(accelerator=DEVICE, devices=devices, num_nodes=nodes, strategy=strat,
                            max_epochs=EPOCHS, logger=rec, log_every_n_steps=1, num_sanity_val_steps=0,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            deterministic=True, default_root_dir=os.path.join(logdir, backend))
        trainer.fit(model, train, val)
        # FSDP: the whole weights, gathered to rank 0 (rank 1 gets none), as a checkpoint saves them
        state = model.state_dict() if strategy == "ddp" else trainer.strategy.lightning_module_state_dict()
        res = {"weights": encode_state(state), "logged": list(rec.rows), "braid": braid_paths(),
               "callback_metrics": {k: float(v) for k, v in sorted(trainer.callback_metrics.items())}}
        model.seen.clear()
        if strategy != "ddp":
            out[backend] = dict(res, backend=dist.get_backend())
            dist.destroy_process_group()
            continue
        try:
            validated = trainer.validate(model, val, verbose=False)   # inference_mode where not gloo
            res["validate"] = [{k: float(v) for k, v in sorted(d.items())} for d in validated]
        except Exception as exc:     # recorded; the test says what failed
            res["validate_error"] = f"{type(exc).__name__}: {exc}"
        out[backend] = dict(res, backend=dist.get_backend(), validate_inference_mode=model.seen.get("inference_mode"))
        try:
            dist.destroy_process_group()
        except Exception:
            if "validate_error" not in res:
                raise
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    require("lightning")
    logdir = str(tmp_path_factory.mktemp("lightning"))
    out = run_world(_worker, WORLD, free_ports(len(BACKENDS)), logdir, init_pg=False, env=FW_ENV, timeout=240)
    report_paths("Lightning", out)
    return out


def test_runs_on_braid(runs):
    for r, res in enumerate(runs):
        assert res["braid"]["backend"] == "braid", r
        assert res[REF]["backend"] == REF, r
        assert res["braid"]["braid"]["calls"] > 0, f"rank {r}: no call reached braid's communicator"
        # split calls on braid's own lanes (the CPU lanes; on GPUs the copy engines, steered there)
        assert res["braid"]["braid"]["built"] > 0, f"rank {r}: no call took braid's split path: {res['braid']['braid']}"


def test_final_weights_equal_reference(runs):
    for r, res in enumerate(runs):
        assert_same_tensors(res["braid"]["weights"], res[REF]["weights"], f"rank {r}: braid vs {REF} weights")
    assert_same_tensors(runs[1]["braid"]["weights"], runs[0]["braid"]["weights"], "rank 1 vs rank 0 (braid)")


def test_logged_metrics_equal_reference(runs):
    for r, res in enumerate(runs):
        got, want = res["braid"]["logged"], res[REF]["logged"]
        assert [row[0] for row in got] == [row[0] for row in want], f"rank {r}: logged steps differ"
        assert got == want, f"rank {r}: logged metrics differ:\nbraid {got}\n{REF}  {want}"
        assert res["braid"]["callback_metrics"] == res[REF]["callback_metrics"], r
    # sync_dist: every rank logged the same values
    assert runs[0]["braid"]["logged"] == runs[1]["braid"]["logged"]
    names = {k for _, row in runs[0]["braid"]["logged"] for k in row}
    assert {"loss_step", "loss_epoch", "val_loss", "val_n"} <= names, names
    # 50 validation samples in all, summed over both ranks, each epoch
    assert [row["val_n"] for _, row in runs[0]["braid"]["logged"] if "val_n" in row] == [50.0] * EPOCHS


def test_trainer_validate_equal_reference(runs):
    """Trainer.validate runs under inference_mode except on a backend named "gloo" (no_grad
    there): on braid the synced metrics are reduced from inference tensors (braid writes them in
    inference mode, in whichever thread finishes the call; tests/test_semantics.py::
    test_inference_tensors checks it small)."""
    for r, res in enumerate(runs):
        assert "validate_error" not in res["braid"], f"rank {r}: {res['braid']['validate_error']}"
        assert res["braid"]["validate_inference_mode"] is True, r
        assert res["braid"]["validate"] == res[REF]["validate"], (r, res["braid"]["validate"], res[REF]["validate"])


def test_trainer_validate_on_the_reference(runs):
    """The reference for the test above: Trainer.validate runs under no_grad on gloo, under
    inference_mode on NCCL, and sums the 50 validation samples over both ranks."""
    for r, res in enumerate(runs):
        assert res[REF]["validate_inference_mode"] is (REF != "gloo"), r
        assert res[REF]["validate"][0]["val_n"] == 50.0, res[REF]["validate"]


# FSDP (torch's FullyShardedDataParallel through Lightning's FSDPStrategy): GPUs only
@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    require("lightning")
    if DEVICE != "cuda":
        pytest.skip("Lightning's FSDP strategy needs a GPU (torch's FSDP needs an accelerator; "
                    "Lightning passes it no device on CPU): BRAID_FW_DEVICE=cuda runs it")
    logdir = str(tmp_path_factory.mktemp("lightning_fsdp"))
    out = run_world(_worker, WORLD, free_ports(len(BACKENDS)), logdir, "fsdp", init_pg=False, env=FW_ENV,
                    timeout=240)
    report_paths("Lightning FSDP", out)
    return out


def test_fsdp_runs_on_braid(fsdp_runs):
    for r, res in enumerate(fsdp_runs):
        assert res["braid"]["backend"] == "braid" and res[REF]["backend"] == REF, r
        assert res["braid"]["braid"]["built"] > 0, f"rank {r}: no call took braid's split path: {res['braid']['braid']}"


def test_fsdp_final_weights_equal_reference(fsdp_runs):
    assert fsdp_runs[0]["braid"]["weights"], "rank 0 got no gathered weights"
    for r, res in enumerate(fsdp_runs):
        assert_same_tensors(res["braid"]["weights"], res[REF]["weights"], f"rank {r}: braid vs {REF} FSDP weights")


def test_fsdp_logged_metrics_equal_reference(fsdp_runs):
    for r, res in enumerate(fsdp_runs):
        assert res["braid"]["logged"] == res[REF]["logged"], f"rank {r}: logged metrics differ"
        assert res["braid"]["callback_metrics"] == res[REF]["callback_metrics"], r
    assert [row["val_n"] for _, row in fsdp_runs[0]["braid"]["logged"] if "val_n" in row] == [50.0] * EPOCHS
