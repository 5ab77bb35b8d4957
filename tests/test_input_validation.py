"""Bad input gets a clear error, never a silent change: the router's matrices, the topology
builders, the NIC choice and the route / sim command lines. Every case checks the exception type
and that the message names the bad value and where it was. Pure CPU, no processes except the few
command lines run end to end."""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import numpy as np
import pytest

from braid.errors import MisuseError
from braid.planner.lp import lp_optimum
from braid.planner.nic import NicState, choose_nic
from braid.planner.router import Path, Router, Topology, direct_only, mesh, multi_node, nvswitch, preset, route
from braid.sim.topology import cluster, load, to_router

MIB = 1 << 20


def good(n: int = 4) -> list[list[int]]:
    return [[0 if s == d else (s + 1) * MIB + d for d in range(n)] for s in range(n)]


def with_cell(m, i, j, v):
    out = [row[:] for row in m]
    out[i][j] = v
    return out


# ---- traffic matrices, at every entry point ----------------------------------------------------

ENTRY = {
    "Router.plan": lambda topo, m: Router(topo).plan(m),
    "route": route,
    "direct_only": direct_only,
    "lp_optimum": lp_optimum,
}

BAD_CELLS = [
    (-5, r"matrix\[2\]\[3\] = -5: a demand can't be negative"),
    (-0.5, r"matrix\[2\]\[3\] = -0.5: a demand can't be negative"),
    (math.nan, r"matrix\[2\]\[3\] = nan"),
    (-math.inf, r"matrix\[2\]\[3\] = -inf"),
    (math.inf, r"matrix\[2\]\[3\] = inf: .*finite"),
    (None, r"matrix\[2\]\[3\] = None .*pass 0"),
    ("100", r"matrix\[2\]\[3\] = '100' is a string; pass byte counts as numbers"),
    ("x", r"matrix\[2\]\[3\] = 'x' is a string"),
    (True, r"matrix\[2\]\[3\] = True: a bool .*not a byte count"),
    (np.bool_(False), r"matrix\[2\]\[3\] = .*False.*: a bool"),
    (2.0 ** 60, r"matrix\[2\]\[3\] = 1.152921504606847e\+18 bytes: above 2\*\*52 bytes .*split it"),
    (10 ** 400, r"matrix\[2\]\[3\] = an int of 401 digits: above 2\*\*52"),
    (3 + 0j, r"matrix\[2\]\[3\] = \(3\+0j\) \(complex\): not a byte count"),
    ([1], r"matrix\[2\]\[3\] = \[1\] \(list\): not a byte count"),
]


@pytest.mark.parametrize("entry", list(ENTRY))
@pytest.mark.parametrize("value, message", BAD_CELLS, ids=[repr(v)[:12] for v, _ in BAD_CELLS])
def test_bad_cell_is_named(entry, value, message):
    with pytest.raises(MisuseError, match=message):
        ENTRY[entry](nvswitch(4), with_cell(good(), 2, 3, value))


BAD_SHAPES = [
    ([[0, 1, 1, 1]] * 3, r"matrix has 3 rows; nvswitch4 needs 4 x 4: 4 rows of 4 byte counts"),
    ([[0, 1], [1, 0]], r"matrix has 2 rows; nvswitch4 needs 4 x 4"),
    ([[0, 1, 1, 1], [1, 0, 1], [1, 1, 0, 1], [1, 1, 1, 0]], r"matrix\[1\] has 3 entries; nvswitch4 needs 4 x 4"),
    ([[0, 1, 1, 1, 1]] * 4, r"matrix\[0\] has 5 entries"),
    ([1, 2, 3, 4], r"matrix\[0\] = 1 is not a row"),
    ([[0, 1, 1, 1], "abcd", [1, 1, 0, 1], [1, 1, 1, 0]], r"matrix\[1\] = 'abcd' is not a row"),
    (5, r"matrix = 5 \(int\) is not a list of rows"),
    (None, r"matrix = None \(NoneType\) is not a list of rows"),
    ({0: [0, 1, 1, 1]}, r"matrix = .* \(dict\) is not a list of rows"),
    (np.ones((3, 4)), r"matrix has shape \(3, 4\); nvswitch4 needs 4 x 4"),
    (np.ones(16), r"matrix has shape \(16,\)"),
    (np.ones((4, 4), dtype=bool), r"matrix is an array of bools"),
    (np.full((4, 4), "1"), r"matrix has dtype <U1"),
    (np.array([[0, 1, 1, None]] * 4, dtype=object), r"matrix\[0\]\[3\] = None"),
    (np.array([[0, 1, 1, -2.0]] * 4), r"matrix\[0\]\[3\] = -2: a demand can't be negative"),
]


@pytest.mark.parametrize("entry", list(ENTRY))
@pytest.mark.parametrize("matrix, message", BAD_SHAPES, ids=[f"shape{i}" for i in range(len(BAD_SHAPES))])
def test_bad_shape_is_named(entry, matrix, message):
    with pytest.raises(MisuseError, match=message):
        ENTRY[entry](nvswitch(4), matrix)


@pytest.mark.parametrize("value", [-1, math.nan, None, "0", True])
def test_diagonal_is_ignored_but_must_be_a_count(value):
    with pytest.raises(MisuseError, match=r"matrix\[1\]\[1\] = "):
        route(nvswitch(4), with_cell(good(), 1, 1, value))


def test_router_hits_still_check():
    """A cache hit (same signature), a repeat of the last plan (equal matrix) and the exact-repeat
    path with a bool where the checked matrix had 0 or 1: all raise on bad values."""
    topo = preset("nvswitch8")
    m = good(8)
    m[0][1] = 1
    router = Router(topo)
    router.plan(m)
    near = [[x + 1 if x > 1 else x for x in row] for row in m]      # same signature: a hit
    assert router.plan(near)[1]
    with pytest.raises(MisuseError, match=r"matrix\[3\]\[4\] = -7"):
        router.plan(with_cell(near, 3, 4, -7))
    with pytest.raises(MisuseError, match=r"matrix\[5\]\[6\] = nan"):
        router.plan(with_cell(near, 5, 6, math.nan))
    assert router.plan(near)[1] and router.plan(near)[1]             # the exact-repeat path, twice
    with pytest.raises(MisuseError, match=r"matrix\[2\]\[2\] = False: a bool"):
        router.plan(with_cell(near, 2, 2, False))                    # == 0 on the diagonal
    assert router.plan(near)[1]
    with pytest.raises(MisuseError, match=r"matrix\[0\]\[1\] = True: a bool"):
        router.plan(with_cell(near, 0, 1, True))                     # == the 1-byte demand
    with pytest.raises(MisuseError, match=r"matrix = 7 \(int\)"):
        router.plan(7)
    plan, hit = router.plan(near)
    assert hit and plan.max_load_us > 0


def test_router_and_route_arguments():
    topo = nvswitch(4)
    with pytest.raises(MisuseError, match=r"Router: topo = 'nvswitch4' is not a Topology"):
        Router("nvswitch4")
    with pytest.raises(MisuseError, match=r"Router: tolerance = -0.1: must be a finite number >= 0"):
        Router(topo, tolerance=-0.1)
    with pytest.raises(MisuseError, match=r"Router: max_cached = 0"):
        Router(topo, max_cached=0)
    with pytest.raises(MisuseError, match=r"route: iters = 0"):
        route(topo, good(), iters=0)
    with pytest.raises(MisuseError, match=r"route: min_split_bytes = -1"):
        route(topo, good(), min_split_bytes=-1)
    with pytest.raises(MisuseError, match=r"route: min_share = 2"):
        route(topo, good(), min_share=2)


# ---- valid edge cases keep working -------------------------------------------------------------

def test_valid_edge_cases():
    topo = nvswitch(4)
    zero = [[0] * 4 for _ in range(4)]
    plan, hit = Router(topo).plan(zero)
    assert plan.max_load_us == 0 and not plan.flows and not hit
    assert direct_only(topo, zero) == 0 and lp_optimum(topo, zero) == 0
    # floats are floored to whole bytes, as before: the same plan as the floored ints
    m = good()
    floats = [[x + 0.75 for x in row] for row in m]
    assert (route(topo, floats).split[2] == route(topo, m).split[2]).all()
    # a diagonal of any valid size is ignored; -0.0 is 0
    diag = [[(1 << 40 if s == d else x) for d, x in enumerate(row)] for s, row in enumerate(m)]
    assert (route(topo, diag).split[2] == route(topo, m).split[2]).all()
    assert (route(topo, with_cell(m, 0, 1, -0.0)).split[2] == route(topo, with_cell(m, 0, 1, 0)).split[2]).all()
    # numpy scalars and arrays, tuples
    assert (route(topo, [[np.int64(x) for x in row] for row in m]).split[2] == route(topo, m).split[2]).all()
    assert (route(topo, np.array(m, dtype=np.int32)).split[2] == route(topo, m).split[2]).all()
    assert (route(topo, tuple(map(tuple, m))).split[2] == route(topo, m).split[2]).all()
    # the caller's array is left alone
    arr = np.array(m, dtype=np.float64)
    route(topo, arr)
    assert (arr == np.array(m)).all()
    # one GPU (no pairs) and two GPUs
    one = nvswitch(1)
    assert Router(one).plan([[123]])[0].max_load_us == 0
    assert route(mesh(1), [[0]]).max_load_us == 0
    two = nvswitch(2)
    assert route(two, [[0, MIB], [MIB, 0]]).max_load_us > 0
    assert route(multi_node(1, 2, 1), [[0, MIB], [MIB, 0]]).max_load_us > 0
    assert route(preset("h200x2", nodes=1, nics=1), [[0, 1], [1, 0]]).max_load_us > 0


# ---- topology builders -------------------------------------------------------------------------

BAD_TOPOLOGIES = [
    (lambda: nvswitch(0), r"nvswitch: n \(GPUs on the switch\) = 0: must be a whole number >= 1"),
    (lambda: nvswitch(-2), r"nvswitch: n .* = -2"),
    (lambda: nvswitch(2.0), r"nvswitch: n .* = 2.0 \(float\)"),
    (lambda: nvswitch(True), r"nvswitch: n .* = True \(bool\)"),
    (lambda: nvswitch(4, nvlink_gbps=0), r"nvswitch: nvlink_gbps = 0: must be a finite number > 0"),
    (lambda: nvswitch(4, pcie_gbps=-53.0), r"nvswitch: pcie_gbps = -53.0"),
    (lambda: nvswitch(4, nvlink_gbps=math.nan), r"nvswitch: nvlink_gbps = nan"),
    (lambda: nvswitch(4, nvlink_gbps=math.inf), r"nvswitch: nvlink_gbps = inf"),
    (lambda: nvswitch(4, host_gbps=0), r"nvswitch: host_gbps = 0: .*or None for pcie_gbps \* n"),
    (lambda: nvswitch(4, nvlink_gbps="390"), r"nvswitch: nvlink_gbps = '390' \(str\)"),
    (lambda: mesh(0), r"mesh: n \(GPUs\) = 0"),
    (lambda: mesh(4, pair_gbps=0), r"mesh: pair_gbps = 0"),
    (lambda: mesh(4, host_gbps=-1), r"mesh: host_gbps = -1"),
    (lambda: multi_node(0), r"multi_node: nodes = 0"),
    (lambda: multi_node(2, gpus_per_node=0), r"multi_node: gpus_per_node = 0"),
    (lambda: multi_node(2, nics=0), r"multi_node: nics \(NICs per node\) = 0: .*only links between nodes"),
    (lambda: multi_node(2, nic_gbps=-50), r"multi_node: nic_gbps = -50"),
    (lambda: preset("nvswitch0"), r"nvswitch: n .* = 0"),
    (lambda: preset("multinode", nodes=-1), r"preset: nodes = -1: must be a whole number >= 1"),
    (lambda: preset("multinode", nics=0), r"preset: nics = 0"),
    (lambda: preset("h200x4", nodes=0), r"preset: nodes = 0"),
    (lambda: preset("nope"), r"unknown topology 'nope'"),
    (lambda: preset(8), r"preset: name = 8 is not a topology name"),
    (lambda: cluster(0), r"cluster: nodes = 0"),
    (lambda: cluster(2.5), r"cluster: nodes = 2.5 \(float\)"),
    (lambda: cluster(2, 3), r"cluster: nics = 3: NICs per node must divide 8"),
    (lambda: cluster(2, True), r"cluster: nics .* = True \(bool\)"),
    (lambda: cluster(2, 0), r"cluster: nics .* = 0"),
    (lambda: load("h200x4").with_shape(nodes=0), r"preset 'h200x4': nodes = 0"),
    (lambda: load("h200x4").with_shape(nodes=2), r"preset 'h200x4': 2 nodes with nics_per_node = 0"),
    (lambda: load("hopper8-8nic-fuselink").with_shape(nics_per_node=-1), r"nics_per_node = -1"),
    (lambda: to_router(cluster(2), max_rails=0), r"to_router: max_rails = 0"),
    (lambda: to_router(cluster(2), max_relays=-1), r"to_router: max_relays = -1"),
]


@pytest.mark.parametrize("build, message", BAD_TOPOLOGIES, ids=[f"topo{i}" for i in range(len(BAD_TOPOLOGIES))])
def test_bad_topology_is_named(build, message):
    with pytest.raises(MisuseError, match=message):
        build()


def _hand_made(cap: float, link: str = "a") -> Topology:
    topo = Topology("hand", 2, {"a": cap, "b": 10.0})
    topo.paths[(0, 1)] = [Path("direct", ((link, 1.0),))]
    topo.paths[(1, 0)] = [Path("direct", (("b", 1.0),))]
    return topo


@pytest.mark.parametrize("entry", list(ENTRY))
@pytest.mark.parametrize("cap, message", [
    (0.0, r"topology 'hand': link 'a' has capacity 0.0 GB/s; capacities must be finite and > 0"),
    (-3, r"link 'a' has capacity -3 GB/s"),
    (math.nan, r"link 'a' has capacity nan GB/s"),
    (math.inf, r"link 'a' has capacity inf GB/s"),
])
def test_bad_capacity_is_named(entry, cap, message):
    with pytest.raises(MisuseError, match=message):
        ENTRY[entry](_hand_made(cap), [[0, MIB], [MIB, 0]])


def test_path_over_an_unknown_link_is_named():
    with pytest.raises(MisuseError, match=r"the direct path from GPU 0 to GPU 1 crosses link 'zz', which has no "
                                          r"capacity"):
        route(_hand_made(5.0, link="zz"), [[0, MIB], [MIB, 0]])


# ---- the NIC choice ----------------------------------------------------------------------------

TWO = [NicState(0, 0), NicState(1, 1)]
FOUR_OF_8 = [NicState(0, 0), NicState(1, 2), NicState(2, 4), NicState(3, 6)]


@pytest.mark.parametrize("kwargs, message", [
    (dict(gpu=99, nbytes=MIB, nics=TWO), r"choose_nic: gpu = 99, but these NICs \(on GPUs \[0, 1\]\) serve GPUs 0..1"),
    (dict(gpu=8, nbytes=MIB, nics=FOUR_OF_8), r"choose_nic: gpu = 8, .*serve GPUs 0..7"),
    (dict(gpu=4, nbytes=MIB, nics=[NicState(0, 0)], num_gpus=4), r"choose_nic: gpu = 4, .*serve GPUs 0..3"),
    (dict(gpu=-1, nbytes=MIB, nics=TWO), r"choose_nic: gpu = -1: must be a whole number >= 0"),
    (dict(gpu=True, nbytes=MIB, nics=TWO), r"choose_nic: gpu = True \(bool\)"),
    (dict(gpu=0.0, nbytes=MIB, nics=TWO), r"choose_nic: gpu = 0.0 \(float\)"),
    (dict(gpu=0, nbytes=-1, nics=TWO), r"choose_nic: nbytes = -1: must be a finite number >= 0"),
    (dict(gpu=0, nbytes=math.nan, nics=TWO), r"choose_nic: nbytes = nan"),
    (dict(gpu=0, nbytes="1M", nics=TWO), r"choose_nic: nbytes = '1M' \(str\)"),
    (dict(gpu=0, nbytes=MIB, nics=[]), r"choose_nic: nics = \[\] must be a non-empty list of NicState"),
    (dict(gpu=0, nbytes=MIB, nics=[NicState(0, 0), 1]), r"choose_nic: nics\[1\] = 1 is not a NicState"),
    (dict(gpu=0, nbytes=MIB, nics=TWO, num_gpus=0), r"choose_nic: num_gpus = 0"),
])
def test_bad_nic_choice_is_named(kwargs, message):
    with pytest.raises(MisuseError, match=message):
        choose_nic(**kwargs)


def test_valid_nic_choices():
    assert choose_nic(7, MIB, FOUR_OF_8).nic == 3                 # the last NIC's switch: GPUs 6 and 7
    assert choose_nic(7, 0, [NicState(0, 0)]).nic == 0            # one NIC: serves every GPU
    assert choose_nic(3, MIB, [NicState(0, 0)], num_gpus=8).nic == 0
    assert choose_nic(np.int64(1), np.int64(MIB), TWO).nic == 1


# ---- the command lines -------------------------------------------------------------------------

def _main(argv, capsys):
    from braid.__main__ import main
    rc = main(argv)
    return rc, capsys.readouterr().err


@pytest.fixture
def matrix_file(tmp_path):
    def write(obj, raw: str | None = None):
        f = tmp_path / "m.json"
        f.write_text(raw if raw is not None else json.dumps(obj))
        return str(f)
    return write


@pytest.mark.parametrize("content, extra, message", [
    ([[0, -5], [1, 0]], [], r"--matrix .*m.json: matrix\[0\]\[1\] = -5: a demand can't be negative"),
    (None, [], r"--matrix .*m.json: matrix\[0\]\[1\] = nan"),                       # NaN in the file
    ([[0, "100"], [1, 0]], [], r"matrix\[0\]\[1\] = '100' is a string; pass byte counts as numbers"),
    ([[0, None], [1, 0]], [], r"matrix\[0\]\[1\] = None \(null in JSON\)"),
    ([[0, True], [1, 0]], [], r"matrix\[0\]\[1\] = True: a bool \(true in JSON\)"),
    ([[0, 1]], [], r"matrix has 1 row; h200x2 needs 2 x 2: 2 rows of 2 byte counts"),
    ({"a": 1}, [], r"matrix = \{'a': 1\} \(dict\) is not a list of rows"),
    ([[0, 1], [1, 0]], ["--nodes", "-1"], r"^braid route: --nodes -1: the number of 8-GPU nodes must be >= 1$"),
    ([[0, 1], [1, 0]], ["--nodes", "0"], r"--nodes 0: "),
    ([[0, 1], [1, 0]], ["--nics", "0"], r"--nics 0: the number of NICs \(rails\) per node must be >= 1"),
])
def test_route_cli_bad_matrix(matrix_file, capsys, content, extra, message):
    path = matrix_file(content, raw='[[0, NaN], [1, 0]]' if content is None else None)
    rc, err = _main(["route", "--matrix", path, "--topology", "h200x2"] + extra, capsys)
    assert rc == 2
    assert err.startswith("braid route: ") and re.search(message, err.strip()), err


@pytest.mark.parametrize("raw, topology, message", [
    ("[[0, 1], [1, 0", "h200x2", r"--matrix .*m.json is not JSON \(.*\); it must hold a list of rows"),
    ("", "h200x2", r"is not JSON"),
    ("[[0, 1], [1, 0]]", "nvswitch0", r"nvswitch: n .* = 0"),
    ("[[0, 1], [1, 0]]", "bogus", r"unknown topology 'bogus'"),
])
def test_route_cli_bad_file_or_topology(matrix_file, capsys, raw, topology, message):
    rc, err = _main(["route", "--matrix", matrix_file(None, raw), "--topology", topology], capsys)
    assert rc == 2 and err.startswith("braid route: ") and re.search(message, err), err


def test_route_cli_missing_file(tmp_path, capsys):
    rc, err = _main(["route", "--matrix", str(tmp_path / "nope.json"), "--topology", "h200x2"], capsys)
    assert rc == 2 and "braid route: cannot read --matrix" in err and "nope.json" in err


@pytest.mark.parametrize("argv, message", [
    (["scale", "--nodes", "0"], r"--nodes '0': 0 nodes; node counts must be whole numbers >= 1"),
    (["scale", "--nodes", "2,-3"], r"--nodes '2,-3': -3 nodes"),
    (["scale", "--nodes", "2,x"], r"--nodes '2,x': 'x' is not a whole number"),
    (["scale", "--nodes", ","], r"--nodes ',': no node counts"),
    (["scale", "--op", "alltoallv", "--nodes", "1"], r"alltoallv needs >= 2 nodes"),
    (["scale", "--hot", "1.5"], r"--hot = 1.5: must be a number in \[0, 1\]"),
    (["scale", "--hot", "-0.1"], r"--hot = -0.1: must be a number in \[0, 1\]"),
    (["scale", "--hot", "nan"], r"--hot = nan"),
    (["scale", "--size", "0"], r"--size '0': expected a whole byte count >= 1"),
    (["scale", "--size=-1M"], r"--size '-1M'"),
    (["scale", "--size", "infG"], r"--size 'infG'"),
    (["scale", "--size", "1.5"], r"--size '1.5'"),
    (["scale", "--size", "lots"], r"--size 'lots'"),
    (["own", "--data", "MATRIX"], r"m.json: expected an object whose \"points\" is a list"),
])
def test_sim_cli_bad_arguments(matrix_file, capsys, argv, message):
    argv = [matrix_file([[0]]) if a == "MATRIX" else a for a in argv]
    rc, err = _main(["sim"] + argv, capsys)
    assert rc == 2 and err.startswith("braid sim: ") and re.search(message, err), err


def test_sim_scale_size_too_small():
    from braid.sim.scale import run
    with pytest.raises(MisuseError, match=r"scale: 1 bytes per GPU is too small for all_reduce on 2 nodes"):
        run("all_reduce", 2, per_gpu_bytes=1)
    with pytest.raises(MisuseError, match=r"scale: hot = 2"):
        run("alltoallv", 2, hot=2)


# end to end: the process exits 2 with one line on stderr and no traceback (started together:
# each pays torch's import)
END_TO_END = [
    (["route", "--matrix", "NEG", "--topology", "h200x2"], "braid route: --matrix", "matrix[0][1] = -5"),
    (["route", "--matrix", "NEG", "--topology", "multinode", "--nodes", "-1"], "braid route: --nodes -1", ">= 1"),
    (["route", "--matrix", "BAD", "--topology", "h200x2"], "braid route: --matrix", "is not JSON"),
    (["sim", "scale", "--hot", "1.5"], "braid sim: --hot = 1.5", "[0, 1]"),
]


def test_command_lines_end_to_end(tmp_path):
    neg, bad = tmp_path / "neg.json", tmp_path / "bad.json"
    neg.write_text("[[0, -5], [1, 0]]")
    bad.write_text("[[0, 1], [1, 0")
    procs = []
    for argv, _, _ in END_TO_END:
        argv = [str(neg) if a == "NEG" else str(bad) if a == "BAD" else a for a in argv]
        procs.append(subprocess.Popen([sys.executable, "-m", "braid"] + argv, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    for p, (argv, head, part) in zip(procs, END_TO_END):
        out, err = p.communicate(timeout=120)
        assert p.returncode == 2, (argv, err)
        assert err.startswith(head) and part in err and "Traceback" not in err, (argv, err)
        assert len(err.strip().splitlines()) == 1 and out == "", (argv, err, out)
