"""The simulator against published figures (FlexLink, FuseLink, NIMBLE) with their tolerances,
against braid's own recorded bench on the H200 host (src/braid/sim/data/sim_bench_h200.json), and the
scale sweep's shape. Figures an honest model does not meet are strict xfails with the reason
(docs/sim.md explains each)."""
from __future__ import annotations

import json
import pathlib

import pytest

from braid.sim import repro
from braid.sim.own import compare, load_points
from braid.sim.scale import run as scale_run

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT / "src" / "braid" / "sim" / "data" / "sim_bench_h200.json"


def _params(rows, known_misses: dict[str, str]):
    out = []
    for r in rows:
        if r.ok is None:
            continue
        marks = [pytest.mark.xfail(strict=True, reason=known_misses[r.name])] if r.name in known_misses else []
        out.append(pytest.param(r, id=r.name, marks=marks))
    return out


FLEXLINK = repro.flexlink()
FUSELINK = repro.fuselink()
NIMBLE = repro.nimble()

NIMBLE_MISSES = {
    f"all-to-all-v hot {h:.1f}: speedup over single path": (
        "link-bound model: the hot GPU's node receives through 4 NICs, so routing can gain at most ~4x "
        "over the single rail (3.0-3.5x with relay pipelines); NIMBLE's >= 5x includes baseline costs "
        "the model does not have")
    for h in (0.7, 0.8, 0.9, 1.0)
}


@pytest.mark.parametrize("row", _params(FLEXLINK, {}))
def test_flexlink_256mb_table(row):
    assert row.ok, f"{row.name}: published {row.published}, simulated {row.simulated:.1f} {row.unit}"


def test_flexlink_split_is_the_planners_and_nvlink_keeps_most():
    shares = {r.name: r.simulated for r in FLEXLINK if r.unit == "%"}
    assert all(0 <= v <= 20 for v in shares.values())
    # every row fits FlexLink bw ~= NCCL bw / (1 - offloaded share)
    for label in {r.name.split(":")[0] for r in FLEXLINK}:
        get = {r.name.split(": ")[1]: r.simulated for r in FLEXLINK if r.name.startswith(label + ":")}
        off = (get["PCIe share"] + get["NIC share"]) / 100
        assert get["FlexLink"] == pytest.approx(get["NCCL"] / (1 - off), rel=0.03), label


@pytest.mark.parametrize("row", _params(FUSELINK, {}))
def test_fuselink_borrowed_nics(row):
    assert row.ok, f"{row.name}: published {row.published}, simulated {row.simulated:.1f}"


def test_fuselink_grows_with_every_borrowed_nic():
    bw = [r.simulated for r in FUSELINK]
    assert all(b > a for a, b in zip(bw, bw[1:]))


@pytest.mark.parametrize("row", _params(NIMBLE, NIMBLE_MISSES))
def test_nimble(row):
    assert row.ok, f"{row.name}: published {row.published}, simulated {row.simulated:.2f} {row.unit}"


def test_nimble_skew_speedup_rises_with_the_hotspot():
    sp = [r.simulated for r in NIMBLE if r.name.startswith("all-to-all-v hot")]
    assert all(b > a for a, b in zip(sp, sp[1:])) and sp[0] > 1.5


# ---- our own machines ----------------------------------------------------------------------------

OWN = compare(load_points(str(DATA)), with_planner=False)
OWN_MISSES = {
    "h200x2-all_to_all_single-256M": (
        "the simulated host lane (483 us) matches braid's recorded host lane (487 us), but the recorded "
        "total (452 us, best of repeats) is below that lane time (lane times are one call's); the model "
        "predicts the slowest lane + 15 us"),
    "h200x4-all_to_all_single-256M": (
        "the model pays each host transfer's first-slot fill (4 MiB at 47 GB/s, ~89 us) as idle time "
        "before the 12 transfers share host memory, while on the machine those D2H bytes already move; "
        "simulated host lane 786 us vs recorded 699 (hidden at 1 GiB: +4.7%)"),
    # the NCCL-share benches: pipelined reductions with forced shares
    "h200x4-all_reduce-256M-ce95_host05": (
        "time that does not scale with bytes: the call took 612 us more than a quarter of its 1 GiB time and "
        "its recorded lanes are ~1.5x the simulated (ce 1807 vs 1160 us) while at 1 GiB they match (4648 vs "
        "4586); the model has no host-side cost (the pipeline's pieces and the staged lane's second "
        "exchange are posted from Python), which 1 GiB hides"),
    "h200x4-reduce_scatter-256M-ce95_host05": (
        "time that does not scale with bytes: the call took 824 us more than a quarter of its 1 GiB time and "
        "its recorded ce lane is 1.6x the simulated (1023 vs 635 us); the model has no host-side cost of "
        "posting the pipelined reduction, which 1 GiB hides (-5.2% there)"),
    "h200x4-all_reduce-256M-nccl60_ce35_host05": (
        "time that does not scale with bytes: the call took 1089 us more than a quarter of its 1 GiB time, "
        "every recorded lane ~1540 us against simulated 690-1140; the model has no host-side cost of "
        "posting three lanes (NCCL's share, the ce pipeline, the staged host path)"),
    "h200x4-all_reduce-1024M-nccl60_ce35_host05": (
        "NCCL's kernels and the copy engines on one NVLink port moved 304 GB/s together, less than either "
        "alone (NCCL 353, ce 329); the model shares the port between them at full rate, with no interference "
        "between the two engines (simulated NCCL lane 4491 us vs recorded 5053)"),
    # the taper benches (tapered cut)
    "h200x4-w2-reduce_scatter-1024M-reductions-taper-balanced-calibration": (
        "a slow process start: the recorded copy-engine lane (1571 us) is the simulated one (1571), but the "
        "host lane took 1799 us for its 7% (simulated 1549 with the others) and the call 1910; the same "
        "shares ran 1558 us in the process of 2026-11-22-h200x4-taper-final-rule (the VM's host-speed "
        "spread, docs/results.md)"),
    "h200x2-reduce_scatter-256M-reductions-taper-calibration-record": (
        "the recorded copy-engine lane alone took 571 us where the same process's calibration had timed "
        "the whole call at 467 us (and 2026-11-22-h200x2-reductions-taper, same machine, 456): the "
        "simulator's 441 us matches those; this first bench point after calibration ran slow for a reason "
        "the recorded data does not show"),
    "h200x4-all_reduce-1024M-ce95_host05": (
        "the recorded total is 485 us above braid's slowest recorded lane (ce 4648 us, which the model "
        "matches: 4586); the model has no time outside the lanes (host-side posting), as in the every-op "
        "sweep's all_reduce 1G (-9.3%, just inside)"),
}


def test_own_presets_host_constants_come_from_calibration():
    """The host lane's constants of h200x2/h200x4 are braid's own calibration of that run, derived as
    the presets' sources say (nothing from the bench points)."""
    from braid.sim.topology import load
    root = ROOT / "bench_results" / "2026-11-22-h200x4-every-op-sweep" / "calibration"
    for w, name in ((2, "calib-f0ea8916f7388a16.json"), (4, "calib-54f70825861dea3d.json")):
        cal = json.loads((root / name).read_text())
        assert cal["key"]["world_size"] == w
        t, host = load(f"h200x{w}"), {k: v["host"]["bw_gbps"] for k, v in cal["table"].items()}
        assert t.c("d2h_gbps") == t.c("h2d_gbps") == pytest.approx(host[f"send_recv/{w}"], abs=0.05)
        mem = (host[f"all_gather/{w}"] * w * w + host[f"all_to_all_single/{w}"] * 2 * (w - 1)) / 2
        assert t.c("host_mem_gbps") == pytest.approx(mem, abs=0.05)
        assert name in t.constants["host_mem_gbps"]["source"]


def _own_params():
    out = []
    for c in OWN:
        marks = [pytest.mark.xfail(strict=True, reason=OWN_MISSES[c.name])] if c.name in OWN_MISSES else []
        out.append(pytest.param(c, id=f"{c.name}-{c.kind.split()[0]}", marks=marks))
    return out


@pytest.mark.parametrize("c", _own_params())
def test_own_bench_within_10_percent(c):
    assert abs(c.error) <= 0.10, f"measured {c.measured_us:.0f} us, simulated {c.simulated_us:.0f} us"


def test_own_comparison_has_predictions_not_only_inputs():
    kinds = [c.kind for c in OWN]
    assert kinds.count("prediction") >= 35 and kinds.count("nccl input") >= 20
    assert len({c.name for c in OWN}) == len(OWN)
    assert set(OWN_MISSES) <= {c.name for c in OWN}


NCCL_SHARE_FILES = ("h200x4-all-reduce-nccl-share/bench_h200x4_ar_auto.json",
                    "h200x4-all-reduce-nccl-share/bench_h200x4_ar_nccl95_host05.json",
                    "h200x4-all-reduce-nccl-share/bench_h200x4_ar_nccl60_ce35_host05.json",
                    "h200x4-all-reduce-nccl-share/bench_h200x4_ar_ce95_host05.json",
                    "h200x4-all-reduce-nccl-share/bench_h200x4_rs_ce95.json",
                    "h200x4-all-reduce-nccl-share/bench_h200x4_hot.json",
                    "h200x4-balanced-a2a-moe-reductions/bench_h200x4_a2a_balanced.json",
                    "h200x4-balanced-a2a-moe-reductions/bench_h200x2_all_reduce_2gpu.json",
                    "h200x4-balanced-a2a-moe-reductions/bench_h200x2_reduce_scatter_2gpu.json",
                    # the later benches: the final auto sweeps, the hot all_to_all after the routed-lane changes
                    "h200x4-calibration-bench-windows/bench_h200x2_all_reduce_2gpu.json",
                    "h200x4-calibration-bench-windows/bench_h200x2_reduce_scatter_2gpu.json",
                    "h200x4-calibration-bench-windows/bench_h200x4_all_reduce.json",
                    "h200x4-routed-a2a-lane-feedback/bench_h200x4_hot.json")


def test_own_nccl_share_and_later_points_are_every_split_point_of_their_files():
    """Every split point >= 256 MiB of the NCCL-share and later benches' reduction, a2a and 2-GPU files is
    stored, as recorded (time, shares, lane times): none left out, none edited."""
    stored = {(p["source"], p["op"], p["nbytes"], p.get("hot_fraction")): p
              for p in load_points(str(DATA)) if "source" in p and not p.get("ce_taper")}
    got = _recorded_split_points(NCCL_SHARE_FILES, stored)
    assert all(p["preset"] == "h200x4" for p in got)   # 2-GPU rows ran on GPUs 0-1 of the 4-GPU machine
    assert len(got) == len(stored) == 29


def _recorded_split_points(files, stored: dict) -> list:
    """The stored point of every split point >= 256 MiB of these bench files, each checked equal
    to its row (time, shares, lane times); `stored` is keyed (source, op, nbytes, hot fraction)."""
    root = ROOT / "bench_results"
    got = []
    for f in files:
        for r in json.loads((root / f"2026-11-22-{f}").read_text()):
            if r["nbytes"] < 256 << 20 or set(r["shares"]) == {"nccl"}:
                continue
            p = stored[(f"bench_results/2026-11-22-{f}", r["op"], r["nbytes"], r.get("hot_fraction"))]
            assert p["world"] == r["world_size"] and p["braid_us"] == pytest.approx(r["time_us"], abs=0.06)
            assert p["shares"] == pytest.approx(r["shares"], abs=6e-5)
            assert p["lane_time_us"] == pytest.approx(r["lane_time_us"], abs=0.06)
            got.append(p)
    return got


def test_routed_hot_plan_is_the_routers_and_carries_the_recorded_shares():
    """On the hot-column matrix braid's router puts host bytes only on the demands into the hot rank,
    the same on each, whatever the lane costs (so the plan can be rebuilt from the recorded host share);
    the rebuilt plans carry the recorded shares."""
    from braid.collectives.routed import RoutedAllToAll
    from braid.planner.model import LaneCost
    from braid.sim.own import hot_matrix, routed_hot_plan
    for ce_bw, host_bw in ((505.0, 29.4), (390.0, 47.0), (300.0, 60.0)):
        r = RoutedAllToAll(4)
        for h in (0.4, 0.7, 1.0):
            m = hot_matrix(4, 256 << 20, h)
            plan, _, _ = r.plan(m, "cuda", {"ce": LaneCost(20.0, ce_bw), "host": LaneCost(20.0, host_bw)}, None, True)
            host = {(t.src, t.dsts[0][0]): t.nbytes for t in plan.lanes["host"]}
            assert set(host) == {(0, 3), (1, 3), (2, 3)}
            assert max(host.values()) - min(host.values()) <= 4096
    hot = [p for p in load_points(str(DATA)) if p.get("hot_fraction") is not None]
    assert len(hot) == 12
    for p in hot:
        plan = routed_hot_plan(hot_matrix(p["world"], p["nbytes"], p["hot_fraction"]), p["shares"]["host"])
        assert plan.shares["host"] == pytest.approx(p["shares"]["host"], abs=2e-4)


def test_sim_copies_of_braid_rules_agree_with_braid():
    """braid.sim stays torch-free, so it carries braid's rules for the bench's hot matrix and the
    routed plan's cut itself. They must equal braid's."""
    pytest.importorskip("torch")
    from braid.sim.own import hot_matrix
    from braid.workloads import hot_matrix as bench_hot
    for h in (0.4, 0.7, 0.9, 1.0):
        assert hot_matrix(4, 256 << 20, h) == [[2 * x for x in row] for row in bench_hot(4, 128 << 20, h)]
    # the routed plan as braid's build_plan cuts it from the router's per-demand path bytes
    from braid.collectives.routed import PATH_LANE, build_plan
    from braid.planner.router import Path
    from braid.sim.own import routed_hot_plan
    for h, share in ((0.7, 0.0857), (1.0, 0.0372), (0.4, 0.0149)):
        m = hot_matrix(4, 1 << 30, h)
        off = sum(m[s][d] for s in range(4) for d in range(4) if s != d)
        per = share * off / 3
        flows = {(s, 3): [(Path("direct", ()), m[s][3] - per), (Path("host", ()), per)] for s in range(3)}
        assert routed_hot_plan(m, share).to_json() == build_plan(m, flows, PATH_LANE["cuda"]).to_json()


# ---- scale -------------------------------------------------------------------------------------

def test_scale_borrowing_helps_skew_only_when_there_are_nics_to_borrow():
    single = scale_run("alltoallv", 8, 8, "single", 0.7)
    borrow = scale_run("alltoallv", 8, 8, "borrow", 0.7)
    assert borrow.busbw_gbps > 3 * single.busbw_gbps
    assert borrow.path_shares.get("borrowed rail", 0) > 0.3
    one = [scale_run("alltoallv", 8, 1, v, 0.7).busbw_gbps for v in ("single", "borrow")]
    assert one[1] == pytest.approx(one[0], rel=0.02)


def test_scale_balanced_collectives_gain_little():
    for op in ("all_reduce", "all_gather"):
        s, b = (scale_run(op, 8, 4, v) for v in ("single", "borrow"))
        assert 0.99 <= b.busbw_gbps / s.busbw_gbps <= 1.1, op
        assert b.plan_cached_us < b.plan_cold_us


# ---- the command line --------------------------------------------------------------------------

def test_cli_reproduce_writes_json(tmp_path, capsys):
    from braid.__main__ import main
    out = tmp_path / "rows.json"
    assert main(["sim", "reproduce", "fuselink", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert {"name", "published", "simulated", "unit"} <= set(rows[0])
    assert "212.4" in capsys.readouterr().out
    assert main(["sim", "scale", "--proxy", "--op", "all_gather", "--nodes", "2", "--nics", "4",
                 "--json", str(tmp_path / "s.json")]) == 0
    assert len(json.loads((tmp_path / "s.json").read_text())) == 3
    assert main(["sim", "scale", "--op", "alltoallv", "--nodes", "1"]) == 2


TAPER_FILES = ("h200x4-reductions-taper-old-calibration/bench_h200x2_reduce_scatter.json",
               "h200x4-reductions-taper-old-calibration/bench_h200x2_all_reduce.json",
               "h200x4-reductions-taper-old-calibration/bench_h200x4_reduce_scatter.json",
               "h200x4-reductions-taper-balanced-calibration/bench_h200x2_reduce_scatter.json",
               "h200x4-reductions-taper-balanced-calibration/bench_h200x2_all_reduce.json",
               "h200x4-reductions-taper-balanced-calibration/bench_h200x4_reduce_scatter.json",
               "h200x4-reductions-taper-balanced-calibration/bench_h200x4_all_reduce.json",
               "h200x4-reductions-taper-repeat/bench_h200x2_reduce_scatter.json",
               "h200x4-reductions-taper-repeat/bench_h200x2_all_reduce.json",
               "h200x4-reductions-taper-repeat/bench_h200x4_all_reduce.json",
               # the 2 x H200 machine (preset h200x2)
            "h200x2-reductions-taper/bench_h200x2_reduce_scatter.json",
            "h200x2-reductions-taper/bench_h200x2_all_reduce.json",
            "h200x2-reductions-taper-calibration-record/bench_h200x2_reduce_scatter.json")


def test_own_taper_points_are_every_split_point_of_their_files():
    """The taper benches (the tapered cut, calibrated in each run): every point >= 256 MiB that is
    not NCCL alone is stored as recorded and simulated with the tapered cut; none left out."""
    stored = {(p["source"], p["op"], p["nbytes"], None): p for p in load_points(str(DATA)) if p.get("ce_taper")}
    got = _recorded_split_points(TAPER_FILES, stored)
    assert all(p["source"].split("/")[1].endswith("-" + p["variant"]) for p in got)   # the folder names the point
    assert len(got) == len(stored) == 20
    # a tapered point is simulated with the taper: at 1 GiB it changes the prediction
    from braid.sim.own import simulate_point
    from braid.sim.topology import load
    f = "bench_results/2026-11-22-h200x4-reductions-taper-repeat/bench_h200x2_reduce_scatter.json"
    p = stored[(f, "reduce_scatter", 1 << 30, None)]
    t = load(p["preset"])
    assert simulate_point(t, p).time_us < 0.97 * simulate_point(t, dict(p, ce_taper=False)).time_us


def test_sim_own_runs_from_any_folder(tmp_path):
    """`braid sim own` without --data reads the recorded bench shipped in the package, whatever the
    working directory (it once read tests/data/... relative to it)."""
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "braid", "sim", "own"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "# split points within 10%:" in proc.stdout and "No such file" not in proc.stderr
