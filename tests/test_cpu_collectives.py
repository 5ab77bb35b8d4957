"""Every op on the CPU lanes (gloo, shm, both), in real multi-process worlds.

Reference results never come from a collective: every rank derives every rank's data from a
seeded generator keyed by (test seed, case, rank), so it builds the expected output locally.
Outputs start as the bitwise complement of the expected bytes, so a byte braid fails to write
can never look right; comparisons are bitwise (uint8 views).

Each test function is one spawned world running many cases (process start-up dominates on small
machines). Workers run with 2 MiB rings of 64 KiB slots, so the larger cases wrap around each
ring many times, and with BRAID_MIN_SPLIT_KB=1 so that multi-lane shares really split.
"""
from __future__ import annotations

import hashlib
import itertools
import math
import random

import pytest
import torch

from conftest import run_world

LANE_SETS = [{"gloo": 1.0}, {"shm": 1.0}, {"gloo": 0.5, "shm": 0.5}, {"gloo": 0.2, "shm": 0.8}, None]
DTYPES = ["float32", "float16", "bfloat16", "int8", "int32", "int64", "uint8", "bool"] + \
    [n for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]
SMALL_SIZES = [0, 1, 7, 1023]
LARGE = 300_001
LARGE_DTYPES = ["float32", "bfloat16", "int8", "int64", "bool"] + \
    [n for n in ("float8_e5m2",) if hasattr(torch, n)]
ENV = {"BRAID_MIN_SPLIT_KB": "1"}


# ---------------------------------------------------------------------------------------------
# data and checks (used inside the workers)
# ---------------------------------------------------------------------------------------------

def seed_of(*key) -> int:
    return int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:8], "little") >> 1


def make(key: tuple, shape, dtype: torch.dtype) -> torch.Tensor:
    """Deterministic data for `key`; no zeros in numeric types, both values in bool."""
    shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
    numel = math.prod(shape)
    g = torch.Generator().manual_seed(seed_of(*key))
    if dtype == torch.bool:
        t = torch.randint(0, 2, (numel,), generator=g).bool()
    elif dtype.is_floating_point:
        mag = torch.rand(numel, generator=g) * 3 + 0.5
        sign = torch.randint(0, 2, (numel,), generator=g) * 2 - 1
        t = (mag * sign).to(dtype)
    else:
        info = torch.iinfo(dtype)
        lo, hi = max(info.min, -(1 << 40)), min(info.max, 1 << 40)
        t = torch.randint(lo, hi, (numel,), generator=g, dtype=torch.int64)
        t[t == 0] = 1
        t = t.to(dtype)
    return t.reshape(shape)


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def poison(out: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Fill `out` with the complement of the bytes it must end up holding."""
    assert out.is_contiguous() and out.numel() == expected.numel()
    raw(out).copy_(torch.bitwise_not(raw(expected.contiguous())))
    return out


def check(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    a, b = raw(got.contiguous()), raw(expected.contiguous())
    if not torch.equal(a, b):
        bad = (a != b).nonzero().reshape(-1)
        raise AssertionError(f"{what}: {bad.numel()} of {a.numel()} bytes differ, first at byte "
                             f"{bad[0].item()} (got {a[bad[0]].item()}, want {b[bad[0]].item()})")


def check_shares(comm, shares, nbytes: int, what: str) -> None:
    """The call ran on the lanes it was given, and a multi-lane split really used each lane."""
    h = comm.last_handle
    assert h is not None, what
    if h.plan is None:
        # gloo alone: braid hands the call to gloo's own collective (no plan, no lanes of its own)
        assert h.native is not None, what
        assert h.shares == {"gloo": 1.0}, (what, h.shares)
        assert shares is None or {k for k, v in shares.items() if v > 0} == {"gloo"}, (what, shares)
        return
    got = h.shares
    assert math.isclose(sum(got.values()), 1.0, rel_tol=1e-9), (what, got)
    if shares is None:
        assert set(got) <= {"gloo", "shm"}, (what, got)
        return
    want = {k for k, v in shares.items() if v > 0}
    assert set(got) == want, (what, got, shares)
    if len(want) > 1 and nbytes >= 64 << 10:
        moved = h.plan.lane_bytes()
        assert all(moved.get(k, 0) > 0 for k in want), (what, "a lane carried nothing", moved)


def cases(sizes_small=SMALL_SIZES, dtypes=DTYPES, large_dtypes=LARGE_DTYPES, lane_sets=LANE_SETS, large=LARGE):
    out = []
    for li, shares in enumerate(lane_sets):
        for dt in dtypes:
            for n in sizes_small:
                out.append((li, shares, dt, n))
        for dt in large_dtypes:
            out.append((li, shares, dt, large))
    return out


def fixed(comm, shares):
    import contextlib
    return comm.fixed_shares(shares) if shares is not None else contextlib.nullcontext()


# ---------------------------------------------------------------------------------------------
# workers
# ---------------------------------------------------------------------------------------------

def _all_gather_worker(rank, w, seed, case_list):
    import braid
    comm = braid.init()
    done = 0
    for ci, (li, shares, dt, n) in enumerate(case_list):
        dtype = getattr(torch, dt)
        inputs = [make((seed, ci, "ag", r), n, dtype) for r in range(w)]
        x = inputs[rank].clone()
        expected = torch.cat(inputs)
        what = f"all_gather_into_tensor world={w} shares={shares} {dt} n={n}"
        with fixed(comm, shares):
            out = poison(torch.empty(w * n, dtype=dtype), expected)
            comm.all_gather_into_tensor(out, x)
            check(out, expected, what)
            check(x, inputs[rank], what + " (input changed)")
            check_shares(comm, shares, n * inputs[0].element_size(), what)
            # output as a 2-D (world, n) tensor
            out2 = poison(torch.empty(w, n, dtype=dtype), expected)
            comm.all_gather_into_tensor(out2, x)
            check(out2, expected, what + " 2-D output")
            # into a list
            outs = [poison(torch.empty(n, dtype=dtype), inputs[r]) for r in range(w)]
            comm.all_gather(outs, x)
            for r in range(w):
                check(outs[r], inputs[r], f"all_gather (list) [{r}] world={w} shares={shares} {dt} n={n}")
            check_shares(comm, shares, n * inputs[0].element_size(), what + " list")
        done += 1
    # shapes: a scalar, a 2-D input, non-contiguous inputs (copied by braid)
    for li, shares in enumerate(LANE_SETS):
        with fixed(comm, shares):
            for form in ("scalar", "2d", "stride2", "transposed"):
                dtype = torch.float32 if form != "transposed" else torch.int16
                key = (seed, "ag-form", li, form)
                if form == "scalar":
                    srcs = [make(key + (r,), (), dtype) for r in range(w)]
                elif form == "2d":
                    srcs = [make(key + (r,), (31, 17), dtype) for r in range(w)]
                elif form == "stride2":
                    srcs = [make(key + (r,), 2 * 50_001, dtype)[::2] for r in range(w)]
                else:
                    srcs = [make(key + (r,), (211, 97), dtype).t() for r in range(w)]
                x = srcs[rank]
                assert x.is_contiguous() == (form in ("scalar", "2d"))
                expected = torch.cat([s.reshape(-1) for s in srcs])
                out = poison(torch.empty(expected.numel(), dtype=dtype), expected)
                comm.all_gather_into_tensor(out, x)
                check(out, expected, f"all_gather {form} shares={shares}")
                outs = [poison(torch.empty(s.shape, dtype=dtype), s) for s in srcs]
                comm.all_gather(outs, x)
                for r in range(w):
                    check(outs[r], srcs[r], f"all_gather list {form} shares={shares} [{r}]")
                done += 1
            # in place: the input is this rank's slot of the output
            n = 50_003
            srcs = [make((seed, "ag-inplace", li, r), n, torch.float64) for r in range(w)]
            expected = torch.cat(srcs)
            out = poison(torch.empty(n * w, dtype=torch.float64), expected)
            out[rank * n:(rank + 1) * n] = srcs[rank]
            comm.all_gather_into_tensor(out, out[rank * n:(rank + 1) * n])
            check(out, expected, f"all_gather in place shares={shares}")
            # contiguous views at odd byte offsets inside larger buffers; the bytes around stay
            srcs = [make((seed, "ag-offset", li, r), n, torch.int8) for r in range(w)]
            expected = torch.cat(srcs)
            inbuf = make((seed, "ag-offset-in", li, rank), n + 5, torch.int8)
            inbuf[5:] = srcs[rank]
            outbuf = make((seed, "ag-offset-out", li, rank), n * w + 10, torch.int8)
            before = outbuf.clone()
            out = outbuf[3:3 + n * w]
            poison(out, expected)
            comm.all_gather_into_tensor(out, inbuf[5:])
            check(out, expected, f"all_gather at byte offsets shares={shares}")
            check(outbuf[:3], before[:3], "bytes before the output view")
            check(outbuf[3 + n * w:], before[3 + n * w:], "bytes after the output view")
            done += 2
    return done


def _broadcast_worker(rank, w, seed, case_list):
    import braid
    comm = braid.init()
    done = 0
    for ci, (li, shares, dt, n) in enumerate(case_list):
        dtype = getattr(torch, dt)
        with fixed(comm, shares):
            for root in range(w):
                data = make((seed, ci, "bc", root), n, dtype)
                t = data.clone() if rank == root else poison(torch.empty(n, dtype=dtype), data)
                comm.broadcast(t, root)
                what = f"broadcast world={w} root={root} shares={shares} {dt} n={n}"
                check(t, data, what)
                check_shares(comm, shares, data.numel() * data.element_size(), what)
        done += 1
    # a 3-D tensor and the keyword form
    for root in range(w):
        data = make((seed, "bc3d", root), (5, 7, 301), torch.float64)
        t = data.clone() if rank == root else poison(torch.empty_like(data), data)
        with comm.fixed_shares({"gloo": 0.5, "shm": 0.5}):
            comm.broadcast(t, src=root)
        check(t, data, f"broadcast 3-D root={root}")
        done += 1
    return done


def _p2p_worker(rank, w, seed, case_list):
    import braid
    comm = braid.init()
    done = 0
    pairs = list(itertools.permutations(range(w), 2))
    for ci, (li, shares, dt, n) in enumerate(case_list):
        dtype = getattr(torch, dt)
        with fixed(comm, shares):
            for s, d in pairs:
                data = make((seed, ci, "p2p", s, d), n, dtype)
                what = f"send/recv {s}->{d} world={w} shares={shares} {dt} n={n}"
                if rank == s:
                    x = data.clone()
                    comm.send(x, d)
                    check(x, data, what + " (sender's tensor changed)")
                    check_shares(comm, shares, x.numel() * x.element_size(), what)
                elif rank == d:
                    y = poison(torch.empty(n, dtype=dtype), data)
                    comm.recv(y, s)
                    check(y, data, what)
                    check_shares(comm, shares, y.numel() * y.element_size(), what)
        done += 1
    # non-contiguous sends, async handles, a 2-D receive buffer
    for li, shares in enumerate(LANE_SETS):
        with fixed(comm, shares):
            for s, d in pairs:
                base = make((seed, "p2p-nc", li, s, d), (300, 401), torch.int32)
                data = base.t()                       # (401, 300), not contiguous
                if rank == s:
                    h = comm.send(data, d, async_op=True)
                    h.wait()
                    assert h.is_completed()
                elif rank == d:
                    y = poison(torch.empty(401, 300, dtype=torch.int32), data)
                    h = comm.recv(y, s, async_op=True)
                    h.wait()
                    assert h.is_completed()
                    check(y, data, f"send/recv non-contiguous {s}->{d} shares={shares}")
                done += 1
    return done


def _a2a_matrix(rng: random.Random, w: int, n: int) -> list[list[int]]:
    cap = max(1, n // w)
    return [[rng.choice([0, 1, rng.randint(0, cap), cap]) for _ in range(w)] for _ in range(w)]


def _a2a_expected(srcs, matrix, rank, w):
    parts = []
    for s in range(w):
        start = sum(matrix[s][:rank])
        parts.append(srcs[s][start:start + matrix[s][rank]])
    return torch.cat(parts)


def _a2a_worker(rank, w, seed, case_list):
    import braid
    comm = braid.init()
    done = 0
    for ci, (li, shares, dt, n) in enumerate(case_list):
        dtype = getattr(torch, dt)
        rng = random.Random(seed_of(seed, ci, "a2a"))
        width = rng.choice([1, 3]) if n < 10_000 else 1
        matrix = _a2a_matrix(rng, w, n)
        srcs = [make((seed, ci, "a2a", s), (sum(matrix[s]), width), dtype) for s in range(w)]
        expected = _a2a_expected(srcs, matrix, rank, w)
        out = poison(torch.empty(expected.shape, dtype=dtype), expected)
        x = srcs[rank].clone()
        what = f"all_to_all_single world={w} shares={shares} {dt} n={n} matrix={matrix} width={width}"
        with fixed(comm, shares):
            comm.all_to_all_single(out, x, [matrix[s][rank] for s in range(w)], matrix[rank])
            check(out, expected, what)
            check(x, srcs[rank], what + " (input changed)")
            biggest = max(matrix[a][b] for a in range(w) for b in range(w) if a != b)
            check_shares(comm, shares, biggest * width * x.element_size(), what)
            # equal splits (split sizes omitted): w * m rows
            m = rng.randint(0, max(1, n // w))
            eq = [make((seed, ci, "a2a-eq", s), (w * m,), dtype) for s in range(w)]
            exp_eq = _a2a_expected(eq, [[m] * w for _ in range(w)], rank, w)
            out_eq = poison(torch.empty(w * m, dtype=dtype), exp_eq)
            comm.all_to_all_single(out_eq, eq[rank].clone())
            check(out_eq, exp_eq, what + " equal splits")
            # the same split sizes given (torch's functional op passes them): the same call
            out_eq = poison(torch.empty(w * m, dtype=dtype), exp_eq)
            comm.all_to_all_single(out_eq, eq[rank].clone(), [m] * w, [m] * w)
            check(out_eq, exp_eq, what + " equal split sizes given")
            # every entry m but the last rank's to itself: the other ranks' own lists are all equal,
            # yet the call is uneven (no rank can call a matrix balanced from its own lists alone)
            if m:
                near = [[m] * w for _ in range(w)]
                near[w - 1][w - 1] += 1
                src = [make((seed, ci, "a2a-near", s), (sum(near[s]),), dtype) for s in range(w)]
                exp_near = _a2a_expected(src, near, rank, w)
                out_near = poison(torch.empty(exp_near.shape, dtype=dtype), exp_near)
                comm.all_to_all_single(out_near, src[rank].clone(), [near[s][rank] for s in range(w)], near[rank])
                check(out_near, exp_near, what + " equal lists on all but one rank")
        done += 1
    # every split zero, and a non-contiguous (transposed) input
    for li, shares in enumerate(LANE_SETS):
        with fixed(comm, shares):
            empty = torch.empty(0, dtype=torch.float32)
            out = torch.empty(0, dtype=torch.float32)
            comm.all_to_all_single(out, empty, [0] * w, [0] * w)
            rng = random.Random(seed_of(seed, li, "a2a-nc"))
            matrix = _a2a_matrix(rng, w, 4000)
            srcs = [make((seed, li, "a2a-nc", s), (5, sum(matrix[s])), torch.float64).t() for s in range(w)]
            expected = _a2a_expected(srcs, matrix, rank, w)
            out = poison(torch.empty(expected.shape, dtype=torch.float64), expected)
            assert not srcs[rank].is_contiguous() or srcs[rank].numel() <= 5
            comm.all_to_all_single(out, srcs[rank], [matrix[s][rank] for s in range(w)], matrix[rank])
            check(out, expected, f"all_to_all_single transposed input shares={shares} matrix={matrix}")
            done += 1
    return done


REDUCE_DTYPES = ["float32", "float16", "bfloat16", "float64", "int8", "int32", "int64", "uint8"]
REDUCTIONS = ["sum", "avg", "product", "min", "max", "premul_sum"]


def make_small_ints(key: tuple, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Nonzero integer values in [-3, 3] ([1, 3] unsigned): sums, products, means of up to four
    ranks are exact in every dtype, so any summation order gives the same bits."""
    g = torch.Generator().manual_seed(seed_of(*key))
    if dtype == torch.uint8:
        return torch.randint(1, 4, (numel,), generator=g).to(dtype)
    mag = torch.randint(1, 4, (numel,), generator=g)
    sign = torch.randint(0, 2, (numel,), generator=g) * 2 - 1
    return (mag * sign).to(dtype)


def reference_reduction(xs: list[torch.Tensor], name: str, factor: float) -> torch.Tensor:
    x = torch.stack([t.reshape(-1) for t in xs]).double()
    if name in ("sum", "premul_sum", "avg"):
        r = (x * factor).sum(0) if name == "premul_sum" else x.sum(0)
        if name == "avg":   # integers: NCCL's average truncates toward zero
            r = r / len(xs) if xs[0].dtype.is_floating_point else torch.trunc(r / len(xs))
    elif name == "product":
        r = x.prod(0)
    elif name == "min":
        r = x.amin(0)
    else:
        r = x.amax(0)
    return r.to(xs[0].dtype)


def _reduction_worker(rank, w, seed, case_list):
    import torch.distributed as dist
    import braid
    from braid.collectives.reduce import PremulSum
    comm = braid.init()
    ops = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "product": dist.ReduceOp.PRODUCT,
           "min": "min", "max": dist.ReduceOp.MAX, "premul_sum": PremulSum(0.5)}
    done = 0
    for ci, (li, shares, dt, n) in enumerate(case_list):
        dtype = getattr(torch, dt)
        usable = [r for r in REDUCTIONS if dtype.is_floating_point or r != "premul_sum"]
        name = usable[ci % len(usable)]
        op = ops[name]
        what = f"world={w} shares={shares} {dt} n={n} {name}"
        with fixed(comm, shares):
            # all_reduce, in place
            xs = [make_small_ints((seed, ci, "ar", r), n, dtype) for r in range(w)]
            want = reference_reduction(xs, name, 0.5)
            t = xs[rank].clone()
            comm.all_reduce(t, op)
            check(t, want, "all_reduce " + what)
            check_shares(comm, shares, n * t.element_size(), "all_reduce " + what)
            # reduce_scatter_tensor: rank r keeps chunk r of the reduction
            xs = [make_small_ints((seed, ci, "rs", r), n * w, dtype) for r in range(w)]
            want = reference_reduction(xs, name, 0.5)[rank * n:(rank + 1) * n]
            out = poison(torch.empty(n, dtype=dtype), want)
            comm.reduce_scatter_tensor(out, xs[rank].clone(), op)
            check(out, want, "reduce_scatter_tensor " + what)
            # reduce_scatter, list form
            out = poison(torch.empty(n, dtype=dtype), want)
            comm.reduce_scatter(out, [xs[rank][d * n:(d + 1) * n].clone() for d in range(w)], op)
            check(out, want, "reduce_scatter (list) " + what)
            # reduce to one root: the others' tensors stay as they were
            root = ci % w
            xs = [make_small_ints((seed, ci, "red", r), n, dtype) for r in range(w)]
            t = xs[rank].clone()
            comm.reduce(t, root, op)
            check(t, reference_reduction(xs, name, 0.5) if rank == root else xs[rank], f"reduce root={root} " + what)
        done += 1
    # what NCCL refuses is refused on every rank, with the op and the dtype named
    from braid import MisuseError
    for bad_dtype, name in ((torch.int16, "sum"), (torch.bool, "avg"), (torch.int64, "premul_sum")):
        try:
            comm.all_reduce(torch.ones(4, dtype=bad_dtype), ops[name])
        except MisuseError as exc:
            done += str(bad_dtype) in str(exc) and "all_reduce" in str(exc) and "loo" not in str(exc)
    return done


def _every_op_worker(rank, w, seed, case_list):
    """World 4: all ops in one world."""
    total = 0
    for fn in (_all_gather_worker, _broadcast_worker, _p2p_worker, _a2a_worker):
        total += fn(rank, w, seed, case_list)
    return total


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------

def _expect(op: str, w: int, n_cases: int) -> int:
    if op == "ag":
        return n_cases + 6 * len(LANE_SETS)
    if op == "bc":
        return n_cases + w
    if op == "p2p":
        return n_cases + len(LANE_SETS) * w * (w - 1)
    return n_cases + len(LANE_SETS)


WORKERS = {"ag": _all_gather_worker, "bc": _broadcast_worker, "p2p": _p2p_worker, "a2a": _a2a_worker}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("op", ["ag", "bc", "p2p", "a2a"])
def test_op_every_dtype_size_and_lane_set(op, world_size):
    case_list = cases()
    if world_size == 3 and op in ("bc", "p2p"):
        # three roots / six pairs per case: keep the small sizes, fewer dtypes at the large size
        case_list = cases(large_dtypes=["float32", "int8", "bool"])
    results = run_world(WORKERS[op], world_size, 1000 + world_size, case_list, env=ENV)
    assert results == [_expect(op, world_size, len(case_list))] * world_size, results


def _world_of_one_worker(rank, w, seed):
    """One rank: every op is a local copy (send/recv has no peer and is refused)."""
    import braid
    from braid import MisuseError
    comm = braid.init()
    n = 0
    for shares in LANE_SETS:
        with fixed(comm, shares):
            x = make((seed, "one"), 10_001, torch.bfloat16)
            out = poison(torch.empty(10_001, dtype=torch.bfloat16), x)
            comm.all_gather_into_tensor(out, x)
            check(out, x, f"world of one all_gather {shares}")
            outs = [poison(torch.empty(10_001, dtype=torch.bfloat16), x)]
            comm.all_gather(outs, x)
            check(outs[0], x, f"world of one all_gather list {shares}")
            t = x.clone()
            comm.broadcast(t, 0)
            check(t, x, f"world of one broadcast {shares}")
            out = poison(torch.empty(10_001, dtype=torch.bfloat16), x)
            comm.all_to_all_single(out, x)
            check(out, x, f"world of one all_to_all_single {shares}")
            try:
                comm.send(x, 0)
            except MisuseError:
                n += 1
    return n


def test_world_of_one():
    assert run_world(_world_of_one_worker, 1, 11, env=ENV) == [len(LANE_SETS)]


@pytest.mark.parametrize("world_size", [2, 3])
def test_reductions_every_dtype_size_and_lane_set(world_size):
    case_list = cases(dtypes=REDUCE_DTYPES, large_dtypes=["float32", "bfloat16", "int64"], large=100_003)
    results = run_world(_reduction_worker, world_size, 2000 + world_size, case_list, env=ENV)
    assert results == [len(case_list) + 3] * world_size, results


def test_every_op_world_of_four():
    case_list = cases(sizes_small=[0, 1, 1023], dtypes=["float32", "bfloat16", "int8", "bool", "int64"],
                      large_dtypes=["float32"], large=100_003,
                      lane_sets=[{"gloo": 1.0}, {"shm": 1.0}, {"gloo": 0.5, "shm": 0.5}, {"gloo": 0.2, "shm": 0.8}])
    results = run_world(_every_op_worker, 4, 4444, case_list, env=ENV, timeout=240)
    assert results == [sum(_expect(op, 4, len(case_list)) for op in WORKERS)] * 4, results


def _default_settings_worker(rank, w, seed):
    """Without fixed shares and with the library's default slot and split sizes."""
    import braid
    comm = braid.init()
    got_shares = set()
    for i, n in enumerate([1, 4095, 1 << 16, 3 << 20]):
        inputs = [make((seed, i, r), n, torch.uint8) for r in range(w)]
        expected = torch.cat(inputs)
        out = poison(torch.empty(n * w, dtype=torch.uint8), expected)
        braid.all_gather_into_tensor(out, inputs[rank])
        check(out, expected, f"default settings all_gather n={n}")
        got_shares |= set(comm.last_handle.shares)
        root = i % w
        t = inputs[root].clone() if rank == root else poison(torch.empty(n, dtype=torch.uint8), inputs[root])
        braid.broadcast(t, root)
        check(t, inputs[root], f"default settings broadcast n={n}")
        if rank == 0:
            braid.send(inputs[0], 1)
        elif rank == 1:
            y = poison(torch.empty(n, dtype=torch.uint8), inputs[0])
            braid.recv(y, 0)
            check(y, inputs[0], f"default settings send/recv n={n}")
        matrix = [[n // (w * 2) + s + d for d in range(w)] for s in range(w)]
        srcs = [make((seed, i, "a", s), sum(matrix[s]), torch.uint8) for s in range(w)]
        expected = _a2a_expected(srcs, matrix, rank, w)
        out = poison(torch.empty(expected.numel(), dtype=torch.uint8), expected)
        braid.all_to_all_single(out, srcs[rank], [matrix[s][rank] for s in range(w)], matrix[rank])
        check(out, expected, f"default settings all_to_all_single n={n}")
    assert got_shares <= {"gloo", "shm"} and got_shares, got_shares
    return sorted(got_shares)


def test_default_settings_and_module_level_api():
    # the default 4 MiB slots; a 16 MiB buffer per rank keeps /dev/shm use small (Docker: 64 MiB)
    env = {"BRAID_HOST_BUFFER_MB": "16", "BRAID_HOST_CHUNK_KB": None, "BRAID_MIN_SPLIT_KB": None}
    results = run_world(_default_settings_worker, 3, 77, env=env)
    assert len({tuple(r) for r in results}) == 1, results


def _async_gloo_worker(rank, w, seed):
    """Several async calls in flight at once on the gloo lane, waited for afterwards."""
    import braid
    comm = braid.init()
    with comm.fixed_shares({"gloo": 1.0}):
        handles, checks = [], []
        for i in range(6):
            n = 10_000 + 977 * i
            inputs = [make((seed, i, r), n, torch.int32) for r in range(w)]
            expected = torch.cat(inputs)
            out = poison(torch.empty(n * w, dtype=torch.int32), expected)
            handles.append(comm.all_gather_into_tensor(out, inputs[rank], async_op=True))
            checks.append((out, expected, f"async all_gather #{i}"))
            data = make((seed, i, "bc"), n, torch.float32)
            t = data.clone() if rank == i % w else poison(torch.empty(n, dtype=torch.float32), data)
            handles.append(comm.broadcast(t, i % w, async_op=True))
            checks.append((t, data, f"async broadcast #{i}"))
        for h in handles:
            assert h is not None
            h.wait()
        for out, expected, what in checks:
            check(out, expected, what)
    return len(checks)


def test_several_async_calls_in_flight_on_gloo():
    assert run_world(_async_gloo_worker, 2, 5) == [12, 12]


def _async_shm_overlap_worker(rank, w, seed):
    """Two async calls in flight on the shm lane; stop at the first wrong result or error."""
    import torch.distributed as dist
    import braid
    comm = braid.init()
    failure = None
    with comm.fixed_shares({"shm": 1.0}):
        for it in range(40):
            n = 100_000
            ins = [[make((seed, it, k, r), n, torch.int32) for r in range(w)] for k in range(2)]
            outs = [poison(torch.empty(n * w, dtype=torch.int32), torch.cat(ins[k])) for k in range(2)]
            try:
                hs = [comm.all_gather_into_tensor(outs[k], ins[k][rank], async_op=True) for k in range(2)]
                for h in hs:
                    h.wait()
                for k in range(2):
                    check(outs[k], torch.cat(ins[k]), f"iteration {it} call {k}")
            except Exception as exc:     # wrong bytes, or a hang ended by BRAID_TIMEOUT_S
                failure = f"iteration {it}: {type(exc).__name__}: {exc}"
            flag = torch.tensor([int(failure is not None)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)       # plain gloo, not braid
            if flag.item():
                break
    return failure


def test_two_async_calls_in_flight_on_shm():
    results = run_world(_async_shm_overlap_worker, 2, 6, env={"BRAID_TIMEOUT_S": "3"}, timeout=150)
    assert results == [None, None], results


def _swap_worker(rank, w, seed):
    """Both ranks isend first, then irecv (torch.distributed accepts it); then two sends in a row
    each way, waited in reverse order; messages larger than the pair rings."""
    import braid
    comm = braid.init()
    peer = 1 - rank
    try:
        for shares in ({"shm": 1.0}, {"gloo": 0.5, "shm": 0.5}):
            for n in (1000, 3_000_001):
                mine = make((seed, rank, n), n, torch.float32)
                theirs = make((seed, peer, n), n, torch.float32)
                y = poison(torch.empty(n), theirs)
                with comm.fixed_shares(shares):
                    hs = [comm.send(mine, peer, async_op=True), comm.recv(y, peer, async_op=True)]
                    for h in hs:
                        h.wait()
                check(y, theirs, f"swap {shares} n={n}")
                a2 = make((seed, rank, n, 2), n, torch.float32)
                ys = [poison(torch.empty(n), make((seed, peer, n, k), n, torch.float32)) for k in (1, 2)]
                with comm.fixed_shares(shares):
                    hs = [comm.send(mine, peer, async_op=True), comm.send(a2, peer, async_op=True),
                          comm.recv(ys[0], peer, async_op=True), comm.recv(ys[1], peer, async_op=True)]
                    for h in reversed(hs):
                        h.wait()
                check(ys[0], theirs, f"two sends, first {shares} n={n}")
                check(ys[1], make((seed, peer, n, 2), n, torch.float32), f"two sends, second {shares} n={n}")
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return True


def test_async_send_recv_swap_between_two_ranks():
    """Sends and recvs are matched per direction (rank a's k-th send to b with b's k-th recv from
    a), and a split send/recv starts once both sides are posted, so neither call blocks on the
    other rank (it used to pair send with send and raise PeerMismatchError)."""
    assert run_world(_swap_worker, 2, 8, env={"BRAID_TIMEOUT_S": "20", "BRAID_HOST_BUFFER_MB": "2",
                                              "BRAID_HOST_CHUNK_KB": "64", "BRAID_MIN_SPLIT_KB": "1"},
                     timeout=120) == [True, True]


def _ring_p2p_worker(rank, w, seed):
    """Every rank isends to the next and irecvs from the previous (a ring shift, as pipeline
    parallelism does), a few rounds, with a collective in between and waits in shuffled order."""
    import braid
    comm = braid.init()
    rng = random.Random(seed)
    nxt, prv = (rank + 1) % w, (rank - 1) % w
    for rnd in range(4):
        n = rng.choice([1, 777, 400_003])           # the same on every rank (shared seed)
        order = rng.sample(range(4), 4)
        shares = rng.choice([{"shm": 1.0}, {"gloo": 0.3, "shm": 0.7}])
        mine = [make((seed, rnd, rank, k), n, torch.float32) for k in range(2)]
        want = [make((seed, rnd, prv, k), n, torch.float32) for k in range(2)]
        got = [poison(torch.empty(n), want[k]) for k in range(2)]
        with comm.fixed_shares(shares):
            hs = [comm.send(mine[0], nxt, async_op=True), comm.recv(got[0], prv, async_op=True),
                  comm.send(mine[1], nxt, async_op=True), comm.recv(got[1], prv, async_op=True)]
            if rnd == 2:                                # a collective while sends are pending
                t = torch.full((5,), float(rank))
                comm.all_reduce(t)
                assert t.tolist() == [float(sum(range(w)))] * 5
            for i in order:
                hs[i].wait()
        for k in range(2):
            check(got[k], want[k], f"ring round {rnd} message {k}")
    braid.close()
    return True


@pytest.mark.parametrize("w", [3, 4])
def test_ring_shift_with_async_send_recv(w):
    assert run_world(_ring_p2p_worker, w, 5, env={"BRAID_TIMEOUT_S": "30", "BRAID_HOST_BUFFER_MB": "2",
                                                  "BRAID_HOST_CHUNK_KB": "64", "BRAID_MIN_SPLIT_KB": "1"},
                     timeout=150) == [True] * w
