"""Router (issue 4, first part): min-congestion plans against the exact LP optimum over the same
candidate paths (scipy, tests only), and plan invariants. Pure; no processes."""
from __future__ import annotations

import json
import random
import zlib

import pytest

from braid.planner.router import (Router, SplitThreshold, direct_only, mesh, multi_node, preset, route,
                                  signature)

pytest.importorskip("scipy.optimize")
from braid.planner.lp import lp_optimum  # noqa: E402


def matrices(n: int, rng: random.Random):
    mib = 1 << 20
    yield "random", [[0 if s == d else rng.randint(1, 64) * mib for d in range(n)] for s in range(n)]
    yield "hot destination", [[0 if s == d else (512 * mib if d == 0 else 8 * mib) for d in range(n)]
                              for s in range(n)]
    one = [[0] * n for _ in range(n)]
    one[0][1] = 1 << 30
    yield "one hot pair", one
    yield "sparse mixed", [[0 if s == d else rng.choice([0, mib // 2, 256 * mib]) for d in range(n)] for s in range(n)]
    perm = list(range(n))
    rng.shuffle(perm)
    yield "permutation", [[(300 * mib if perm[s] == d and s != d else 0) for d in range(n)] for s in range(n)]


KNOWN_GAP: set = set()   # (topology, matrix class) pairs known to miss 5%: none at present


def _case(name, label, m):
    marks = [pytest.mark.xfail(strict=True, reason="router within ~8% of the LP on dense random mesh4 "
                                                   "matrices, not 5% (issue 4 open)")] if (name, label) in KNOWN_GAP else []
    return pytest.param(name, label, m, id=f"{name}-{label}", marks=marks)


CASES = [_case(name, label, m) for name in ("h200x2", "h200x4", "mesh4", "nvswitch8")
         for label, m in matrices(preset(name).num_gpus, random.Random(zlib.crc32(name.encode())))
         if any(any(row) for row in m)]


@pytest.mark.parametrize("name,label,matrix", CASES)
def test_within_5_percent_of_lp(name, label, matrix):
    topo = preset(name)
    plan = route(topo, matrix, min_split_bytes=0)     # the solver itself; the <= 1 MiB policy is tested apart
    opt = lp_optimum(topo, matrix)
    assert plan.max_load_us <= opt * 1.05 + 1e-9, f"{name} {label}: {plan.max_load_us:.1f} us vs LP {opt:.1f}"
    assert plan.max_load_us >= opt * (1 - 1e-6)          # nothing beats the optimum


@pytest.mark.parametrize("name,label,matrix", [pytest.param(*c.values, id=c.id) for c in CASES])
def test_every_byte_on_exactly_one_valid_path(name, label, matrix):
    topo = preset(name)
    plan = route(topo, matrix)
    for s in range(len(matrix)):
        for d in range(len(matrix)):
            if s == d or not matrix[s][d]:
                assert (s, d) not in plan.flows or not plan.flows[(s, d)]
                continue
            flows = plan.flows[(s, d)]
            assert sum(b for _, b in flows) == matrix[s][d]
            assert all(b > 0 and p in topo.candidates(s, d) for p, b in flows)
    # the reported link loads are the flows' loads
    load = {e: 0.0 for e in topo.capacity}
    for fl in plan.flows.values():
        for p, b in fl:
            for e, w in p.links:
                load[e] += b * w
    assert load == pytest.approx(plan.link_load)


def test_small_demands_take_one_path_and_skew_uses_more():
    topo = preset("mesh4")
    m = [[0] * 4 for _ in range(4)]
    m[0][1] = 512 << 10                                  # 512 KiB: at or below the 1 MiB multipath floor
    m[2][3] = 1 << 30
    plan = route(topo, m)
    assert len(plan.flows[(0, 1)]) == 1
    assert len(plan.flows[(2, 3)]) >= 3                  # direct, relays and host all help a hot pair
    assert plan.max_load_us < direct_only(topo, m) / 2.5


def test_multi_node_rails_spread_a_pair():
    topo = multi_node(2, gpus_per_node=8, nics=4, nic_gbps=50.0)
    m = [[0] * 16 for _ in range(16)]
    m[0][8] = 1 << 30                                    # GPU 0 of node 0 -> GPU 0 of node 1
    plan = route(topo, m)
    rails = {p.via[0] for p, _ in plan.flows[(0, 8)]}
    assert rails == {0, 1, 2, 3}                         # all four rails, borrowed over NVLink
    assert plan.max_load_us == pytest.approx((1 << 30) / (4 * 50e3), rel=0.05)


def test_router_module_has_no_torch():
    import ast
    import pathlib
    import braid.planner.router as r
    tree = ast.parse(pathlib.Path(r.__file__).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
             for a in n.names] + [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not any(x.split(".")[0] == "torch" for x in names)


def test_route_cli(tmp_path, capsys):
    from braid.__main__ import main
    m = [[0, 1 << 30, 8 << 20, 8 << 20], [8 << 20, 0, 8 << 20, 8 << 20],
         [8 << 20, 8 << 20, 0, 8 << 20], [8 << 20, 8 << 20, 8 << 20, 0]]
    f = tmp_path / "m.json"
    f.write_text(json.dumps(m))
    out = tmp_path / "plan.json"
    assert main(["route", "--matrix", str(f), "--topology", "mesh4", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "max link load" in text and "LP optimum" in text
    obj = json.loads(out.read_text())
    assert obj["lp_optimum"] > 0 and obj["max_load"] >= obj["lp_optimum"] * (1 - 1e-6)
    assert obj["plan_time_us"] > 0 and obj["plan_time_hit_us"] > 0 and obj["ratio"] <= 1.05
    assert 0 < obj["lower_bound_us"] <= obj["lp_optimum"] * (1 + 1e-9)
    assert "cache hit" in text
    flows = {(x["src"], x["dst"]): sum(p["bytes"] for p in x["paths"]) for x in obj["flows"]}
    assert flows[(0, 1)] == 1 << 30
    f.write_text(json.dumps([[0, 1], [1, 0]]))
    assert main(["route", "--matrix", str(f), "--topology", "mesh4"]) == 2     # wrong shape: clear error
    assert "4 rows of 4" in capsys.readouterr().err


def test_route_cli_runs_the_shipped_example(capsys):
    """The README's `braid route --matrix examples/route_matrix_4gpu.json --topology h200x4`: the
    hot demands into GPU 3 take a second path, the quiet ones stay direct."""
    import pathlib

    from braid.__main__ import main
    example = pathlib.Path(__file__).resolve().parents[1] / "examples" / "route_matrix_4gpu.json"
    m = json.loads(example.read_text())
    assert len(m) == 4 and all(len(row) == 4 and row[i] == 0 for i, row in enumerate(m))
    assert main(["route", "--matrix", str(example), "--topology", "h200x4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {tuple(map(int, x.split()[:2])): x.split()[3:] for x in lines if x[:1] == " "}
    assert len(rows) == 12
    assert all(len(rows[(s, 3)]) > 1 for s in range(3)) and rows[(0, 1)] == ["direct=1.00"]
    assert any(x.startswith("max link load") for x in lines)


# -------------------------------------------------------------------------------------------------
# wider topologies, the certificate, plan invariants, reuse, the learned size threshold
# -------------------------------------------------------------------------------------------------

TOPOLOGIES = {
    "mesh8": lambda: mesh(8),
    "2x4gpu-4nic": lambda: multi_node(2, gpus_per_node=4, nics=4),
    "nvswitch16": lambda: preset("nvswitch16"),
    "2x8gpu-8nic": lambda: multi_node(2, gpus_per_node=8, nics=8),
}


def adversarial(n: int, rng: random.Random):
    """Matrices that stress a min-max router beyond `matrices()`."""
    mib = 1 << 20
    yield "two hot destinations", [[0 if s == d else (400 * mib if d in (0, n - 1) else 4 * mib) for d in range(n)]
                                   for s in range(n)]
    yield "shift by one", [[(256 * mib if d == (s + 1) % n else 0) for d in range(n)] for s in range(n)]
    yield "heavy tail", [[0 if s == d else int(mib * rng.paretovariate(1.2)) for d in range(n)] for s in range(n)]
    one = [[0] * n for _ in range(n)]
    one[0][n - 1], one[n - 1][0] = 1 << 30, 1 << 29
    yield "hot pair both ways", one


WIDE = [pytest.param(name, label, m, id=f"{name}-{label}") for name in TOPOLOGIES
        for source in (matrices, adversarial)
        for label, m in source(TOPOLOGIES[name]().num_gpus, random.Random(zlib.crc32(name.encode()) + 1))
        if any(any(row) for row in m)]
WIDE += [pytest.param(name, label, m, id=f"{name}-{label}") for name in ("mesh4", "nvswitch8")
         for label, m in adversarial(preset(name).num_gpus, random.Random(7))]


def _topology(name):
    return TOPOLOGIES[name]() if name in TOPOLOGIES else preset(name)


@pytest.mark.parametrize("name,label,matrix", WIDE)
def test_wide_topologies_within_5_percent_and_certified(name, label, matrix):
    topo = _topology(name)
    plan = route(topo, matrix, min_split_bytes=0)
    opt = lp_optimum(topo, matrix)
    assert plan.max_load_us <= opt * 1.05 + 1e-9, f"{name} {label}: {plan.max_load_us:.1f} us vs LP {opt:.1f}"
    # the certificate is a true lower bound, and the default gap (2%) holds against it
    assert 0 < plan.lower_bound_us <= opt * (1 + 1e-9)
    assert plan.max_load_us <= plan.lower_bound_us * 1.02 * (1 + 1e-6)
    check_plan(topo, matrix, plan)


def check_plan(topo, matrix, plan):
    """Every byte of every demand on exactly one valid candidate path; relays through one GPU
    that is neither end; the reported loads and most loaded link are the flows' own."""
    n = len(matrix)
    load = {e: 0.0 for e in topo.capacity}
    if plan.fractions is not None:                           # what a reuse rescales: never below zero
        assert float(plan.fractions.min()) >= 0.0
    for s in range(n):
        for d in range(n):
            flows = plan.flows.get((s, d), [])
            if s == d or matrix[s][d] <= 0:
                assert not flows
                continue
            assert sum(b for _, b in flows) == int(matrix[s][d])
            assert all(isinstance(b, int) and b > 0 for _, b in flows)
            names = [p.name() for p, _ in flows]
            assert len(names) == len(set(names))                 # a path appears once per demand
            for p, b in flows:
                assert p in topo.candidates(s, d)
                if p.kind == "relay":
                    assert len(p.via) == 1 and p.via[0] not in (s, d)
                for e, w in p.links:
                    load[e] += b * w
    assert set(plan.link_load) == set(topo.capacity)
    assert load == pytest.approx(plan.link_load, rel=1e-12, abs=1e-6)
    worst = max(load[e] / (topo.capacity[e] * 1e3) for e in load)
    assert plan.max_load_us == pytest.approx(worst, rel=1e-12)


def test_small_demands_fixed_and_certificate_counts_them():
    topo = preset("nvswitch8")
    rng = random.Random(3)
    m = [[0 if s == d else rng.choice([64 << 10, 1 << 20, 200 << 20]) for d in range(8)] for s in range(8)]
    plan = route(topo, m)                                  # default: <= 1 MiB on one path
    check_plan(topo, m, plan)
    for (s, d), fl in plan.flows.items():
        if m[s][d] <= 1 << 20:
            assert len(fl) == 1 and fl[0][0].kind == "direct"
    assert plan.lower_bound_us <= lp_optimum(topo, m) * (1 + 1e-9)


def test_multi_node_two_by_four_uses_every_rail_for_a_hot_pair():
    topo = multi_node(2, gpus_per_node=4, nics=4)
    m = [[0] * 8 for _ in range(8)]
    m[1][6] = 1 << 30
    plan = route(topo, m)
    check_plan(topo, m, plan)
    assert {p.via[0] for p, _ in plan.flows[(1, 6)]} == {0, 1, 2, 3}
    assert plan.max_load_us == pytest.approx((1 << 30) / (4 * 50e3), rel=0.02)


def test_bad_matrix_shape_is_a_clear_error():
    with pytest.raises(ValueError, match="needs 4 x 4"):
        route(preset("mesh4"), [[0, 1], [1, 0]])


def _drift(m, rng, rel):
    return [[0 if b == 0 else max(1, int(b * (1 + rng.uniform(-rel, rel)))) for b in row] for row in m]


@pytest.mark.parametrize("name", ["h200x4", "mesh4", "nvswitch8", "2x4gpu-4nic"])
def test_reuse_is_a_plan_for_the_new_matrix(name):
    topo = _topology(name)
    n = topo.num_gpus
    rng = random.Random(11)
    m = [[0 if s == d else rng.randint(2, 64) << 20 for d in range(n)] for s in range(n)]
    router = Router(topo)
    first, hit = router.plan(m)
    assert not hit and not first.reused
    check_plan(topo, m, first)
    m2 = _drift(m, rng, 0.02)
    again, hit = router.plan(m2)
    assert hit and again.reused and again is not first
    check_plan(topo, m2, again)                             # bytes of m2, not of m
    opt = lp_optimum(topo, m2)
    assert again.lower_bound_us <= opt * (1 + 1e-9)        # the reuse bound is a true lower bound
    assert again.max_load_us <= (1 + router.tolerance) * again.lower_bound_us * (1 + 1e-9)
    assert again.max_load_us <= opt * (1 + router.tolerance) + 1e-9
    # the split follows the cached fractions (to within a byte per path)
    for key, fl in first.flows.items():
        old = {p.name(): b / m[key[0]][key[1]] for p, b in fl}
        new = {p.name(): b / m2[key[0]][key[1]] for p, b in again.flows[key]}
        assert old.keys() == new.keys()
        assert all(abs(old[k] - new[k]) < 1e-6 for k in old)


def test_signature_hit_and_hysteresis_and_replan():
    topo = preset("h200x4")
    router = Router(topo)
    m = [[0 if s == d else 64 << 20 for d in range(4)] for s in range(4)]
    router.plan(m)
    m2 = [[0 if s == d else (64 << 20) + 4096 for d in range(4)] for s in range(4)]   # same powers of two
    assert signature(m2) == signature(m)
    plan, hit = router.plan(m2)
    assert hit and all(sum(b for _, b in fl) == (64 << 20) + 4096 for fl in plan.flows.values())
    # a matrix that drifts a few percent a step keeps its plan (different signatures included)
    rng = random.Random(5)
    cur, hits = m, 0
    for _ in range(10):
        cur = _drift(cur, rng, 0.03)
        plan, hit = router.plan(cur)
        check_plan(topo, cur, plan)
        hits += hit
    assert hits >= 8
    # a hot pair appears: the old plan is far from the bound, so it is replanned
    hot = [row[:] for row in cur]
    hot[0][1] = 1 << 30
    plan, hit = router.plan(hot)
    assert not hit and not plan.reused
    check_plan(topo, hot, plan)
    assert len(plan.flows[(0, 1)]) >= 2


def test_reuse_with_a_new_demand_and_a_vanished_one():
    topo = preset("nvswitch8")
    m = [[0 if s == d else 32 << 20 for d in range(8)] for s in range(8)]
    m[2][5] = 0
    router = Router(topo, tolerance=0.5)                  # loose: force the reuse path
    router.plan(m)
    m2 = [row[:] for row in m]
    m2[2][5] = 32 << 20                                   # zero before: gets one path
    m2[3][4] = 0                                          # gone now
    plan, hit = router.plan(m2)
    assert hit and plan.reused
    check_plan(topo, m2, plan)
    assert len(plan.flows[(2, 5)]) == 1 and plan.flows[(2, 5)][0][0].kind == "direct"   # its cheapest path
    assert (3, 4) not in plan.flows
    # with the default tolerance the same change is checked against the bound, and replanned if needed
    strict = Router(topo)
    strict.plan(m)
    plan, hit = strict.plan(m2)
    check_plan(topo, m2, plan)
    assert plan.max_load_us <= (1 + strict.tolerance) * plan.lower_bound_us * (1 + 1e-9)


def test_reuse_applies_the_size_threshold():
    topo = preset("mesh4")
    m = [[0 if s == d else 8 << 20 for d in range(4)] for s in range(4)]
    m[0][1] = 1 << 30
    router = Router(topo, tolerance=1.0)
    router.plan(m)
    m2 = [row[:] for row in m]
    m2[0][1] = 512 << 10                                  # now at or below 1 MiB: one path, even on reuse
    plan, _ = router.plan(m2)
    check_plan(topo, m2, plan)
    assert len(plan.flows[(0, 1)]) == 1


@pytest.mark.parametrize("rows,expected", [
    ([], 1 << 20),                                                       # nothing measured: start value
    ([(256 << 10, 10, 20)] * 3, 1 << 20),                                # small loses: stays
    ([(4 << 20, 100, 150)] * 3, 4 << 20),                                # multipath loses at 4 MiB: moves up
    ([(512 << 10, 40, 30)] * 3 + [(256 << 10, 20, 25)] * 3, 256 << 10),  # wins at 512K, loses at 256K: down
    ([(4 << 20, 100, 150)] * 2, 1 << 20),                                # too few samples: ignored
    ([(64 << 20, 900, 600)] * 3 + [(8 << 20, 140, 150)] * 3 + [(2 << 20, 40, 60)] * 3, 8 << 20),
    ([(1 << 20, 30, 30)] * 3, 1 << 20),                                  # a tie keeps the current edge
])
def test_split_threshold_learns_from_measurements(rows, expected):
    th = SplitThreshold()
    for nbytes, one, many in rows:
        th.observe(nbytes, one, many)
    assert th.threshold_bytes == expected


def test_split_threshold_rejects_bad_input_and_router_uses_it():
    th = SplitThreshold()
    with pytest.raises(ValueError):
        th.observe(0, 1.0, 1.0)
    with pytest.raises(ValueError):
        SplitThreshold(initial_bytes=1)
    topo = preset("mesh4")
    router = Router(topo)
    m = [[0 if s == d else 2 << 20 for d in range(4)] for s in range(4)]
    m[0][1] = 1 << 30
    router.plan(m)
    for _ in range(3):
        router.observe(2 << 20, 50.0, 80.0)               # multipath measured slower at 2 MiB
    assert router.threshold.threshold_bytes == 2 << 20
    plan, hit = router.plan(m)
    assert not hit                                         # a threshold move empties the cache
    assert all(len(plan.flows[(s, d)]) == 1 for s in range(4) for d in range(4) if s != d and m[s][d] <= 2 << 20)
    check_plan(topo, m, plan)


@pytest.mark.parametrize("n", [4, 8])
def test_nvswitch_plans_never_relay_and_quiet_demands_stay_direct(n):
    """On a switch a relay crosses the sender's out port and the receiver's in port like the direct
    path, plus two more: it can never lower the most loaded link, so plans must not use it. Demands
    away from the hot rank gain nothing from spreading and keep one path."""
    rng = random.Random(n)
    topo = preset(f"nvswitch{n}")
    m = [[0 if i == j else rng.randint(2, 64) << 20 for j in range(n)] for i in range(n)]
    m[1] = [0 if j == 1 else 1 << 30 for j in range(n)]
    plan = route(topo, m)
    assert plan.max_load_us <= lp_optimum(topo, m) * 1.05
    for (s, d), paths in plan.flows.items():
        assert all(p.kind != "relay" for p, _ in paths), (s, d, [p.name() for p, _ in paths])
        if s != 1:
            assert [p.kind for p, _ in paths] == ["direct"], (s, d, [p.name() for p, _ in paths])
    assert any(p.kind == "host" for p, _ in plan.flows[(1, 2)])   # the hot sender offloads to PCIe


def test_the_same_matrix_again_is_a_hit_on_the_same_plan():
    topo = _topology("nvswitch8")
    n = topo.num_gpus
    rng = random.Random(5)
    m = [[0 if s == d else rng.randint(2, 64) << 20 for d in range(n)] for s in range(n)]
    router = Router(topo)
    first, hit = router.plan(m)
    assert not hit
    again, hit = router.plan([row[:] for row in m])
    assert hit and again.reused and again is not first
    assert again.max_load_us == first.max_load_us and again.flows == first.flows
    check_plan(topo, m, again)
    # another split threshold: not the same question any more (small demands are cut differently)
    router.threshold.threshold_bytes = 1 << 40
    third, _ = router.plan(m)
    assert third is not again and not any(len(p) > 1 for p in third.flows.values())
    check_plan(topo, m, third)
