"""The simulator's pieces on hand-computed cases: max-min sharing, the event loop, chunk
pipelines, presets (every constant sourced, loadable from the installed package), the router
converter, and the NIC policy as a table. Pure; no processes, no torch in braid.sim."""
from __future__ import annotations

import ast
import json
import math
import pathlib

import pytest

from braid.planner.nic import NicChoice, NicPolicy, NicState, choose_nic
from braid.sim.collectives import simulate_op
from braid.sim.flow import Flow, max_min_rates, pipeline_rate_gbps, simulate, step_pipeline_us
from braid.sim.topology import PRESETS, cluster, load, preset_text, to_router

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "braid"


def F(name, nbytes, *links, **kw):
    return Flow(name, nbytes, tuple((e, 1.0) for e in links), **kw)


# ---- max-min sharing ---------------------------------------------------------------------------

@pytest.mark.parametrize("cap, flows, want", [
    ({"a": 10}, [F("x", 1, "a"), F("y", 1, "a")], [5, 5]),                              # fair split
    ({"a": 10, "b": 4}, [F("x", 1, "a"), F("y", 1, "a", "b")], [6, 4]),                 # y capped by b, x takes the rest
    ({"a": 10}, [F("x", 1, "a", cap_gbps=2), F("y", 1, "a")], [2, 8]),                  # engine cap
    ({"a": 12, "b": 12}, [F("x", 1, "a"), F("y", 1, "a", "b"), F("z", 1, "b")], [6, 6, 6]),
    ({"a": 9}, [Flow("m", 1, (("a", 3.0),))], [3]),                                      # weight 3 (multicast staging)
])
def test_max_min_rates(cap, flows, want):
    assert max_min_rates(cap, flows) == pytest.approx(want)


def test_event_loop_reassigns_freed_capacity():
    # x (1000 B) and y (2000 B) share a 10 GB/s link: 5 each until x ends at 0.2 us, then y alone at 10
    res = simulate({"a": 10, "b": 10}, [F("x", 1000, "a"), F("y", 2000, "a", "b")])
    assert res.finish_us == pytest.approx([0.2, 0.3])


def test_latency_delays_start_and_lets_others_run_alone():
    # y waits 1 us, x runs alone at 10 for 1 us (10 KB... 10e3 B), then they share
    res = simulate({"a": 10}, [F("x", 20e3, "a"), F("y", 5e3, "a", latency_us=1.0)])
    # t=1: x has 10e3 left, y 5e3; both at 5 -> y ends at 2, x has 5e3 left, at 10 -> 2.5
    assert res.finish_us == pytest.approx([2.5, 2.0])
    assert res.group_finish_us() == {"": pytest.approx(2.5)}


def test_zero_byte_flow_finishes_at_its_latency_and_unknown_link_is_an_error():
    assert simulate({}, [Flow("d", 0, (), 7.0)]).finish_us == [7.0]
    with pytest.raises(KeyError, match="not in the topology"):
        simulate({"a": 1}, [F("x", 1, "b")])


def test_after_orders_flows_like_a_stream_and_a_counter_wait():
    # a then b on one stream (b waits for a), c on another link from the start; d waits for b and c
    # and 2 us more: a 0..1, b 1..2 (alone on "a"), c 0..3, d starts at 5, ends at 6
    res = simulate({"a": 10, "c": 10}, [F("a", 10e3, "a"), F("b", 10e3, "a", after=("a",)),
                                        F("c", 30e3, "c"), F("d", 10e3, "a", after=("b", "c"), latency_us=2.0)])
    assert res.finish_us == pytest.approx([1.0, 2.0, 3.0, 6.0])
    # a dependent flow shares the link with what is still running when it starts
    res = simulate({"a": 10}, [F("x", 10e3, "a"), F("y", 20e3, "a"), F("z", 5e3, "a", after=("x",))])
    # x, y at 5 until x ends at 2; then y (10e3 left) and z share: z ends at 3, y at 3.5
    assert res.finish_us == pytest.approx([2.0, 3.5, 3.0])
    # a zero-byte flow in a chain passes its finish on; start_us still holds
    res = simulate({"a": 10}, [F("m", 0, latency_us=1.0), F("n", 10e3, "a", after=("m",), start_us=4.0)])
    assert res.finish_us == pytest.approx([1.0, 5.0])
    with pytest.raises(KeyError, match="waits for"):
        simulate({"a": 1}, [F("x", 1, "a", after=("nope",))])
    with pytest.raises(RuntimeError, match="cycle"):
        simulate({"a": 1}, [F("x", 1, "a", after=("y",)), F("y", 1, "a", after=("x",))])


def test_pipeline_formulas():
    # window 1: stages never overlap, rate is the harmonic sum (FuseLink's borrowed NIC)
    assert pipeline_rate_gbps([200, 50, 200], 1, 1e6) == pytest.approx(1 / (1 / 200 + 1 / 50 + 1 / 200))
    # a deep window reaches the slowest stage
    assert pipeline_rate_gbps([120, 120], 8, 2e6) == pytest.approx(120)
    # double buffer with a 10 us handshake per chunk of 1 MB at 100 GB/s: 2 MB per (10 + 10 + 10) us
    assert pipeline_rate_gbps([100, 100], 2, 1e6, 10.0) == pytest.approx(2e6 / 30 / 1e3)
    # step-synchronous ring: 3 steps, 8 MB a step at 20 GB/s, 4 MB slot, 2 stages, 10 us each
    assert step_pipeline_us(3, 8e6, 20, 10, 2, 4e6) == pytest.approx(3 * (10 + (4e6 + 8e6) / 20e3))
    with pytest.raises(ValueError):
        pipeline_rate_gbps([1], 0, 1)


def test_send_recv_split_on_h200x4_by_hand():
    """ce 90% over NVLink (390) and host 10% (D2H 47 -> H2D 47, braid's calibrated host lane) of 1 GB, plus each lane's latency."""
    topo = load("h200x4")
    n = 10 ** 9
    res = simulate_op(topo, "send_recv", 4, n, {"ce": 0.9, "host": 0.1})
    ce = 18.6 + 0.9 * n / 390e3
    host = 18.6 + 4194304 / 47.0e3 + 0.1 * n / 47.0e3
    assert res.lane_time_us["ce"] == pytest.approx(ce, rel=1e-3)
    assert res.lane_time_us["host"] == pytest.approx(host, rel=1e-3)
    assert res.time_us == pytest.approx(max(ce, host) + 15.0, rel=1e-3)


def test_capacity_of_sets_rates_by_what_is_active():
    # link a is 10 while y runs, 20 after: x (30e3 B) shares 10 with y (5e3 B) until 1 us, then alone at 20
    cap_of = lambda act: {"a": 10.0 if any(f.name == "y" for f in act) else 20.0}      # noqa: E731
    res = simulate({"a": 20.0}, [F("x", 30e3, "a"), F("y", 5e3, "a")], capacity_of=cap_of)
    assert res.finish_us == pytest.approx([1.0 + 25e3 / 20e3, 1.0])


def test_measured_nccl_alone_takes_its_measured_time():
    """On our machines NCCL's flows carry the measured table's latency and rate: alone, any op at
    any size takes exactly the table's time (it is an input), and it needs the preset's own world."""
    for name in ("h200x2", "h200x4"):
        topo = load(name)
        w = topo.num_gpus
        for op in topo.nccl_busbw:
            for n in (48 << 20, 64 << 20, 200 << 20, 700 << 20, 1 << 30, 3 << 30):
                res = simulate_op(topo, op, w, n, {"nccl": 1.0})
                assert res.time_us == pytest.approx(topo.nccl_measured_us(op, w, n), rel=1e-6), (name, op, n)
    with pytest.raises(ValueError, match="measured on its 4 GPUs"):
        simulate_op(load("h200x4"), "all_reduce", 2, 1 << 30, {"nccl": 1.0})


def test_nccl_share_of_all_reduce_runs_beside_the_host_lane():
    """all_reduce with NCCL 0.95 + host 0.05 on 4 GPUs: NCCL reduces a page-aligned prefix of 0.95 of
    the bytes at its measured cost (the host lane stays on PCIe, so NCCL is undisturbed); the host
    lane's staged path has the rest; the op is the slower of the two + the multi-lane overhead."""
    topo = load("h200x4")
    n = 1 << 30
    res = simulate_op(topo, "all_reduce", 4, n, {"nccl": 0.95, "host": 0.05})
    prefix = round(0.95 * n / 4096) * 4096
    assert res.lane_time_us["nccl"] == pytest.approx(topo.nccl_measured_us("all_reduce", 4, prefix), rel=1e-6)
    alone = simulate_op(topo, "all_reduce", 4, n - prefix, {"host": 1.0}).time_us
    assert res.lane_time_us["host"] == pytest.approx(alone, rel=0.02)
    assert res.time_us == pytest.approx(max(res.lane_time_us.values()) + 15.0)
    # beside the copy engines NCCL shares NVLink: slower than alone on its prefix
    mixed = simulate_op(topo, "all_reduce", 4, n, {"nccl": 0.6, "ce": 0.35, "host": 0.05})
    assert mixed.lane_time_us["nccl"] > 1.2 * topo.nccl_measured_us("all_reduce", 4, 0.6 * n)


def test_pipelined_ce_reduction_overlaps_its_steps():
    """The copy engines' pipelined all_reduce on 2 GPUs, 1 GiB: each GPU's NVLink in-port carries
    its pulls and its gathers (2 x 512 MiB) at the all-at-once rate, and of the reduction kernels
    only what the last pieces expose is added; the staged version pays the whole reduction."""
    topo = load("h200x4")
    n = 1 << 30
    pipe = simulate_op(topo, "all_reduce", 2, n, {"ce": 1.0}).time_us
    staged = simulate_op(topo, "all_reduce", 2, n, {"ce": 1.0}, ce_reduce="staged").time_us
    link = n / 335e3                                   # 2 x n/2 into each GPU at nvlink_busy_gbps
    piece = n / 2 / 4                                  # 4 pieces per chunk
    assert link < pipe < link + 18.6 + 2 * 3 * piece / 2100e3 + 2 * piece / 335e3
    assert staged > pipe + 0.5 * 3 * (n / 2) / 2100e3
    rs = simulate_op(topo, "reduce_scatter", 4, n, {"ce": 1.0})      # no gather: pulls + reductions
    assert n * 3 / 4 / 390e3 < rs.time_us < n * 3 / 4 / 335e3 + 18.6 + 6 * (n / 16) / 2100e3


def test_the_copy_engines_reduce_pushes_to_the_root_alone():
    """A reduce on the copy engines (collectives/ce_reduce.py, root 0): the all_reduce's pipeline
    with the reduced pieces pushed into rank 0 only. Rank 0's in-port carries what it carries in
    the all_reduce, so the reduce takes about as long (never longer); it is slower than the
    reduce_scatter (which gathers nothing) and faster than its staged version."""
    from braid.sim.collectives import ce_reduction_flows
    topo = load("h200x4")
    flows = ce_reduction_flows(topo, "reduce", 4, [16 << 20] * 4)
    into = {f.name.split("<")[0].split(".")[1] for f in flows if f.name.startswith("ce.gather")}
    assert into == {"gather0"}
    assert {f.name.split("<")[1] for f in flows if f.name.startswith("ce.gather")} == {"1", "2", "3"}
    n = 64 << 20
    rd = simulate_op(topo, "reduce", 4, n, {"ce": 1.0}).time_us
    ar = simulate_op(topo, "all_reduce", 4, n, {"ce": 1.0}).time_us
    rs = simulate_op(topo, "reduce_scatter", 4, n, {"ce": 1.0}).time_us
    staged = simulate_op(topo, "reduce", 4, n, {"ce": 1.0}, ce_reduce="staged").time_us
    assert rs < rd <= ar + 1e-6 and rd < staged, (rs, rd, ar, staged)
    # before the push, a reduce's copy-engine share took the staged path
    assert simulate_op(topo, "reduce", 4, n, {"ce": 1.0}, "pipelined").time_us == pytest.approx(staged)


def test_ce_pulls_are_serial_per_destination_and_the_busy_rate_lasts_while_a_port_sends():
    """lanes/ce.py: each destination pulls its pieces one after the other, sources rotated. A GPU
    that receives from three peers while sending a little gets the all-at-once rate (335) only while
    it sends; after that its port takes the one-pair rate (390)."""
    from braid.planner.plan import all_to_all_movement, split
    from braid.sim.collectives import run_flows, transfer_flows
    topo = load("h200x4")
    m = [[0, 0, 0, 300 << 20], [0, 0, 0, 300 << 20], [0, 0, 0, 300 << 20], [10 << 20, 0, 0, 0]]
    plan = split(all_to_all_movement(m), {"ce": 1.0}, 0)
    flows = transfer_flows(topo, "ce", plan)
    into3 = [f for f in flows if f.name.endswith(tuple(f">3.{i}" for i in range(3)))]
    assert [f.after for f in into3] == [(), (into3[0].name,), (into3[1].name,)]
    res = run_flows(topo, flows)
    t = res.group_finish_us()["ce"]
    small = 18.6 + (10 << 20) / 335e3                   # GPU 3 sends 10 MiB (while at 335)
    assert t == pytest.approx(small + (900 << 20) / 390e3 - (10 << 20) / 335e3 * (1 - 335 / 390), rel=0.01)


# ---- presets -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_constant_has_a_source(name):
    obj = json.loads(preset_text(name))
    assert obj["constants"], name
    for key, c in obj["constants"].items():
        assert str(c.get("source", "")).strip() and "value" in c and "unit" in c, (name, key)
    topo = load(name)
    assert topo.capacity(), name


def test_presets_ship_inside_the_installed_package():
    from importlib import resources
    import braid.sim
    files = {p.name for p in resources.files(braid.sim).joinpath("presets").iterdir()}
    assert {f"{n}.json" for n in PRESETS} <= files
    import tomllib
    py = tomllib.loads((SRC.parents[1] / "pyproject.toml").read_text())
    globs = py["tool"]["setuptools"]["package-data"]["braid.sim"]
    assert "presets/*.json" in globs and "data/*.json" in globs     # the presets and the recorded bench
    assert resources.files(braid.sim).joinpath("data", "sim_bench_h200.json").is_file()


def test_cluster_generator_and_router_converter():
    for nics in (1, 4, 8):
        topo = cluster(4, nics)
        assert topo.num_gpus == 32 and topo.nics_per_node == nics
        rt = to_router(topo)
        assert len(rt.paths) == 32 * 31
        assert len(rt.candidates(0, 8)) == nics            # one path per rail across nodes
        first = rt.candidates(3, 9)[0]                       # PXN: the destination's rail first
        assert first.via == (topo.home_nic(9),)
    with pytest.raises(ValueError):
        cluster(2, 3)
    with pytest.raises(ValueError):
        load("nope")
    mesh = to_router(load("h100x4-mesh-4rail-nimble"), max_relays=1)
    assert [p.kind for p in mesh.candidates(0, 1)] == ["direct", "relay"]
    assert any(e == "relay2" for e, _ in mesh.candidates(0, 1)[1].links)


def test_sim_sources_never_import_torch():
    offenders = []
    files = list((SRC / "sim").glob("*.py")) + [SRC / "planner" / "nic.py"]
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{f.name}: {n}" for n in names if n == "torch" or n.startswith("torch.")]
    assert not offenders


# ---- the NIC policy (FuseLink) -----------------------------------------------------------------

P = NicPolicy(max_borrowed_inflight=1, relay_mem_bytes=8 << 20, direct_depth=2)
MB = 1 << 20


@pytest.mark.parametrize("gpu, nics, want", [
    # own NIC idle: direct
    (0, [NicState(0, 0), NicState(1, 1)], NicChoice(0, None, "direct")),
    # own NIC busy with own ops: borrow the idle one, relay through its owner
    (0, [NicState(0, 0, owner_inflight=2), NicState(1, 1)], NicChoice(1, 1, "borrowed")),
    # the owner is using its NIC: not borrowable (owner first) -> queue on the own NIC
    (0, [NicState(0, 0, owner_inflight=2), NicState(1, 1, owner_inflight=1)], NicChoice(0, None, "queued")),
    # cap on borrowed operations in flight reached -> next idle NIC
    (0, [NicState(0, 0, owner_inflight=2), NicState(1, 1, borrowed_inflight=1), NicState(2, 2)],
     NicChoice(2, 2, "borrowed")),
    # relay memory on the owner GPU would overflow -> not borrowable
    (0, [NicState(0, 0, owner_inflight=2), NicState(1, 1, relay_bytes=8 * MB)], NicChoice(0, None, "queued")),
    # least loaded borrowable NIC wins, ties by index
    (0, [NicState(0, 0, owner_inflight=2), NicState(1, 1, relay_bytes=MB // 2), NicState(2, 2)],
     NicChoice(2, 2, "borrowed")),
    # a GPU without a NIC of its own (4 NICs, 8 GPUs): its home NIC is the one on its switch (owner 2)
    (3, [NicState(0, 0), NicState(1, 2), NicState(2, 4), NicState(3, 6)], NicChoice(1, 2, "direct")),
    # ... and its own ops on that NIC count as borrowed ones there; the owner's traffic still comes first
    (3, [NicState(0, 0, owner_inflight=1), NicState(1, 2, borrowed_inflight=2), NicState(2, 4)],
     NicChoice(2, 4, "borrowed")),
])
def test_nic_policy_table(gpu, nics, want):
    assert choose_nic(gpu, MB, nics, P) == want


def test_nic_policy_without_borrowing_and_bad_input():
    busy = [NicState(0, 0, owner_inflight=5), NicState(1, 1)]
    assert choose_nic(0, MB, busy, NicPolicy(borrow=False)).reason == "no-borrow"
    with pytest.raises(ValueError):
        choose_nic(0, -1, busy)
    with pytest.raises(ValueError):
        choose_nic(0, 1, [])
    assert math.isfinite(MB)


def test_the_pushed_all_reduce_pays_one_handshake_of_the_two():
    """The copy engines' all_reduce as braid runs it now ("pushed"): the same flows as the pulled
    pipeline, without the done handshake (half of ce_latency_us, which counts start and done).
    reduce_scatter has no closing handshake to drop: the same time in both versions."""
    topo = load("h200x2")
    half = topo.c("ce_latency_us") / 2
    for nbytes in (1 << 20, 16 << 20, 64 << 20):
        pulled = simulate_op(topo, "all_reduce", 2, nbytes, {"ce": 1.0}, "pipelined").time_us
        pushed = simulate_op(topo, "all_reduce", 2, nbytes, {"ce": 1.0}, "pushed").time_us
        assert pushed == pytest.approx(pulled - half, abs=0.01), (nbytes, pulled, pushed)
        rs = [simulate_op(topo, "reduce_scatter", 2, nbytes, {"ce": 1.0}, v).time_us for v in ("pipelined", "pushed")]
        assert rs[0] == pytest.approx(rs[1]), (nbytes, rs)
    assert simulate_op(topo, "all_reduce", 2, 1 << 20, {"ce": 1.0}).time_us == \
        simulate_op(topo, "all_reduce", 2, 1 << 20, {"ce": 1.0}, "pushed").time_us     # the default
