"""The bench end to end on the CPU lanes: every op, one small size, JSON as the issue specifies.
Catches hangs in the bench's own collectives (a rank-dependent check once deadlocked `reduce`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

REQUIRED = {"op", "nbytes", "world_size", "dtype", "time_us", "algbw_gbps", "busbw_gbps", "wrong", "shares",
            "baseline", "ratio"}


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
        assert {"name", "time_us", "busbw_gbps"} <= set(p["baseline"])


def test_route_and_env_commands_run():
    proc = subprocess.run([sys.executable, "-m", "braid", "env"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "BRAID_HOST_BUFFER_MB" in proc.stdout


def test_bench_hot_fraction_and_moe_on_cpu_lanes(tmp_path):
    """Issue 4's bench modes: skewed all_to_all by hot fraction (one sweep per value, routed) and one
    MoE layer (dispatch + combine); outputs checked against gloo's."""
    env = dict(os.environ, BRAID_CACHE_DIR=str(tmp_path / "cache"), BRAID_HOST_BUFFER_MB="4",
               BRAID_TIMEOUT_S="60", BRAID_ROUTE="on")
    out = tmp_path / "hot.json"
    common = ["--nproc", "3", "--sizes", "2M:2M", "--iters", "1", "--fixed-iters", "--repeat", "1",
              "--no-calibrate", "--plain"]
    proc = subprocess.run([sys.executable, "-m", "braid", "bench", "--op", "all_to_all_single",
                           "--hot-fraction", "0.7,1", *common, "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    points = json.loads(out.read_text())
    assert [p["hot_fraction"] for p in points] == [0.7, 1.0]
    assert all(p["wrong"] == 0 and set(p["shares"]) == {"gloo", "shm"} for p in points), points
    out = tmp_path / "moe.json"
    proc = subprocess.run([sys.executable, "-m", "braid", "bench", "--op", "moe", *common, "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (p,) = json.loads(out.read_text())
    assert p["op"] == "moe" and p["wrong"] == 0 and p["time_us"] > 0
    bad = subprocess.run([sys.executable, "-m", "braid", "bench", "--op", "all_to_all_single",
                          "--hot-fraction", "1.5"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "fractions between 0 and 1" in bad.stderr
