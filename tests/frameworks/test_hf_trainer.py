"""The Hugging Face transformers Trainer on backend braid: the same seeded run as on the reference
backend, 2 ranks (gloo on CPU; NCCL with BRAID_FW_DEVICE=cuda, tests/frameworks/_fw.py).

What a user writes: make the process group before the TrainingArguments, which then find it:

    import braid, torch.distributed as dist
    dist.init_process_group("braid")
    args = TrainingArguments(..., use_cpu=True)     # no ddp_backend: its choices do not include braid

The model is a tiny GPT-2 built from a config (vocabulary of 61 tokens, 2 layers of width 16: no
download, nothing from the network), trained for 8 steps on seeded random token sequences with an
evaluation every 4 steps and one more at the end, on 21 evaluation samples (uneven over 2 ranks:
the Trainer's gather_for_metrics drops the padding). With 2 ranks every reduction adds two values,
the same float in either order, so the final weights, every logged loss and gradient norm, and the
evaluation loss and token accuracy must equal the reference run's bit for bit.
"""
from __future__ import annotations

import datetime
import os

import pytest

from conftest import run_world
from _fw import (BACKENDS, DEVICE, FW_ENV, REF, assert_same_tensors, braid_paths, encode_state, end_accelerate_run,
                 free_ports, rank_env, report_paths, require)

WORLD = 2
N_TRAIN, N_EVAL, SEQ, VOCAB = 64, 21, 16, 61
# log entries that measure time, not the run
TIMING = ("runtime", "per_second", "total_flos")


def _worker(rank: int, w: int, ports: list[int], workdir: str) -> dict:
    import logging
    import warnings

    import numpy as np
    import torch
    import torch.distributed as dist
    import braid  # noqa: F401  registers the backend "braid"
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)

    class Tokens(torch.utils.data.Dataset):
        def __init__(self, n: int, seed: int):
            g = torch.Generator().manual_seed(seed)
            base = torch.randint(0, VOCAB, (n, SEQ), generator=g)
            # a learnable pattern: every other token repeats the one before it
            base[:, 1::2] = base[:, 0::2]
            self.ids = base

        def __len__(self):
            return self.ids.shape[0]

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    def accuracy(p):
        preds, labels = p.predictions, p.label_ids
        return {"accuracy": float((preds[:, :-1] == labels[:, 1:]).mean())}

    def argmax(logits, labels):
        return logits.argmax(-1)

    out: dict = {}
    for backend, port in zip(BACKENDS, ports):
        rank_env(rank, w, port)
        dist.init_process_group(backend, rank=rank, world_size=w, timeout=datetime.timedelta(seconds=60))
        transformers.set_seed(11)
        config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=2, n_head=2,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = GPT2LMHeadModel(config)
        args = TrainingArguments(
            output_dir=os.path.join(workdir, backend), use_cpu=DEVICE == "cpu", seed=11, data_seed=11,
            per_device_train_batch_size=4, per_device_eval_batch_size=4, max_steps=8, learning_rate=3e-3,
            eval_strategy="steps", eval_steps=4, logging_steps=1, save_strategy="no", report_to=[],
            disable_tqdm=True, dataloader_num_workers=0, log_level="error")
        trainer = Trainer(model=model, args=args, train_dataset=Tokens(N_TRAIN, 1), eval_dataset=Tokens(N_EVAL, 2),
                          compute_metrics=accuracy, preprocess_logits_for_metrics=argmax)
        trainer.train()
        final = trainer.evaluate()
        pred = trainer.predict(Tokens(N_EVAL, 2))
        history = [{k: v for k, v in row.items() if not any(t in k for t in TIMING)}
                   for row in trainer.state.log_history]
        out[backend] = {
            "backend": dist.get_backend(), "world": trainer.args.world_size, "history": history,
            "final": {k: v for k, v in final.items() if not any(t in k for t in TIMING)},
            "predict_shape": list(np.asarray(pred.predictions).shape),
            "weights": encode_state(trainer.model.state_dict()), "braid": braid_paths(),
        }
        end_accelerate_run()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    require("transformers")
    require("accelerate")
    workdir = str(tmp_path_factory.mktemp("hf_trainer"))
    out = run_world(_worker, WORLD, free_ports(len(BACKENDS)), workdir, init_pg=False, env=FW_ENV, timeout=300)
    report_paths("transformers Trainer", out)
    return out


def test_runs_on_braid(runs):
    for r, res in enumerate(runs):
        assert res["braid"]["backend"] == "braid" and res[REF]["backend"] == REF, r
        assert res["braid"]["world"] == WORLD, res["braid"]["world"]
        assert res["braid"]["braid"]["calls"] > 0, f"rank {r}: no call reached braid's communicator"
        # split calls on braid's own lanes (the CPU lanes; on GPUs the copy engines, steered there)
        assert res["braid"]["braid"]["built"] > 0, f"rank {r}: no call took braid's split path: {res['braid']['braid']}"


def test_final_weights_equal_reference(runs):
    for r, res in enumerate(runs):
        assert_same_tensors(res["braid"]["weights"], res[REF]["weights"], f"rank {r}: braid vs {REF} weights")
    assert_same_tensors(runs[1]["braid"]["weights"], runs[0]["braid"]["weights"], "rank 1 vs rank 0 (braid)")


def test_logged_metrics_equal_reference(runs):
    for r, res in enumerate(runs):
        got, want = res["braid"]["history"], res[REF]["history"]
        assert got == want, f"rank {r}: log history differs:\nbraid {got}\n{REF}  {want}"
        assert res["braid"]["final"] == res[REF]["final"], r
    rows = runs[0]["braid"]["history"]
    assert sum("loss" in row for row in rows) == 8, rows            # one training loss per step
    # evaluations at steps 4 and 8, then trainer.evaluate() once more at step 8
    assert [row["step"] for row in rows if "eval_loss" in row] == [4, 8, 8], rows
    assert 0.0 <= runs[0]["braid"]["final"]["eval_accuracy"] <= 1.0


def test_evaluation_sees_every_sample_once(runs):
    for r, res in enumerate(runs):
        # gather_for_metrics dropped the padding of the uneven last batch: 21 samples, not 24
        assert res["braid"]["predict_shape"] == [N_EVAL, SEQ], res["braid"]["predict_shape"]
