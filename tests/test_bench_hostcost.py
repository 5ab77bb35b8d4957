"""The bench's host cost: the summary line under each table (braid's host time per call as a ratio
of the baseline's, each side's median, the first call of a shape), its JSON record, and the first
call of each point timed apart from the steady state. Values are checked for consistency, never
for which side is faster."""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time

import pytest

from braid.bench import output

SUMMARY_KEYS = {"op", "baseline", "points", "host_ratio_median", "host_ratio_min", "host_ratio_max",
                "host_us_median", "baseline_host_us_median", "first_call_us_median", "first_call_us_max",
                "baseline_first_call_us_median", "baseline_first_call_us_max"}
LINE = re.compile(r"^# host per call: braid/gloo median (\d+\.\d\d)x \(min (\d+\.\d\d)x, max (\d+\.\d\d)x "
                  r"over (\d+) points\); median braid [\d.]+ us, gloo [\d.]+ us \| first call \(prepare\): "
                  r"braid median [\d.]+ us, max [\d.]+ us; gloo median [\d.]+ us, max [\d.]+ us "
                  r"\| at 256 KiB: braid's algbw \d+% of the copy ceiling, gloo's \d+%$", re.M)


def test_bench_summary_line_and_first_calls_on_cpu_lanes(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, BRAID_CACHE_DIR=str(tmp_path / "cache"), BRAID_HOST_BUFFER_MB="4",
               BRAID_TIMEOUT_S="60")
    proc = subprocess.run(
        [sys.executable, "-m", "braid", "bench", "--op", "all_gather", "--nproc", "2", "--sizes", "64K:256K",
         "--iters", "2", "--fixed-iters", "--repeat", "1", "--no-calibrate", "--plain", "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    points = json.loads(out.read_text())
    assert [p["nbytes"] for p in points] == [64 << 10, 128 << 10, 256 << 10]
    for p in points:
        # the first call of the shape, each side, apart from the steady-state host_us
        assert p["first_call_us"] > 0 and p["baseline"]["first_call_us"] > 0
        assert p["host_us"] > 0 and p["baseline"]["host_us"] > 0
        assert p["host_summary"] == points[-1]["host_summary"]      # one record for the table
    s = points[-1]["host_summary"]
    assert SUMMARY_KEYS <= set(s) and s["op"] == "all_gather" and s["baseline"] == "gloo" and s["points"] == 3
    ratios = [p["host_us"] / p["baseline"]["host_us"] for p in points]
    assert s["host_ratio_median"] == pytest.approx(statistics.median(ratios))
    assert s["host_ratio_min"] == pytest.approx(min(ratios)) and s["host_ratio_max"] == pytest.approx(max(ratios))
    assert 0 < s["host_ratio_min"] <= s["host_ratio_median"] <= s["host_ratio_max"]
    assert s["host_us_median"] == pytest.approx(statistics.median(p["host_us"] for p in points))
    assert s["baseline_host_us_median"] == pytest.approx(statistics.median(p["baseline"]["host_us"] for p in points))
    firsts = [p["first_call_us"] for p in points]
    assert s["first_call_us_median"] == pytest.approx(statistics.median(firsts))
    assert s["first_call_us_max"] == pytest.approx(max(firsts))
    assert s["baseline_first_call_us_max"] == pytest.approx(max(p["baseline"]["first_call_us"] for p in points))
    # the printed line under the table says the same numbers
    (m,) = LINE.findall(proc.stdout)
    assert m == (f"{s['host_ratio_median']:.2f}", f"{s['host_ratio_min']:.2f}", f"{s['host_ratio_max']:.2f}", "3")
    rows = proc.stdout.splitlines()
    at = next(i for i, line in enumerate(rows) if LINE.match(line))
    assert rows[at - 1].split()[0] == str(256 << 10), "the summary follows the table's last row"


def _pt(nbytes, host, base_host, first=None, base_first=None, op="all_reduce"):
    p = {"op": op, "nbytes": nbytes, "host_us": host, "baseline": {"name": "nccl", "host_us": base_host}}
    if first is not None:
        p["first_call_us"] = first
        p["baseline"]["first_call_us"] = base_first
    return p


def test_host_summary_and_line():
    pts = [_pt(1 << 20, 300.0, 30.0, 5000.0, 900.0), _pt(2 << 20, 100.0, 50.0, 2000.0, 40.0),
           _pt(4 << 20, 60.0, 40.0, 8000.0, 60.0)]
    s = output.host_summary(pts)
    assert s["points"] == 3 and s["baseline"] == "nccl" and s["op"] == "all_reduce"
    assert s["host_ratio_median"] == 2.0 and s["host_ratio_min"] == 1.5 and s["host_ratio_max"] == 10.0
    assert s["host_us_median"] == 100.0 and s["baseline_host_us_median"] == 40.0
    assert (s["first_call_us_median"], s["first_call_us_max"]) == (5000.0, 8000.0)
    assert (s["baseline_first_call_us_median"], s["baseline_first_call_us_max"]) == (60.0, 900.0)
    assert "hot_fraction" not in s
    assert output.summary_line(s) == (
        "host per call: braid/nccl median 2.00x (min 1.50x, max 10.00x over 3 points); median braid 100 us, "
        "nccl 40 us | first call (prepare): braid median 5000 us, max 8000 us; nccl median 60 us, max 900 us")
    # JSON written before this change (no first calls): the ratio part alone
    old = output.host_summary([_pt(1 << 20, 8.0, 4.0)])
    assert "first_call_us_median" not in old
    assert output.summary_line(old) == ("host per call: braid/nccl median 2.00x (min 2.00x, max 2.00x over 1 point); "
                                        "median braid 8.0 us, nccl 4.0 us")
    assert output.host_summary([{"op": "x", "baseline": {"name": "nccl"}}]) is None


def test_cpu_tables_say_how_close_the_largest_size_gets_to_the_copy_ceiling():
    pts = [dict(_pt(n, 50.0, 100.0), copy_ceiling_gbps=10.0, algbw_gbps=bw) for n, bw in ((1 << 20, 2.0), (64 << 20, 4.0))]
    for p, base_bw in zip(pts, (1.0, 2.5)):
        p["baseline"]["algbw_gbps"] = base_bw
    s = output.host_summary(pts)
    assert s["ceiling_nbytes"] == 64 << 20 and s["ceiling_fraction"] == 0.4 and s["baseline_ceiling_fraction"] == 0.25
    assert output.summary_line(s).endswith("| at 64 MiB: braid's algbw 40% of the copy ceiling, nccl's 25%")
    gpu = output.host_summary([dict(_pt(1 << 20, 50.0, 100.0), algbw_gbps=3.0)])   # no ceiling: not said
    assert "ceiling_fraction" not in gpu and "ceiling" not in output.summary_line(gpu)
    assert output._size(3 << 30) == "3 GiB" and output._size(1000) == "1000 B"


def test_cpu_all_reduce_tables_say_the_ratio_one_copy_would_give():
    """A CPU all_reduce point carries the baseline's time over one copy of its tensor (every rank
    at once): the most any all_reduce could gain there. The summary lists it per size."""
    pts = [dict(_pt(n, 50.0, 100.0), ratio_bound=b) for n, b in ((1 << 20, 20.44), (64 << 20, 4.96))]
    pts.append(_pt(256 << 20, 50.0, 100.0))              # a point without it (not measured): left out
    s = output.host_summary(pts)
    assert s["ratio_bound"] == [(1 << 20, 20.44), (64 << 20, 4.96)]
    assert output.summary_line(s).endswith(
        "| at one copy's time (every rank copying its tensor at once) the ratio could reach 20.4 at 1 MiB, 5.0 at 64 MiB")
    assert "ratio_bound" not in output.host_summary([_pt(1 << 20, 50.0, 100.0)])


def test_cpu_all_reduce_tables_say_the_ratio_at_braids_own_floor():
    """A CPU all_reduce point may carry the baseline's time over braid's own copies and reductions
    with no wait (the native call's floor); the summary lists it per size after the copy's bound."""
    pts = [dict(_pt(n, 50.0, 100.0), ratio_bound=b, ratio_floor=f)
           for n, b, f in ((1 << 20, 20.44, 6.27), (4 << 20, 9.0, 3.14))]
    pts.append(dict(_pt(16 << 20, 50.0, 100.0), ratio_bound=4.5))     # no floor measured there
    s = output.host_summary(pts)
    assert s["ratio_floor"] == [(1 << 20, 6.27), (4 << 20, 3.14)]
    line = output.summary_line(s)
    assert line.endswith("| at the floor of braid's own copies and reductions (every rank at once in its own memory, no wait) "
                         "6.3 at 1 MiB, 3.1 at 4 MiB")
    assert line.index("could reach") < line.index("floor of braid's")
    assert "ratio_floor" not in output.host_summary([_pt(1 << 20, 50.0, 100.0)])


def test_plain_table_prints_the_summary_once_after_its_rows(capsys):
    ui = output.PlainUi(2)
    ui.start_op("all_reduce", "all_reduce  world 2", "nccl")
    p = dict(_pt(1 << 20, 300.0, 30.0, 5000.0, 900.0), count=1, dtype="float32", time_us=10.0, algbw_gbps=1.0,
             busbw_gbps=1.0, wrong=0, shares={"ce": 1.0}, ratio=1.0)
    p["baseline"].update(time_us=10.0, busbw_gbps=1.0)
    p["host_summary"] = output.host_summary([p])
    ui.row(p)
    ui.end_op()
    ui.end_op()         # a second end (the run's last table is ended twice): nothing more
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("# host per call: braid/nccl median 10.00x")
    assert lines[-2].split()[0] == str(1 << 20)
    assert sum(line.startswith("# host per call") for line in lines) == 1


def test_first_calls_are_entered_together_and_timed_alone(monkeypatch):
    """Each side's first call: GPU work drained and a barrier before it, drained after, and only
    the call itself on the clock (the slowest rank's, over gloo)."""
    import types

    import torch.distributed as dist

    from braid.bench import sweep
    seen = []
    monkeypatch.setattr(sweep, "_sync", lambda comm: seen.append("sync"))
    monkeypatch.setattr(dist, "barrier", lambda group=None: seen.append("barrier"))
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None, group=None: seen.append(("max", op)))

    def braid():
        seen.append("braid")
        time.sleep(0.02)
    load = types.SimpleNamespace(baseline=lambda: seen.append("baseline"), braid=braid)
    got = sweep._first_calls(types.SimpleNamespace(cuda=False, gloo_group=None), load)
    assert seen == ["sync", "barrier", "baseline", "sync", "sync", "barrier", "braid", "sync",
                    ("max", dist.ReduceOp.MAX)]
    assert set(got) == {"braid", "baseline"} and got["braid"] >= 20_000 and got["baseline"] >= 0
