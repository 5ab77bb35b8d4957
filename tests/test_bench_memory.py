"""The bench's host-memory fit: a CPU point whose buffers the host cannot hold is named and not
run (rather than a rank killed by the kernel), the memory the host can give is read from
/proc/meminfo and the memory cgroup (v2 and v1), and the output check holds no mask the size of
the output."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from braid.bench.sweep import host_memory_free
from braid.workloads import _differ, footprint


def _write(root, rel, text):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_differ_counts_every_differing_byte_across_chunk_edges():
    g = torch.Generator().manual_seed(3)
    a = torch.randn(10_007, generator=g)
    b = a.clone()
    flip = torch.randperm(a.numel(), generator=g)[:97]
    b[flip] += 1.0                                     # each flipped float differs in >= 1 byte
    want = int((a.view(torch.uint8) != b.view(torch.uint8)).sum())
    assert want >= 97
    for chunk in (1, 7, 4096, 40_028, 1 << 20):        # 40_028 = the byte count: one chunk
        assert _differ(a, b, chunk=chunk) == want
    assert _differ(a, a.clone(), chunk=13) == 0


def test_footprint_grows_with_the_gathered_output():
    n = 64 << 20
    assert footprint("all_gather", n, 16, 4) > 3 * 16 * n          # out, the baseline's, gloo's flat copy
    assert footprint("all_gather", n, 16, 4) > footprint("all_gather", n, 2, 4)
    # a reduction's check holds float64 copies: bf16 needs more per byte than float32
    assert footprint("all_reduce", n, 8, 2) > footprint("all_reduce", n, 8, 4) > 3 * n
    for op in ("broadcast", "send_recv", "all_to_all_single", "moe", "reduce_scatter", "reduce"):
        assert footprint(op, n, 4, 4) >= 3 * n


def test_host_memory_free_takes_the_smaller_of_host_and_cgroup(tmp_path):
    _write(tmp_path, "proc/meminfo", "MemTotal: 131072000 kB\nMemAvailable: 104857600 kB\n")   # 100 GiB
    assert host_memory_free(str(tmp_path)) == 100 << 30
    # cgroup v2: a 64 GiB limit, 30 GiB used of which 6 GiB droppable page cache -> 40 GiB
    _write(tmp_path, "sys/fs/cgroup/memory.max", str(64 << 30))
    _write(tmp_path, "sys/fs/cgroup/memory.current", str(30 << 30))
    _write(tmp_path, "sys/fs/cgroup/memory.stat", f"anon {24 << 30}\ninactive_file {6 << 30}\n")
    assert host_memory_free(str(tmp_path)) == 40 << 30
    # no limit: the host's figure again
    _write(tmp_path, "sys/fs/cgroup/memory.max", "max")
    assert host_memory_free(str(tmp_path)) == 100 << 30


def test_host_memory_free_reads_cgroup_v1_and_nothing_gives_none(tmp_path):
    assert host_memory_free(str(tmp_path)) is None
    _write(tmp_path, "sys/fs/cgroup/memory/memory.limit_in_bytes", str(8 << 30))
    _write(tmp_path, "sys/fs/cgroup/memory/memory.usage_in_bytes", str(3 << 30))
    _write(tmp_path, "sys/fs/cgroup/memory/memory.stat", f"total_inactive_file {1 << 30}\n")
    assert host_memory_free(str(tmp_path)) == 6 << 30
    _write(tmp_path, "sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712")   # v1's "none"
    assert host_memory_free(str(tmp_path)) is None


def test_bench_names_a_point_the_host_cannot_hold_and_runs_the_rest(tmp_path):
    out = tmp_path / "bench.json"
    # 51 MiB for the bench: all_gather at 256 KiB on 2 ranks needs ~3.5 MiB, at 4 MiB ~56 MiB
    env = dict(os.environ, BRAID_CACHE_DIR=str(tmp_path / "cache"), BRAID_TIMEOUT_S="60",
               BRAID_BENCH_HOST_MEMORY_GB="0.05")
    proc = subprocess.run(
        [sys.executable, "-m", "braid", "bench", "--cpu", "--op", "all_gather", "--nproc", "2", "--sizes", "256K:4M",
         "--factor", "16", "--iters", "2", "--fixed-iters", "--repeat", "1", "--no-calibrate", "--plain",
         "--json", str(out)], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "# 4 MiB: not run: its buffers need about" in proc.stdout
    assert "BRAID_BENCH_HOST_MEMORY_GB" in proc.stdout
    points = json.loads(out.read_text())
    assert [(p["op"], p["nbytes"]) for p in points] == [("all_gather", 256 << 10)]
    assert points[0]["wrong"] == 0
