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
