"""The planner as pure tables: no processes, no torch.

(a) the planner package imports without torch; (b) split() covers every destination byte exactly
once from the right source byte (every op's movement, the reductions' two phases included);
(c) the cost model: equal finish, lane choice, fit; (d) the host ring schedules, run through a
discrete-event simulation of the counter protocol the shm lane uses.
"""
from __future__ import annotations

import ast
import itertools
import json
import math
import pathlib
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from braid.planner import model
from braid.planner.model import LaneCost, choose_shares, choose_with_native, equal_finish, fit, predicted_time_us
from braid.planner.plan import (LINK_GROUP, LaneKind, Plan, all_gather_movement, all_to_all_movement,
                                broadcast_movement, chunk_bounds, gather_chunks_movement, p2p_movement,
                                reduce_scatter_movement, split)
from braid.planner.rings import COLL, PAIR, RingCursor, ring_id, schedule

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "braid"
PLANNER = SRC / "planner"


# ---------------------------------------------------------------------------------------------
# (a) no torch in the planner
# ---------------------------------------------------------------------------------------------

def test_planner_sources_never_import_torch():
    files = sorted(PLANNER.rglob("*.py"))
    assert len(files) >= 4, files
    offenders = []
    for f in files:
        tree = ast.parse(f.read_text(), filename=str(f))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if node.level == 0 else []
                # a relative import must stay inside the planner package
                if node.level > 1:
                    offenders.append(f"{f.name}:{node.lineno} relative import leaves the planner")
            else:
                continue
            for n in names:
                if n == "torch" or n.startswith("torch."):
                    offenders.append(f"{f.name}:{node.lineno} imports {n}")
    assert not offenders, offenders


def test_planner_package_imports_with_torch_blocked():
    """Load braid.planner (not braid/__init__, which needs torch) with `import torch` forbidden."""
    script = textwrap.dedent(f"""
        import importlib.abc, sys, types
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("torch is blocked in this test")
                return None
        sys.meta_path.insert(0, Block())
        pkg = types.ModuleType("braid")
        pkg.__path__ = [{str(SRC)!r}]
        sys.modules["braid"] = pkg
        import braid.planner as p
        plan = p.split(p.all_gather_movement(3, 1000, False), {{"shm": 0.5, "gloo": 0.5}}, 1000, 64, 1)
        assert p.Plan.from_json(plan.to_json()) == plan
        print("torch" in sys.modules, sorted(p.__all__) == sorted(set(p.__all__)))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"]


# ---------------------------------------------------------------------------------------------
# (b) split()
# ---------------------------------------------------------------------------------------------

NO_SOURCE = -1


def expected_sources(op: str, w: int, params: dict) -> dict[tuple[int, int], np.ndarray]:
    """For every output buffer (rank, buf): the global source id (src_rank << 32 | src_byte) that
    each byte must hold, written from the op's definition (not from the movement builders)."""
    exp: dict[tuple[int, int], np.ndarray] = {}

    def ids(src: int, start: int, n: int) -> np.ndarray:
        return (np.int64(src) << 32) + np.arange(start, start + n, dtype=np.int64)

    if op == "all_gather":
        n = params["n"]
        for d in range(w):
            if params["into_list"]:
                for r in range(w):
                    exp[(d, r)] = ids(r, 0, n)
            else:
                exp[(d, 0)] = np.concatenate([ids(r, 0, n) for r in range(w)])
    elif op == "broadcast":
        n, root = params["n"], params["root"]
        for d in range(w):
            if d != root:
                exp[(d, 0)] = ids(root, 0, n)
    elif op == "all_to_all_single":
        m = params["matrix"]
        for d in range(w):
            parts = []
            for s in range(w):
                start = sum(m[s][:d])
                parts.append(ids(s, start, m[s][d]))
            exp[(d, 0)] = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    elif op == "send_recv":
        exp[(params["dst"], 0)] = ids(params["src"], 0, params["n"])
    elif op == "reduce_scatter":
        # reductions, phase 1: rank d's scratch (buffer 1) holds every rank's copy of chunk d, in rank order
        b = params["bounds"]
        for d in range(w):
            size = b[d + 1] - b[d]
            if size:
                exp[(d, 1)] = np.concatenate([ids(s, b[d], size) for s in range(w)])
    elif op == "gather_chunks":
        # phase 2: rank d's reduced chunk to the same place in the others' outputs (or the root's);
        # a rank's own chunk is already in place and must not be written
        b, root = params["bounds"], params["root"]
        for q in range(w):
            if root is not None and q != root:
                continue
            arr = np.full(b[-1], NO_SOURCE, dtype=np.int64)
            for d in range(w):
                if d != q:
                    arr[b[d]:b[d + 1]] = ids(d, b[d], b[d + 1] - b[d])
            exp[(q, 0)] = arr
    return exp


@pytest.mark.parametrize("numel,world", [(0, 3), (1, 4), (7, 3), (9, 3), (1000, 7), (100_003, 8)])
def test_chunk_bounds(numel, world):
    for esz in (1, 2, 4, 8):
        b = chunk_bounds(numel, world, esz)
        sizes = [(b[i + 1] - b[i]) // esz for i in range(world)]
        assert b[0] == 0 and b[-1] == numel * esz and len(b) == world + 1
        assert all((b[i + 1] - b[i]) % esz == 0 for i in range(world))
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def random_case(rng: random.Random):
    w = rng.randint(2, 5)
    kind = rng.choice(["all_gather", "all_gather_list", "broadcast", "all_to_all_single", "send_recv",
                       "reduce_scatter", "gather_chunks"])
    big = rng.choice([0, 1, 7, 63, 64, 65, 1000, 4097, 100_003, 1 << 20])
    if kind in ("reduce_scatter", "gather_chunks"):
        esz = rng.choice([1, 2, 4, 8])
        bounds = chunk_bounds(big // esz, w, esz)
        if kind == "reduce_scatter":
            return kind, w, {"bounds": bounds}, reduce_scatter_movement(w, bounds), bounds[-1]
        root = rng.choice([None, rng.randrange(w)])
        params = {"bounds": bounds, "root": root}
        return kind, w, params, gather_chunks_movement(w, bounds, root), bounds[-1]
    if kind.startswith("all_gather"):
        params = {"n": big, "into_list": kind == "all_gather_list"}
        return "all_gather", w, params, all_gather_movement(w, big, params["into_list"]), big
    if kind == "broadcast":
        params = {"n": big, "root": rng.randrange(w)}
        return kind, w, params, broadcast_movement(w, big, params["root"]), big
    if kind == "all_to_all_single":
        matrix = [[rng.choice([0, 1, rng.randint(1, 5000), rng.randint(1, 300_000)]) for _ in range(w)]
                  for _ in range(w)]
        size = max(max(sum(r) for r in matrix), max(sum(matrix[s][d] for s in range(w)) for d in range(w)))
        return kind, w, {"matrix": matrix}, all_to_all_movement(matrix), size
    s, d = rng.sample(range(w), 2)
    params = {"src": s, "dst": d, "n": big}
    return kind, w, params, p2p_movement(w, s, d, big), big


def random_shares(rng: random.Random) -> dict[str, float]:
    names = rng.sample([k.value for k in LaneKind], rng.randint(1, 3))
    shares = {k: rng.choice([0.0, 0.01, 0.2, 0.5, 1.0, rng.random()]) for k in names}
    if not any(v > 0 for v in shares.values()):
        shares[names[0]] = rng.random() + 0.01
    return shares


@pytest.mark.parametrize("seed", range(300))
def test_split_covers_every_destination_byte_once(seed):
    rng = random.Random(seed)
    op, w, params, movement, size = random_case(rng)
    shares = random_shares(rng)
    align = rng.choice([1, 8, 64, 256, 4096])
    min_split = rng.choice([1, 64, 4096, 256 << 10])
    plan = split(movement, shares, size, align=align, min_split=min_split)

    # shares: only the positive lanes, normalised, in LaneKind order
    positive = {k: v for k, v in shares.items() if v > 0}
    assert set(plan.shares) == set(positive)
    assert set(plan.lanes) == set(positive)
    assert math.isclose(sum(plan.shares.values()), 1.0, rel_tol=1e-12)
    order = [k.value for k in LaneKind]
    assert list(plan.shares) == sorted(plan.shares, key=order.index)
    total = sum(positive.values())
    for k, v in positive.items():
        assert math.isclose(plan.shares[k], v / total, rel_tol=1e-12)

    # coverage: every output byte written exactly once, from the right source byte
    exp = expected_sources(op, w, params)
    got = {key: np.full(len(a), NO_SOURCE, dtype=np.int64) for key, a in exp.items()}
    count = {key: np.zeros(len(a), dtype=np.int64) for key, a in exp.items()}

    def write(src, src_off, n, rank, buf, off):
        key = (rank, buf)
        assert key in exp, f"{op}: write to unexpected buffer {key}"
        assert 0 <= off and off + n <= len(exp[key]), (key, off, n, len(exp[key]))
        got[key][off:off + n] = (np.int64(src) << 32) + np.arange(src_off, src_off + n, dtype=np.int64)
        count[key][off:off + n] += 1

    for lane, transfers in plan.lanes.items():
        for t in transfers:
            assert t.nbytes > 0
            for d, b, off in t.dsts:
                assert d != t.src, f"transfer to self on lane {lane}: {t}"
                write(t.src, t.src_off, t.nbytes, d, b, off)
    for c in plan.local:
        write(c.rank, c.src_off, c.nbytes, c.rank, c.buf, c.dst_off)
    for key in exp:
        wanted = exp[key] != NO_SOURCE
        assert (count[key][wanted] == 1).all(), f"{op} {key}: bytes written {set(count[key].tolist())} times"
        assert (count[key][~wanted] == 0).all(), f"{op} {key}: bytes written that must stay"
        assert np.array_equal(got[key], exp[key]), f"{op} {key}: wrong source bytes"

    # pieces: one contiguous piece per lane per original transfer, cut at aligned points
    names = list(plan.shares)
    biggest = max(names, key=lambda k: plan.shares[k])
    pieces_of = {t: [] for t in movement.transfers}
    for lane, transfers in plan.lanes.items():
        for p in transfers:
            owners = [t for t in movement.transfers
                      if t.src == p.src and t.src_off <= p.src_off < t.src_off + t.nbytes
                      and len(t.dsts) == len(p.dsts)
                      and all(pd == (td[0], td[1], td[2] + p.src_off - t.src_off)
                              for pd, td in zip(p.dsts, t.dsts))]
            assert len(owners) == 1, (p, owners)
            pieces_of[owners[0]].append((lane, p))
    for t, pieces in pieces_of.items():
        if len(names) == 1 or t.nbytes < min_split:
            assert pieces == [(biggest, t)], (t, pieces)
            continue
        lanes_in_order = [lane for lane, _ in pieces]
        assert lanes_in_order == [k for k in names if k in lanes_in_order], "pieces out of lane order"
        assert len(set(lanes_in_order)) == len(lanes_in_order), "two pieces of one transfer on one lane"
        pos = t.src_off
        for lane, p in sorted(pieces, key=lambda lp: lp[1].src_off):
            assert p.src_off == pos, "pieces not contiguous"
            inner = p.src_off - t.src_off
            assert inner == 0 or inner % align == 0, f"cut at {inner} not aligned to {align}"
            # each piece within one alignment unit of its lane's share
            assert abs(p.nbytes - plan.shares[lane] * t.nbytes) <= align + 1e-6 * t.nbytes, (lane, p.nbytes)
            pos += p.nbytes
        assert pos == t.src_off + t.nbytes
        # a lane absent from this transfer may only be one whose share rounds to nothing
        for k in names:
            if k not in lanes_in_order:
                assert plan.shares[k] * t.nbytes <= align, (k, plan.shares[k], t.nbytes)

    # bytes conserved, and the plan survives JSON
    assert sum(plan.lane_bytes().values()) == movement.total_bytes()
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert again.to_json() == plan.to_json()
    json.loads(plan.to_json())


def test_split_single_lane_and_zero_share_lane():
    mv = all_gather_movement(4, 1 << 20, False)
    plan = split(mv, {"gloo": 0.0, "shm": 1.0}, 1 << 20, align=64, min_split=1)
    assert list(plan.lanes) == ["shm"]
    assert plan.lanes["shm"] == mv.transfers
    with pytest.raises(ValueError):
        split(mv, {"gloo": 0.0}, 1 << 20)


def test_movements_describe_the_ops():
    # local copies: all_gather keeps each rank's own slot local; all_to_all the diagonal
    ag = all_gather_movement(3, 10, False)
    assert sorted((c.rank, c.buf, c.dst_off) for c in ag.local) == [(0, 0, 0), (1, 0, 10), (2, 0, 20)]
    agl = all_gather_movement(3, 10, True)
    assert sorted((c.rank, c.buf, c.dst_off) for c in agl.local) == [(0, 0, 0), (1, 1, 0), (2, 2, 0)]
    assert all(len(t.dsts) == 2 for t in ag.transfers)      # multicast to both peers
    a2a = all_to_all_movement([[1, 2], [3, 4]])
    assert [(c.rank, c.src_off, c.nbytes, c.dst_off) for c in a2a.local] == [(0, 0, 1, 0), (1, 3, 4, 2)]
    assert broadcast_movement(1, 10, 0).transfers == []
    assert all_gather_movement(3, 0, False).transfers == [] and all_gather_movement(3, 0, False).local == []
    assert p2p_movement(2, 0, 1, 0).transfers == [] and p2p_movement(2, 0, 1, 5).p2p


# ---------------------------------------------------------------------------------------------
# (c) the cost model
# ---------------------------------------------------------------------------------------------

def random_costs(rng: random.Random, names, floors: bool = False) -> dict[str, LaneCost]:
    return {k: LaneCost(rng.choice([0.5, 1.0, 10.0, rng.uniform(0.5, 500.0), rng.uniform(0.5, 1e5)]),
                        rng.choice([0.1, 1.0, 30.0, rng.uniform(0.05, 500.0)]),
                        rng.choice([0.0, 0.0, rng.uniform(1.0, 2000.0)]) if floors else 0.0) for k in names}


def finish_time_reference(costs: dict[str, LaneCost], n: float) -> float:
    """T with sum_i max(0, (T - a_i) b_i) = n, by bisection (independent of the library's sweep)."""
    def f(t):
        return sum(max(0.0, (t - c.latency_us) * c.bw_gbps * 1e3) for c in costs.values()) - n
    lo = min(c.latency_us for c in costs.values())
    hi = max(c.latency_us for c in costs.values()) + n / max(c.bw_gbps * 1e3 for c in costs.values()) + 1.0
    from scipy.optimize import brentq
    return brentq(f, lo, hi, xtol=1e-12, rtol=1e-14, maxiter=500)


@pytest.mark.parametrize("seed", range(200))
def test_equal_finish_makes_lanes_finish_together(seed):
    rng = random.Random(seed)
    names = [f"lane{i}" for i in range(rng.randint(2, 5))]
    costs = random_costs(rng, names)
    n = rng.choice([1, 100, 4096, 1 << 20, 1 << 30, rng.randint(1, 1 << 34)])
    shares = equal_finish(costs, n)
    assert shares and set(shares) <= set(costs)
    assert math.isclose(sum(shares.values()), 1.0, rel_tol=1e-9)
    assert all(v > 0 for v in shares.values())
    times = {k: costs[k].time_us(v * n) for k, v in shares.items()}
    t_ref = finish_time_reference(costs, n)
    for k, t in times.items():
        assert math.isclose(t, t_ref, rel_tol=1e-6), (k, t, t_ref, times)
    for k in costs:
        if k not in shares:       # left out: its latency alone reaches the finish time
            assert costs[k].latency_us >= t_ref * (1 - 1e-9), (k, costs[k], t_ref)
        else:
            assert costs[k].latency_us < t_ref


def test_equal_finish_slow_latency_lane_gets_nothing():
    costs = {"fast": LaneCost(1.0, 10.0), "late": LaneCost(1e6, 1000.0)}
    n = 10_000_000                 # the fast lane alone finishes in 1001 us << 1e6 us
    assert equal_finish(costs, n) == {"fast": 1.0}
    # a lane far slower in bandwidth but with equal latency still gets its proportional share
    sh = equal_finish({"a": LaneCost(5.0, 30.0), "b": LaneCost(5.0, 10.0)}, 1 << 30)
    assert math.isclose(sh["a"], 0.75, rel_tol=1e-9) and math.isclose(sh["b"], 0.25, rel_tol=1e-9)


def test_equal_finish_degenerate_sizes():
    costs = {"a": LaneCost(10.0, 1.0), "b": LaneCost(1.0, 0.001)}
    assert equal_finish(costs, 0) == {"b": 1.0}       # nothing to move: the lowest latency
    assert equal_finish({"only": LaneCost(3.0, 3.0)}, 1 << 30) == {"only": 1.0}


@pytest.mark.parametrize("seed", range(200))
def test_choose_shares_rules(seed):
    rng = random.Random(seed)
    names = rng.sample([k.value for k in LaneKind], rng.randint(1, 5))
    costs = random_costs(rng, names, floors=seed % 2 == 1)
    n = rng.choice([0, 1, 64, 4096, 1 << 20, 1 << 28, rng.randint(1, 1 << 34)])
    shares = choose_shares(costs, n)
    size = max(n, 1)
    assert shares and set(shares) <= set(costs)
    assert math.isclose(sum(shares.values()), 1.0, rel_tol=1e-9)
    groups = [LINK_GROUP[LaneKind(k)] for k in shares]
    assert len(groups) == len(set(groups)), f"two lanes of one link group share: {shares}"
    assert not ("ce" in shares and "nccl" in shares)
    best_single = min(costs[k].time_us(size) for k in costs)
    if len(shares) == 1:
        (k, v), = shares.items()
        assert v == 1.0
        assert costs[k].time_us(size) == best_single
    else:
        assert min(shares.values()) >= model.MIN_SHARE
        # splitting is only chosen when it is predicted to beat the best lane alone
        assert predicted_time_us(costs, shares, size) < best_single
        if all(c.floor_us == 0 for c in costs.values()):
            times = [costs[k].time_us(v * size) for k, v in shares.items()]
            assert max(times) - min(times) <= 1e-6 * max(times)


def test_lane_cost_floor():
    c = LaneCost(10.0, 1.0, floor_us=100.0)
    assert c.time_us(0) == 100.0 and c.time_us(1000) == 100.0        # 10 + 1 us is under the floor
    assert c.time_us(1_000_000) == pytest.approx(10.0 + 1000.0)
    assert LaneCost(**c.to_dict()) == c


@pytest.mark.parametrize("seed", range(150))
def test_choose_with_native_rules(seed):
    """NCCL's own call alone, or a split over the other (non-excluded) lanes that beats it."""
    rng = random.Random(seed)
    names = rng.sample(["ce", "nccl", "host"], rng.randint(1, 3))
    costs = random_costs(rng, names, floors=seed % 3 == 0)
    exclude = tuple(rng.sample(["ce", "host"], rng.randint(0, 1)))
    n = rng.choice([0, 1, 4096, 1 << 20, 1 << 30, rng.randint(1, 1 << 34)])
    got = choose_with_native(costs, n, "nccl", exclude)
    size = max(n, 1)
    assert math.isclose(sum(got.values()), 1.0, rel_tol=1e-9)
    if "nccl" not in costs:
        usable = {k: c for k, c in costs.items() if k not in exclude} or costs
        assert got == choose_shares(usable, n)
        return
    if got == {"nccl": 1.0}:
        pool = {k: c for k, c in costs.items() if k != "nccl" and k not in exclude}
        if pool:
            alt = choose_shares(pool, size)
            assert len(alt) == 1 or predicted_time_us(pool, alt, size) >= costs["nccl"].time_us(size)
        return
    assert "nccl" not in got and len(got) > 1, got           # never NCCL inside a split
    assert not set(got) & set(exclude), (got, exclude)
    assert predicted_time_us(costs, got, size) < costs["nccl"].time_us(size)


def test_choose_with_native_tables():
    gpu = {"ce": LaneCost(12.0, 360.0), "nccl": LaneCost(10.0, 320.0), "host": LaneCost(30.0, 30.0)}
    assert choose_with_native(gpu, 4096) == {"nccl": 1.0}
    big = choose_with_native(gpu, 1 << 30)
    assert set(big) == {"ce", "host"} and big["ce"] > big["host"]
    assert choose_with_native(gpu, 1 << 30, exclude=("ce",)) == {"nccl": 1.0}
    cpu = {"gloo": LaneCost(150.0, 1.0), "shm": LaneCost(60.0, 2.0)}
    assert choose_with_native(cpu, 1 << 30) == choose_shares(cpu, 1 << 30)
    assert choose_with_native(cpu, 1 << 30, exclude=("gloo",)) == {"shm": 1.0}
    # a lane alone beats NCCL (the copy engines' own reduction): only taken with single_ok, and
    # only when it is faster by the margin
    red = {"ce": LaneCost(20.0, 390.0), "nccl": LaneCost(15.0, 300.0), "host": LaneCost(30.0, 1.0)}
    assert choose_with_native(red, 1 << 30) == {"nccl": 1.0}
    assert choose_with_native(red, 1 << 30, single_ok=True) == {"ce": 1.0}
    near = {"ce": LaneCost(20.0, 305.0), "nccl": LaneCost(15.0, 300.0)}
    assert choose_with_native(near, 1 << 30, single_ok=True) == {"nccl": 1.0}
    assert choose_with_native(red, 4096, single_ok=True) == {"nccl": 1.0}


def test_choose_with_native_share_tables():
    """native_share (all_reduce on GPUs): NCCL's own collective may keep a share beside the host
    lane when that beats NCCL alone and the other lanes' split; never below the margin."""
    four = {"ce": LaneCost(20.0, 330.0), "nccl": LaneCost(15.0, 350.0), "host": LaneCost(40.0, 20.0)}
    assert choose_with_native(four, 1 << 30) == {"nccl": 1.0}            # without native_share
    got = choose_with_native(four, 1 << 30, native_share=True)
    assert set(got) == {"nccl", "host"} and 0.03 < got["host"] < 0.08, got
    assert predicted_time_us(four, got, 1 << 30) < four["nccl"].time_us(1 << 30) * 0.97
    assert choose_with_native(four, 1 << 20, native_share=True) == {"nccl": 1.0}   # small: NCCL
    # the copy engines faster than NCCL: the NVLink group keeps one lane, the ce + host split
    two = {"ce": LaneCost(20.0, 390.0), "nccl": LaneCost(15.0, 330.0), "host": LaneCost(40.0, 34.0)}
    got = choose_with_native(two, 1 << 30, native_share=True)
    assert set(got) == {"ce", "host"}, got


@pytest.mark.parametrize("seed", range(100))
def test_choose_with_native_share_never_predicted_slower(seed):
    rng = random.Random(seed)
    costs = random_costs(rng, ["ce", "nccl", "host"], floors=seed % 3 == 0)
    n = rng.choice([1, 4096, 1 << 20, 1 << 30, rng.randint(1, 1 << 34)])
    got = choose_with_native(costs, n, "nccl", native_share=True)
    plain = choose_with_native(costs, n, "nccl")
    assert math.isclose(sum(got.values()), 1.0, rel_tol=1e-9)
    if got != plain:
        assert "nccl" in got and len(got) > 1, (got, plain)
        assert predicted_time_us(costs, got, max(n, 1)) < predicted_time_us(costs, plain, max(n, 1)) * 0.97


@pytest.mark.parametrize("n", [0, 1, 64, 1024, 16 << 10])
def test_choose_shares_small_messages_take_one_lane(n):
    costs = {"ce": LaneCost(12.0, 360.0), "nccl": LaneCost(10.0, 320.0), "host": LaneCost(30.0, 30.0)}
    shares = choose_shares(costs, n)
    assert len(shares) == 1
    (k,) = shares
    assert k == min(costs, key=lambda x: costs[x].time_us(max(n, 1)))
    cpu = {"gloo": LaneCost(150.0, 1.0), "shm": LaneCost(60.0, 2.0)}
    assert choose_shares(cpu, n) == {"shm": 1.0}


def test_choose_shares_large_messages_use_lanes_of_different_groups():
    costs = {"ce": LaneCost(12.0, 360.0), "nccl": LaneCost(10.0, 320.0), "host": LaneCost(30.0, 30.0)}
    shares = choose_shares(costs, 1 << 30)
    assert set(shares) == {"ce", "host"}      # ce beats nccl at this size; both drive NVLink
    cpu = {"gloo": LaneCost(150.0, 1.0), "shm": LaneCost(60.0, 2.0)}
    s = choose_shares(cpu, 1 << 30)
    assert set(s) == {"gloo", "shm"} and s["shm"] > s["gloo"]
    # same groups given explicitly: only one lane of the group survives
    s2 = choose_shares({"x": LaneCost(1.0, 1.0), "y": LaneCost(1.0, 1.0)}, 1 << 30, groups={"x": "g", "y": "g"})
    assert len(s2) == 1
    with pytest.raises(ValueError):
        choose_shares({}, 10)


@pytest.mark.parametrize("seed", range(50))
def test_fit_recovers_latency_and_bandwidth(seed):
    rng = random.Random(seed)
    lat = rng.uniform(0.5, 1000.0)
    bw = rng.uniform(0.01, 1000.0)
    truth = LaneCost(lat, bw)
    a = rng.randint(1, 1 << 20)
    b = a + rng.randint(1, 1 << 30)
    got = fit(a, truth.time_us(a), b, truth.time_us(b))
    assert math.isclose(got.latency_us, lat, rel_tol=1e-6, abs_tol=1e-6)
    assert math.isclose(got.bw_gbps, bw, rel_tol=1e-6)
    for size in (0, a, b, 3 * b):
        assert math.isclose(got.time_us(size), truth.time_us(size), rel_tol=1e-6)


def test_fit_clamps_ill_posed_lines():
    with pytest.raises(ValueError):
        fit(10, 1.0, 10, 2.0)
    got = fit(100, 50.0, 200, 40.0)            # time fell with size: bandwidth from the larger point
    assert got.bw_gbps > 0 and got.latency_us >= 0.5
    got = fit(100, 0.0, 1000, 1.0)              # negative intercept clamped to 0.5 us
    assert got.latency_us == 0.5


# ---------------------------------------------------------------------------------------------
# (d) ring schedules, simulated
# ---------------------------------------------------------------------------------------------

def fresh_cursors(w: int, slots: int) -> dict[tuple, RingCursor]:
    cur = {ring_id(COLL, r): RingCursor(slots) for r in range(w)}
    for r, d in itertools.permutations(range(w), 2):
        cur[ring_id(PAIR, r, d)] = RingCursor(slots)
    return cur


def random_ops(rng: random.Random, w: int, count: int):
    ops = []
    for _ in range(count):
        kind = rng.choice(["ag", "agl", "bc", "a2a", "p2p", "p2p", "rs", "gather"])
        n = rng.choice([0, 1, rng.randint(1, 12), rng.randint(1, 60)])
        if kind == "rs":
            mv = reduce_scatter_movement(w, chunk_bounds(n, w, rng.choice([1, 2])))
        elif kind == "gather":
            mv = gather_chunks_movement(w, chunk_bounds(n, w, 1), rng.choice([None, rng.randrange(w)]))
        elif kind in ("ag", "agl"):
            mv = all_gather_movement(w, n, kind == "agl")
        elif kind == "bc":
            mv = broadcast_movement(w, n, rng.randrange(w))
        elif kind == "a2a":
            mv = all_to_all_movement([[rng.choice([0, rng.randint(1, 30)]) for _ in range(w)] for _ in range(w)])
        else:
            s, d = rng.sample(range(w), 2)
            mv = p2p_movement(w, s, d, n)
        ops.append(mv)
    return ops


def participants(mv, w):
    if not mv.p2p:
        return list(range(w))
    return sorted({mv.transfers[0].src, mv.transfers[0].dsts[0][0]}) if mv.transfers else []


def simulate(w: int, slots: int, chunk: int, ops, rng: random.Random, exchange_barrier: bool):
    """Run every rank's schedule through the shm lane's counter protocol.

    Returns (stuck ranks, cursors, inputs, outputs, steps taken).

    Each rank works through its ops in order; inside an op it may take its produce head (once every
    `wait_for` done counter is reached) or its consume head (once the ring's full counter reached
    g + 1), as shm.py's worker thread does. Among all enabled actions one is picked at random. With
    `exchange_barrier` a collective can start only when every rank reached it (the descriptor
    exchange); without it ranks run ahead freely (strictly more interleavings).
    """
    cursors = [fresh_cursors(w, slots) for _ in range(w)]
    inputs, outputs, work = [], [], [[] for _ in range(w)]
    for k, mv in enumerate(ops):
        inp = {r: bytes(rng.randrange(256) for _ in range(max([t.src_off + t.nbytes for t in mv.transfers
                                                               if t.src == r] + [0])))
               for r in range(w)}
        inputs.append(inp)
        outs = {}
        for t in mv.transfers:
            for d, b, off in t.dsts:
                outs.setdefault((d, b), {})
        outputs.append(outs)
        for r in participants(mv, w):
            produce, consume = schedule(mv.transfers, r, w, chunk, cursors[r], mv.p2p)
            for st in produce:
                assert st.slot == st.g % slots and 0 < st.nbytes <= chunk
            for st in consume:
                assert st.slot == st.g % slots and 0 < st.nbytes <= chunk
            work[r].append((k, produce, consume))

    readers: dict[tuple, set] = {}       # (ring, g) -> ranks that read that chunk
    for r in range(w):
        for _, _, consume in work[r]:
            for st in consume:
                readers.setdefault((st.ring, st.g), set()).add(r)
    slot_mem: dict[tuple, list] = {}     # (ring, slot) -> (g, bytes)
    full: dict[tuple, int] = {}
    done: dict[tuple, int] = {}

    def done_key(ring, consumer):
        return (ring, consumer) if ring[0] == COLL else (ring, "pair")

    pos = [[0, 0, 0] for _ in range(w)]          # op index in work[r], next produce, next consume
    posted = [set() for _ in ops]

    def head(r):
        return work[r][pos[r][0]] if pos[r][0] < len(work[r]) else None

    steps = 0
    while True:
        actions = []
        for r in range(w):
            if head(r) is not None:
                posted[head(r)[0]].add(r)
        for r in range(w):
            h = head(r)
            if h is None:
                continue
            k, produce, consume = h
            if exchange_barrier and len(posted[k]) < len(participants(ops[k], w)):
                continue
            pi, ci = pos[r][1], pos[r][2]
            if pi < len(produce):
                st = produce[pi]
                if all(done.get(done_key(st.ring, c), 0) >= v for c, v in st.wait_for):
                    actions.append((r, "produce"))
            if ci < len(consume):
                st = consume[ci]
                if full.get(st.ring, 0) >= st.g + 1:
                    actions.append((r, "consume"))
            if pi == len(produce) and ci == len(consume):
                actions.append((r, "next"))
        if not actions:
            break
        steps += 1
        r, what = rng.choice(actions)
        k, produce, consume = head(r)
        if what == "produce":
            st = produce[pos[r][1]]
            assert st.ring[1] == r, "a rank produced into another rank's ring"
            # the slot must be free: every reader of the chunk it held has read it
            if (st.ring, st.slot) in slot_mem:
                old_g = slot_mem[(st.ring, st.slot)][0]
                unread = [c for c in readers.get((st.ring, old_g), ())
                          if done.get(done_key(st.ring, c), 0) < old_g + 1]
                assert not unread, (f"chunk {st.g} overwrites chunk {old_g} of ring {st.ring} "
                                    f"before ranks {unread} read it")
            data = inputs[k][r][st.src_off: st.src_off + st.nbytes]
            assert len(data) == st.nbytes
            slot_mem[(st.ring, st.slot)] = (st.g, data)
            assert full.get(st.ring, 0) == st.g, f"ring {st.ring} produced out of order"
            full[st.ring] = st.g + 1
            pos[r][1] += 1
        elif what == "consume":
            st = consume[pos[r][2]]
            g, data = slot_mem[(st.ring, st.slot)]
            assert g == st.g, f"rank {r} read chunk {g} from ring {st.ring} slot {st.slot}, wanted {st.g}"
            for b, off in st.dsts:
                outputs[k][(r, b)][off] = outputs[k][(r, b)].get(off, [])
                outputs[k][(r, b)][off].append(data)
            key = done_key(st.ring, r)
            assert done.get(key, 0) < st.g + 1
            done[key] = st.g + 1
            pos[r][2] += 1
        else:
            pos[r] = [pos[r][0] + 1, 0, 0]
    stuck = {r: pos[r] for r in range(w) if head(r) is not None}
    return stuck, cursors, inputs, outputs, steps


@pytest.mark.parametrize("seed", range(400))
def test_ring_schedules_deliver_every_chunk_once_without_deadlock(seed):
    rng = random.Random(seed)
    w = rng.randint(2, 4)
    slots = rng.randint(2, 3)
    chunk = rng.randint(1, 8)
    ops = random_ops(rng, w, rng.randint(1, 10))
    barrier = seed % 2 == 0
    stuck, cursors, inputs, outputs, steps = simulate(w, slots, chunk, ops, rng, barrier)
    assert not stuck, f"deadlock: ranks {stuck} cannot progress (world {w}, {slots} slots, chunk {chunk})"

    for k, mv in enumerate(ops):
        expect: dict[tuple, bytearray] = {}
        for t in mv.transfers:
            src_bytes = inputs[k][t.src][t.src_off: t.src_off + t.nbytes]
            for d, b, off in t.dsts:
                buf = expect.setdefault((d, b), {})
                for i in range(t.nbytes):
                    assert off + i not in buf, "movement writes one byte twice"
                    buf[off + i] = src_bytes[i]
        for key, want in expect.items():
            got: dict[int, int] = {}
            for off, datas in outputs[k][key].items():
                for data in datas:
                    for i, byte in enumerate(data):
                        assert off + i not in got, f"op {k} {key}: byte {off + i} delivered twice"
                        got[off + i] = byte
            assert got == want, f"op {k} ({mv.op}) {key}: wrong or missing bytes"

    # every rank that took part in a ring's ops ends with the same cursor for that ring
    for rid in cursors[0]:
        users = list(range(w)) if rid[0] == COLL else [rid[1], rid[2]]
        states = {(cursors[r][rid].next_g, tuple(cursors[r][rid].recent)) for r in users}
        assert len(states) == 1, (rid, states)


def test_ring_schedule_waits_for_the_right_readers():
    """Hand-checked: 2 slots, a broadcast of 5 chunks from rank 0 to ranks 1 and 2."""
    cur = [fresh_cursors(3, 2) for _ in range(3)]
    mv = broadcast_movement(3, 10, 0)
    prod, cons = schedule(mv.transfers, 0, 3, 2, cur[0], False)
    assert [s.g for s in prod] == [0, 1, 2, 3, 4]
    assert [s.slot for s in prod] == [0, 1, 0, 1, 0]
    assert [s.wait_for for s in prod] == [(), (), ((1, 1), (2, 1)), ((1, 2), (2, 2)), ((1, 3), (2, 3))]
    assert cons == []
    p1, c1 = schedule(mv.transfers, 1, 3, 2, cur[1], False)
    assert p1 == [] and [(s.g, s.dsts) for s in c1] == [(g, ((0, 2 * g),)) for g in range(5)]
    # the next op continues the numbering, and its first chunk waits for the previous op's readers
    prod2, _ = schedule(p2p_movement(3, 0, 1, 2).transfers, 0, 3, 2, cur[0], True)
    assert prod2[0].ring == (PAIR, 0, 1) and prod2[0].g == 0
    prod3, _ = schedule(broadcast_movement(3, 2, 0).transfers, 0, 3, 2, cur[0], False)
    assert prod3[0].g == 5 and prod3[0].wait_for == ((1, 4), (2, 4))


# --- the copy engines' piece rule (planner/pieces.py) ------------------------------------------

@pytest.mark.parametrize("longest, want_bytes, count", [
    (64 << 20, 16 << 20, 4),
    (1 << 30, 256 << 20, 4),
    (493 << 20, (493 << 20) // 4, 4),
    (8 << 30, 256 << 20, 32),         # the piece cap wins over the count
    (3 << 20, 16 << 20, 1),           # the piece floor
    (32 << 20, 16 << 20, 2),
])
def test_piece_rule_table(longest, want_bytes, count):
    from braid.planner.pieces import piece_elems, pieces
    per = piece_elems(longest, 2)
    got = per * 2
    assert got % 4096 == 0
    assert abs(got - want_bytes) < 4096
    cut = pieces(longest // 2, per)
    assert len(cut) == count
    assert cut[0][0] == 0 and cut[-1][1] == longest // 2
    assert all(a == b for (_, a), (b, _) in zip(cut, cut[1:]))


def test_piece_rule_override_and_limits():
    from braid.planner.pieces import MAX_PIECES, piece_elems
    assert piece_elems(1 << 28, 2, piece_mb=8) * 2 == 8 << 20
    # an override that would need too many pieces doubles until the counter space holds them
    per = piece_elems(1 << 30, 2, piece_mb=1)
    assert -(-(1 << 30) // (per * 2)) <= MAX_PIECES
    assert piece_elems(0, 4) >= 1


@pytest.mark.parametrize("longest_mb", [64, 200, 471, 1024, 4096, 8192])
def test_piece_rule_tapered_tail(longest_mb):
    """Large pieces end in a taper (1/2, 1/4, 1/8, 1/8 of a piece): the cut still covers the chunk
    exactly, in order, within the counter space, and only the end changes."""
    from braid.planner.pieces import MAX_PIECES, PAGE, TAPER_FROM_BYTES, piece_elems, pieces, tail_elems
    esz = 2
    n = (longest_mb << 20) // esz - 123              # an odd length
    per = piece_elems(n * esz, esz)
    tail = tail_elems(per, esz)
    flat, cut = pieces(n, per), pieces(n, per, tail)
    assert cut[0][0] == 0 and cut[-1][1] == n
    assert all(b == c for (_, b), (c, _) in zip(cut, cut[1:])) and all(b > a for a, b in cut)
    assert len(cut) <= MAX_PIECES
    if per * esz < TAPER_FROM_BYTES:
        assert tail == 0 and cut == flat
        return
    assert tail * esz % PAGE == 0 and tail <= per // 8
    sizes = [b - a for a, b in cut]
    assert sizes[-1] == sizes[-2] == tail
    assert sizes[-4:] == [4 * tail, 2 * tail, tail, tail]
    assert len(flat) + 2 <= len(cut) <= len(flat) + 4
    # before the taper: whole pieces, then at most one shorter one
    head = sizes[:-4]
    assert all(x == per for x in head[:-1]) and 0 < head[-1] <= per


def test_piece_rule_no_taper_for_small_or_single_pieces():
    from braid.planner.pieces import pieces
    assert pieces(100, 100, 10) == [(0, 100)]           # one piece: nothing to overlap
    assert pieces(1000, 100, 0) == pieces(1000, 100)
    assert pieces(1000, 100, 60) == pieces(1000, 100)   # a tail over half a piece is no taper
    assert [b - a for a, b in pieces(1000, 100, 10)][-4:] == [40, 20, 10, 10]


def test_sim_taper_shortens_a_large_ce_reduce_scatter_only():
    """The simulator runs the same cut: at 1 GiB on 2 x H200 the tapered end saves most of the
    last piece's reduction; at 256 MiB (pieces of 32 MiB) nothing changes."""
    from braid import envs
    from braid.sim.collectives import simulate_op
    from braid.sim.topology import load
    topo = load("h200x2")
    t = {}
    for size in (256 << 20, 1 << 30):
        for on in (0, 1):
            with envs.override(BRAID_CE_TAPER=on):
                t[size, on] = simulate_op(topo, "reduce_scatter", 2, size, {"ce": 1.0}).time_us
    assert t[256 << 20, 1] == pytest.approx(t[256 << 20, 0])
    assert 0.85 * t[1 << 30, 0] < t[1 << 30, 1] < 0.97 * t[1 << 30, 0]


# --- the calibration's line through host-bound points (model.fit_points) -----------------------

def test_fit_points_skips_a_host_bound_small_size():
    from braid.planner.model import fit_points
    M = 1 << 20
    # 2 x H200 copy engines, all_reduce: floor 350 us; 64 MiB host-bound at 480; 256 MiB 811; 512 MiB 1560
    c = fit_points(350.0, [(64 * M, 480.0), (256 * M, 811.0), (512 * M, 1560.0)])
    assert c.floor_us == 350.0
    assert c.latency_us < 100.0
    assert abs(c.time_us(256 * M) - 811.0) < 1.0 and abs(c.time_us(512 * M) - 1560.0) < 1.0
    # the old two-point line through the host-bound size
    from braid.planner.model import fit
    old = fit(64 * M, 480.0, 512 * M, 1560.0)
    assert old.latency_us > 200.0 and old.time_us(256 * M) > 900.0
    # a small size well above the floor is used as before
    # a lane whose small size is mostly bytes (NCCL: 55 us latency, 322 GB/s) keeps the two-point line
    c2 = fit_points(80.0, [(64 * M, 55 + 64 * M / 322e3), (512 * M, 55 + 512 * M / 322e3)])
    assert abs(c2.latency_us - 55.0) < 1e-6 and abs(c2.bw_gbps - 322.0) < 1e-6 and c2.floor_us == 80.0


def test_fit_points_every_smaller_size_host_bound():
    from braid.planner.model import fit_points
    M = 1 << 20
    # both smaller sizes dominated by fixed costs: the largest of them is used
    c = fit_points(500.0, [(64 * M, 520.0), (256 * M, 600.0), (512 * M, 1000.0)])
    assert abs(c.time_us(256 * M) - 600.0) < 1e-6 and abs(c.time_us(512 * M) - 1000.0) < 1e-6
    assert c.time_us(1 * M) == 500.0                  # the floor bounds small calls
    import pytest as _pytest
    with _pytest.raises(ValueError):
        fit_points(1.0, [(M, 2.0)])
    with _pytest.raises(ValueError):
        fit_points(1.0, [(M, 2.0), (M, 3.0)])


def test_gpu_check_is_per_host():
    """Two nodes of ranks on cuda:LOCAL_RANK share GPU indices across hosts, never within one."""
    import pytest
    from braid.comm.communicator import _check_gpus_per_host
    from braid.errors import MisuseError
    two_nodes = [("a", "b1", 10, 0), ("a", "b1", 11, 1), ("b", "b2", 20, 0), ("b", "b2", 21, 1)]
    _check_gpus_per_host(two_nodes)                       # no error: 0 and 1 on each host
    rebooted = [("a", "b1", 10, 0), ("a", "b9", 11, 0)]   # same name, another boot: another host
    _check_gpus_per_host(rebooted)
    with pytest.raises(MisuseError, match=r"ranks 0 and 1 both use GPU 0 of host a"):
        _check_gpus_per_host([("a", "b1", 10, 0), ("a", "b1", 11, 0), ("b", "b2", 20, 0)])
    with pytest.raises(MisuseError, match=r"ranks 1 and 3 both use GPU 1 of host b"):
        _check_gpus_per_host([("a", "b1", 1, 0), ("b", "b2", 2, 1), ("b", "b2", 3, 0), ("b", "b2", 4, 1)])


def test_the_piece_floor_setting_reaches_the_reduction():
    """BRAID_CE_MIN_PIECE_MB sets the smallest piece of the copy engines' reduction: by default
    (16 MiB) a 16 MiB chunk goes whole and a 24 MiB one in 16 + 8 MiB; with a 4 MiB floor the
    24 MiB chunk goes in 4 pieces of 6 MiB; a 256 MiB chunk in quarters of 64 MiB whatever floor
    below that."""
    from braid.collectives.ce_reduce import piece_elems
    from braid.envs import override
    from braid.planner.pieces import pieces
    mib = 1 << 20
    esz = 2
    chunks = [(0, 24 * mib // esz), (24 * mib // esz, 24 * mib // esz)]
    assert len(pieces(16 * mib // esz, piece_elems([(0, 16 * mib // esz)], esz))) == 1
    per = piece_elems(chunks, esz)
    assert per * esz == 16 * mib and len(pieces(chunks[0][1], per)) == 2
    with override(BRAID_CE_MIN_PIECE_MB=4):
        per = piece_elems(chunks, esz)
        assert per * esz == 6 * mib and len(pieces(chunks[0][1], per)) == 4
    with override(BRAID_CE_MIN_PIECE_MB=32):
        big = [(0, 256 * mib // esz)]
        assert piece_elems(big, esz) * esz == 64 * mib      # a quarter of the chunk is above the floor
