"""GPU tier: reductions on every lane combination against a float64 reference and NCCL, and
determinism (the same inputs give bitwise the same output twice and on every rank)."""
from __future__ import annotations

import itertools
import time

import torch
import torch.distributed as dist

from braid.collectives.reduce import PremulSum
from gpu_world import needs, run
from test_gpu_collectives import ENV, LANE_SETS

NEEDS = needs(2)
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int32, torch.int64, torch.uint8]
OPS = ["sum", "avg", "product", "min", "max", "premul"]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _inputs(n, dtype, world, seed):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, generator=g) * 2 for _ in range(world)]
    if not dtype.is_floating_point:
        lo = 0 if dtype == torch.uint8 else -3
        xs = [x.round().clamp(lo, 3) for x in xs]
    return [x.to(dtype) for x in xs]


def _expected(xs, name, dtype):
    x64 = torch.stack([x.double() for x in xs])
    if name in ("sum", "premul"):
        e = (x64 * (0.5 if name == "premul" else 1.0)).sum(0)
    elif name == "avg":   # integers: the sum divided, truncated toward zero (NCCL's integer average)
        e = x64.mean(0) if dtype.is_floating_point else torch.trunc(x64.sum(0) / len(xs))
    elif name == "product":
        e = x64.prod(0)
    elif name == "min":
        e = x64.amin(0)
    else:
        e = x64.amax(0)
    if not dtype.is_floating_point:   # integer sums/products wrap like NCCL's
        e = e.to(torch.int64).to(dtype).double()
    return e


def _close(got, exp, dtype, world):
    if not dtype.is_floating_point:
        return torch.equal(got.double(), exp)
    tol = TOL[dtype] * world
    return bool(((got.double() - exp).abs() <= tol * (exp.abs() + 1)).all())


def _worker(rank, world, comm, dev):
    # large buffers first, each lane alone and together, against NCCL (different summation
    # order: tolerance) and bitwise against itself
    t0 = time.perf_counter()
    x = torch.randn(1 << 24, device=dev, dtype=torch.bfloat16) * (rank + 1)
    ref = x.clone()
    dist.all_reduce(ref)
    scale = x.abs().double()          # rounding error of a sum scales with sum |x_i|, not |sum|
    dist.all_reduce(scale)
    for shares in LANE_SETS:
        a = x.clone()
        with comm.fixed_shares(shares):
            comm.all_reduce(a)
        off = ((a.double() - ref.double()).abs() > 0.03 * scale + 1e-3)
        bad = int(off.sum())
        if bad:
            idx = off.nonzero().flatten()
            per = x.numel() // world
            chunks = torch.bincount(idx // per, minlength=world).tolist()
            raise AssertionError(f"large all_reduce {shares} rank {rank}: {bad} elements off NCCL's result; "
                                 f"bad per chunk {chunks}; first {idx[:3].tolist()} last {idx[-3:].tolist()}; "
                                 f"got {a[idx[:3]].tolist()} want {ref[idx[:3]].tolist()}")
        o = torch.empty(x.numel() // world, device=dev, dtype=x.dtype)
        with comm.fixed_shares(shares):
            comm.reduce_scatter_tensor(o, x)
        lo, hi = rank * o.numel(), (rank + 1) * o.numel()
        c, sc = ref[lo:hi], scale[lo:hi]
        bad = int(((o.double() - c.double()).abs() > 0.03 * sc + 1e-3).sum())
        assert bad == 0, f"large reduce_scatter {shares}: {bad} elements off NCCL's result"
    if rank == 0:
        print(f"world {world}: large cases {time.perf_counter() - t0:.1f} s", flush=True)
    # odd sizes long enough for the copy engines' pipeline to cut several pieces per chunk,
    # with a split point that is not a multiple of anything: float64 reference, bitwise
    # repeatable, the same on every rank
    refs = {}           # the CPU references, made once per case (not once per lane set)

    def ref(n, dtype, name, seed):
        key = (n, dtype, name, seed)
        if key not in refs:
            xs = _inputs(n, dtype, world, seed=seed)
            refs[key] = (xs, _expected(xs, name, dtype))
        return refs[key]

    for shares in LANE_SETS:
        for dtype, n, name in ((torch.float32, 3_000_007, "sum"), (torch.bfloat16, 5_000_011, "max"),
                               (torch.float16, 4_000_037, "avg"), (torch.int32, 2_999_999, "sum")):
            xs, exp = ref(n, dtype, name, n)
            runs = []
            for _ in range(2):
                t = xs[rank].to(dev)
                with comm.fixed_shares(shares):
                    comm.all_reduce(t, name)
                runs.append(t)
            assert _close(runs[0].cpu(), exp, dtype, world), f"pipelined all_reduce {shares} {dtype} n={n} {name}"
            assert torch.equal(runs[0], runs[1]), f"all_reduce not repeatable {shares} {dtype} n={n}"
            gathered = [torch.empty_like(runs[0]) for _ in range(world)]
            dist.all_gather(gathered, runs[0])
            assert all(torch.equal(g, runs[0]) for g in gathered), f"ranks disagree {shares} {dtype} n={n}"
            m = -(-n // world)
            full = torch.cat([xs[rank][:m]] * world).to(dev)
            out = torch.empty(m, dtype=dtype, device=dev)
            with comm.fixed_shares(shares):
                comm.reduce_scatter_tensor(out, full, name)
            if (m, n, dtype, name) not in refs:
                refs[(m, n, dtype, name)] = _expected([x[:m] for x in xs], name, dtype)
            exp_rs = refs[(m, n, dtype, name)]
            assert _close(out.cpu(), exp_rs, dtype, world), f"pipelined reduce_scatter {shares} {dtype} n={m}"
    refs.clear()
    # the tapered cut and the even one reduce every element in the same order: bitwise the same
    # (the two-GPU run tapers pieces from 1 MiB, so both cuts differ there)
    from braid import envs
    x = (torch.randn(5_000_011, device=dev) * (rank + 1)).to(torch.bfloat16)
    for shares in ({"ce": 1.0}, {"ce": 0.9, "host": 0.1}):
        got = []
        for taper in (0, 1):
            with envs.override(BRAID_CE_TAPER=taper), comm.fixed_shares(shares):
                t = x.clone()
                comm.all_reduce(t)
                o = torch.empty(x.numel() // world, dtype=x.dtype, device=dev)
                comm.reduce_scatter_tensor(o, x[: o.numel() * world])
                got.append((t, o))
        assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1]), \
            f"tapered and even cuts differ {shares}"
    if rank == 0:
        print(f"world {world}: pipelined odd sizes {time.perf_counter() - t0:.1f} s", flush=True)
    # every op x dtype x size on every lane set with 2 GPUs; with more, each lane set takes a
    # rotating quarter of the op x dtype x size cases (all of them across the lane sets): the
    # full product took over 3 minutes on 4 x H200
    for li, shares in enumerate(LANE_SETS):
        with comm.fixed_shares(shares):
            for i, (dtype, n, name) in enumerate(itertools.product(DTYPES, [0, 1, 7, 4099, 300_001], OPS)):
                if world > 2 and i % 4 != li % 4:
                    continue
                if name == "premul" and not dtype.is_floating_point:
                    continue
                if name == "product" and dtype.is_floating_point and dtype != torch.float32:
                    continue   # products of many half values under/overflow: covered in float32
                op = PremulSum(0.5) if name == "premul" else name
                xs, exp = ref(n, dtype, name, n * 31 + len(name))
                t = xs[rank].to(dev)
                comm.all_reduce(t, op)
                assert _close(t.cpu(), exp, dtype, world), f"all_reduce {shares} {dtype} n={n} {name}"
                t2 = xs[rank].to(dev)
                comm.all_reduce(t2, op)
                assert torch.equal(t, t2), f"all_reduce not deterministic {shares} {dtype} n={n} {name}"
                gathered = [torch.empty_like(t) for _ in range(world)]
                dist.all_gather(gathered, t)
                assert all(torch.equal(g, t) for g in gathered), "ranks disagree on the all_reduce result"
                full = torch.cat([xs[rank]] * world).to(dev)       # every chunk: this rank's data
                out = torch.empty(n, dtype=dtype, device=dev)
                comm.reduce_scatter_tensor(out, full, op)
                assert _close(out.cpu(), exp, dtype, world), f"reduce_scatter {shares} {dtype} n={n} {name}"
                t3 = xs[rank].to(dev)
                comm.reduce(t3, world - 1, op)
                if rank == world - 1:
                    assert _close(t3.cpu(), exp, dtype, world), f"reduce {shares} {dtype} n={n} {name}"
                else:
                    assert torch.equal(t3.cpu(), xs[rank]), "reduce changed a non-root tensor"
    if rank == 0:
        print(f"world {world}: every op x dtype x lane set {time.perf_counter() - t0:.1f} s", flush=True)


@NEEDS
def test_reductions_two_gpus(tmp_path):
    # pieces of 1 MiB and up (by default 16 MiB: these sizes would go in one piece) that end in a
    # taper (planner/pieces.py; by default from 64 MiB), so that the pipeline of several pieces,
    # pushed and tapered, runs at these sizes; the four-GPU run keeps the defaults
    run(2, tmp_path, _worker, dict(ENV, BRAID_CE_TAPER_FROM_KB="1024", BRAID_CE_MIN_PIECE_MB="1"))


@needs(4)
def test_reductions_four_gpus(tmp_path):
    run(4, tmp_path, _worker, ENV)
