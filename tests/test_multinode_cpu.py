"""A world of several nodes on CPU: BRAID_FAKE_NODES cuts the test's ranks into pretend nodes,
BRAID_HIER=1 turns the node and rail steps on (off, the default, leaves every call to gloo whole).

Each pretend node gets its own braid communicator (segment, shm and gloo lanes); the steps between
nodes run on gloo rail groups (comm/hier.py). Every op is checked against a reference computed
locally from every rank's seeded input (no collective in the reference), at odd sizes, for the
direct API and for the braid backend, on 2 x 2 and 3 x 2 pretend nodes. Data-movement ops must give
the same bits as the reference; reductions use data whose sums are exact in every order (quarter
steps), so they are compared bit for bit too.
"""
from __future__ import annotations

import pytest

from conftest import run_world

SIZES = (3, 1031, 65537)          # elements per rank (odd, and not divisible by the node size)


def _data(seed: int, rank: int, n: int, dtype):
    import torch
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype.is_floating_point:
        return (torch.randint(-40, 41, (n,), generator=g).to(torch.float64) / 4).to(dtype)
    return torch.randint(-1000, 1000, (n,), generator=g, dtype=torch.int64).to(dtype)


def _reduce(stack, name):
    import torch
    if name == "sum":
        return stack.sum(0, dtype=stack.dtype)
    if name == "max":
        return stack.max(0).values
    if name == "min":
        return stack.min(0).values
    if name == "avg":
        total = stack.sum(0, dtype=stack.dtype)
        return total / stack.shape[0] if stack.dtype.is_floating_point else torch.div(
            total, stack.shape[0], rounding_mode="trunc")
    raise AssertionError(name)


def _worker(rank, world, mode, fake):
    import torch
    import torch.distributed as dist

    import braid
    from braid.comm.hier import HierHandle
    if mode == "backend":
        # a new rendezvous port, picked by rank 0 and told over the first group (reusing the first
        # group's port races with its store's shutdown)
        from conftest import free_port
        box = [free_port() if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        dist.barrier()
        dist.destroy_process_group()
        dist.init_process_group("braid", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{box[0]}")
        api = dist
        from braid.backend import world_group
        pg = world_group()
        comm = pg.ensure_communicator()
    else:
        comm = braid.init()
        api = braid
    per_node = world // fake
    assert comm.hier is not None and comm.hier.num_nodes == fake and comm.hier.per_node == per_node
    assert comm.hier.node.world_size == per_node and comm.hier.node.segment is not None
    assert comm.segment is None            # the world spans (pretend) nodes: no world segment
    ops = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.MAX: "max", dist.ReduceOp.MIN: "min", dist.ReduceOp.AVG: "avg"}
    bad, steps_seen = [], set()

    def check(what, got, want):
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
            diff = (got.double() - want.double()).abs().max().item() if got.shape == want.shape else "shape"
            bad.append(f"rank {rank} {what}: differs (max diff {diff})")

    def note():
        h = comm.last_handle
        if isinstance(h, HierHandle):
            steps_seen.update(s for s, _, _ in h.steps)
        return h

    seed = 11
    for n in SIZES:
        for dtype in (torch.float32, torch.int64, torch.bfloat16):
            seed += 1
            ins = [_data(seed, r, n, dtype) for r in range(world)]
            stack = torch.stack(ins)
            for op, name in ops.items():
                if dtype is torch.bfloat16 and name == "avg":
                    continue       # bf16 quarter steps divided by 6 round differently per order
                t = ins[rank].clone()
                api.all_reduce(t, op=op)
                check(f"all_reduce {name} {dtype} n={n}", t, _reduce(stack, name))
                assert isinstance(note(), HierHandle), f"all_reduce {name} {dtype} n={n} did not run in steps"
            # all_gather (tensor and list)
            out = torch.empty(n * world, dtype=dtype)
            api.all_gather_into_tensor(out, ins[rank])
            check(f"all_gather_into_tensor {dtype} n={n}", out, torch.cat(ins))
            note()
            lst = [torch.empty(n, dtype=dtype) for _ in range(world)]
            api.all_gather(lst, ins[rank])
            check(f"all_gather list {dtype} n={n}", torch.cat(lst), torch.cat(ins))
            # reduce_scatter: every rank's input holds world chunks of n
            big = [_data(seed + 500, r, n * world, dtype) for r in range(world)]
            for op, name in ops.items():
                if dtype is torch.bfloat16 and name == "avg":
                    continue
                o = torch.empty(n, dtype=dtype)
                api.reduce_scatter_tensor(o, big[rank].clone(), op=op)
                want = _reduce(torch.stack(big), name)[rank * n:(rank + 1) * n]
                check(f"reduce_scatter {name} {dtype} n={n}", o, want)
                note()
            # broadcast from every root
            for root in range(world):
                t = ins[rank].clone()
                api.broadcast(t, src=root)
                check(f"broadcast root {root} {dtype} n={n}", t, ins[root])
                note()
            # all_to_all, equal splits: big[r][d*n:(d+1)*n] goes to d
            o = torch.empty(n * world, dtype=dtype)
            api.all_to_all_single(o, big[rank])
            want = torch.cat([big[s][rank * n:(rank + 1) * n] for s in range(world)])
            check(f"all_to_all_single {dtype} n={n}", o, want)
            note()
            # uneven all_to_all, reduce, send/recv: the native library whole
            splits = [(rank + d) % 3 + 1 for d in range(world)]
            recv = [(s + rank) % 3 + 1 for s in range(world)]
            src = _data(seed + 900, rank, sum(splits), dtype)
            o = torch.empty(sum(recv), dtype=dtype)
            api.all_to_all_single(o, src, recv, splits)
            parts = []
            for s in range(world):
                their = [(s + d) % 3 + 1 for d in range(world)]
                full = _data(seed + 900, s, sum(their), dtype)
                off = sum(their[:rank])
                parts.append(full[off:off + their[rank]])
            check(f"uneven all_to_all {dtype} n={n}", o, torch.cat(parts))
            t = ins[rank].clone()
            api.reduce(t, dst=world - 1, op=dist.ReduceOp.SUM)
            if rank == world - 1:
                check(f"reduce {dtype} n={n}", t, _reduce(stack, "sum"))
    # a small call below BRAID_HIER_MIN_BYTES goes whole; then the threshold is the default
    return {"bad": bad, "steps": sorted(steps_seen)}


@pytest.mark.parametrize("mode", ["direct", "backend"])
@pytest.mark.parametrize("world,fake", [(4, 2), (6, 3)])
def test_every_op_on_pretend_nodes(world, fake, mode):
    res = run_world(_worker, world, mode, fake, timeout=240,
                    env={"BRAID_FAKE_NODES": str(fake), "BRAID_HIER": "1", "BRAID_HIER_MIN_BYTES": "0"})
    for r in res:
        assert not r["bad"], "\n".join(r["bad"][:20])
    steps = set(res[0]["steps"])       # direct API and backend alike run every call in steps
    for s in ("node reduce_scatter", "rail all_reduce", "node all_gather", "rail all_gather",
              "rail reduce_scatter", "node broadcast", "node all_to_all", "rail all_to_all"):
        assert s in steps, (s, steps)


@pytest.mark.parametrize("world,fake", [(4, 2), (6, 3)])
def test_all_reduce_in_pieces(world, fake):
    """all_reduce in pieces of 1 KiB (up to 8 per call, the rail step of one beside the node steps
    of the next): every op still exact."""
    res = run_world(_worker, world, "direct", fake, timeout=240,
                    env={"BRAID_FAKE_NODES": str(fake), "BRAID_HIER": "1", "BRAID_HIER_MIN_BYTES": "0",
                         "BRAID_HIER_PIECE_KB": "1"})
    for r in res:
        assert not r["bad"], "\n".join(r["bad"][:20])


def _threshold_worker(rank, world):
    import torch
    import braid
    from braid.comm.hier import HierHandle
    comm = braid.init()
    small = torch.ones(16)
    braid.all_reduce(small)
    small_steps = isinstance(comm.last_handle, HierHandle)
    big = torch.ones(1 << 18)      # 1 MiB of float32: the default threshold
    braid.all_reduce(big)
    return {"small": small_steps, "big": isinstance(comm.last_handle, HierHandle),
            "ok": bool((small == world).all() and (big == world).all())}


def test_small_calls_go_whole_large_ones_in_steps():
    res = run_world(_threshold_worker, 4, env={"BRAID_FAKE_NODES": "2", "BRAID_HIER": "1"})
    assert all(r["ok"] for r in res)
    assert not any(r["small"] for r in res) and all(r["big"] for r in res)


def _bad_fake_worker(rank, world):
    import braid
    from braid.errors import MisuseError
    try:
        braid.init()
    except MisuseError as exc:
        return str(exc)
    return ""


def test_fake_nodes_must_divide_the_world():
    res = run_world(_bad_fake_worker, 3, env={"BRAID_FAKE_NODES": "2"})
    assert all("BRAID_FAKE_NODES=2 does not divide the world of 3" in r for r in res)


def test_node_layout_rules():
    from braid.comm.hier import node_layout
    nodes, why = node_layout(["a", "a", "b", "b"])
    assert nodes == [[0, 1], [2, 3]] and why == ""
    assert "different rank counts" in node_layout(["a", "a", "b"])[1]
    assert "not consecutive" in node_layout(["a", "b", "a", "b"])[1]


def test_bench_on_pretend_nodes_says_which_step_ran_where(tmp_path):
    """`braid bench` on a world of 2 pretend nodes: every point is right, and the JSON names the
    node steps (braid's lanes) and the rail steps (gloo) of each call."""
    import json
    import os
    import subprocess
    import sys
    out = tmp_path / "bench.json"
    env = dict(os.environ, BRAID_CACHE_DIR=str(tmp_path / "cache"), BRAID_HOST_BUFFER_MB="4",
               BRAID_TIMEOUT_S="60", BRAID_FAKE_NODES="2", BRAID_HIER="1", BRAID_HIER_MIN_BYTES="0")
    proc = subprocess.run(
        [sys.executable, "-m", "braid", "bench", "--op", "all", "--nproc", "4",
         "--sizes", "256K:256K", "--iters", "2", "--fixed-iters", "--repeat", "1", "--no-calibrate",
         "--plain", "--json", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    points = json.loads(out.read_text())
    assert {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all_single"} <= {p["op"] for p in points}
    for p in points:
        assert p["wrong"] == 0
        if p["op"] in ("send_recv", "reduce"):       # whole, on gloo
            assert "steps" not in p and p["shares"] == {"gloo": 1.0}, p
            continue
        steps = [s["step"] for s in p["steps"]]
        assert any(s.startswith("node ") for s in steps) and any(s.startswith("rail ") for s in steps), steps
        assert "rail-gloo" in p["shares"] and abs(sum(p["shares"].values()) - 1.0) < 1e-6


_TWO_LAUNCH_SCRIPT = r'''
import os, sys, torch, torch.distributed as dist
import braid
from braid.comm.hier import HierHandle
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
comm = braid.init()
assert comm.hier is not None and comm.hier.num_nodes == 2, "two launches must make two nodes"
x = torch.arange(1001, dtype=torch.float64) + rank
braid.all_reduce(x)
want = torch.arange(1001, dtype=torch.float64) * world + sum(range(world))
ok = torch.equal(x, want) and isinstance(comm.last_handle, HierHandle)
out = torch.empty(1001 * world, dtype=torch.float64)
braid.all_gather_into_tensor(out, torch.full((1001,), float(rank), dtype=torch.float64))
ok = ok and torch.equal(out, torch.arange(world, dtype=torch.float64).repeat_interleave(1001))
print(f"RESULT rank {rank} node {os.environ['GROUP_RANK']} ok={ok}", flush=True)
braid.close()
dist.destroy_process_group()
sys.exit(0 if ok else 3)
'''


def test_two_torchrun_launches_make_two_nodes(tmp_path):
    """Two `torchrun --nnodes=2 --node_rank=0/1` launches against 127.0.0.1, 2 ranks each: with
    BRAID_FAKE_NODES=2 each launch is one node (one host cannot tell them apart otherwise), and the
    calls run as node and rail steps."""
    import os
    import subprocess
    import sys

    from conftest import free_port
    script = tmp_path / "two_launch.py"
    script.write_text(_TWO_LAUNCH_SCRIPT)
    port = free_port()
    env = dict(os.environ, BRAID_FAKE_NODES="2", BRAID_HIER="1", BRAID_HIER_MIN_BYTES="0", BRAID_HOST_BUFFER_MB="2",
               BRAID_HOST_CHUNK_KB="64", BRAID_CALIBRATE="off", BRAID_CACHE_DIR=str(tmp_path / "cache"),
               BRAID_TIMEOUT_S="60", OMP_NUM_THREADS="1",
               TMPDIR=str(tmp_path))          # torchrun's agent leaves a torchelastic_* folder there
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
         "--node-rank", str(k), "--master-addr", "127.0.0.1", "--master-port", str(port), str(script)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for k in (0, 1)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=180)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    text = "\n".join(outs)
    assert all(p.returncode == 0 for p in procs), text[-4000:]
    for r in range(4):
        assert f"RESULT rank {r} node {r // 2} ok=True" in text, text[-4000:]


def _uneven_worker(rank, world, hot):
    """Uneven all_to_all over the rails (BRAID_ROUTE=on): skewed matrices with a hot pair across
    nodes, zeros, rows of several elements, against a local reference."""
    import random

    import torch

    import braid
    from braid.comm.hier import HierHandle
    comm = braid.init()
    bad, steps = [], set()
    rng = random.Random(99)                      # the same matrices on every rank
    for call in range(6):
        width = rng.choice([1, 3, 17])
        dtype = rng.choice([torch.float32, torch.int64, torch.bfloat16])
        m = [[rng.choice([0, 1, 5, 40]) for _ in range(world)] for _ in range(world)]
        if hot:
            m[0][world - 1] = 3000 + call        # rank 0 -> the last rank, on another node
            m[1][world - 2] = 2000
        def rows(s, d, m=m, width=width, dtype=dtype, call=call):
            g = torch.Generator().manual_seed(call * 10000 + s * 100 + d)
            return torch.randint(-500, 500, (m[s][d], width), generator=g).to(dtype)
        inp = torch.cat([rows(rank, d) for d in range(world)])
        out = torch.full((sum(m[s][rank] for s in range(world)), width), -7).to(dtype)
        braid.all_to_all_single(out, inp, [m[s][rank] for s in range(world)], m[rank])
        want = torch.cat([rows(s, rank) for s in range(world)])
        if not torch.equal(out, want):
            bad.append(f"rank {rank} call {call}: differs")
        h = comm.last_handle
        if isinstance(h, HierHandle):
            steps.update(s for s, _, _ in h.steps)
    # a rank whose output split sizes disagree with its peers' input split sizes: every rank raises
    from braid.errors import PeerMismatchError
    inp = torch.ones(world, 2)
    outs = [1] * world
    if rank == 0:
        outs = [2] + [1] * (world - 2)           # still world - 1 + 1 rows, but one split wrong
        outs.append(0)
    try:
        braid.all_to_all_single(torch.empty(sum(outs), 2), inp, outs, [1] * world)
        raised = ""
    except PeerMismatchError as exc:
        raised = str(exc)
    return {"bad": bad, "steps": sorted(steps), "raised": raised}


@pytest.mark.parametrize("world,fake", [(4, 2), (6, 3)])
def test_uneven_all_to_all_over_every_rail(world, fake):
    res = run_world(_uneven_worker, world, True, timeout=240,
                    env={"BRAID_FAKE_NODES": str(fake), "BRAID_HIER": "1", "BRAID_HIER_MIN_BYTES": "0", "BRAID_ROUTE": "on"})
    for r in res:
        assert not r["bad"], r["bad"]
        assert {"node all_to_all (to the rails)", "rail all_to_all", "node all_to_all (from the rails)"} <= set(r["steps"])
        assert "rank 0 expects 2 rows from rank 0" in r["raised"], r["raised"]


def _rail_use_worker(rank, world):
    """The hot pair's rows cross on every rail: the plan spreads them (no step asserts timing)."""
    import torch

    import braid
    comm = braid.init()
    m = [[4] * world for _ in range(world)]
    m[0][world - 1] = 4096
    inp = torch.ones(sum(m[rank]), 8)
    out = torch.empty(sum(m[s][rank] for s in range(world)), 8)
    braid.all_to_all_single(out, inp, [m[s][rank] for s in range(world)], m[rank])
    parts = comm.hier._a2av.parts(m, 32)
    return {"hot": parts[(0, world - 1)], "ok": bool((out == 1).all())}


def test_hot_pair_uses_every_rail():
    res = run_world(_rail_use_worker, 4, env={"BRAID_FAKE_NODES": "2", "BRAID_HIER": "1", "BRAID_HIER_MIN_BYTES": "0",
                                              "BRAID_ROUTE": "on"})
    for r in res:
        assert r["ok"] and sum(r["hot"]) == 4096 and all(v > 0 for v in r["hot"]), r["hot"]


def test_split_rows_sums_exactly():
    from braid.comm.hier_a2a import _split_rows
    assert _split_rows([1.0, 1.0, 1.0], 10, 4) == [4, 3, 3]
    assert _split_rows([0.0, 0.0], 7, 4) == [7, 0]
    assert _split_rows([3.0, 1.0], 0, 4) == [0, 0]
    assert sum(_split_rows([0.2, 0.5, 0.3], 1001, 2)) == 1001


def _off_worker(rank, world):
    import torch
    import braid
    comm = braid.init()
    t = torch.arange(300_000, dtype=torch.float64) + rank
    braid.all_reduce(t)
    return {"hier": comm.hier is not None, "nodes": comm.num_nodes, "single": comm.single_node,
            "ok": bool(torch.equal(t, torch.arange(300_000, dtype=torch.float64) * world + sum(range(world)))),
            "shares": comm.last_handle.shares}


def test_steps_are_off_by_default():
    """Without BRAID_HIER the pretend nodes are seen (no world segment) and every call goes to gloo
    whole, right."""
    for r in run_world(_off_worker, 4, env={"BRAID_FAKE_NODES": "2"}):
        assert not r["hier"] and r["nodes"] == 2 and not r["single"] and r["ok"]
        assert r["shares"] == {"gloo": 1.0}


def test_ddp_and_fsdp_train_through_the_steps(tmp_path):
    """DDP and FSDP2 under backend braid on 2 x 2 pretend nodes with the steps on for every call:
    the workload bench compares every step's loss and the final weights with plain gloo (exit 3 on
    a mismatch beyond its stated tolerance)."""
    import json
    import os
    import subprocess
    import sys
    out = tmp_path / "jobs.json"
    env = dict(os.environ, BRAID_CACHE_DIR=str(tmp_path / "cache"), BRAID_HOST_BUFFER_MB="4",
               BRAID_TIMEOUT_S="60", BRAID_FAKE_NODES="2", BRAID_HIER="1", BRAID_HIER_MIN_BYTES="0")
    proc = subprocess.run([sys.executable, "-m", "braid", "bench", "--workload", "ddp,fsdp", "--nproc", "4",
                           "--steps", "2", "--repeat", "1", "--plain", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert {r["workload"] for r in rows} == {"ddp", "fsdp"}
    assert all(r["losses_equal"] is True for r in rows), rows


def _beacon_worker(rank, world):
    import time

    import braid
    comm = braid.init()
    assert comm.hier is not None
    if rank == 3:                       # node 1 gives up, with no call in flight anywhere
        comm.hier.node.abort("injected on rank 3")
    t0 = time.monotonic()
    while not comm.aborted and time.monotonic() - t0 < 15:
        time.sleep(0.05)
    took = time.monotonic() - t0
    out = {"world": comm.aborted, "node": comm.hier.node.aborted or "", "took": took}
    try:
        braid.all_reduce(__import__("torch").ones(1 << 20))
        out["next_call"] = "returned"
    except braid.BraidError as exc:
        out["next_call"] = type(exc).__name__
    return out


def test_a_node_that_gives_up_ends_the_world_on_every_node():
    """Nodes do not share a segment: a node's abort reaches the other nodes through the process
    group's store (comm/hier.py, _Beacon), within a few of its one-second looks; every rank's
    world and node communicators are then aborted and refuse the next call."""
    res = run_world(_beacon_worker, 4, env={"BRAID_FAKE_NODES": "2", "BRAID_HIER": "1"}, timeout=90)
    for r, out in enumerate(res):
        assert out["world"], (r, out)
        assert out["took"] < 10, (r, out)
        assert out["next_call"] == "LaneFailureError", (r, out)
        if r < 2:                       # the other node learnt it from the store
            assert "another node gave up" in out["world"] and "injected on rank 3" in out["world"], (r, out)
            assert out["node"], (r, out)
