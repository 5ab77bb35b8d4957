"""The bench's host-memory fit: a CPU point whose buffers the host cannot hold is named and not
run (rather than a rank killed by the kernel), the memory the host can give is read from
/proc/meminfo and the memory cgroup (v2 and v1), and the output check holds no mask the size of
the output."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from braid.bench.sweep import host_memory_free
from braid.workloads import _beyond, _differ, footprint


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


_PEAKS = r"""
import json, sys, torch
from braid.workloads import _beyond, _differ

def peak_mib(fn):
    # MiB the resident high-water mark rose by while fn ran (Linux: /proc)
    def hwm():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:")) / 1024
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                            # the high-water mark back to the resident size now
    before = hwm()
    out = fn()
    return hwm() - before, out

chunk, elems = int(sys.argv[1]), int(sys.argv[2])
g = torch.Generator().manual_seed(5)
a = torch.randint(0, 255, (64 << 20,), dtype=torch.uint8, generator=g)
b = a.clone()
b[::4099] += 1
x = torch.randn(16 << 20, generator=g)          # 64 MiB of float32
y = x.clone()
y[::1001] += 1.0
scale = torch.ones(x.numel(), dtype=torch.float64)
res = {"want_d": int(torch.count_nonzero(a != b)), "want_b": int(torch.count_nonzero(y != x))}
res["peak_d"], res["d"] = peak_mib(lambda: _differ(a, b, chunk=chunk))
res["peak_b"], res["b"] = peak_mib(lambda: _beyond(x, y, scale, 1e-5, chunk=elems))
res["peak_whole"], _ = peak_mib(lambda: int((a != b).sum()))
print(json.dumps(res))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/self/clear_refs")
def test_checks_hold_pieces_not_copies_of_the_whole_output():
    """A check of 64 MiB holds a piece's mask or float64 pieces at a time, never a copy of the
    whole: a bool mask's .sum() goes through an int64 copy (8 bytes per byte compared), float64
    copies of the whole tensors 2 x 8 bytes per element; the 64 MiB all_gather on 16 CPU ranks was
    killed for that. Measured in a fresh interpreter, with pieces of 2 MiB and 256 Ki elements: in
    a process that has run many tests, the allocator may place successive pieces on fresh pages (a
    16 MiB piece rose the mark by 48 MiB there), which says nothing about the check."""
    from braid.workloads import CHECK_CHUNK, CHECK_CHUNK_ELEMS
    assert CHECK_CHUNK <= 16 << 20 and CHECK_CHUNK_ELEMS * 8 <= 16 << 20   # the defaults are pieces
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.join(os.path.dirname(__file__), "..", "src"), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", _PEAKS, str(2 << 20), str(1 << 18)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["d"] == r["want_d"] > 0
    assert r["b"] == r["want_b"] == len(range(0, 16 << 20, 1001))
    assert r["peak_whole"] > 256                 # the measure sees a whole-output copy (int64: 512 MiB)
    assert r["peak_d"] < 32, r                   # a whole-output bool mask alone is 64 MiB
    assert r["peak_b"] < 64, r                   # a float64 copy of one whole tensor is 128 MiB
    g = torch.Generator().manual_seed(6)
    u = torch.randn(10_001, generator=g)
    v = u.clone()
    v[::7] += 1.0
    assert _beyond(u, v, None, 0.0) == _beyond(u, v, torch.ones(u.numel(), dtype=torch.float64), 1e-5) \
        == len(range(0, 10_001, 7))
    assert _beyond(u, u.clone(), torch.ones(u.numel(), dtype=torch.float64), 1e-5, chunk=333) == 0


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
    # 256 MiB for the bench: all_gather at 256 KiB on 2 ranks needs ~132 MiB (a check's 64 MiB of
    # pieces a rank included), at 16 MiB ~352 MiB: past 80% of it
    env = dict(os.environ, BRAID_CACHE_DIR=str(tmp_path / "cache"), BRAID_TIMEOUT_S="60",
               BRAID_BENCH_HOST_MEMORY_GB="0.25")
    proc = subprocess.run(
        [sys.executable, "-m", "braid", "bench", "--cpu", "--op", "all_gather", "--nproc", "2", "--sizes", "256K:16M",
         "--factor", "64", "--iters", "2", "--fixed-iters", "--repeat", "1", "--no-calibrate", "--plain",
         "--json", str(out)], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "# 16 MiB: not run: its buffers need about" in proc.stdout
    assert "BRAID_BENCH_HOST_MEMORY_GB" in proc.stdout
    points = json.loads(out.read_text())
    assert [(p["op"], p["nbytes"]) for p in points] == [("all_gather", 256 << 10)]
    assert points[0]["wrong"] == 0


def _broadcast_check(rank, world):
    """The broadcast workload on 2 gloo ranks, with a comm whose broadcast is right, then one that
    does nothing: the check (which refills the non-root buffer itself) must tell them apart, and
    a timed call must not refill (the host time is the call's own)."""
    import torch.distributed as dist
    from braid.workloads import make

    class Comm:
        def __init__(self, works):
            self.rank, self.world_size, self.device, self.works, self.calls = rank, world, torch.device("cpu"), works, 0

        def broadcast(self, t, src):
            self.calls += 1
            if self.works:
                dist.broadcast(t, src)

    out = {}
    for works in (True, False):
        comm = Comm(works)
        load = make(comm, "broadcast", 4099 * 4, torch.float32)
        load.braid()
        load.baseline()
        out[str(works)] = load.wrong()
        assert comm.calls == 2            # the timed call and the check's own
    return out


def test_broadcast_check_refills_and_catches_a_broadcast_that_did_nothing():
    from conftest import run_world
    got = run_world(_broadcast_check, 2, init_pg=True)
    assert got[0] == {"True": 0, "False": 0}          # the root's buffer is its own input either way
    assert got[1]["True"] == 0
    # the non-root kept its zeros: every byte differs but the root's own zero bytes (~1 in 256)
    assert 0.95 * 4099 * 4 < got[1]["False"] <= 4099 * 4
