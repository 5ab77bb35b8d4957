"""`braid sim scale`'s multi-node model (sim/scale.py): braid's hierarchical steps against NCCL's
ring / tree, and skewed all-to-all routed by the hierarchical planner against one path per demand.
Properties only (more NICs never slower, balanced traffic gains little, a hot pair gains from
idle NICs), the closed forms on small cases, and the command line. No timings."""
from __future__ import annotations

import json
import math

import pytest

from braid.planner.checks import MisuseError
from braid.planner.router import direct_only, multi_node
from braid.sim import scale as sc

M = 64 << 20


# ---- closed forms ------------------------------------------------------------------------------

def test_nccl_flat_all_reduce_is_the_closed_form_on_two_nodes():
    m = sc.MACHINES["h100"]
    B = min(0.7 * 390.0, 8 * 49.3) * 1e3                      # bytes per us: NVLink at NCCL's reach
    ring = 2 * 15 * 5.0 + 2 * 15 / 16 * M / B                 # 2(W-1) steps of 5 us, W = 16
    tree = 2 * (1 * 5.0 + 7 * 1.5) + 2 * M / B                # log2(2) = 1 across, a chain of 8 inside
    t, algo = sc.nccl_flat_us(m, "all_reduce", 2, 8, M)
    assert t == pytest.approx(min(ring, tree)) and algo == ("ring" if ring <= tree else "tree")
    # one NIC per node: the NIC bounds the ring
    t1, _ = sc.nccl_flat_us(m, "all_gather", 2, 1, M)
    assert t1 == pytest.approx(15 * 5.0 + 15 / 16 * M / (49.3 * 1e3))


def test_rail_formulas_and_the_tree_taking_over_at_many_nodes():
    S, B, a = 8 << 20, 49.3, 5.0
    assert sc.rail_us("reduce_scatter", 4, S, B, a) == pytest.approx(3 * a + 0.75 * S / (B * 1e3))
    assert sc.rail_us("all_gather", 4, S, B, a) == pytest.approx(3 * a + 3 * S / (B * 1e3))
    assert sc.rail_us("all_to_all", 4, S, B, a) == pytest.approx(a + 0.75 * S / (B * 1e3))
    assert sc.rail_us("all_reduce", 4, S, B, a) == pytest.approx(6 * a + 1.5 * S / (B * 1e3))     # ring
    small = 4096                                               # latency-bound: 2 log2(128) steps, not 254
    assert sc.rail_us("all_reduce", 128, small, B, a) == pytest.approx(14 * a + 2 * small / (B * 1e3))
    assert sc.rail_us("all_reduce", 1, S, B, a) == 0.0


def test_braid_steps_follow_the_multi_node_algorithms():
    r = sc.hier("h100", "all_reduce", 4, 8, M)
    assert list(r.steps) == ["node reduce_scatter", "rail all_reduce", "node all_gather"]
    assert r.braid_us == pytest.approx(sum(r.steps.values()))
    assert r.overlap_us == pytest.approx(max(r.steps.values()))
    # the rail step is NCCL over 4 ranks, each GPU on its own NIC, on its M / 8 shard
    assert r.steps["rail all_reduce"] == pytest.approx(sc.rail_us("all_reduce", 4, M / 8, 49.3, 5.0))
    assert list(sc.hier("h100", "all_gather", 4, 8, M).steps) == ["rail all_gather", "node all_gather"]
    assert list(sc.hier("h100", "reduce_scatter", 4, 8, M).steps) == ["node reduce_scatter", "rail reduce_scatter"]
    assert list(sc.hier("h100", "all_to_all", 4, 8, M).steps) == ["node all_to_all", "rail all_to_all"]
    one = sc.hier("h100", "all_reduce", 1, 8, M)                # one node: braid's own op, no rail
    assert list(one.steps) == ["node all_reduce"] and one.nccl_algo == "node"


# ---- properties --------------------------------------------------------------------------------

@pytest.mark.parametrize("gpu", ["h100", "h800"])
@pytest.mark.parametrize("op", sc.MODEL_OPS)
def test_more_nics_never_slower_and_more_nodes_never_faster(gpu, op):
    for n in (2, 8, 128):
        rows = [sc.hier(gpu, op, n, k, M) for k in (1, 2, 4, 8)]
        for a, b in zip(rows, rows[1:]):
            assert b.braid_us <= a.braid_us * (1 + 1e-9), (n, b.nics)
            assert b.nccl_us <= a.nccl_us * (1 + 1e-9), (n, b.nics)
    for k in (1, 8):
        rows = [sc.hier(gpu, op, n, k, M) for n in (2, 4, 16, 64)]
        for a, b in zip(rows, rows[1:]):
            assert b.braid_us >= a.braid_us * (1 - 1e-9) and b.nccl_us >= a.nccl_us * (1 - 1e-9), (b.nodes, k)


def test_braid_lanes_never_slow_a_node_step_much_and_help_on_h800():
    for gpu in ("h100", "h800"):
        for op in sc.MODEL_OPS:
            r = sc.hier(gpu, op, 8, 8, M)
            assert r.braid_us <= 1.02 * r.nccl_node_us, (gpu, op)
    # H800's NVLink (200 GB/s) at NCCL's 70 % is the bottleneck with 8 NICs: the copy engines' rate pays
    r = sc.hier("h800", "all_gather", 8, 8, 256 << 20)
    assert r.nccl_node_us > 1.1 * r.braid_us and r.speedup > 1.05


def test_hierarchy_sends_fewer_bytes_across_for_all_reduce_on_two_nodes():
    # one NIC per node: NIC-bound; the hierarchy moves 2(N-1)/N M per node, NCCL's ring 2(W-1)/W M
    r = sc.hier("h100", "all_reduce", 2, 1, 256 << 20)
    assert r.steps["rail all_reduce"] == pytest.approx(
        sc.rail_us("all_reduce", 2, (256 << 20) / 8, 49.3 / 8, 5.0))
    assert r.speedup > 1.3


def test_more_nics_never_slower_for_skewed_traffic():
    rows = [sc.skew("h100", 4, k, 0.7, M) for k in (1, 2, 4, 8)]
    for a, b in zip(rows, rows[1:]):
        assert b.routed_us <= a.routed_us * (1 + 1e-6) and b.direct_us <= a.direct_us * (1 + 1e-6)
    assert all(r.lower_bound_us <= r.routed_us * (1 + 1e-9) for r in rows)
    assert all(r.routed_us <= r.direct_us * (1 + 1e-6) for r in rows)


def test_a_hot_pair_gains_from_idle_nics_and_balanced_traffic_gains_little():
    for n in (2, 8, 32):
        hot = sc.skew("h100", n, 8, 0.7, M)
        assert hot.gain > 4, n                                   # the hot GPU's rail alone vs every NIC
        assert sc.skew("h100", n, 1, 0.7, M).gain == pytest.approx(1.0, abs=1e-3)   # no idle NIC to use
        bal = sc.skew("h100", n, 8, 0.0, M)
        assert 0.98 <= bal.gain <= 1.05, n                     # within the router's 2 % gap of one path
    assert sc.skew("h100", 8, 8, 0.7, M).braid_us < sc.skew("h100", 8, 8, 0.7, M).nccl_us


@pytest.mark.parametrize("nodes", [2, 3])
def test_direct_pxn_is_the_routers_direct_only_where_the_first_path_is_the_home_rail(nodes):
    # one NIC per node: the router's first candidate is rail 0, which is every GPU's home rail
    mat = sc.hot_matrix(nodes, 8, M, 0.6)
    topo = multi_node(nodes, 8, 1, nic_gbps=49.3, nvlink_gbps=390.0)
    assert sc.direct_pxn_us(nodes, 8, 1, 49.3, 390.0, mat) == pytest.approx(direct_only(topo, mat.tolist()))


def test_hot_matrix_rows_send_the_per_gpu_bytes():
    mat = sc.hot_matrix(3, 4, 1 << 20, 0.7)
    assert mat.shape == (12, 12) and all(mat[i, i] == 0 for i in range(12))
    assert all(abs(mat[s].sum() - (1 << 20)) <= 12 for s in range(12))
    assert mat[5, 8] >= 0.7 * (1 << 20) - 1                     # node 1's GPU 1 -> GPU 0 of node 2


def test_bad_arguments_name_the_value_and_the_fix():
    with pytest.raises(MisuseError, match=r"3 NICs per node on h100 \(8 GPUs per node\).*use 1, 2, 4, 8"):
        sc.hier("h100", "all_reduce", 2, 3)
    with pytest.raises(MisuseError, match=r"unknown machine 'a100'"):
        sc.hier("a100", "all_reduce", 2, 8)
    with pytest.raises(MisuseError, match=r"100 bytes per GPU is too small .* use at least 1024 bytes"):
        sc.hier("h100", "all_gather", 16, 8, 100)
    with pytest.raises(MisuseError, match=r"needs >= 2 nodes"):
        sc.skew("h100", 1, 8)
    with pytest.raises(MisuseError, match=r"scale: hot = 1.5"):
        sc.skew("h100", 2, 8, 1.5)


# ---- the command line --------------------------------------------------------------------------

def test_cli_prints_the_table_and_the_verdict(tmp_path, capsys):
    from braid.__main__ import main
    out = tmp_path / "scale.json"
    assert main(["sim", "scale", "--gpu", "h100,nimble", "--nodes", "2,16", "--nics", "1,4",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for word in ("all_reduce", "reduce_scatter", "skewed all_to_all", "16 nodes", "pays:", "nimble"):
        assert word in text, word
    rows = json.loads(out.read_text())
    coll, skewed = rows["collectives"], rows["skewed"]
    assert len(coll) == 2 * 2 * 4 * 2                     # machines x NICs x ops x node counts
    assert {r["op"] for r in coll} == set(sc.MODEL_OPS)
    assert all(math.isfinite(r["speedup"]) and r["speedup"] > 0 for r in coll)
    assert {(r["gpu"], r["nics"], r["hot"]) for r in skewed} >= {("h100", 4, 0.7), ("h100", 4, 0.0), ("nimble", 1, 0.7)}
    assert main(["sim", "scale", "--nics", "3", "--nodes", "2"]) == 2
    assert "3 NICs per node" in capsys.readouterr().err
    assert main(["sim", "scale", "--gpu", "a100"]) == 2
    assert main(["sim", "scale", "--op", "alltoallv", "--nodes", "1"]) == 2
