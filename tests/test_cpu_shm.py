"""Whole CPU collectives through the node segment (braid.comm.cpushm): every op, dtype and
reduction against references built from every rank's inputs, odd, zero and multi-chunk sizes,
the same bits on every rank, a disagreement and a dead peer raising on time, the lanes still
taken under explicit shares or with BRAID_CPU_SHM=0."""
import os
import time
import zlib

import pytest
import torch

from conftest import run_world as _run_world

ON = {"BRAID_CPU_SHM": "1"}


def run_world(fn, w, *args, env=None, **kw):
    """conftest's run_world with the path on (the tier runs with it off unless a test asks)."""
    return _run_world(fn, w, *args, env=dict(ON, **(env or {})), **kw)

RED_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
              torch.int32, torch.int64, torch.bool]
MOVE_DTYPES = RED_DTYPES + [torch.complex64]
# the ring area is 2 MiB per rank in the tests (conftest): 300,001 float32 elements take 3 chunks
SIZES = [0, 1, 7, 4099, 300_001]
FLOAT_OPS = ["sum", "avg", "product", "min", "max", "premul_sum"]
INT_OPS = ["sum", "avg", "product", "min", "max", "band", "bor", "bxor"]
BOOL_OPS = ["sum", "product", "min", "max", "band", "bor", "bxor"]


# every rank builds every rank's input for its references: drawn one by one, the inputs were the
# larger part of these tests' time (8 ranks on 2 cores: 85 s). So each (size, dtype) draws one
# random tensor, and each rank's input is a window of it at an offset of its own (7 apart between
# ranks, 131 between salts): no two ranks' inputs are equal, or one's shifted copy where it reads
SPAN = 8192
_POOLS: dict = {}


def _draw(n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.rand(n, generator=g) > 0.5
    if dtype.is_floating_point:
        return ((torch.rand(n, generator=g, dtype=torch.float64) - 0.3) * 4).to(dtype)
    if dtype.is_complex:
        return torch.randn(n, generator=g, dtype=dtype)
    lo, hi = (0, 256) if dtype is torch.uint8 else (-100, 100) if dtype is torch.int8 else (-10**6, 10**6)
    return torch.randint(lo, hi, (n,), generator=g, dtype=torch.int64).to(dtype)


def peek(rank, n, dtype, salt):
    """What data() returns, as a read-only view of the draw (no copy): for references only."""
    assert 0 <= rank < 18, rank
    key = (n, dtype)
    pool = _POOLS.get(key)
    if pool is None:
        if len(_POOLS) >= 2:             # the last two draws: a few MB each
            del _POOLS[next(iter(_POOLS))]
        pool = _POOLS[key] = _draw(n + SPAN, dtype, 7919 * n + zlib.crc32(str(dtype).encode()))
    off = 1 + 7 * rank + 131 * (salt % 61)
    return pool[off:off + n]


def data(rank, n, dtype, salt):
    """Rank `rank`'s input: fresh random values (never all zeros), the same wherever it is rebuilt
    (a window of the (n, dtype) draw, which every process draws alike)."""
    return peek(rank, n, dtype, salt).clone()


def reference(xs, name, factor):
    """The reduction of every rank's input: floats in float64 (checked with a tolerance), integers
    and bools in their own type (exact: wrap-around sums are order-free)."""
    dt = xs[0].dtype
    if dt.is_floating_point:
        s = torch.stack([x.double() for x in xs])
        if name in ("sum", "avg", "premul_sum"):
            out = s.sum(0) * (factor if name == "premul_sum" else 1.0)
            return out / len(xs) if name == "avg" else out
        return {"product": lambda: s.prod(0), "min": lambda: s.min(0).values, "max": lambda: s.max(0).values}[name]()
    acc = xs[0].clone()
    for x in xs[1:]:
        if dt is torch.bool:
            acc = {"sum": acc | x, "max": acc | x, "bor": acc | x, "product": acc & x, "min": acc & x,
                   "band": acc & x, "bxor": acc ^ x}[name]
        else:
            acc = {"sum": acc + x, "avg": acc + x, "product": acc * x, "min": torch.minimum(acc, x),
                   "max": torch.maximum(acc, x), "band": acc & x, "bor": acc | x, "bxor": acc ^ x}[name]
    if name == "avg":
        acc = torch.div(acc, len(xs), rounding_mode="trunc")
    return acc


def close(got, want, xs, name):
    if not got.dtype.is_floating_point:
        return torch.equal(got, want)
    if got.numel() == 0:
        return True
    # bf16/fp16 round each partial result; bound by the magnitude of what was summed
    eps = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-6, torch.float64: 1e-12}[got.dtype]
    if name == "product":
        scale = torch.stack([x.double().abs() for x in xs]).prod(0) * len(xs)
    else:
        scale = torch.stack([x.double().abs() for x in xs]).sum(0)
    # half precision: results near zero round on the subnormal grid (absolute, not relative)
    return bool(((got.double() - want).abs() <= 4 * eps * scale + torch.finfo(got.dtype).tiny).all())


def _ops_worker(rank, w):
    import torch.distributed as dist
    import braid
    comm = braid.init()
    bad, bits = [], []

    def note(what, ok, t):
        if not ok:
            bad.append(what)
        if comm.last_call[-1] != "shm" or comm.last_handle.shares != {"shm": 1.0}:
            bad.append(f"{what}: did not run whole through the segment ({comm.last_handle})")
        if not what.startswith("reduce"):     # reduce_scatter, reduce: not alike across ranks
            bits.append((what, t.contiguous().view(-1).view(torch.uint8).clone() if t.numel() else t))

    def what_ok(what, ok):
        if not ok:
            bad.append(what)
        if comm.last_call[-1] != "shm":
            bad.append(f"{what}: did not run whole through the segment")
        return ok

    # The results that every rank must hold alike (all_reduce, all_gather, broadcast) go into
    # `bits`, compared across ranks at the end; so one rank (a different one from call to call)
    # checks each of them against the reference and the others only that theirs are the same
    # bits. The reference over every rank's input was most of each rank's time at 8 ranks.
    turn = [0]

    def checker():
        turn[0] += 1
        return turn[0] % w == rank

    for n in SIZES:
        for dt in RED_DTYPES:
            ops = BOOL_OPS if dt is torch.bool else FLOAT_OPS if dt.is_floating_point else INT_OPS
            for k, name in enumerate(ops):
                factor = 0.37 if name == "premul_sum" else 1.0
                op = braid.PremulSum(factor) if name == "premul_sum" else name
                t = data(rank, n, dt, k)
                comm.all_reduce(t, op=op)
                if checker():
                    xs = [peek(r, n, dt, k) for r in range(w)]
                    ok = close(t, reference(xs, name, factor), xs, name)
                else:
                    ok = True
                note(f"all_reduce {name} {dt} n={n}", ok, t)
                m = n // w
                if m:
                    out = torch.empty(m, dtype=dt)
                    comm.reduce_scatter_tensor(out, peek(rank, n, dt, k)[: m * w].clone(), op=op)
                    part = [peek(r, n, dt, k)[rank * m:(rank + 1) * m] for r in range(w)]
                    note(f"reduce_scatter {name} {dt} n={n}", close(out, reference(part, name, factor), part, name), out)
        for dt in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
            for root in {0, w - 1}:
                for name in ("sum", "max"):
                    xs = [peek(r, n, dt, 55 + root) for r in range(w)]
                    t = data(rank, n, dt, 55 + root)
                    comm.reduce(t, root, op=name)
                    want = reference(xs, name, 1.0) if rank == root else xs[rank]
                    note(f"reduce root {root} {name} {dt} n={n}", close(t, want, xs, name), t if rank == root else t[:0])
        for dt in MOVE_DTYPES:
            xs = [peek(r, n * w, dt, 77) for r in range(w)]
            out = torch.empty(n * w, dtype=dt)
            comm.all_to_all_single(out, data(rank, n * w, dt, 77))
            want = torch.cat([x.view(w, n)[rank] for x in xs])
            if not what_ok(f"all_to_all n={n} {dt}", torch.equal(out, want)):
                pass
            out = torch.empty(n * w, dtype=dt)
            comm.all_gather_into_tensor(out, data(rank, n, dt, 99))
            ok = torch.equal(out, torch.cat([peek(r, n, dt, 99) for r in range(w)])) if checker() else True
            note(f"all_gather {dt} n={n}", ok, out)
            for root in {0, w - 1}:
                t = data(rank, n, dt, 99)
                comm.broadcast(t, root)
                note(f"broadcast root {root} {dt} n={n}", torch.equal(t, peek(root, n, dt, 99)), t)
    # broadcasts of several pieces (BCAST_CHUNK), the last one partial, from every root
    for n in (5_000_011, 2 * 1_048_576 + 3):
        for root in range(w):
            t = data(rank, n, torch.uint8, 131 + root)
            comm.broadcast(t, root)
            note(f"broadcast in pieces root {root} n={n}", torch.equal(t, peek(root, n, torch.uint8, 131 + root)), t)
    # async calls return a finished handle; many calls back to back with changing sizes
    for i in range(200):
        n = (i * 7919) % 70_001
        t = data(rank, n, torch.float32, i)
        h = comm.all_reduce(t, async_op=True)
        h.wait()
        xs = [peek(r, n, torch.float32, i) for r in range(w)]
        if not close(t, reference(xs, "sum", 1.0), xs, "sum"):
            bad.append(f"back to back {i} n={n}")
    # every rank holds the same bits of every reduction
    digests = [(what, zlib.crc32(b.numpy()) if b.numel() else 0, b.numel()) for what, b in bits]
    every = [None] * w
    dist.all_gather_object(every, digests, group=comm.gloo_group)
    for e in every:
        diff = [a[0] for a, b in zip(digests, e) if a != b]
        if diff:
            bad.append(f"ranks differ in their results: {diff[:3]} ({len(diff)} results)")
    braid.close()
    return bad


@pytest.mark.parametrize("w", [2, 3, 4, 8])
def test_every_op_dtype_and_reduction(w):
    for bad in run_world(_ops_worker, w, timeout=300):
        assert bad == [], bad


def _mismatch_worker(rank, w):
    import braid
    from braid.errors import PeerMismatchError
    comm = braid.init()
    t = torch.ones(10 + rank)
    t0 = time.monotonic()
    try:
        comm.all_reduce(t)
        raised = None
    except PeerMismatchError as e:
        raised = str(e)
    took = time.monotonic() - t0
    t = torch.full((5,), float(rank + 1))
    comm.all_reduce(t)             # the communicator stays usable
    braid.close()
    return raised, took, t.tolist()


def test_a_disagreement_raises_on_every_rank():
    for raised, took, after in run_world(_mismatch_worker, 2):
        assert raised is not None and "different calls" in raised and "rank 1: all_reduce of 44 bytes" in raised
        assert took < 5
        assert after == [3.0] * 5


def _dead_peer_worker(rank, w):
    import braid
    comm = braid.init()
    comm.all_reduce(torch.ones(4))
    if rank == 1:
        os._exit(3)
    t0 = time.monotonic()
    try:
        comm.all_reduce(torch.ones(4))
        return "no error", 0.0
    except Exception as e:       # noqa: BLE001  the type and the time are checked
        return type(e).__name__, time.monotonic() - t0


def test_a_dead_peer_raises_in_time():
    res = run_world(_dead_peer_worker, 2, env={"BRAID_TIMEOUT_S": "20"}, allowed_exit={1: 3})
    name, took = res[0]
    assert name in ("LaneFailureError", "BraidTimeoutError"), name
    assert took < 20


def _pushed_worker(rank, w):
    """Rank 1 gives up the way a GPU communicator does: its abort mark, then every counter of the
    segment pushed far ahead (which also ends waits on its round stamp). Rank 0's next round must
    raise that abort, not read the half rank 1 never wrote."""
    import braid
    comm = braid.init()
    t = torch.full((5,), float(rank + 1))
    comm.all_reduce(t)
    torch.distributed.barrier()
    if rank == 1:
        comm.segment.mark_aborted(4, "rank 1: given up for the test")
        comm.segment.abort()
        torch.distributed.barrier()
        return t.tolist(), None
    torch.distributed.barrier()          # rank 1 has pushed the counters
    try:
        comm.all_reduce(torch.ones(5))
        return t.tolist(), "no error"
    except Exception as e:        # noqa: BLE001  the type and text are checked
        return t.tolist(), f"{type(e).__name__}: {e}"


def test_a_peer_whose_counters_jumped_ahead_is_an_abort_not_data():
    res = run_world(_pushed_worker, 2)
    assert res[0][0] == [3.0] * 5 and res[1][0] == [3.0] * 5
    assert res[0][1] is not None and "rank 1 aborted" in res[0][1] and "given up for the test" in res[0][1], res[0][1]


def _lanes_worker(rank, w):
    import braid
    comm = braid.init()
    out = []
    t = torch.ones(1000)
    comm.all_reduce(t)
    out.append(comm.last_call[-1])
    with comm.fixed_shares({"shm": 0.5, "gloo": 0.5}):
        t = torch.ones(1000)
        comm.all_reduce(t)
        out.append(sorted(comm.last_handle.shares))
    out.append(t[:3].tolist())
    braid.close()
    return out


def test_explicit_shares_and_the_setting_keep_the_lanes():
    for shares, fixed, vals in run_world(_lanes_worker, 2):
        assert shares == "shm" and fixed == ["gloo", "shm"] and vals == [2.0] * 3
    for path, fixed, vals in run_world(_lanes_worker, 2, env={"BRAID_CPU_SHM": "0"}):
        assert path != "shm" and fixed == ["gloo", "shm"] and vals == [2.0] * 3


def _backend_worker(rank, w):
    import datetime
    import torch.distributed as dist
    import braid  # noqa: F401  registers the backend
    dist.init_process_group("braid", rank=rank, world_size=w, timeout=datetime.timedelta(seconds=60))
    bad = []
    x = data(rank, 5003, torch.float32, 1)
    xs = [data(r, 5003, torch.float32, 1) for r in range(w)]
    comm = braid.init()             # the backend's communicator
    t = x.clone()
    for _ in range(3):              # repeats take the same path (no forwarding to gloo)
        t = x.clone()
        dist.all_reduce(t)
        if comm.last_call[-1] != "shm":
            bad.append(f"all_reduce ran {comm.last_call}")
    if not close(t, reference(xs, "sum", 1.0), xs, "sum"):
        bad.append("all_reduce")
    out = torch.empty(5003 * w)
    for _ in range(3):
        dist.all_gather_into_tensor(out, x)
        if comm.last_call[-1] != "shm":
            bad.append(f"all_gather_into_tensor ran {comm.last_call}")
    if not torch.equal(out, torch.cat(xs)):
        bad.append("all_gather_into_tensor")
    m = 5003 // w
    rs = torch.empty(m)
    dist.reduce_scatter_tensor(rs, x[: m * w].clone())
    part = [y[rank * m:(rank + 1) * m] for y in xs]
    if not close(rs, reference(part, "sum", 1.0), part, "sum"):
        bad.append("reduce_scatter_tensor")
    b = x.clone()
    dist.broadcast(b, src=1)
    if not torch.equal(b, xs[1]):
        bad.append("broadcast")
    calls = comm.ncalls
    dist.barrier()
    if comm.ncalls != calls + 1 or comm.last_call[0] != "barrier":
        bad.append(f"barrier ran {comm.last_call}")
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    dist.destroy_process_group()
    return bad


def test_under_the_braid_backend():
    for bad in run_world(_backend_worker, 3, init_pg=False):
        assert bad == [], bad


def _a2av_worker(rank, w):
    import braid
    from braid.errors import PeerMismatchError
    comm = braid.init()
    bad = []
    for case in range(12):
        g = torch.Generator().manual_seed(case)
        hi = 400_000 if case == 11 else 3000          # the last case does not fit a half: rounds
        mat = torch.randint(0, hi, (w, w), generator=g)
        mat[case % w, (case + 1) % w] = 0             # an empty pair
        rows_in, rows_out = mat[rank].tolist(), mat[:, rank].tolist()
        dt = [torch.float32, torch.int64, torch.bfloat16][case % 3]
        xs = [data(r, int(mat[r].sum()) * 3, dt, case).view(-1, 3) for r in range(w)]
        out = torch.empty(sum(rows_out), 3, dtype=dt)
        comm.all_to_all_single(out, xs[rank], rows_out, rows_in)
        pieces = []
        for r in range(w):
            start = int(mat[r, :rank].sum())
            pieces.append(xs[r][start: start + int(mat[r, rank])])
        if not torch.equal(out, torch.cat(pieces)):
            bad.append(f"case {case}")
        if comm.last_call[-1] != "shm":
            bad.append(f"case {case} path {comm.last_call}")
    # split sizes that do not match across ranks: an error on every rank, then usable again
    ins = [2] * w
    outs = [2] * w if rank else [3] + [2] * (w - 1)
    try:
        comm.all_to_all_single(torch.empty(sum(outs)), torch.ones(sum(ins)), outs, ins)
        bad.append("no mismatch raised")
    except PeerMismatchError as e:
        if "split sizes" not in str(e):
            bad.append(str(e))
    t = torch.full((w,), float(rank))
    out = torch.empty(w)
    comm.all_to_all_single(out, t, [1] * w, [1] * w)
    if out.tolist() != [float(r) for r in range(w)]:
        bad.append(f"after the mismatch {out.tolist()}")
    braid.close()
    return bad


@pytest.mark.parametrize("w", [2, 3])
def test_uneven_all_to_all(w):
    for bad in run_world(_a2av_worker, w, timeout=300):
        assert bad == [], bad


def test_rounds_smaller_than_the_call():
    """BRAID_CPU_ROUND_KB cuts all_reduce and reduce_scatter into many rounds: every op, dtype and
    reduction still right, and the same bits on every rank."""
    for bad in run_world(_ops_worker, 3, env={"BRAID_CPU_ROUND_KB": "4"}, timeout=300):
        assert bad == [], bad


def _aligned_worker(rank, w):
    """all_gather and broadcast copy in the widest words a tensor's address and size allow; ranks
    whose tensors sit at other offsets (so other widths) still agree on every byte."""
    import braid
    comm = braid.init()
    bad = []
    for n in (8, 4096, 65_536, 3 * 1_048_576 + 8):
        for off in (0, 1, 2, 4):
            mine = (off + rank) % 3 * 2          # offsets 0, 2, 4 by rank: widths 8, 2, 4
            base = torch.empty(n + 16, dtype=torch.uint8)
            x = base[mine: mine + n]
            x.copy_(data(rank, n, torch.uint8, off))
            out_base = torch.empty(n * w + 16, dtype=torch.uint8)
            out = out_base[off: off + n * w]
            comm.all_gather_into_tensor(out, x)
            if not torch.equal(out, torch.cat([data(r, n, torch.uint8, off) for r in range(w)])):
                bad.append(("all_gather", n, off))
            t = x.clone() if off % 2 else x
            comm.broadcast(t, off % w)
            if not torch.equal(t, data(off % w, n, torch.uint8, off)):
                bad.append(("broadcast", n, off))
    braid.close()
    return bad


def test_copies_in_words_at_any_offset():
    for bad in run_world(_aligned_worker, 3, timeout=120):
        assert bad == []
