"""The bench end to end on the CPU lanes: every op, one small size, JSON as the issue specifies.
Catches hangs in the bench's own collectives (a rank-dependent check once deadlocked `reduce`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from braid.comm import native_cpu

REQUIRED = {"op", "nbytes", "world_size", "dtype", "time_us", "algbw_gbps", "busbw_gbps", "wrong", "shares",
            "baseline", "ratio", "host_us"}


def test_bench_every_op_on_cpu_lanes(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, BRAID_CACHE_DIR=str(tmp_path / "cache"), BRAID_HOST_BUFFER_MB="4",
               BRAID_TIMEOUT_S="60")
    proc = subprocess.run(
        [sys.executable, "-m", "braid", "bench", "--op", "all", "--nproc", "2", "--sizes", "256K:256K",
         "--iters", "2", "--fixed-iters", "--repeat", "1", "--no-calibrate", "--plain", "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "no GPU: running braid's CPU lanes" in proc.stdout
    points = json.loads(out.read_text())
    assert {p["op"] for p in points} == {"all_gather", "broadcast", "send_recv", "all_to_all_single",
                                         "all_reduce", "reduce_scatter", "reduce"}
    for p in points:
        assert REQUIRED <= set(p), f"{p['op']}: missing {REQUIRED - set(p)}"
        assert p["wrong"] == 0 and p["time_us"] > 0 and p["baseline"]["name"] == "gloo"
        assert abs(sum(p["shares"].values()) - 1.0) < 1e-6
        assert set(p["shares"]) <= {"gloo", "shm"}, f"{p['op']}: a CPU world has no NCCL: {p['shares']}"
        assert {"name", "time_us", "busbw_gbps", "host_us"} <= set(p["baseline"])
        assert p["host_us"] > 0 and p["baseline"]["host_us"] > 0
        # every op: its first call of the shape timed apart, and its table's host summary
        assert p["first_call_us"] > 0 and p["baseline"]["first_call_us"] > 0
        assert p["host_summary"]["op"] == p["op"] and p["host_summary"]["points"] == 1
        # the other baselines: reported with the reason they did not run, never dropped
        if p["op"] in ("all_reduce", "all_gather", "reduce_scatter"):
            alts = p["alternatives"]
            assert alts and all(a["status"] == "unavailable" and "CUDA" in a["why"] for a in alts.values()), alts
        else:
            assert "alternatives" not in p
        assert p["best_baseline"]["name"] == "gloo" and p["ratio_best"] == p["ratio"]
        # the all_reduce's bound: gloo's time over one copy of the tensor on every rank at once
        if p["op"] == "all_reduce":
            assert p["copy_us"] > 0 and p["ratio_bound"] == pytest.approx(p["baseline"]["time_us"] / p["copy_us"])
            assert p["host_summary"]["ratio_bound"] == [[256 << 10, p["ratio_bound"]]]
            # ...and over braid's own copies and reductions with no wait, where the native pool builds
            if native_cpu.build() is not None:
                assert p["floor_us"] > 0 and p["ratio_floor"] == pytest.approx(p["baseline"]["time_us"] / p["floor_us"])
                assert p["host_summary"]["ratio_floor"] == [[256 << 10, p["ratio_floor"]]]
        else:
            assert "ratio_bound" not in p and "floor_us" not in p
    assert "# other baselines: symm_mem two_shot: unavailable (needs CUDA tensors" in proc.stdout
    assert "the ratio could reach" in proc.stdout
    assert proc.stdout.count("# host per call: braid/gloo median") == len(points)


def test_route_and_env_commands_run():
    proc = subprocess.run([sys.executable, "-m", "braid", "env"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "BRAID_HOST_BUFFER_MB" in proc.stdout


def test_bench_hot_fraction_and_moe_on_cpu_lanes(tmp_path):
    """The skew bench modes: skewed all_to_all by hot fraction (one sweep per value, routed) and one
    MoE layer (dispatch + combine); outputs checked against gloo's. Both in one run (--op takes a
    list): one world of 3 ranks started instead of two."""
    env = dict(os.environ, BRAID_CACHE_DIR=str(tmp_path / "cache"), BRAID_HOST_BUFFER_MB="4",
               BRAID_TIMEOUT_S="60", BRAID_ROUTE="on")
    out = tmp_path / "skew.json"
    proc = subprocess.run([sys.executable, "-m", "braid", "bench", "--op", "all_to_all_single,moe",
                           "--hot-fraction", "0.7,1", "--nproc", "3", "--sizes", "2M:2M", "--iters", "1",
                           "--fixed-iters", "--repeat", "1", "--no-calibrate", "--plain", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    points = json.loads(out.read_text())
    assert [(p["op"], p.get("hot_fraction")) for p in points] == [
        ("all_to_all_single", 0.7), ("all_to_all_single", 1.0), ("moe", None)], points
    hot, (p,) = points[:2], points[2:]
    assert all(h["wrong"] == 0 and set(h["shares"]) == {"gloo", "shm"} for h in hot), hot
    assert p["wrong"] == 0 and p["time_us"] > 0
    bad = subprocess.run([sys.executable, "-m", "braid", "bench", "--op", "all_to_all_single",
                          "--hot-fraction", "1.5"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "fractions between 0 and 1" in bad.stderr


def _launch_seen(monkeypatch, ngpu: int, argv: list[str], task: str = "bench"):
    """What `launch` would spawn on a machine showing `ngpu` GPUs: (exit status, world, cfg, printed)."""
    import io
    from contextlib import redirect_stdout

    import torch
    import torch.multiprocessing as mp

    from braid import bench
    seen = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: ngpu > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: ngpu)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(bench.config, "set_gpu_env", lambda: None)

    class Finished:               # the ranks' context, all of them already ended well
        processes, error_files = [], []

        def join(self, timeout=None):
            return True

    def fake_start(fn, args, nprocs, join, start_method):
        seen["cfg"], seen["world"] = args[0], args[1]
        assert nprocs == args[1] and start_method == "spawn"
        return None if join else Finished()
    monkeypatch.setattr(mp, "start_processes", fake_start)
    import argparse
    p = argparse.ArgumentParser()
    (bench.add_bench_arguments if task == "bench" else bench.add_calibrate_arguments)(p)
    args = p.parse_args(argv)
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = bench.launch(bench.config_from_args(task, args), args.nproc)
    return rc, seen.get("world"), seen.get("cfg"), buf.getvalue()


def test_one_gpu_runs_the_cpu_lanes_not_an_error(monkeypatch):
    """The README's bench command on a one-GPU machine: 2 gloo ranks on the CPU lanes, said once."""
    rc, world, cfg, out = _launch_seen(monkeypatch, 1, ["--op", "all"])
    assert rc == 0 and world == 2 and cfg.cpu is True
    assert "one GPU visible" in out
    rc, world, cfg, out = _launch_seen(monkeypatch, 1, [], task="calibrate")
    assert rc == 0 and world == 2 and cfg.cpu is True and "one GPU visible" in out


def test_gpu_machines_keep_one_rank_per_gpu(monkeypatch):
    rc, world, cfg, out = _launch_seen(monkeypatch, 4, ["--op", "all_reduce"])
    assert rc == 0 and world == 4 and cfg.cpu is False and out == ""
    # more ranks than GPUs: spawned on the GPUs, sharing them (each rank's placement: test_shared_gpu.py)
    rc, world, cfg, out = _launch_seen(monkeypatch, 1, ["--nproc", "2"])
    assert rc == 0 and world == 2 and cfg.cpu is False and out == ""
    rc, world, cfg, out = _launch_seen(monkeypatch, 2, ["--nproc", "4"])
    assert rc == 0 and world == 4 and cfg.cpu is False
    # BRAID_SHARED_GPU=1 asked for on one GPU: 2 ranks share it instead of the CPU lanes
    monkeypatch.setenv("BRAID_SHARED_GPU", "1")
    rc, world, cfg, out = _launch_seen(monkeypatch, 1, [])
    assert rc == 0 and world == 2 and cfg.cpu is False and "one GPU visible" not in out
    monkeypatch.delenv("BRAID_SHARED_GPU")
    # --cpu chooses the CPU lanes on a GPU machine (2 ranks by default), and says so
    rc, world, cfg, out = _launch_seen(monkeypatch, 4, ["--cpu"])
    assert rc == 0 and world == 2 and cfg.cpu is True and "--cpu" in out


def test_no_gpu_line_without_gpus(monkeypatch):
    rc, world, cfg, out = _launch_seen(monkeypatch, 0, [])
    assert rc == 0 and world == 2 and "no GPU" in out


def test_cpu_workers_join_with_gloo(monkeypatch):
    """A rank told `cpu` on a GPU machine initialises gloo, not NCCL."""
    import torch
    import torch.distributed as dist

    from braid import bench
    got = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: got.setdefault("set_device", i))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: got.setdefault("backend", backend))
    monkeypatch.setattr(bench.config, "set_gpu_env", lambda: None)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    assert bench._init_rank(0, 2, 12345, cpu=True) is False
    assert got == {"backend": "gloo"}


def test_other_baselines_registry():
    """Every alternative names its op and says why it cannot run on a CPU world; the best
    baseline of a point is the fastest that ran (an unavailable one is listed, never chosen)."""
    import types

    import torch

    from braid.bench import baselines
    from braid.bench.sweep import _add_alternatives
    cpu = types.SimpleNamespace(cuda=False)
    assert {a.op for a in baselines.ALTERNATIVES} == {"all_reduce", "all_gather", "reduce_scatter"}
    st = baselines.statuses(cpu, "all_reduce", torch.float32)
    assert set(st) == {"symm_mem two_shot", "symm_mem one_shot"} and all("CUDA" in v for v in st.values())
    assert baselines.statuses(cpu, "broadcast", torch.float32) == {}
    point = {}
    alts = {"fast": {"status": "ok", "time_us": 50.0, "copy_in_us": 9.0},
            "off": {"status": "unavailable", "why": "no symmetric memory"},
            "broken": {"status": "failed", "why": "rank 1: RuntimeError: boom"}}
    _add_alternatives(point, alts, "nccl", t_base=80.0, t_braid=100.0)
    assert point["best_baseline"] == {"name": "fast", "time_us": 50.0} and point["ratio_best"] == 0.5
    assert point["alternatives"]["off"] == {"status": "unavailable", "why": "no symmetric memory"}
    assert point["alternatives"]["broken"]["status"] == "failed"
    assert point["alternatives"]["fast"]["copy_in_us"] == 9.0 and point["alternatives"]["fast"]["ratio"] == 0.5
    slow = {}
    _add_alternatives(slow, {"slow": {"status": "ok", "time_us": 90.0, "copy_in_us": 1.0}}, "nccl", 80.0, 100.0)
    assert slow["best_baseline"]["name"] == "nccl" and slow["ratio_best"] == 0.8


def _closed_stdout_run(tmp_path, argv: list[str], read_first_line: bool):
    """Run `braid ARGV` with stdout a pipe whose reader goes away (as `| head -1` does):
    (exit status, stderr, files torch left in the temporary folder)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir(parents=True)
    env = dict(os.environ, BRAID_CACHE_DIR=str(tmp_path / "cache"), BRAID_HOST_BUFFER_MB="4",
               BRAID_TIMEOUT_S="60", TMPDIR=str(tmp))
    proc = subprocess.Popen([sys.executable, "-m", "braid", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    if read_first_line:
        proc.stdout.readline()
    proc.stdout.close()
    _, err = proc.communicate(timeout=240)
    return proc.returncode, err.decode(errors="replace"), sorted(p.name for p in tmp.iterdir())


def test_closed_stdout_ends_the_ranks_quietly(tmp_path):
    """`braid topo | head -1`, `braid bench | head -1`: the rank that finds stdout closed exits without
    a traceback, the launcher ends the others and exits 141 (128 + SIGPIPE), torch's error files gone."""
    rc, err, left = _closed_stdout_run(tmp_path / "topo", ["topo", "--cpu"], read_first_line=False)
    assert rc == 141 and "Traceback" not in err and "BrokenPipe" not in err and "Terminating" not in err, err
    assert not [f for f in left if f.startswith("pytorch-errorfile")], left
    # the bench: the first line is the launcher's own, then rank 0's table (rich where installed)
    rc, err, left = _closed_stdout_run(tmp_path / "bench", ["bench", "--op", "all_gather", "--cpu", "--sizes",
                                                            "256K:256K", "--iters", "1", "--fixed-iters",
                                                            "--repeat", "1", "--no-calibrate"],
                                       read_first_line=True)
    assert rc == 141 and "Traceback" not in err and "BrokenPipe" not in err and "Terminating" not in err, err
    assert not [f for f in left if f.startswith("pytorch-errorfile")], left


def test_op_takes_a_comma_list():
    """--op as --workload: a comma list run in turn, 'all' (every op but moe) inside one, repeats
    dropped; an unknown name is refused by the parser, --trace wants one op."""
    import argparse

    import pytest

    from braid import bench

    def ops(*argv):
        p = argparse.ArgumentParser()
        bench.add_bench_arguments(p)
        return bench.config_from_args("bench", p.parse_args(list(argv))).ops
    assert ops("--op", "all_gather,all_reduce") == ("all_gather", "all_reduce")
    assert ops("--op", " all_reduce, all_gather ,all_reduce") == ("all_reduce", "all_gather")
    assert ops("--op", "all") == bench.OPS and ops("--op", "all,moe") == bench.OPS + ("moe",)
    assert ops("--op", "moe") == ("moe",) and ops() == ("all_gather",)
    for bad in ("all_gather,nope", ","):
        with pytest.raises(SystemExit):
            ops("--op", bad)
    with pytest.raises(SystemExit, match="--trace follows one op"):
        ops("--op", "all_gather,all_reduce", "--trace", "4")
    proc = subprocess.run([sys.executable, "-m", "braid", "bench", "--op", "all_gather,bogus"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown: bogus" in proc.stderr and "Traceback" not in proc.stderr


def test_sizes_in_text_are_binary_units_and_verdicts_name_the_native_library(capsys):
    """The trace, the calibrate table and the plots' titles say KiB/MiB/GiB as the docs do; calibrate's
    verdicts name gloo, not NCCL, on CPU ranks."""
    from braid.bench import commands
    from braid.bench.output import human_bytes, print_trace
    assert [human_bytes(n) for n in (100, 1536, 256 << 10, 16 << 20, 1 << 30)] == \
        ["100 B", "1.5 KiB", "256 KiB", "16 MiB", "1 GiB"]
    assert human_bytes(4 << 20, sep="") == "4MiB"
    print_trace([], "all_gather", 16 << 20, 40, 2, None)
    commands._print_verdicts({"broadcast/2/pays": {"20": False, "22": {"gloo": 0.4, "shm": 0.6}}}, "gloo")
    out = capsys.readouterr().out
    assert "# trace: all_gather 16 MiB x 40 calls" in out
    assert "'no' when gloo alone was" in out and "NCCL" not in out
    assert "1MiB=no 4MiB=(gloo=0.40,shm=0.60)" in out


def test_other_baselines_are_checked_against_nccls_output():
    """An alternative whose output differs from NCCL's (or has another shape) fails its check and
    is reported as failed, not timed; bf16 rounding of a sum in another order passes."""
    import torch
    from braid.bench.baselines import _mismatch
    want = torch.randn(1001, dtype=torch.float32)
    assert _mismatch(want.clone(), want) == ""
    assert _mismatch(want.to(torch.bfloat16), want) == ""
    bad = want.clone()
    bad[::7] += 10.0
    assert "143 of 1001 elements differ" in _mismatch(bad, want)
    assert "shape" in _mismatch(want[:1000], want)
