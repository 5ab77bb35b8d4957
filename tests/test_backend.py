"""braid as a torch.distributed backend: `dist.init_process_group("braid")` + plain dist.* calls.

Two spawned worlds (2 and 3 ranks) run many cases each and report per case; the tests below read
the reports. References are computed locally on every rank from seeded data of every rank (no
collective builds them); data has no zeros. Settings as in the CPU collective tests, with
BRAID_MIN_SPLIT_KB=1 so that the larger cases really split over gloo and shm.
"""
from __future__ import annotations

import datetime
import hashlib
import os
import traceback

import pytest
import torch

from conftest import braid_shm_entries, run_world

# CPU only: on a machine with GPUs the braid backend is GPU-capable like NCCL (one GPU per rank)
ENV = {"BRAID_MIN_SPLIT_KB": "1", "CUDA_VISIBLE_DEVICES": ""}
SIZES = [7, 1023, 100_003]
DTYPES = ["float32", "bfloat16", "int64"]


# ---------------------------------------------------------------------------------------------
# helpers (run inside the workers)
# ---------------------------------------------------------------------------------------------

def _seed(*key) -> int:
    return int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:8], "little") >> 1


def _data(key, n, dtype: torch.dtype) -> torch.Tensor:
    """Seeded values with no zeros: floats in +-[0.5, 3.5), integers in +-[1, 2**20)."""
    g = torch.Generator().manual_seed(_seed(*key))
    if dtype.is_floating_point:
        mag = torch.rand(n, generator=g) * 3 + 0.5
        sign = torch.randint(0, 2, (n,), generator=g) * 2 - 1
        return (mag * sign).to(dtype)
    t = torch.randint(1, 1 << 20, (n,), generator=g, dtype=torch.int64)
    t = t * (torch.randint(0, 2, (n,), generator=g) * 2 - 1)
    return t.to(dtype)


def _same(got: torch.Tensor, want: torch.Tensor, what: str, exact: bool = True) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, \
        f"{what}: got {got.dtype}{tuple(got.shape)}, want {want.dtype}{tuple(want.shape)}"
    if exact:
        if not torch.equal(got, want):
            bad = (got != want).nonzero().reshape(-1)
            raise AssertionError(f"{what}: {bad.numel()} of {got.numel()} elements differ, first at {bad[0].item()}")
    else:
        tol = {torch.bfloat16: 2e-2, torch.float16: 2e-3}.get(got.dtype, 1e-5)
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol, msg=what)


def _reduce_ref(parts: list[torch.Tensor], red: str) -> torch.Tensor:
    dtype = parts[0].dtype
    acc = torch.stack([p.float() if dtype.is_floating_point else p for p in parts])
    if red == "sum":
        out = acc.sum(0)
    elif red == "avg":
        out = acc.sum(0) / len(parts)
    elif red == "max":
        out = acc.amax(0)
    elif red == "min":
        out = acc.amin(0)
    else:
        raise ValueError(red)
    return out.to(dtype)


class _Report:
    """Runs named cases; a failing case records its traceback and the rest still run (the
    world stays in step: every case below is collective and fails alike on every rank, or is
    local)."""

    def __init__(self):
        self.out: dict[str, str] = {}

    def case(self, name, fn, *args):
        try:
            fn(*args)
            self.out[name] = "ok"
        except Exception:
            self.out[name] = traceback.format_exc()[-3000:]


def _init(rank: int, w: int):
    import torch.distributed as dist
    import braid  # noqa: F401  registers the backend
    dist.init_process_group("braid", rank=rank, world_size=w, timeout=datetime.timedelta(seconds=60))
    return dist.distributed_c10d._get_default_group()


def _braid_maps() -> list[str]:
    """braid segments this process still maps or holds open."""
    found = [line.strip() for line in open("/proc/self/maps") if "/braid-" in line]
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "/braid-" in target:
            found.append(target)
    return found


# ---------------------------------------------------------------------------------------------
# the cases (inside the workers)
# ---------------------------------------------------------------------------------------------

def _handled_by_braid(comm, before, what: str) -> None:
    """The call just made ran on braid's communicator (not on an inner gloo group)."""
    assert comm.last_handle is not None and comm.last_handle is not before, f"{what} did not run on braid"
    lanes = set(comm.last_handle.shares)
    assert lanes and lanes <= {"gloo", "shm"}, f"{what}: lanes {lanes}"


def _p2p_pairs(rank: int, w: int, tag: str, pg=None) -> None:
    """Ring: every rank isends to rank+1 and irecvs from rank-1; then a blocking send/recv pair
    between ranks 1 and 0. With `pg`: check that braid's communicator ran them."""
    import torch.distributed as dist
    nxt, prv = (rank + 1) % w, (rank - 1) % w
    for n in (7, 100_003):
        mine = _data((tag, "ring", n, rank), n, torch.float32)
        got = torch.empty(n)
        before = pg._comm.last_handle if pg is not None else None
        works = [dist.isend(mine, nxt), dist.irecv(got, prv)]
        if pg is not None:
            _handled_by_braid(pg._comm, before, f"isend/irecv n={n}")
        assert all(isinstance(wk, dist.Work) for wk in works), [type(wk) for wk in works]
        for wk in works:
            wk.wait()
        _same(got, _data((tag, "ring", n, prv), n, torch.float32), f"isend/irecv n={n}")
    if w >= 2 and rank in (0, 1):
        n = 1023
        t = _data((tag, "pair", 0), n, torch.int64) if rank == 1 else torch.zeros(n, dtype=torch.int64)
        if rank == 1:
            dist.send(t, 0)
        else:
            dist.recv(t, 1)
            _same(t, _data((tag, "pair", 0), n, torch.int64), "send/recv")


def _reductions(rank: int, w: int) -> None:
    import torch.distributed as dist
    R = dist.ReduceOp
    for dtype_name in DTYPES:
        dtype = getattr(torch, dtype_name)
        for n in SIZES:
            reds = [("sum", R.SUM), ("max", R.MAX)] + ([("avg", R.AVG)] if dtype.is_floating_point else [])
            for red, op in reds:
                parts = [_data(("ar", dtype_name, n, red, r), n, dtype) for r in range(w)]
                t = parts[rank].clone()
                dist.all_reduce(t, op=op)
                exact = red == "max" or not dtype.is_floating_point or (w == 2 and red == "sum")
                _same(t, _reduce_ref(parts, red), f"all_reduce {red} {dtype_name} n={n}", exact)


def _reduce_scatter(rank: int, w: int) -> None:
    import torch.distributed as dist
    for dtype_name in DTYPES:
        dtype = getattr(torch, dtype_name)
        for m in (7, 1023):
            parts = [_data(("rs", dtype_name, m, r), m * w, dtype) for r in range(w)]
            out = torch.empty(m, dtype=dtype)
            dist.reduce_scatter_tensor(out, parts[rank].clone())
            want = _reduce_ref([p[rank * m:(rank + 1) * m] for p in parts], "sum")
            _same(out, want, f"reduce_scatter_tensor {dtype_name} m={m}", exact=not dtype.is_floating_point or w == 2)
            out2 = torch.empty(m, dtype=dtype)
            dist.reduce_scatter(out2, list(parts[rank].clone().chunk(w)))
            _same(out2, want, f"reduce_scatter (list) {dtype_name} m={m}", exact=not dtype.is_floating_point or w == 2)


def _gathers(rank: int, w: int, pg) -> None:
    import torch.distributed as dist
    for dtype_name in DTYPES:
        dtype = getattr(torch, dtype_name)
        for n in SIZES:
            parts = [_data(("ag", dtype_name, n, r), n, dtype) for r in range(w)]
            out = torch.empty(n * w, dtype=dtype)
            before = pg._comm.last_handle
            dist.all_gather_into_tensor(out, parts[rank])
            _handled_by_braid(pg._comm, before, f"all_gather_into_tensor {dtype_name} n={n}")
            _same(out, torch.cat(parts), f"all_gather_into_tensor {dtype_name} n={n}")
            outs = [torch.empty(n, dtype=dtype) for _ in range(w)]
            dist.all_gather(outs, parts[rank])
            for r in range(w):
                _same(outs[r], parts[r], f"all_gather (list) {dtype_name} n={n} from rank {r}")


def _broadcasts(rank: int, w: int) -> None:
    import torch.distributed as dist
    for root in range(1, w):            # non-zero roots
        for dtype_name in DTYPES:
            dtype = getattr(torch, dtype_name)
            for n in SIZES:
                want = _data(("bc", dtype_name, n, root), n, dtype)
                t = want.clone() if rank == root else torch.zeros(n, dtype=dtype)
                dist.broadcast(t, src=root)
                _same(t, want, f"broadcast root={root} {dtype_name} n={n}")


def _all_to_all(rank: int, w: int) -> None:
    """Uneven splits: rank s sends (s + 2 d + 1) * 3 rows of 5 to rank d."""
    import torch.distributed as dist
    cols = 5
    rows = [[(s + 2 * d + 1) * 3 for d in range(w)] for s in range(w)]
    for dtype_name in DTYPES:
        dtype = getattr(torch, dtype_name)
        ins = [_data(("a2a", dtype_name, s), sum(rows[s]) * cols, dtype).view(-1, cols) for s in range(w)]
        out = torch.empty(sum(rows[s][rank] for s in range(w)), cols, dtype=dtype)
        dist.all_to_all_single(out, ins[rank], output_split_sizes=[rows[s][rank] for s in range(w)],
                               input_split_sizes=rows[rank])
        want = torch.cat([ins[s].split(rows[s])[rank] for s in range(w)])
        _same(out, want, f"all_to_all_single uneven {dtype_name}")
        # even split (no sizes)
        ev = _data(("a2a-even", dtype_name, rank), w * 6, dtype)
        out = torch.empty(w * 6, dtype=dtype)
        dist.all_to_all_single(out, ev)
        want = torch.cat([_data(("a2a-even", dtype_name, s), w * 6, dtype)[rank * 6:(rank + 1) * 6] for s in range(w)])
        _same(out, want, f"all_to_all_single even {dtype_name}")


def _reduce_to_root(rank: int, w: int) -> None:
    import torch.distributed as dist
    root = w - 1
    parts = [_data(("reduce", r), 1023, torch.int64) for r in range(w)]
    t = parts[rank].clone()
    dist.reduce(t, dst=root)
    if rank == root:
        _same(t, _reduce_ref(parts, "sum"), "reduce to last rank")


def _async_ops(rank: int, w: int) -> None:
    import torch.distributed as dist
    parts = [_data(("async", r), 1023, torch.float32) for r in range(w)]
    t = parts[rank].clone()
    work = dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)
    assert isinstance(work, dist.Work), type(work)
    assert work.wait() is True
    assert work.is_completed()
    want = _reduce_ref(parts, "max")
    _same(t, want, "async all_reduce after wait()")
    fut = work.get_future()
    _same(fut.wait()[0], want, "async all_reduce future value")
    # a second async call whose future is taken before wait(): the future waits
    out = torch.empty(1023 * w)
    work = dist.all_gather_into_tensor(out, parts[rank], async_op=True)
    _same(work.get_future().wait()[0], torch.cat(parts), "async all_gather_into_tensor future")
    _same(out, torch.cat(parts), "async all_gather_into_tensor output")


def _objects_and_barrier(rank: int, w: int) -> None:
    import torch.distributed as dist
    objs = [None] * w
    dist.all_gather_object(objs, {"rank": rank, "word": "x" * (rank + 3), "n": [rank] * rank})
    assert objs == [{"rank": r, "word": "x" * (r + 3), "n": [r] * r} for r in range(w)], objs
    box = [f"from-{w - 1}"] if rank == w - 1 else [None]
    dist.broadcast_object_list(box, src=w - 1)
    assert box == [f"from-{w - 1}"], box
    dist.barrier()
    work = dist.barrier(async_op=True)
    work.wait()


def _forwarded(rank: int, w: int, pg) -> None:
    """Ops braid leaves to the inner gloo group give torch's results."""
    import torch.distributed as dist
    # bitwise AND: not a braid reduction
    parts = [_data(("band", r), 1023, torch.int64) for r in range(w)]
    t = parts[rank].clone()
    before = pg._comm.last_handle
    dist.all_reduce(t, op=dist.ReduceOp.BAND)
    assert pg._comm.last_handle is before, "BAND ran on braid's communicator"
    want = parts[0].clone()
    for p in parts[1:]:
        want &= p
    _same(t, want, "all_reduce BAND (inner gloo)")
    # gather and scatter
    root = w - 1
    mine = _data(("gather", rank), 7, torch.float32)
    got = [torch.empty(7) for _ in range(w)] if rank == root else None
    dist.gather(mine, got, dst=root)
    if rank == root:
        for r in range(w):
            _same(got[r], _data(("gather", r), 7, torch.float32), f"gather from rank {r}")
    chunks = [_data(("scatter", r), 7, torch.float32) for r in range(w)]
    out = torch.empty(7)
    dist.scatter(out, chunks if rank == 0 else None, src=0)
    _same(out, chunks[rank], "scatter from rank 0")


def _pg_overloads(rank: int, w: int, pg) -> None:
    """The process group's methods in every form torch's own binding accepts, called directly
    (torch's DDP calls `process_group.allreduce(tensor)` when it joins uneven inputs): a single
    tensor for a list, a ReduceOp, a root or a timeout for the options object."""
    import torch.distributed as dist
    n = 1023
    parts = [_data(("ovl", r), n, torch.float32) for r in range(w)]
    for args, kwargs, red in [((), {}, "sum"), ((dist.ReduceOp.MAX,), {}, "max"), ((), {"op": dist.ReduceOp.MIN}, "min")]:
        t = parts[rank].clone()
        pg.allreduce(t, *args, **kwargs).wait()
        _same(t, _reduce_ref(parts, red), f"pg.allreduce(tensor, {args}, {kwargs})")
        t = parts[rank].clone()
        pg.allreduce([t], *args, **kwargs).wait()
        _same(t, _reduce_ref(parts, red), f"pg.allreduce([tensor], {args}, {kwargs})")
    root = w - 1
    t = parts[rank].clone()
    pg.broadcast(t, root).wait()
    _same(t, parts[root], "pg.broadcast(tensor, root)")
    t = parts[rank].clone()
    pg.reduce(t, root, dist.ReduceOp.SUM).wait()
    if rank == root:
        _same(t, _reduce_ref(parts, "sum"), "pg.reduce(tensor, root, op)")
    outs = [torch.empty(n) for _ in range(w)]
    pg.allgather(outs, parts[rank].clone()).wait()
    for r in range(w):
        _same(outs[r], parts[r], f"pg.allgather(list, tensor): rank {r}'s part")
    ins = [_data(("ovl-rs", rank, d), n, torch.float32) for d in range(w)]
    out = torch.empty(n)
    pg.reduce_scatter(out, ins, dist.ReduceOp.SUM).wait()
    _same(out, _reduce_ref([_data(("ovl-rs", r, rank), n, torch.float32) for r in range(w)], "sum"),
          "pg.reduce_scatter(tensor, list, op)")
    splits = [3 + d for d in range(w)]                 # rank d gets 3 + d elements from every rank
    src = _data(("ovl-a2a", rank), sum(splits), torch.float32)
    got = torch.empty((3 + rank) * w)
    pg.alltoall_base(got, src, [3 + rank] * w, splits, datetime.timedelta(seconds=30)).wait()
    offs = [sum(splits[:rank])]
    want = torch.cat([_data(("ovl-a2a", r), sum(splits), torch.float32)[offs[0]: offs[0] + 3 + rank] for r in range(w)])
    _same(got, want, "pg.alltoall_base(..., timeout)")
    pg.barrier(datetime.timedelta(seconds=30)).wait()


def _misuse_propagates(rank: int, w: int) -> None:
    import torch.distributed as dist
    import braid
    out = torch.empty(5 * w - 1)               # one element short of world_size * 5
    try:
        dist.all_gather_into_tensor(out, torch.ones(5))
    except braid.MisuseError as exc:
        assert "all_gather" in str(exc), str(exc)
    else:
        raise AssertionError("a too small all_gather output did not raise braid.MisuseError")
    t = torch.ones(3)
    dist.all_reduce(t)                 # the world still works after the error
    assert t.tolist() == [float(w)] * 3, t


def _ddp(rank: int, w: int, pg) -> None:
    """A tiny DDP model, 2 SGD steps: DDP's gradients equal the average of every rank's local
    gradient, computed here on a plain copy of the model."""
    import copy
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(1234)
    model = torch.nn.Linear(6, 3)
    ref = copy.deepcopy(model)
    ddp = DDP(model)
    comm = pg.ensure_communicator()
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        xs = [_data(("ddp-x", step, r), 4 * 6, torch.float32).view(4, 6) for r in range(w)]
        before = comm.last_handle
        opt.zero_grad()
        (ddp(xs[rank]) ** 2).sum().backward()
        assert comm.last_handle is not before, "DDP's gradient all_reduce did not run on braid"
        ref_opt.zero_grad()
        grads = []
        for r in range(w):
            ref.zero_grad()
            (ref(xs[r]) ** 2).sum().backward()
            grads.append([p.grad.clone() for p in ref.parameters()])
        for i, p in enumerate(ref.parameters()):
            p.grad = sum(g[i] for g in grads) / w
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=f"DDP step {step} grad of {name}")
        # every rank holds the same gradient, bit for bit
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        every = [torch.empty_like(flat) for _ in range(w)]
        dist.all_gather(every, flat)
        for r in range(w):
            _same(every[r], flat, f"DDP step {step}: rank {r}'s gradient")
        opt.step()
        ref_opt.step()


def _ddp_join(rank: int, w: int) -> None:
    """DDP with uneven inputs (`model.join()`, unused parameters found): each rank has a batch
    count of its own; the ranks that run out join the others' all_reduces (torch calls the
    process group's allreduce with a single tensor there). Every rank ends with the same weights,
    equal to a local replay: per step, the average over the ranks that still had a batch of
    their gradients (joined ranks contribute zeros, divided by the world size). With
    throw_on_early_termination, every rank raises once the first runs out."""
    import copy
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(4321)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    ref = copy.deepcopy(model)
    ddp = DDP(model, find_unused_parameters=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    steps = [2 + r for r in range(w)]          # rank r runs 2 + r batches
    batches = lambda r: [_data(("join", r, k), 3 * 6, torch.float32).view(3, 6) for k in range(steps[r])]   # noqa: E731
    with ddp.join():
        for x in batches(rank):
            opt.zero_grad()
            ddp(x).square().sum().backward()
            opt.step()
    for k in range(max(steps)):
        grads = []
        for r in range(w):
            if k < steps[r]:
                ref.zero_grad()
                ref(batches(r)[k]).square().sum().backward()
                grads.append([p.grad.clone() for p in ref.parameters()])
        ref_opt.zero_grad()
        for i, p in enumerate(ref.parameters()):
            p.grad = sum(g[i] for g in grads) / w
        ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        _same(p.detach(), q.detach(), f"DDP join: {name}", exact=False)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = [torch.empty_like(flat) for _ in range(w)]
    dist.all_gather(every, flat)
    for r in range(w):
        _same(every[r], flat, f"DDP join: rank {r}'s weights")
    # throw_on_early_termination: once a rank runs out, every rank raises at the same step
    raised = None
    try:
        with ddp.join(throw_on_early_termination=True):
            for k, x in enumerate(batches(rank)):
                opt.zero_grad()
                ddp(x).square().sum().backward()
                opt.step()
    except RuntimeError as exc:
        raised = (k, str(exc))
    assert raised is not None and "exhausted" in raised[1], raised
    # rank 0 (the fewest batches) raises as it leaves its loop, the others at their next batch
    assert raised[0] == (steps[0] - 1 if rank == 0 else steps[0]), raised


def _ops_worker(rank: int, w: int) -> dict:
    import torch.distributed as dist
    import braid
    from braid.backend import BraidProcessGroup
    torch.set_num_threads(1)
    pg = _init(rank, w)
    rep = _Report()
    rep.out["backend"] = str(dist.get_backend())
    rep.out["group_type"] = type(pg).__name__
    # point to point as the very first calls: on the inner gloo group (no Communicator yet)
    rep.case("p2p_first", _p2p_pairs, rank, w, "first")
    rep.out["comm_after_first_p2p"] = pg._comm is not None
    rep.case("all_reduce", _reductions, rank, w)
    rep.out["comm_made"] = pg._comm is not None and not pg._comm.closed
    rep.case("reduce_scatter", _reduce_scatter, rank, w)
    rep.case("all_gather", _gathers, rank, w, pg)
    rep.case("broadcast", _broadcasts, rank, w)
    rep.case("all_to_all_single", _all_to_all, rank, w)
    rep.case("reduce", _reduce_to_root, rank, w)
    rep.case("p2p_after", _p2p_pairs, rank, w, "after", pg)    # now through braid's communicator
    rep.case("async", _async_ops, rank, w)
    rep.case("objects_barrier", _objects_and_barrier, rank, w)
    rep.case("forwarded", _forwarded, rank, w, pg)
    rep.case("pg_overloads", _pg_overloads, rank, w, pg)
    rep.case("misuse", _misuse_propagates, rank, w)
    rep.case("ddp", _ddp, rank, w, pg)
    rep.case("ddp_join", _ddp_join, rank, w)

    def shared_communicator():
        comm = braid.init()
        assert comm is pg.ensure_communicator(), "braid.init() made a second communicator"
        braid.close()                   # the backend's communicator stays open
        assert not comm.closed
        t = torch.ones(4)
        dist.all_reduce(t)
        assert t.tolist() == [float(w)] * 4

    rep.case("shared_communicator", shared_communicator)

    def subgroup():
        members = [0, 1]
        sub = dist.new_group(members)
        if rank in members:
            assert isinstance(sub, BraidProcessGroup) and not sub._world, sub
            t = _data(("sub", rank), 1023, torch.int64)
            dist.all_reduce(t, group=sub)
            _same(t, _reduce_ref([_data(("sub", r), 1023, torch.int64) for r in members], "sum"), "subgroup all_reduce")
            assert sub._comm is None
            dist.destroy_process_group(sub)

    rep.case("subgroup", subgroup)

    def destroy():
        comm = pg._comm
        assert _braid_maps(), "expected the node segment to be mapped before destroy"
        dist.destroy_process_group()
        assert comm.closed, "destroy_process_group left braid's communicator open"
        assert comm.segment is None or comm.segment.closed
        left = _braid_maps()
        assert not left, left
        assert not dist.is_initialized()

    rep.case("destroy", destroy)
    return rep.out


# ---------------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def world(request):
    info: dict = {}
    reports = run_world(_ops_worker, request.param, init_pg=False, env=ENV, info=info, timeout=150)
    return {"w": request.param, "reports": reports, "pids": info["pids"], "shm": braid_shm_entries()}


CASES = ["p2p_first", "all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all_single",
         "reduce", "p2p_after", "async", "objects_barrier", "forwarded", "pg_overloads", "misuse", "ddp", "ddp_join",
         "shared_communicator", "subgroup", "destroy"]


@pytest.mark.parametrize("case", CASES)
def test_case(world, case):
    bad = {r: rep.get(case, "not run") for r, rep in enumerate(world["reports"]) if rep.get(case) != "ok"}
    assert not bad, f"{case} (world of {world['w']}):\n" + "\n".join(f"rank {r}: {v}" for r, v in bad.items())


def test_backend_name_and_lazy_communicator(world):
    for r, rep in enumerate(world["reports"]):
        assert rep["backend"] == "braid", (r, rep["backend"])
        assert rep["group_type"] == "BraidProcessGroup", (r, rep["group_type"])
        assert rep["comm_after_first_p2p"] is False, "send/recv before any collective made the communicator"
        assert rep["comm_made"] is True, "the first collective did not make braid's communicator"


def test_no_segment_left_in_dev_shm(world):
    ours = {n for n in world["shm"] if any(n.startswith(f"braid-{p}-") for p in world["pids"])}
    assert not ours, ours


def test_register_is_idempotent():
    import torch.distributed as dist
    import braid.backend as backend
    backend.register()
    backend.register()
    assert dist.Backend.backend_list.count("braid") == 1
    assert "BRAID" in dist.Backend._plugins


# ---- GPU send/recv queue (the logic, with a stand-in for the inner NCCL group) ----------------

class _FakeTensor:
    is_cuda = True
    device = "cuda:0"


class _FakeWork:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait(self):
        self.log.append(("wait", self.name))
        return True

    def is_completed(self):
        return True


class _FakeNccl:
    """Records what the queue posts; _start/_end_coalescing take no argument, as on a raw backend."""

    def __init__(self):
        self.log = []

    def _start_coalescing(self):
        self.log.append("start")

    def _end_coalescing(self):
        self.log.append("end")
        return _FakeWork(self.log, "group")

    def send(self, ts, peer, tag):
        self.log.append(("send", peer))
        return _FakeWork(self.log, f"send{peer}")

    def recv(self, ts, peer, tag):
        self.log.append(("recv", peer))
        return _FakeWork(self.log, f"recv{peer}")

    def eager_connect_single_device(self, device):
        self.log.append(("connect", device))


def test_queued_gpu_sends_and_recvs_post_as_one_group_on_first_wait():
    import types
    from braid.backend import BraidProcessGroup, _QueuedWork
    pg = types.SimpleNamespace(nccl=_FakeNccl(), _p2p_queue=[], _p2p_world=False, _braid_rank=7)
    pg.flush_p2p = lambda: BraidProcessGroup.flush_p2p(pg)
    pg._copy_to_self = lambda q: BraidProcessGroup._copy_to_self(pg, q)
    # before the communicator of all ranks exists, one op alone goes as it is, without a group
    w = _QueuedWork(pg, [_FakeTensor()])
    pg._p2p_queue.append((False, [_FakeTensor()], 3, 0, w))
    assert w.is_completed()
    assert pg.nccl.log == [("recv", 3)]
    pg.nccl.log.clear()
    works = []
    for sending, peer in ((True, 1), (False, 1), (True, 2)):
        w = _QueuedWork(pg, [_FakeTensor()])
        pg._p2p_queue.append((sending, [_FakeTensor()], peer, 0, w))
        works.append(w)
    assert pg.nccl.log == []                        # nothing posted before anyone asks
    works[1].wait()
    assert pg.nccl.log == ["start", ("send", 1), ("recv", 1), ("send", 2), "end", ("wait", "group")]
    assert pg._p2p_queue == []
    assert works[0].is_completed() and works[2].wait()
    assert pg.nccl.log.count("start") == 1          # posted once
    # the group made the communicator of all ranks: from now on one op alone is a group too
    # (its peer may post the matching op inside a group: both must be on that communicator)
    pg.nccl.log.clear()
    w = _QueuedWork(pg, [_FakeTensor()])
    pg._p2p_queue.append((False, [_FakeTensor()], 3, 0, w))
    assert w.is_completed()
    assert pg.nccl.log == ["start", ("recv", 3), "end"]


def _queue_pg(world_known: bool, rank: int = 7):
    import types
    from braid.backend import BraidProcessGroup
    pg = types.SimpleNamespace(nccl=_FakeNccl(), _p2p_queue=[], _p2p_world=world_known, bound_device_id=None,
                               _braid_rank=rank)
    pg.flush_p2p = lambda: BraidProcessGroup.flush_p2p(pg)
    pg._copy_to_self = lambda q: BraidProcessGroup._copy_to_self(pg, q)
    pg.connect = lambda dev: BraidProcessGroup._connect_world(pg, dev)
    return pg


def test_a_lone_send_or_recv_is_a_group_once_the_communicator_of_all_ranks_exists():
    """The hang's pattern (4 ranks): rank 1 posts [isend to 0, send to 3] together, rank 0 its
    recv from 1 alone. torch's NCCL group sends a lone op over the pair's communicator and a
    grouped one over that of all ranks: with every post a group, both travel on the latter."""
    from braid.backend import _QueuedWork
    for ops in ([(False, 1)], [(True, 2)], [(True, 0), (False, 0)]):
        pg = _queue_pg(world_known=True)
        works = []
        for sending, peer in ops:
            works.append(_QueuedWork(pg, [_FakeTensor()]))
            pg._p2p_queue.append((sending, [_FakeTensor()], peer, 0, works[-1]))
        pg.flush_p2p()
        assert pg.nccl.log == ["start"] + [("send" if s else "recv", p) for s, p in ops] + ["end"]
        assert all(w._inner.name == "group" for w in works)
        pg.flush_p2p()                                  # nothing queued: nothing posted
        assert pg.nccl.log.count("start") == 1


def test_sends_to_itself_are_copies_and_need_no_other_rank():
    """One rank's batch to itself (torch's test_batch_isend_irecv_self_nccl): each receive from
    itself gets its own earlier-queued sends' data in order, as copies, with nothing posted to NCCL
    (its batch would need the communicator of all ranks, which needs every rank); the rest of the
    queue still goes to NCCL, in its order."""
    import torch
    from braid.backend import _QueuedWork
    g = torch.Generator().manual_seed(5)
    for world_known in (False, True):
        pg = _queue_pg(world_known=world_known, rank=0)
        a, b = torch.randn(7, generator=g), torch.randn(3, 4, generator=g)
        ra, rb = torch.full((7,), -1.0), torch.full((12,), -1.0)
        ops = [(False, [ra], 0), (True, [a], 0), (True, [_FakeTensor()], 1), (False, [rb], 0), (True, [b], 0)]
        works = []
        for sending, ts, peer in ops:
            works.append(_QueuedWork(pg, ts))
            pg._p2p_queue.append((sending, ts, peer, 0, works[-1]))
        works[0].wait()
        assert torch.equal(ra, a) and torch.equal(rb, b.view(-1))
        assert pg.nccl.log[:3] == (["start", ("send", 1), "end"] if world_known else [("send", 1)])
        assert all(w.is_completed() for w in works)
    # a receive from itself with no send of its own in the queue goes to NCCL as before
    pg = _queue_pg(world_known=True, rank=0)
    r = torch.zeros(2)
    w = _QueuedWork(pg, [r])
    pg._p2p_queue.append((False, [_FakeTensor()], 0, 0, w))
    pg.flush_p2p()
    assert pg.nccl.log == ["start", ("recv", 0), "end"] and torch.equal(r, torch.zeros(2))


def test_the_communicator_of_all_ranks_is_connected_once():
    pg = _queue_pg(world_known=False)
    pg.connect("cuda:1")
    assert pg.nccl.log == [("connect", "cuda:1")] and pg._p2p_world
    pg.connect("cuda:1")
    assert pg.nccl.log == [("connect", "cuda:1")]                      # once
    bound = _queue_pg(world_known=False)
    bound.bound_device_id = "cuda:0"        # init_process_group(device_id=...): torch connected it
    bound.connect("cuda:0")
    assert bound.nccl.log == [] and bound._p2p_world


def test_a_failed_connect_keeps_torchs_choice_of_communicator(caplog):
    from braid.backend import _QueuedWork
    pg = _queue_pg(world_known=False)

    def refuse(device):
        raise RuntimeError("NCCL error: unhandled system error")
    pg.nccl.eager_connect_single_device = refuse
    pg.connect("cuda:0")
    assert not pg._p2p_world and "connecting the inner NCCL group failed" in caplog.text
    w = _QueuedWork(pg, [_FakeTensor()])
    pg._p2p_queue.append((True, [_FakeTensor()], 1, 0, w))
    pg.flush_p2p()
    assert pg.nccl.log == [("send", 1)]


def test_coalescing_calls_pass_the_device_only_where_it_is_wanted():
    from braid.backend import _coalescing
    seen = []
    assert _coalescing(lambda: seen.append("none") or "a", "cuda:0") == "a"

    def with_dev(dev):
        seen.append(dev)
        return "b"
    assert _coalescing(with_dev, "cuda:0") == "b"
    assert seen == ["none", "cuda:0"]


def test_a_destroy_that_does_not_return_says_why(caplog):
    # torch's destroy_process_group stuck in a group's shutdown (NCCL's destroy waits for every
    # CUDA graph that captured one of its calls): after the watch's bound a warning names the
    # wait and its usual cause, once; a destroy that returns in time leaves no warning, and a
    # look outside any destroy finds nothing to watch
    import logging
    import threading
    import time

    from braid.comm.ledger import TeardownWatch

    def destroy_process_group(stuck_s):         # the name the watch looks for on the stack
        watch = TeardownWatch.start(after_s=0.3, period_s=0.02)
        time.sleep(stuck_s)
        return watch

    assert TeardownWatch.frame() is None and not TeardownWatch(0.0).look(time.monotonic())
    with caplog.at_level(logging.WARNING, logger="braid"):
        destroy_process_group(0.0).join(5)
    assert not [r for r in caplog.records if "destroy_process_group" in r.getMessage()]
    with caplog.at_level(logging.WARNING, logger="braid"):
        t = destroy_process_group(1.5)
        t.join(5)
    assert not t.is_alive()
    said = [r.getMessage() for r in caplog.records if "destroy_process_group has not returned" in r.getMessage()]
    assert len(said) == 1, caplog.records
    assert "CUDA graph" in said[0] and "torch._dynamo.reset()" in said[0] and "test_backend.py" in said[0], said

    # the watchdog's form: it looks from its own thread while another is inside a destroy
    out = threading.Event()
    w = TeardownWatch(after_s=1.0)
    th = threading.Thread(target=_stuck_in_destroy, args=(out,))
    th.start()
    t_end = time.monotonic() + 5
    while TeardownWatch.frame() is None and time.monotonic() < t_end:
        time.sleep(0.01)
    seen = {"first": w.look(100.0), "early": w.look(100.5) and not w.said, "late": w.look(101.5)}
    out.set()
    th.join(5)
    seen["after"] = w.look(102.0)
    assert seen == {"first": True, "early": True, "late": False, "after": False} and w.said, seen


def _stuck_in_destroy(out):
    def destroy_process_group():
        out.wait(5)
    destroy_process_group()


def _destroy_closes_first(rank, world, backend_api):
    # torch's destroy_process_group (braid wraps it) closes a communicator before any of its
    # groups is shut down: a prepared all_reduce with NCCL's share keeps a CUDA graph that holds
    # an NCCL call of braid's NCCL group, whose destroy waits for the graph (and torch shuts the
    # groups a communicator made down before the default group)
    import torch.distributed as dist
    import braid  # noqa: F401  (registers the backend, wraps destroy_process_group)
    from braid.comm import Communicator
    if backend_api:
        dist.init_process_group("braid", rank=rank, world_size=world)
        t = torch.ones(5)
        dist.all_reduce(t)
        comm = dist.distributed_c10d._get_default_group()._comm
    else:
        comm = Communicator()
        t = torch.ones(5)
        comm.all_reduce(t)
    seen = {}
    groups = [comm.gloo_group]
    close = comm.close

    def watched_close():                            # (the backend's shutdown closes it again: a no-op)
        import traceback
        if not seen:
            seen["before_shutdowns"] = not any(f.name == "shutdown" for f in traceback.extract_stack())
            seen["groups_alive"] = all(g in dist.distributed_c10d._world.pg_map for g in groups)
            seen["initialized"] = dist.is_initialized()
        close()
    comm.close = watched_close
    from torch.distributed import destroy_process_group     # the name as code imports it after braid
    destroy_process_group()
    return {"sum": t.tolist(), "closed": comm.closed, **seen, "wrapped": destroy_process_group is dist.destroy_process_group
            and getattr(destroy_process_group, "_braid_wraps", None) is not None}


@pytest.mark.parametrize("backend_api", [False, True], ids=["direct", "backend"])
def test_destroy_process_group_closes_braids_communicators_before_their_groups(backend_api):
    out = run_world(_destroy_closes_first, 2, backend_api, init_pg=not backend_api)
    for r in out:
        assert r["sum"] == [2.0] * 5 and r["closed"] and r["wrapped"], r
        assert r["before_shutdowns"] and r["groups_alive"] and r["initialized"], r


def test_the_destroy_wrap_starts_the_watch_on_machines_with_gpus_and_runs_torchs_own(monkeypatch):
    import torch.distributed as dist
    import braid.backend as bk
    from braid.comm import communicator as cm
    calls = []
    monkeypatch.setattr(bk.TeardownWatch, "start", classmethod(lambda cls, *a, **k: calls.append("watch")))
    monkeypatch.setattr(cm, "close_before_destroy", lambda group=None: calls.append(("close", group)))
    for gpus in (True, False):
        calls.clear()
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus)
        with pytest.raises((ValueError, RuntimeError, AssertionError)):   # torch's own: no group here
            dist.destroy_process_group()
        assert calls == (["watch", ("close", None)] if gpus else [("close", None)]), calls
