"""The router's shortcuts (issue 4, planning time) against the exact LP optimum.

Every shortcut here must keep the plan within tolerance of the optimum, so each is checked where it
could go wrong:
- candidates dropped before the solve (a path that another path beats on every link): the LP over
  the kept candidates has the same optimum as the LP over all of them;
- the early exit (certificate tried at the iterate and at the predictor's point, from a centred
  start): plans within 2% of their own proven bound and within 5% of the LP, on the benchmark's
  random and skewed matrices and on adversarial ones, for 4-, 8- and 16-GPU topologies;
- the bound when nothing is solved (every demand on one path);
- the per-call tables cached by the set of split demands (the same plan whatever the cache held);
- cache hits (the rescaled plan within tolerance of the LP for the new matrix);
- the matrix reader's fast path and the cache key.
No timing assertions: scripts/bench_router.py measures those.
"""
from __future__ import annotations

import random
import zlib

import pytest

from braid.planner.router import (Router, _compiled, _rowmin, _signature_key, mesh, multi_node, nvswitch, preset,
                                  route, signature)

np = pytest.importorskip("numpy")
pytest.importorskip("scipy.optimize")
from braid.planner.lp import lp_optimum  # noqa: E402

from test_router import adversarial, check_plan, matrices  # noqa: E402

MIB = 1 << 20

TOPOLOGIES = {
    "h200x4": lambda: preset("h200x4"),
    "mesh4": lambda: preset("mesh4"),
    "nvswitch8": lambda: preset("nvswitch8"),
    "mesh8": lambda: mesh(8),
    "2x4gpu-4nic": lambda: multi_node(2, gpus_per_node=4, nics=4),
    "nvswitch16": lambda: preset("nvswitch16"),
    "2x8gpu-8nic": lambda: multi_node(2, gpus_per_node=8, nics=8),
}


def bench_matrices(n: int, rng: random.Random):
    """The kinds scripts/bench_router.py times: every demand 1-64 MiB, and the same with one hot
    destination taking 128-512 MiB from everyone."""
    yield "bench random", [[0 if s == d else rng.randint(1, 64) * MIB for d in range(n)] for s in range(n)]
    hot = rng.randrange(n)
    yield "bench skewed", [[0 if s == d else (rng.randint(128, 512) if d == hot else rng.randint(1, 64)) * MIB
                            for d in range(n)] for s in range(n)]


def _cases(names, sources, seeds):
    out = []
    for name in names:
        n = TOPOLOGIES[name]().num_gpus
        for seed in seeds:
            rng = random.Random(zlib.crc32(name.encode()) + seed)
            for source in sources:
                for label, m in source(n, rng):
                    if any(any(row) for row in m):
                        out.append(pytest.param(name, label, m, id=f"{name}-{label}-{seed}"))
    return out


EARLY_EXIT = (_cases(TOPOLOGIES, (bench_matrices,), (1, 2, 3))
              + _cases(("h200x4", "mesh4", "nvswitch8", "mesh8", "2x4gpu-4nic"), (matrices, adversarial), (11,)))


@pytest.mark.parametrize("name,label,matrix", EARLY_EXIT)
def test_early_exit_within_gap_of_its_bound_and_of_the_lp(name, label, matrix):
    topo = TOPOLOGIES[name]()
    plan = route(topo, matrix, min_split_bytes=0)
    opt = lp_optimum(topo, matrix)
    assert 0 < plan.lower_bound_us <= opt * (1 + 1e-9)                       # a true lower bound
    assert plan.max_load_us <= plan.lower_bound_us * 1.02 * (1 + 1e-6)       # the certificate it stopped on
    assert plan.max_load_us <= opt * 1.05 + 1e-9
    check_plan(topo, matrix, plan)


@pytest.mark.parametrize("name", sorted(TOPOLOGIES))
def test_dropped_candidates_never_change_the_optimum(name):
    """A candidate is left out of the solve only when a kept one puts no more bytes on any link;
    the LP over the kept candidates has the optimum of the LP over all of them."""
    topo = TOPOLOGIES[name]()
    c = _compiled(topo)
    n = topo.num_gpus
    kept = {}
    for (s, d), ps in topo.paths.items():
        p = s * n + d
        cols = sorted({int(j) for j in c.rcol[p, :c.nkeep[p]]})
        kept[(s, d)] = [ps[j] for j in cols]
        fastest = min(c_time(topo, q) for q in ps)                                # first: a fastest one
        assert c_time(topo, ps[int(c.rcol[p, 0])]) <= fastest * (1 + 1e-12)
        for j, q in enumerate(ps):
            if j in cols:
                continue
            use = _use(q)
            assert any(all(use.get(e, 0.0) >= w for e, w in _use(ps[i]).items()) for i in cols), (s, d, q.name())
    reduced = type(topo)(topo.name, n, dict(topo.capacity), kept)
    rng = random.Random(5)
    for label, m in list(bench_matrices(n, rng)) + list(adversarial(n, rng)):
        if any(any(row) for row in m):
            assert lp_optimum(reduced, m) == pytest.approx(lp_optimum(topo, m), rel=1e-6), label


def _use(path):
    out = {}
    for e, w in path.links:
        out[e] = out.get(e, 0.0) + w
    return out


def c_time(topo, path):
    return sum(w / topo.capacity[e] for e, w in path.links)


def test_nvswitch_solve_sees_direct_and_host_only():
    c = _compiled(preset("nvswitch8"))
    assert c.R == 2 and set(c.nkeep.tolist()) == {0, 2}       # relays beaten by the direct path


def test_padded_pairs_route_within_tolerance():
    """Pairs with fewer kept candidates than others are padded with copies of their fastest path;
    the copies fold back into it (one entry per candidate) and the plan stays optimal."""
    topo = mesh(4)
    topo.paths[(0, 1)] = topo.paths[(0, 1)][:2]               # direct and one relay only
    topo.paths[(2, 3)] = topo.paths[(2, 3)][:1]               # direct only: never split
    c = _compiled(topo)
    assert c.rpad.any()
    rng = random.Random(2)
    for m in ([[0, 1 << 30, 8 * MIB, 8 * MIB], [8 * MIB, 0, 8 * MIB, 8 * MIB],
               [8 * MIB, 8 * MIB, 0, 1 << 29], [8 * MIB, 8 * MIB, 8 * MIB, 0]],
              [[0 if s == d else rng.randint(1, 256) * MIB for d in range(4)] for s in range(4)]):
        plan = route(topo, m, min_split_bytes=0)
        check_plan(topo, m, plan)
        assert plan.max_load_us <= lp_optimum(topo, m) * 1.05 + 1e-9
        assert len(plan.flows[(2, 3)]) == 1


@pytest.mark.parametrize("name", ["nvswitch8", "2x4gpu-4nic"])
def test_nothing_to_solve_still_proves_a_bound(name):
    """Every demand at or below the split size (or with one useful path): no solve; the bound
    prices the busiest link alone: a true lower bound (0 when every demand could avoid that link),
    and the whole load there when no demand could have moved."""
    topo = TOPOLOGIES[name]()
    n = topo.num_gpus
    rng = random.Random(4)
    m = [[0 if s == d else rng.randint(1, 64) * MIB for d in range(n)] for s in range(n)]
    plan = route(topo, m, min_split_bytes=1 << 40)
    check_plan(topo, m, plan)
    assert all(len(fl) == 1 for fl in plan.flows.values())
    assert 0 <= plan.lower_bound_us <= lp_optimum(topo, m) * (1 + 1e-9)
    if name == "2x4gpu-4nic":                                 # a pair inside a node: direct is its only useful path
        one = [[0] * n for _ in range(n)]
        one[0][1] = 1 << 30
        plan = route(topo, one)
        assert plan.lower_bound_us == pytest.approx(plan.max_load_us, rel=1e-9)


def test_cached_tables_do_not_change_plans():
    """The per-call tables are cached by the set of split demands: plans are the same whether the
    cache is cold, warm, or holds other sets."""
    topo = preset("nvswitch8")
    rng = random.Random(9)
    ms = [[[0 if s == d else rng.choice([MIB // 2, 8 * MIB, 64 * MIB, 300 * MIB]) for d in range(8)]
           for s in range(8)] for _ in range(4)]
    first = [route(topo, m).split[2] for m in ms]
    again = [route(topo, m).split[2] for m in reversed(ms)][::-1]
    _compiled(topo).rows.clear()
    cold = [route(topo, m).split[2] for m in ms]
    for a, b, c in zip(first, again, cold):
        assert (a == b).all() and (a == c).all()


REUSE = _cases(("h200x4", "mesh4", "nvswitch8", "mesh8", "2x4gpu-4nic"), (bench_matrices, adversarial), (21,))


@pytest.mark.parametrize("name,label,matrix", REUSE)
def test_cache_hit_within_tolerance_of_the_lp(name, label, matrix):
    """A drifted matrix through a Router: hit or miss, the plan is within the Router's tolerance of
    the LP optimum for the new matrix, and a hit's bound is a true lower bound."""
    topo = TOPOLOGIES[name]()
    router = Router(topo, min_split_bytes=0)
    router.plan(matrix)
    rng = random.Random(len(label))
    for rel in (0.01, 0.05, 0.2):
        m2 = [[0 if b == 0 else max(1, int(b * (1 + rng.uniform(-rel, rel)))) for b in row] for row in matrix]
        plan, hit = router.plan(m2)
        check_plan(topo, m2, plan)
        opt = lp_optimum(topo, m2)
        assert plan.lower_bound_us <= opt * (1 + 1e-9)
        assert plan.max_load_us <= opt * (1 + router.tolerance) + 1e-9
        assert hit == plan.reused


@pytest.mark.parametrize("width", range(1, 10))
def test_rowmin(width):
    x = np.random.default_rng(width).random((7, width))
    assert (_rowmin(x) == x.min(1)).all()


def test_matrix_reader_paths_agree():
    """Lists of rows take a fast path; arrays, floats and tuples plan the same; negatives and bad
    shapes are errors (tests/test_input_validation.py has the rest)."""
    topo = nvswitch(4)
    m = [[0, 5 * MIB, 7, 0], [1, 0, 3 * MIB, 2], [0, 0, 0, 9 * MIB], [4 * MIB, 0, 1, 0]]
    ref = route(topo, np.array(m))
    for same in (m, [[float(x) + 0.5 for x in row] for row in m], [tuple(row) for row in m]):
        plan = route(topo, same)
        assert (plan.split[2] == ref.split[2]).all() and plan.max_load_us == ref.max_load_us
    neg = [row[:] for row in m]
    neg[0][3] = -5
    with pytest.raises(ValueError, match=r"matrix\[0\]\[3\] = -5"):     # negative: an error, not "no demand"
        route(topo, neg)
    with pytest.raises(ValueError, match="needs 4 x 4"):
        route(topo, [[0, 1, 2, 3]] * 3)
    with pytest.raises(ValueError, match="byte counts"):
        route(topo, [[0, 1, 2], [0, 1, 2], [0, 1, 2], [0, 1, 2, 3]])        # ragged rows
    with pytest.raises(ValueError, match="byte counts"):
        route(topo, [[0, "x", 2, 3]] * 4)
    with pytest.raises(ValueError, match="2\\*\\*52"):
        route(topo, [[0, 2.0 ** 60, 0, 0]] + [[0] * 4] * 3)


def test_cache_key_is_the_signature():
    rng = random.Random(3)
    for _ in range(200):
        a = [[rng.choice([0, 1, 2, 3, rng.randint(1, 1 << 40)]) for _ in range(4)] for _ in range(4)]
        b = [[rng.choice([0, 1, x, x + 1, 2 * x]) for x in row] for row in a]
        for m in (a, b):
            for i in range(4):
                m[i][i] = 0
        ka, kb = (_signature_key(np.array(x, dtype=np.float64).ravel()) for x in (a, b))
        assert (ka == kb) == (signature(a) == signature(b))
