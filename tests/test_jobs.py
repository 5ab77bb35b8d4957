"""`braid bench --workload`: training steps under the braid backend against the same steps on gloo.

Worlds of 2 and 3 CPU ranks run tiny ddp / fsdp / moe_layer workloads through braid.jobs (the
default group is braid's; BRAID_MIN_SPLIT_KB=1 makes braid really split the calls over gloo and
shm); the tests read the rows. The loss comparison and the CLI parsing are checked in-process, and
one end-to-end `python3 -m braid bench --workload ...` run checks the exit status and the JSON.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import os
import subprocess
import sys

import pytest
import torch

from conftest import run_world

ENV = {"BRAID_MIN_SPLIT_KB": "1", "CUDA_VISIBLE_DEVICES": ""}
TINY = dict(width=32, depth=2, batch=4, tokens=16, steps=2, repeat=2, warmup=1)


def _workloads_worker(rank: int, w: int, names: list[str]) -> dict:
    import torch.distributed as dist
    import braid
    from braid import jobs
    from braid.bench import Config
    dist.init_process_group("braid", rank=rank, world_size=w, timeout=datetime.timedelta(seconds=60))
    comm = braid.init()
    ctx = jobs.make_ctx(comm, jobs.settings(Config("bench", **TINY), cuda=False))
    out = {"backend": str(dist.get_backend())}
    for name in names:
        comm.last_handle = None
        row = jobs.run_workload(ctx, name)
        handle = comm.last_handle
        row["braid_shares"] = dict(getattr(handle, "shares", None) or {})   # the last call braid split
        out[name] = row
    if "fsdp" in names:     # a torch whose FSDP2 cannot build here: a row that says so, no crash

        def broken(ctx):
            raise RuntimeError("no FSDP2 here")
        jobs.fsdp_replicas = broken
        out["fsdp_broken"] = jobs.run_workload(ctx, "fsdp")
    return out


@pytest.fixture(scope="module")
def world2():
    return run_world(_workloads_worker, 2, ["ddp", "fsdp", "moe_layer"], init_pg=False, env=ENV, timeout=150)


@pytest.fixture(scope="module")
def world3():
    return run_world(_workloads_worker, 3, ["ddp"], init_pg=False, env=ENV, timeout=150)


@pytest.mark.parametrize("name", ["ddp", "fsdp", "moe_layer"])
def test_two_ranks_train_alike_bitwise(world2, name):
    rows = [rep[name] for rep in world2]
    assert all(rep["backend"] == "braid" for rep in world2)
    row = rows[0]
    assert row["losses_equal"] is True and row["losses_bitwise"] is True, row["losses_cell"]
    assert row["loss_max_rel_diff"] == 0 and row["grad_max_rel_diff"] == 0 and row["param_max_rel_diff"] == 0
    assert row["losses_cell"] == "bitwise"
    # training moves: per-step losses differ, and the weights changed
    assert len(row["losses"]) == TINY["warmup"] + TINY["steps"] * TINY["repeat"]
    assert len(set(row["losses"])) > 1 and all(math.isfinite(x) and x > 0 for x in row["losses"])
    assert row["params_moved"] is True
    # every window timed, positive; the floor where the communication can be taken out
    sides = ["braid", "baseline"] + (["floor"] if name != "fsdp" else [])
    assert sorted(row["windows"]) == sorted(sides)
    assert all(len(row["windows"][s]) == TINY["repeat"] and min(row["windows"][s]) > 0 for s in sides)
    assert row["time_ms"] > 0 and row["baseline"]["time_ms"] > 0 and row["baseline"]["name"] == "gloo"
    assert row["ratio"] == pytest.approx(row["baseline"]["time_ms"] / row["time_ms"])
    # every window's host time to queue its steps (at most the window's own time) and the device's after it
    assert sorted(row["host_time"]) == sorted(sides)
    for s in sides:
        h = row["host_time"][s]
        assert len(h["windows"]["host_ms_per_step"]) == len(h["windows"]["device_tail_ms"]) == TINY["repeat"]
        assert all(0 < q <= w * (1 + 1e-9) for q, w in zip(h["windows"]["host_ms_per_step"], row["windows"][s]))
        assert min(h["windows"]["device_tail_ms"]) >= 0
        assert h["host_ms_per_step"] == pytest.approx(statistics.median(h["windows"]["host_ms_per_step"]))
    if name == "fsdp":
        assert row["floor_ms"] is None and row["comm_removed"] is None
    else:
        assert row["floor_ms"] > 0
    # every rank built the same row from the same reductions (the slowest rank's time)
    for other in rows[1:]:
        assert other["time_ms"] == row["time_ms"] and other["losses_equal"] is True
    # the braid replica's last collective ran on braid's own lanes (not handed to gloo whole)
    assert row["braid_shares"] and set(row["braid_shares"]) <= {"gloo", "shm"}, row["braid_shares"]


def test_sizes_reported(world2):
    ddp, fsdp, moe = (world2[0][n] for n in ("ddp", "fsdp", "moe_layer"))
    assert ddp["params"] == fsdp["params"] == TINY["depth"] * TINY["width"] ** 2
    assert (ddp["width"], ddp["depth"], ddp["batch"], ddp["bucket_mb"]) == (32, 2, 4, 25)
    assert (moe["tokens"], moe["hidden"]) == (16, 32)
    assert moe["params"] == 2 * (2 * 32 * 32 + 32)     # each rank: projection (with bias) + expert


def test_fsdp_that_cannot_build_says_why(world2):
    row = world2[0]["fsdp_broken"]
    assert row["error"] == "not available on CPU: RuntimeError: no FSDP2 here", row
    from braid import jobs
    assert "not available on CPU" in jobs.format_row(row)


def test_three_ranks_within_tolerance(world3):
    row = world3[0]["ddp"]
    assert row["world_size"] == 3
    assert row["losses_equal"] is True, row["losses_cell"]
    assert row["loss_max_rel_diff"] <= row["loss_tolerance"] == 1e-5
    assert max(row["grad_max_rel_diff"], row["param_max_rel_diff"]) <= row["tensor_tolerance"]
    assert "MISMATCH" not in row["losses_cell"]


def test_compare_flags_differences_beyond_the_tolerance():
    from braid import jobs
    base = [1.0, 0.9, 0.8]
    same = jobs.compare(torch.tensor(base), torch.tensor(base), 1e-5)
    assert same == {"bitwise": True, "max_rel_diff": 0.0, "ok": True}
    assert jobs.describe(same, 1e-5) == "bitwise"
    close = jobs.compare([1.0, 0.9, 0.8 * (1 + 2e-6)], base, 1e-5)
    assert close["ok"] and not close["bitwise"] and close["max_rel_diff"] == pytest.approx(2e-6, rel=1e-3)
    assert jobs.describe(close, 1e-5) == "max rel diff 2e-06 (tol 1e-05)"
    far = jobs.compare([1.0, 0.9, 0.81], base, 1e-5)
    assert far["ok"] is False and far["max_rel_diff"] == pytest.approx(0.0125)
    assert jobs.describe(far, 1e-5).startswith("MISMATCH")
    assert jobs.compare([1.0, float("nan")], [1.0, 0.5], 1e-2)["ok"] is False
    assert jobs.compare([1.0], [1.0, 2.0], 1e-2)["ok"] is False


def _parse(argv: list[str]):
    from braid import bench
    p = argparse.ArgumentParser()
    bench.add_bench_arguments(p)
    return bench.config_from_args("bench", p.parse_args(argv))


def test_cli_workload_parsing():
    with pytest.raises(SystemExit) as exc:
        _parse(["--workload", "nope"])
    assert "ddp, fsdp, moe_layer" in str(exc.value) and "nope" in str(exc.value)
    with pytest.raises(SystemExit) as exc:
        _parse(["--workload", "ddp", "--op", "all_reduce"])
    assert "--op" in str(exc.value) and "--workload" in str(exc.value)
    cfg = _parse(["--workload", "ddp"])
    assert cfg.workloads == ("ddp",) and cfg.ops == () and cfg.repeat is None   # the op sweep does not run
    from braid import jobs
    assert jobs.settings(cfg, True)["repeat"] == 9 and jobs.settings(cfg, False)["repeat"] == 5
    cfg = _parse(["--workload", "all", "--width", "64", "--hidden", "128", "--steps", "3", "--repeat", "2"])
    assert cfg.workloads == ("ddp", "fsdp", "moe_layer") and cfg.width == 128 and cfg.steps == 3 and cfg.repeat == 2
    cfg = _parse(["--workload", "moe_layer,ddp", "--sizes", "1M:1M"])
    assert cfg.workloads == ("moe_layer", "ddp") and any("--sizes" in n for n in cfg.notes)
    with pytest.raises(SystemExit):
        _parse(["--workload", "ddp", "--steps", "0"])
    cfg = _parse([])          # no --workload: the op sweep as before
    assert cfg.workloads == () and cfg.ops == ("all_gather",) and cfg.repeat == 2
    from braid import jobs
    assert jobs.settings(_parse(["--workload", "ddp"]), cuda=True)["width"] == 8192
    assert jobs.settings(_parse(["--workload", "ddp"]), cuda=False)["width"] == 256
    with pytest.raises(SystemExit, match="int32"):
        jobs.settings(_parse(["--workload", "ddp", "--dtype", "int32"]), cuda=False)


def test_launch_allows_one_rank_for_workloads_only(monkeypatch):
    from test_bench_cli import _launch_seen
    rc, world, cfg, _ = _launch_seen(monkeypatch, 1, ["--workload", "ddp", "--nproc", "1"])
    assert rc == 0 and world == 1 and cfg.cpu is False          # the GPU step code on one rank
    rc, world, cfg, out = _launch_seen(monkeypatch, 1, ["--workload", "ddp"])
    assert rc == 0 and world == 2 and cfg.cpu is True and "one GPU visible" in out
    rc, world, _, _ = _launch_seen(monkeypatch, 1, ["--op", "all_reduce", "--nproc", "1"])
    assert rc == 2 and world is None                            # the op sweep still needs 2 ranks


def test_bench_workload_end_to_end(tmp_path):
    out = tmp_path / "jobs.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", BRAID_CALIBRATE="off", BRAID_CACHE_DIR=str(tmp_path / "cache"),
               BRAID_TIMEOUT_S="60")
    proc = subprocess.run(
        [sys.executable, "-m", "braid", "bench", "--workload", "ddp,moe_layer", "--width", "64", "--depth", "2",
         "--batch", "4", "--steps", "2", "--repeat", "2", "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "comm removed" in proc.stdout and "losses match the baseline" in proc.stdout
    rows = json.loads(out.read_text())
    assert [r["workload"] for r in rows] == ["ddp", "moe_layer"]
    for r in rows:
        assert r["losses_equal"] is True and r["world_size"] == 2 and r["dtype"] == "float32"
        assert {"time_ms", "baseline", "floor_ms", "ratio", "comm_removed", "loss_max_rel_diff", "windows",
                "params", "machine", "torch"} <= set(r)
        assert len(r["windows"]["braid"]) == 2
    assert rows[0]["params"] == 2 * 64 * 64 and rows[1]["hidden"] == 64


def test_trial_steps_run_until_the_verdicts_and_the_baseline_keeps_pace(monkeypatch):
    """braid's whole-or-split trials get warm-up steps of their own before the timed windows;
    the baseline runs as many (its losses compare step by step), and a cap ends them."""
    from types import SimpleNamespace

    from braid import jobs

    class Arb:
        enabled, left = True, 7

        def trying(self):
            return self.left > 0

    arb = Arb()
    ran = {"braid": 0, "baseline": 0}

    class Rep:
        def __init__(self, name):
            self.name = name

        def run(self, k):
            ran[self.name] += k
            if self.name == "braid":
                arb.left -= k

    monkeypatch.setattr(jobs.dist, "all_reduce", lambda t, op=None, group=None: None)
    ctx = SimpleNamespace(comm=SimpleNamespace(_arbiter=arb), timer=None, sync=lambda: None, s={"steps": 4})
    reps = {"braid": Rep("braid"), "baseline": Rep("baseline")}
    steps, ms = jobs.settle_trials(ctx, reps)
    # runs of a window's 4 steps, the flags between them: 7 steps of trials take two runs
    assert steps == 8 and ran == {"braid": 8, "baseline": 8} and ms is not None and ms >= 0
    assert jobs.settle_trials(ctx, reps) == (0, None)              # settled: nothing more
    monkeypatch.setattr(jobs, "TRIAL_STEPS_MAX", 3)
    arb.left = 100
    assert jobs.settle_trials(ctx, reps)[0] == 3                  # the cap (a shorter last run)
    assert ran == {"braid": 11, "baseline": 11}
    # the trials over, the backend's hand-off on its way: the steps go on until it is in place
    monkeypatch.setattr(jobs, "TRIAL_STEPS_MAX", 500)
    arb.left, coming = 0, [6]

    def handing():
        return coming[0] > 0
    monkeypatch.setattr(jobs, "_handing_off", lambda: handing)
    Rep.run = lambda self, k: (ran.__setitem__(self.name, ran[self.name] + k),
                               self.name == "braid" and coming.__setitem__(0, coming[0] - k))
    assert jobs.settle_trials(ctx, reps)[0] == 8                  # two runs of 4 steps
    assert jobs.settle_trials(ctx, reps) == (0, None)              # in place: nothing more
    arb.enabled = False
    coming[0] = 5
    assert jobs.settle_trials(ctx, reps) == (0, None)              # no trials (CPU, or learning off)


def test_host_line_names_each_replica_host_and_device_time():
    from braid.jobs import host_line
    line = host_line({"braid": {"host_ms_per_step": 7.4, "device_tail_ms": 0.7},
                      "baseline": {"host_ms_per_step": 1.25, "device_tail_ms": 45.0}})
    assert "braid 7.40 ms (GPU 0.7 ms after)" in line and "baseline 1.25 ms (GPU 45.0 ms after)" in line
