"""Skewed all_to_all_single through the router (issue 4): plans and multi-process runs on CPU lanes.

The plan tests are pure: every byte of every demand on exactly one lane, in order, pages kept.
The world tests run real uneven all_to_all calls on 3 and 4 CPU ranks with BRAID_ROUTE=on (the
router's per-pair lane mix over shm + gloo), bitwise against outputs each rank builds itself.
"""
from __future__ import annotations

import random

import math

import pytest
import torch

from braid.collectives.routed import PATH_LANE, RoutedAllToAll, build_plan, native_time_us
from braid.planner.model import LaneCost
from braid.planner.plan import all_to_all_movement
from braid.planner.router import nvswitch, route
from conftest import run_world
from test_cpu_collectives import make

GPU_COSTS = {"ce": LaneCost(20.0, 380.0), "host": LaneCost(40.0, 45.0)}


def skewed(w: int, hot: int, total: int, h: float, rng: random.Random) -> list[list[int]]:
    """Every rank sends a fraction h of `total` bytes to rank `hot`, the rest spread over the others."""
    m = []
    for s in range(w):
        row = [0] * w
        row[hot] = int(total * h)
        others = [d for d in range(w) if d != hot]
        for d in others:
            row[d] = int(total * (1 - h) / len(others)) + rng.randrange(0, 4096)
        m.append(row)
    return m


def _covered(plan, matrix):
    """Every destination byte written exactly once, from the right source offset: per demand the
    pieces tile [0, n) without gap or overlap, each at the same shift as the whole transfer."""
    mv = all_to_all_movement(matrix)
    whole = {(t.src, t.dsts[0][0]): t for t in mv.transfers}
    pieces = {}
    for lane, ts in plan.lanes.items():
        assert lane in ("ce", "host"), lane
        for t in ts:
            (d, buf, off), = t.dsts
            assert buf == 0 and t.nbytes > 0
            pieces.setdefault((t.src, d), []).append((off, t.nbytes, t.src_off))
    assert set(pieces) == set(whole)
    for key, ps in pieces.items():
        t = whole[key]
        at = t.dsts[0][2]
        for off, n, src_off in sorted(ps):
            assert off == at, (key, "gap or overlap", off, at)
            assert src_off - off == t.src_off - t.dsts[0][2], (key, "piece from the wrong source offset")
            at += n
        assert at == t.dsts[0][2] + t.nbytes, (key, "demand not fully covered")


@pytest.mark.parametrize("w,h", [(2, 0.9), (4, 0.7), (4, 1.0), (8, 0.4)])
def test_routed_plan_covers_every_byte_once(w, h):
    rng = random.Random(w * 10 + int(h * 10))
    matrix = skewed(w, w - 1, 64 << 20, h, rng)
    router = RoutedAllToAll(w).router("cuda", GPU_COSTS)
    rp, _ = router.plan(matrix)
    plan = build_plan(matrix, rp.flows, PATH_LANE["cuda"])
    _covered(plan, matrix)
    for ts in plan.lanes.values():
        for t in ts:
            assert t.src_off % 1 == 0 and t.nbytes > 0
    assert abs(sum(plan.shares.values()) - 1) < 1e-9


def test_hot_pair_offloads_and_quiet_pairs_stay_on_one_lane():
    """With one hot receiver, the demands into it take a second lane (its NVLink port is the
    bottleneck); demands between quiet ranks keep one lane."""
    w, hot = 4, 3
    matrix = [[0] * w for _ in range(w)]
    for s in range(w):
        for d in range(w):
            if s != d:
                matrix[s][d] = (512 << 20) if d == hot else (4 << 20)
    rt = RoutedAllToAll(w)
    plan, routed_us, native_us = rt.plan(matrix, "cuda", GPU_COSTS, LaneCost(15.0, 300.0), force=False)
    assert plan is not None and routed_us < native_us
    by_pair = {}
    for lane, ts in plan.lanes.items():
        for t in ts:
            by_pair.setdefault((t.src, t.dsts[0][0]), set()).add(lane)
    for s in range(w - 1):
        assert by_pair[(s, hot)] == {"ce", "host"}, (s, by_pair[(s, hot)])
    for s in range(w - 1):
        for d in range(w - 1):
            if s != d:
                assert by_pair[(s, d)] == {"ce"}, (s, d, by_pair[(s, d)])


def test_routed_prediction_declines_balanced_traffic_and_native_time_model():
    w = 4
    bal = [[0 if s == d else 64 << 20 for d in range(w)] for s in range(w)]
    cost = LaneCost(10.0, 300.0)
    # balanced: the busiest port carries 3 x 64 MiB; the model scales it back to a per-rank size
    assert native_time_us(bal, cost) == pytest.approx(cost.time_us(3 * (64 << 20) * 4 / 3))
    skew = [row[:] for row in bal]
    skew[0][1] = 1 << 30
    assert native_time_us(skew, cost) > native_time_us(bal, cost)
    # a native call far faster than any lane: routing declines unless forced
    fast = LaneCost(1.0, 10_000.0)
    plan, _, _ = RoutedAllToAll(w).plan(skew, "cuda", GPU_COSTS, fast, force=False)
    assert plan is None
    plan, _, _ = RoutedAllToAll(w).plan(skew, "cuda", GPU_COSTS, fast, force=True)
    assert plan is not None


def test_router_bound_matches_plan_loads():
    w = 4
    topo = nvswitch(w, nvlink_gbps=300.0, pcie_gbps=40.0, relays=False)
    matrix = skewed(w, 0, 256 << 20, 0.9, random.Random(3))
    rp = route(topo, matrix)
    for (s, d), parts in rp.flows.items():
        assert sum(b for _, b in parts) == matrix[s][d]
        assert all(p.kind in ("direct", "host") for p, _ in parts)


# ---------------------------------------------------------------------------------------------
# multi-process runs (CPU lanes)
# ---------------------------------------------------------------------------------------------

def _worker(rank, w, cases):
    import braid
    comm = braid.init()
    out = []
    for ci, (matrix, dtype_name) in enumerate(cases):
        dtype = getattr(torch, dtype_name)
        esz = torch.empty((), dtype=dtype).element_size()
        ins = [matrix[rank][d] // esz for d in range(w)]
        outs = [matrix[s][rank] // esz for s in range(w)]
        x = make(("routed", ci, rank), sum(ins), dtype)
        exp = torch.cat([make(("routed", ci, s), sum(matrix[s][d] // esz for d in range(w)), dtype)
                         [sum(matrix[s][d] // esz for d in range(rank)):][: outs[s]] for s in range(w)])
        y = (~exp.view(torch.uint8)).view(dtype).clone() if exp.numel() else exp.clone()
        for rep in range(2):            # twice: the second call reuses the router's cached plan
            y.view(torch.uint8).copy_(~exp.view(torch.uint8)) if exp.numel() else None
            comm.all_to_all_single(y, x, outs, ins)
            assert torch.equal(y.view(torch.uint8), exp.view(torch.uint8)), (ci, rep, dtype_name)
        h = comm.last_handle
        out.append(sorted(h.plan.lanes) if h.plan is not None else ["native"])
    braid.close()
    return out


@pytest.mark.parametrize("w", [3, 4])
def test_routed_all_to_all_bitwise_on_cpu_lanes(w):
    rng = random.Random(w)
    cases = []
    for k in range(3):
        hot = rng.randrange(w)
        h = rng.choice([0.7, 0.9, 1.0])
        dtype = rng.choice(["float32", "bfloat16", "int8", "int64"])
        m = skewed(w, hot, (5 << 19) + rng.randrange(1, 999), h, rng)
        esz = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        m = [[(v // esz) * esz for v in row] for row in m]
        cases.append((m, dtype))
    cases.append(([[0] * w for _ in range(w)], "float32"))          # nothing to move
    res = run_world(_worker, w, cases, env={"BRAID_ROUTE": "on", "BRAID_HOST_BUFFER_MB": "2",
                                            "BRAID_HOST_CHUNK_KB": "64"})
    for per_rank in res:
        # the skewed cases ran on both CPU lanes (shm and gloo carried bytes)
        assert any(lanes == ["gloo", "shm"] for lanes in per_rank[:-1]), per_rank


# ---------------------------------------------------------------------------------------------
# router -> plan -> relay lane, end to end (a directly wired topology, where relays pay)
# ---------------------------------------------------------------------------------------------

def _mesh_plan(w, seed):
    from braid.planner.router import mesh
    rng = random.Random(seed)
    topo = mesh(w, pair_gbps=100.0, pcie_gbps=10.0)
    matrix = [[0] * w for _ in range(w)]
    for s in range(w):
        for d in range(w):
            if s != d:
                matrix[s][d] = rng.randrange(1, 64) * 4096 + rng.randrange(0, 7)
    matrix[0][1] = (6 << 20) + 5            # one hot pair: the router spreads it over relays
    rp = route(topo, matrix)
    return matrix, build_plan(matrix, rp.flows, PATH_LANE["cpu"], relay=True)


def test_mesh_plan_relays_the_hot_pair_and_covers_every_byte():
    matrix, plan = _mesh_plan(4, 1)
    assert plan.lanes.get("relay"), plan.shares
    vias = {t.via for t in plan.lanes["relay"] if t.src == 0 and t.dsts[0][0] == 1}
    assert vias and vias <= {2, 3}, vias
    assert all(t.via == -1 for k, ts in plan.lanes.items() if k != "relay" for t in ts)
    pieces = {}
    for ts in plan.lanes.values():
        for t in ts:
            pieces.setdefault((t.src, t.dsts[0][0]), []).append((t.dsts[0][2], t.nbytes))
    mv = all_to_all_movement(matrix)
    for t in mv.transfers:
        got = sorted(pieces[(t.src, t.dsts[0][0])])
        at = t.dsts[0][2]
        for off, n in got:
            assert off == at
            at += n
        assert at == t.dsts[0][2] + t.nbytes


def _relay_worker(rank, w, seed):
    import braid
    comm = braid.init()
    matrix, plan = _mesh_plan(w, seed)
    x = make(("mesh", seed, rank), sum(matrix[rank]), torch.uint8)
    exp = torch.cat([make(("mesh", seed, s), sum(matrix[s]), torch.uint8)
                     [sum(matrix[s][:rank]):][: matrix[s][rank]] for s in range(w)])
    y = ~exp
    for _ in range(2):
        y.copy_(~exp)
        comm.run_plan(plan, x, [y])
        assert torch.equal(y, exp), "routed plan with relays differs from the reference"
    braid.close()
    return sorted(plan.lanes)


def test_routed_plan_with_relays_runs_bitwise_on_cpu():
    res = run_world(_relay_worker, 4, 1, env={"BRAID_RELAY_BUFFER_MB": "1", "BRAID_HOST_BUFFER_MB": "2",
                                             "BRAID_HOST_CHUNK_KB": "64"})
    assert "relay" in res[0]


def test_routing_declines_when_the_host_cannot_post_it_in_time():
    """A skewed call whose GPU time is below the routed path's host time goes native: the
    default host estimate first, then the measured one (MoE at 64 MiB on 4 GPUs ran 0.58 x NCCL
    routed, bound by ~1.2 ms of host time per call)."""
    w, hot = 4, 3
    def skewed(mib):
        return [[0 if s == d else (mib << 20 if d == hot else (mib << 20) // 16) for d in range(w)]
                for s in range(w)]
    native = LaneCost(15.0, 300.0)
    rt = RoutedAllToAll(w)
    assert rt.host_time_us() == pytest.approx(RoutedAllToAll.HOST_US_PER_PAIR * w * w)
    small, big = skewed(16), skewed(512)
    assert rt.plan(small, "cuda", GPU_COSTS, native, force=False)[0] is None
    plan, routed_us, native_us = rt.plan(big, "cuda", GPU_COSTS, native, force=False)
    assert plan is not None and routed_us >= rt.host_time_us()
    # this rank's measurement alone changes nothing (ranks must decide alike); the agreed value
    # is the slowest rank's host time from the exchanged descriptors
    names = {"direct": "ce", "host": "host"}
    rt.observe_host(20.0)
    assert rt.report(None) == {"rhost": 20.0, "robs": None}
    assert rt.host_time_us() == pytest.approx(RoutedAllToAll.HOST_US_PER_PAIR * w * w)
    assert rt.agree([{"rhost": 20.0}, {"rhost": 35.0}, {"rhost": None}, {}], names) == []
    assert rt.host_time_us() == pytest.approx(35.0)
    assert rt.plan(small, "cuda", GPU_COSTS, native, force=False)[0] is not None
    rt.observe_host(10_000.0)                    # one slow call (a cold plan) is not the estimate
    assert rt.host_us == 20.0
    for _ in range(RoutedAllToAll.HOST_WINDOW):  # calls that stay slow become it
        rt.observe_host(900.0)
    assert rt.host_us == 900.0
    # forced routing ignores the prediction
    slow = RoutedAllToAll(w)
    slow.agree([{"rhost": 1e9}], {"direct": "ce", "host": "host"})
    assert slow.plan(small, "cuda", GPU_COSTS, native, force=True)[0] is not None


def test_routing_skips_the_solve_when_the_host_time_alone_loses():
    w = 4
    matrix = [[0 if s == d else (8 << 20 if d == 0 else 1 << 20) for d in range(w)] for s in range(w)]
    rt = RoutedAllToAll(w)
    calls = []
    router = rt.router("cuda", GPU_COSTS)
    real = router.plan
    router.plan = lambda m: calls.append(m) or real(m)
    plan, routed_us, native_us = rt.plan(matrix, "cuda", GPU_COSTS, LaneCost(15.0, 300.0), force=False)
    assert plan is None and calls == [] and routed_us >= 0.97 * native_us
    rt.plan(matrix, "cuda", GPU_COSTS, LaneCost(15.0, 300.0), force=True)
    assert len(calls) == 1


def test_lane_observations_are_learned_only_when_every_rank_reports_the_same_call():
    names = {"direct": "ce", "host": "host"}
    rt = RoutedAllToAll(3)
    # one rank has not finished the observed call: nothing learned
    assert rt.agree([{"robs": [[1, {"ce": 900.0, "host": 300.0}]]}, {"robs": None},
                     {"robs": [[1, {"ce": 900.0, "host": 300.0}]]}], names) == []
    assert rt.pcie_scale == 1.0
    # different calls: nothing learned
    assert rt.agree([{"robs": [[1, {"ce": 900.0, "host": 300.0}]]}, {"robs": [[2, {"ce": 1.0, "host": 1.0}]]},
                     {"robs": [[1, {"ce": 900.0, "host": 300.0}]]}], names) == []
    # the same call everywhere: the slowest rank's time per lane; host finished at 2x ce: less host.
    # A rank that has finished a later call too reports both; only the call all reported is learned
    assert rt.agree([{"robs": [[1, {"ce": 300.0, "host": 900.0}], [2, {"ce": 1.0, "host": 1.0}]]},
                     {"robs": [[1, {"ce": 450.0, "host": 800.0}]]},
                     {"robs": [[1, {"ce": 200.0, "host": 700.0}]]}], names) == [1]
    assert rt.pcie_scale == pytest.approx(2 ** (round(math.log2((450 / 900) ** 0.5) * 8) / 8))


def test_learn_lanes_moves_toward_equal_finish_with_hysteresis_and_bounds():
    names = {"direct": "ce", "host": "host"}
    rt = RoutedAllToAll(4)
    rt.learn_lanes({"ce": 1000.0, "host": 950.0}, names)        # within 15%: no change
    assert rt.pcie_scale == 1.0
    rt.learn_lanes({"ce": 1000.0, "host": 250.0}, names)        # host idle 3/4 of the time: but the
    assert rt.pcie_scale == 1.0                                 # calibrated capacity is the ceiling
    rt.learn_lanes({"ce": 500.0, "host": 5000.0}, names)        # host 10x late: down, at most 2x
    assert rt.pcie_scale == pytest.approx(0.5)
    rt.learn_lanes({"ce": 1000.0, "host": 250.0}, names)        # host early again: back up
    up = rt.pcie_scale
    assert 0.9 < up <= 1.0
    for _ in range(20):
        rt.learn_lanes({"ce": 100.0, "host": 1e6}, names)
    assert rt.pcie_scale == pytest.approx(RoutedAllToAll.SCALE_RANGE[0])
    low = rt.pcie_scale
    rt.learn_lanes({"ce": 100.0}, names)                         # host carried nothing: probe up
    assert rt.pcie_scale > low
    for _ in range(40):
        rt.learn_lanes({"ce": 1e6, "host": 1.0}, names)
    assert rt.pcie_scale == pytest.approx(RoutedAllToAll.SCALE_RANGE[1])
    rt.learn_lanes({"ce": 100.0, "host": 400.0}, names)          # slower again: below the ceiling
    assert rt.pcie_scale == pytest.approx(0.5)
    # the scale reaches the router's topology
    a = RoutedAllToAll(4).router("cuda", GPU_COSTS)
    b = rt.router("cuda", GPU_COSTS)
    assert b.topo.capacity["h2d0"] == pytest.approx(a.topo.capacity["h2d0"] * rt.pcie_scale)
    assert b.topo.capacity["d2h3"] == pytest.approx(a.topo.capacity["d2h3"] * rt.pcie_scale)
    nv = [k for k in a.topo.capacity if not k.startswith(("d2h", "h2d", "host"))]
    assert nv and all(b.topo.capacity[k] == a.topo.capacity[k] for k in nv)


def _adapt_worker(rank, w, matrix, calls):
    """The same skewed matrix, routed every call, with the second lane (gloo) made 6x slower:
    the agreed capacity scale falls (less goes through gloo), identically on every rank, and
    every call stays bitwise right."""
    import braid
    comm = braid.init()
    comm.slowdown["gloo"] = 6.0
    esz = 4
    ins = [matrix[rank][d] // esz for d in range(w)]
    outs = [matrix[s][rank] // esz for s in range(w)]
    x = make(("adapt", rank), sum(ins), torch.float32)
    exp = torch.cat([make(("adapt", s), sum(matrix[s][d] // esz for d in range(w)), torch.float32)
                     [sum(matrix[s][d] // esz for d in range(rank)):][: outs[s]] for s in range(w)])
    gloo_bytes = []
    for _ in range(calls):
        y = torch.zeros_like(exp)
        comm.all_to_all_single(y, x, outs, ins)
        assert torch.equal(y, exp)
        h = comm.last_handle
        gloo_bytes.append(h.plan.lane_bytes().get("gloo", 0) if h.plan is not None else 0)
    scale = comm._routed.pcie_scale
    braid.close()
    return scale, gloo_bytes


def test_routed_plans_adapt_to_a_slow_second_lane_on_every_rank_alike():
    w, hot = 3, 0
    rng = random.Random(5)
    m = skewed(w, hot, 3 << 20, 0.9, rng)
    m = [[(v // 4) * 4 for v in row] for row in m]
    res = run_world(_adapt_worker, w, m, 14, env={"BRAID_ROUTE": "on", "BRAID_HOST_BUFFER_MB": "2",
                                                  "BRAID_HOST_CHUNK_KB": "64"})
    scales = {s for s, _ in res}
    assert len(scales) == 1, res                     # agreed: the same on every rank
    scale = scales.pop()
    assert scale < 1.0, res
    for _, gb in res:
        assert gb[0] > 0 and gb[-1] < gb[0], gb      # the slow lane carries less than at first


def test_a_decline_for_host_time_is_rechecked_in_trials_ever_more_rarely():
    """An agreed host time that is too high would stop routing for good (no routed call, no new
    measurement): such declines are re-checked by a trial of TRIAL routed calls in a row, after
    RECHECK_FAR calls (routing far from winning), then twice as many each time. The first call of
    a plan (it solved the plan, opened peers' buffers) is not a sample of the steady host time."""
    w = 4
    matrix = [[0 if s == d else ((512 << 20) if d == 0 else (1 << 20)) for d in range(w)] for s in range(w)]
    native = LaneCost(15.0, 300.0)
    rt = RoutedAllToAll(w)
    plan, gpu_us, native_us = rt.plan(matrix, "cuda", GPU_COSTS, native, force=False)
    assert plan is not None
    rt.agree([{"rhost": 50.0 * native_us}], {"direct": "ce", "host": "host"})   # the cold first call's
    T, F = RoutedAllToAll.TRIAL, RoutedAllToAll.RECHECK_FAR
    got = [rt.plan(matrix, "cuda", GPU_COSTS, native, force=False)[0] is not None for _ in range(4 * F + 3 * T)]
    routed = [i for i, g in enumerate(got) if g]
    starts = [i for i in routed if i - 1 not in routed]
    assert starts == [F - 1, 3 * F + T - 2] and len(routed) == 2 * T, routed
    # steady: a routed call after a routed call of the same class; the first of a trial is not
    steady = []
    for _ in range(T):
        rt.plan(matrix, "cuda", GPU_COSTS, native, force=True)
        steady.append(rt.steady)
    assert steady == [False] + [True] * (T - 1)
    # cold samples are dropped; steady ones make the estimate
    rt.observe_host(9000.0, cold=True)
    assert rt.host_us is None
    rt.observe_host(300.0)
    assert rt.host_us == 300.0


def test_a_repeated_matrix_reuses_the_built_plan_until_anything_changes():
    w = 4
    m = [[0 if s == d else ((256 << 20) if d == 3 else (8 << 20)) for d in range(w)] for s in range(w)]
    native = LaneCost(15.0, 300.0)
    rt = RoutedAllToAll(w)
    rt.agreed_host_us = 0.0
    a = rt.plan(m, "cuda", GPU_COSTS, native, force=True)[0]
    assert rt.last_cold
    b = rt.plan([row[:] for row in m], "cuda", GPU_COSTS, native, force=True)[0]
    assert b is a and not rt.last_cold
    m2 = [row[:] for row in m]
    m2[0][3] += 4096
    c = rt.plan(m2, "cuda", GPU_COSTS, native, force=True)[0]
    assert c is not a
    _covered(c, m2)
    rt.pcie_scale = 0.5                         # a learned lane capacity: another router, a new plan
    d = rt.plan(m2, "cuda", GPU_COSTS, native, force=True)[0]
    assert d is not c
    _covered(d, m2)
    # an MoE layer's dispatch and combine (a matrix and its transpose, in turn) keep both plans
    mt = [list(col) for col in zip(*m2)]
    e = rt.plan(mt, "cuda", GPU_COSTS, native, force=True)[0]
    assert rt.plan(m2, "cuda", GPU_COSTS, native, force=True)[0] is d and not rt.last_cold
    assert rt.plan(mt, "cuda", GPU_COSTS, native, force=True)[0] is e and not rt.last_cold
    _covered(e, mt)


# ---------------------------------------------------------------------------------------------
# learned corrections of the routing decision
# ---------------------------------------------------------------------------------------------

def _close_call(w=4):
    """A skewed matrix and a native cost whose raw prediction beats routing by 15%."""
    m = [[0 if s == d else ((256 << 20) if d == 3 else (16 << 20)) for d in range(w)] for s in range(w)]
    probe = RoutedAllToAll(w)
    probe.agreed_host_us = 0.0
    probe.plan(m, "cuda", GPU_COSTS, LaneCost(0.0, 300.0), force=True)
    kind, cls, gpu_raw = probe.last_pred
    assert kind == "r"
    busiest = max(sum(m[s][d] for s in range(w) if s != d) for d in range(w))
    bw = busiest * w / (w - 1) / (gpu_raw / 1.15) / 1e3        # GB/s so that native = gpu_raw / 1.15
    return m, LaneCost(0.0, bw), cls, gpu_raw


def _observe(rt, seq, pred, times_per_rank):
    rt.in_flight[seq] = pred
    return rt.agree([{"robs": [[seq, t]]} for t in times_per_rank], {"direct": "ce", "host": "host"}) == [seq]


def _calls(rt, m, native, n):
    return ["r" if rt.plan(m, "cuda", GPU_COSTS, native, force=False)[0] is not None else "n" for _ in range(n)]


def test_a_close_decline_is_tried_in_a_block_then_follows_what_was_measured():
    """The raw model says native wins by 15%. Once the native side has its samples, routing is
    tried in a block of TRIAL calls in a row; when the agreed observations show routing faster
    and native slower than predicted (as h = 0.7 at 256 MiB on 4 x H200), every later call
    routes. Learning is agreed state only."""
    m, native, cls, gpu_raw = _close_call()
    rt = RoutedAllToAll(4)
    rt.agreed_host_us = 0.0
    T = RoutedAllToAll.TRIAL
    assert _calls(rt, m, native, 5) == ["n"] * 5          # no native samples yet: no trial
    assert rt.last_pred[0] == "n" and rt.steady
    native_raw = rt.last_pred[2]
    assert native_raw == pytest.approx(gpu_raw / 1.15, rel=1e-6)
    # declined native calls took 1.05x and 2.5x their prediction (the late one counted a peer's lag)
    assert _observe(rt, 1, ("n", cls, native_raw), [{"cycle": 1.05 * native_raw}, {"cycle": 0.9 * native_raw}])
    assert "n" not in rt.fix(cls)
    assert _observe(rt, 2, ("n", cls, native_raw), [{"cycle": 2.5 * native_raw}])
    assert rt.fix(cls)["n"] == pytest.approx(1.05)
    # native measured, routing within EXPLORE of it and never measured: a block of T routed calls
    got, steady = [], []
    for seq in range(3, 3 + T + 3):        # the caller times the steady calls (comm._observe)
        got += _calls(rt, m, native, 1)
        steady.append(rt.steady)
        if rt.steady:
            rt.expect(seq)
    assert got == ["r"] * T + ["n"] * 3 and steady == [False] + [True] * (T - 1) + [False, True, True]
    assert [p[0] for p in rt.in_flight.values()] == ["r"] * (T - 1) + ["n"] * 2
    # while the trial's observations are in flight, no other trial starts
    assert _calls(rt, m, native, 2) == ["n", "n"]
    # routed calls' cycles: 0.6x and 0.9x the prediction (the slowest rank's); one sample is not
    # enough, the least of two is the correction
    t = 0.6 * gpu_raw
    names = {"direct": "ce", "host": "host"}
    assert rt.in_flight[4] == ("r", cls, gpu_raw)
    assert rt.agree([{"robs": [[4, {"ce": t, "host": t * 0.95, "cycle": t}]]},
                     {"robs": [[4, {"ce": t * 0.9, "host": t, "cycle": 0.5 * gpu_raw}]]}], names) == [4]
    assert "r" not in rt.fix(cls)
    assert rt.agree([{"robs": [[5, {"ce": 0.9 * gpu_raw, "host": 0.85 * gpu_raw, "cycle": 0.9 * gpu_raw}]]}],
                    names) == [5]
    assert rt.fix(cls)["r"] == pytest.approx(0.6) and rt.pcie_scale == 1.0
    rt.in_flight.clear()
    first = rt.plan(m, "cuda", GPU_COSTS, native, force=False)
    assert first[0] is not None
    assert first[1] == pytest.approx(0.6 * gpu_raw) and first[2] == pytest.approx(1.05 * native_raw)
    # routing wins now; native is re-checked in a block after RECHECK[0] calls, then twice as many
    R = RoutedAllToAll.RECHECK[0]
    got = ["r"] + _calls(rt, m, native, 3 * R + 2 * T)
    nat = [i for i, k in enumerate(got) if k == "n"]
    assert nat == list(range(R - 1, R - 1 + T)) + list(range(3 * R + T - 2, 3 * R + 2 * T - 2)), nat
    # only the last FIX_WINDOW samples count: routing that became slow stops being chosen
    for k in range(RoutedAllToAll.FIX_WINDOW):
        _observe(rt, 10 + k, ("r", cls, gpu_raw), [{"ce": 2.0 * gpu_raw, "host": 2.0 * gpu_raw, "cycle": 2.0 * gpu_raw}])
    assert rt.fix(cls)["r"] == pytest.approx(2.0)
    assert _calls(rt, m, native, 40) == ["n"] * 40
    # a different shape class is not affected by what this one learned
    big = [[v * 4 for v in row] for row in m]
    rt.plan(big, "cuda", GPU_COSTS, native, force=False)
    assert rt.last_pred[1] != cls


def test_learned_samples_are_bounded_and_empty_measurements_ignored():
    rt = RoutedAllToAll(2)
    for _ in range(3):
        rt.learn_time("r", (1, 0), 1e9, 1.0)
    assert rt.fix((1, 0))["r"] == pytest.approx(RoutedAllToAll.FIX_RANGE[1])
    rt.learn_time("n", (1, 0), 1.0, 1e9)
    rt.learn_time("n", (1, 0), 1.0, 1e9)
    assert rt.fix((1, 0))["n"] == pytest.approx(RoutedAllToAll.FIX_RANGE[0])
    rt.learn_time("r", (2, 0), 0.0, 100.0)
    assert rt.fix((2, 0)) == {}


def _native_obs_worker(rank, w, matrix, calls):
    """Skewed calls that routing declines (host time set far above any call) run gloo's own
    all_to_all; each is timed and the agreed time becomes the class's native correction."""
    import braid
    comm = braid.init()
    comm._routed.agreed_host_us = 1e12          # test hook: no routed call can win
    comm.pays[f"all_to_all_single/{w}"] = {20: False}   # and the calibration's verdict: gloo alone
    esz = 4
    ins = [matrix[rank][d] // esz for d in range(w)]
    outs = [matrix[s][rank] // esz for s in range(w)]
    x = make(("nobs", rank), sum(ins), torch.float32)
    exp = torch.cat([make(("nobs", s), sum(matrix[s][d] // esz for d in range(w)), torch.float32)
                     [sum(matrix[s][d] // esz for d in range(rank)):][: outs[s]] for s in range(w)])
    for _ in range(calls):
        y = torch.zeros_like(exp)
        comm.all_to_all_single(y, x, outs, ins)
        assert torch.equal(y, exp)
        assert comm.last_handle.plan is None           # native
    fix = {repr(k): v for k, v in comm._routed.samples.items()}
    braid.close()
    return fix


def test_declined_native_calls_are_timed_and_learned_alike_on_every_rank():
    w = 3
    m = skewed(w, 1, 2 << 20, 0.9, random.Random(7))
    m = [[(v // 4) * 4 for v in row] for row in m]
    res = run_world(_native_obs_worker, w, m, 6, env={"BRAID_ROUTE": "auto"})
    assert all(r == res[0] for r in res), res
    (cls, ent), = res[0].items()
    assert set(ent) == {"n"} and len(ent["n"]) >= 2 and min(ent["n"]) > 0


def test_host_time_is_agreed_per_shape_class():
    """A host time measured on 1 GiB calls (where the host waits for a busy GPU inside the call)
    must not decline 256 MiB calls: each class has its own agreed value, the default elsewhere."""
    w = 4
    names = {"direct": "ce", "host": "host"}
    big = [[0 if s == d else ((1 << 30) if d == 3 else (16 << 20)) for d in range(w)] for s in range(w)]
    mid = [[v // 4 for v in row] for row in big]
    rt = RoutedAllToAll(w)
    from braid.collectives.routed import shape_class
    cb, cm = shape_class(big), shape_class(mid)
    assert cb != cm
    rt.observe_host(6000.0, cls=cb)
    rep = rt.report(None)
    assert rep["rcls"] == list(cb)
    # ranks reporting different classes: nothing agreed
    assert not rt.agree([rep, {"rhost": 10.0, "rcls": list(cm)}], names)
    assert rt.agreed_host == {}
    rt.agree([rep, dict(rep, rhost=6500.0)], names)
    assert rt.host_time_us(cb) == 6500.0
    assert rt.host_time_us(cm) == pytest.approx(RoutedAllToAll.HOST_US_PER_PAIR * w * w)
    native = LaneCost(15.0, 300.0)
    rt.plan(mid, "cuda", GPU_COSTS, native, force=False)
    assert rt.last_cls == cm and rt.host_time_us() == pytest.approx(RoutedAllToAll.HOST_US_PER_PAIR * w * w)


def _trial_worker(rank, w, matrix, calls):
    """Skewed calls under BRAID_ROUTE=auto with the host time hook at zero (routing plausible): the
    class is measured on the side the model picks, then the other side is tried in a block. Every
    call bitwise right; the sequence of sides and the learned samples must be the same on every
    rank (agreed state only)."""
    import braid
    comm = braid.init()
    comm._routed.agreed_host_us = 0.0
    comm.pays[f"all_to_all_single/{w}"] = {20: False}   # the share-based split is out: native or routed
    esz = 4
    ins = [matrix[rank][d] // esz for d in range(w)]
    outs = [matrix[s][rank] // esz for s in range(w)]
    x = make(("trial", rank), sum(ins), torch.float32)
    exp = torch.cat([make(("trial", s), sum(matrix[s][d] // esz for d in range(w)), torch.float32)
                     [sum(matrix[s][d] // esz for d in range(rank)):][: outs[s]] for s in range(w)])
    sides = []
    for _ in range(calls):
        y = torch.zeros_like(exp)
        comm.all_to_all_single(y, x, outs, ins)
        assert torch.equal(y, exp)
        sides.append("r" if comm.last_handle.plan is not None else "n")
        assert len(comm.route_samples.pending) <= comm._routed.IN_FLIGHT
    samples = {repr(k): v for k, v in comm._routed.samples.items()}
    braid.close()
    return "".join(sides), samples


def test_both_sides_are_measured_in_blocks_alike_on_every_rank():
    w = 3
    m = skewed(w, 1, 2 << 20, 0.9, random.Random(11))
    m = [[(v // 4) * 4 for v in row] for row in m]
    res = run_world(_trial_worker, w, m, 40, env={"BRAID_ROUTE": "auto"})
    assert all(r == res[0] for r in res), res
    sides, samples = res[0]
    (cls, ent), = samples.items()
    # both sides measured, each from steady calls: a block of the other side came after the first
    assert set(ent) == {"r", "n"} and all(len(v) >= 1 for v in ent.values()), res[0]
    first = sides[0]
    other = "n" if first == "r" else "r"
    assert other * RoutedAllToAll.TRIAL in sides, sides


def test_steady_calls_are_timed_freely_while_measuring_and_one_at_a_time_after():
    """Each timed call costs two timing events and queries: every steady call of a trial, or of a
    side that has no samples yet, may be timed (IN_FLIGHT at once); once a side is measured and
    no trial runs, one call at a time."""
    m, native, cls, gpu_raw = _close_call()
    rt = RoutedAllToAll(4)
    rt.agreed_host_us = 0.0
    L = RoutedAllToAll.IN_FLIGHT
    rt.plan(m, "cuda", GPU_COSTS, native, force=False)
    assert not rt.wants_sample(0)                       # the first call of a class: not steady
    rt.plan(m, "cuda", GPU_COSTS, native, force=False)
    assert rt.last_pred[0] == "n" and rt.sample_limit == L and rt.wants_sample(L - 1) and not rt.wants_sample(L)
    rt.learn_time("n", cls, 1.0, 1.0)
    rt.learn_time("n", cls, 1.0, 1.0)                   # native measured: now the routing trial
    got = []
    for seq in range(RoutedAllToAll.TRIAL + 2):
        rt.plan(m, "cuda", GPU_COSTS, native, force=False)
        got.append((rt.last_pred[0], rt.sample_limit))
        if rt.wants_sample(len(rt.in_flight)):          # as comm._run does
            rt.expect(seq)
    assert got[:RoutedAllToAll.TRIAL] == [("r", L)] * RoutedAllToAll.TRIAL
    assert got[RoutedAllToAll.TRIAL:] == [("n", 1)] * 2
    # the trial's steady calls all timed; the native ones wait until those are learned
    assert [p[0] for p in rt.in_flight.values()] == ["r"] * (RoutedAllToAll.TRIAL - 1)
    assert not rt.wants_sample(len(rt.in_flight)) and rt.wants_sample(0)


def _declined_worker(rank, w, matrix):
    """A skewed call that routing declines runs the native all_to_all itself (what the decision
    compared routing with), even where the calibration would split balanced traffic of that size;
    with routing off, the same call takes the share split."""
    import braid
    comm = braid.init()
    comm._routed.agreed_host_us = 1e12          # test hook: no routed call can win
    comm.pays[f"all_to_all_single/{w}"] = {20: True}   # the split pays for this size
    esz = 4
    ins = [matrix[rank][d] // esz for d in range(w)]
    outs = [matrix[s][rank] // esz for s in range(w)]
    x = make(("decl", rank), sum(ins), torch.float32)
    exp = torch.cat([make(("decl", s), sum(matrix[s][d] // esz for d in range(w)), torch.float32)
                     [sum(matrix[s][d] // esz for d in range(rank)):][: outs[s]] for s in range(w)])
    got = []
    for mode in ("auto", "off"):
        comm.routing = mode
        y = torch.zeros_like(exp)
        comm.all_to_all_single(y, x, outs, ins)
        assert torch.equal(y, exp), mode
        got.append(sorted(comm.last_handle.shares))
    braid.close()
    return got


def test_a_declined_skewed_call_is_the_native_all_to_all_not_the_share_split():
    w = 3
    m = skewed(w, 1, 4 << 20, 0.9, random.Random(3))
    m = [[(v // 4) * 4 for v in row] for row in m]
    res = run_world(_declined_worker, w, m)
    for auto, off in res:
        assert auto == ["gloo"], res
        assert len(off) > 1, res                 # the split the declined call did not take


def _threshold_worker(rank, w, mib_exact):
    """The routing threshold is inclusive, as NIMBLE's (multipath off at or below 1 MB): a pair of
    exactly 1 MiB is not routed even with every other pair empty, 1 MiB + 4 KiB is."""
    import braid
    comm = braid.init()
    comm._routed.agreed_host_us = 0.0
    out = []
    for big in ((1 << 20), (1 << 20) + 4096):
        matrix = [[0] * w for _ in range(w)]
        matrix[0][w - 1] = big
        ins = [matrix[rank][d] // 4 for d in range(w)]
        outs = [matrix[s][rank] // 4 for s in range(w)]
        x = make(("thr", rank, big), sum(ins), torch.float32)
        y = torch.zeros(sum(outs), dtype=torch.float32)
        comm.all_to_all_single(y, x, outs, ins)
        if rank == w - 1:
            assert torch.equal(y, make(("thr", 0, big), big // 4, torch.float32))
        out.append(comm.last_route is not None and comm._routed.last_pred is not None)
        comm.route_samples.last = None
    braid.close()
    return out


def test_the_routing_threshold_is_at_or_below_one_mib():
    res = run_world(_threshold_worker, 3, True, env={"BRAID_ROUTE": "auto"})
    assert all(r == [False, True] for r in res), res
