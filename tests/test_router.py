"""Router (issue 4, first part): min-congestion plans against the exact LP optimum over the same
candidate paths (scipy, tests only), and plan invariants. Pure; no processes."""
from __future__ import annotations

import json
import random
import zlib

import pytest

from braid.planner.router import Router, direct_only, multi_node, preset, route, signature

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


def test_router_cache_reuses_plans_for_the_same_signature():
    topo = preset("h200x4")
    router = Router(topo)
    m = [[0 if s == d else 64 << 20 for d in range(4)] for s in range(4)]
    first, hit = router.plan(m)
    assert not hit
    m2 = [[0 if s == d else (64 << 20) + 4096 for d in range(4)] for s in range(4)]   # same powers of two
    assert signature(m2) == signature(m)
    again, hit = router.plan(m2)
    assert hit and again is first
    m3 = [[0 if s == d else 1 << 30 for d in range(4)] for s in range(4)]
    _, hit = router.plan(m3)
    assert not hit


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
    assert obj["plan_time_us"] > 0 and obj["ratio"] <= 1.05
    flows = {(x["src"], x["dst"]): sum(p["bytes"] for p in x["paths"]) for x in obj["flows"]}
    assert flows[(0, 1)] == 1 << 30
    f.write_text(json.dumps([[0, 1], [1, 0]]))
    assert main(["route", "--matrix", str(f), "--topology", "mesh4"]) == 2     # wrong shape: clear error
    assert "4 rows of 4" in capsys.readouterr().err
