"""The simulator against published figures (FlexLink, FuseLink, NIMBLE) with their tolerances,
against braid's own recorded bench on the H200 host (tests/data/sim_bench_h200.json), and the
scale sweep's shape. Figures an honest model does not meet are strict xfails with the reason
(docs/sim.md explains each)."""
from __future__ import annotations

import json
import pathlib

import pytest

from braid.sim import repro
from braid.sim.own import compare, load_points
from braid.sim.scale import run as scale_run

DATA = pathlib.Path(__file__).resolve().parent / "data" / "sim_bench_h200.json"


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
    ("h200x2", "all_to_all_single", 256): (
        "the simulated host lane (483 us) matches braid's recorded host lane (487 us), but the recorded "
        "total (452 us, best of repeats) is below that lane time (lane times are one call's); the model "
        "predicts the slowest lane + 15 us"),
    ("h200x4", "all_to_all_single", 256): (
        "the model pays each host transfer's first-slot fill (4 MiB at 47 GB/s, ~89 us) as idle time "
        "before the 12 transfers share host memory, while on the machine those D2H bytes already move; "
        "simulated host lane 786 us vs recorded 699 (hidden at 1 GiB: +4.7%)"),
}


def test_own_presets_host_constants_come_from_calibration():
    """The host lane's constants of h200x2/h200x4 are braid's own calibration of that run, derived as
    the presets' sources say (nothing from the bench points)."""
    from braid.sim.topology import load
    root = DATA.parent.parent.parent / "bench_results" / "2026-11-22-run3" / "calibration"
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
        key = (c.preset, c.op, c.nbytes >> 20)
        marks = [pytest.mark.xfail(strict=True, reason=OWN_MISSES[key])] if key in OWN_MISSES else []
        out.append(pytest.param(c, id=f"{c.preset}-{c.op}-{c.nbytes >> 20}M-{c.kind.split()[0]}", marks=marks))
    return out


@pytest.mark.parametrize("c", _own_params())
def test_own_bench_within_10_percent(c):
    assert abs(c.error) <= 0.10, f"measured {c.measured_us:.0f} us, simulated {c.simulated_us:.0f} us"


def test_own_comparison_has_predictions_not_only_inputs():
    kinds = [c.kind for c in OWN]
    assert kinds.count("prediction") >= 14 and kinds.count("nccl input") >= 20


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
    assert main(["sim", "scale", "--op", "all_gather", "--nodes", "2", "--nics", "4",
                 "--json", str(tmp_path / "s.json")]) == 0
    assert len(json.loads((tmp_path / "s.json").read_text())) == 3
    assert main(["sim", "scale", "--op", "alltoallv", "--nodes", "1"]) == 2
