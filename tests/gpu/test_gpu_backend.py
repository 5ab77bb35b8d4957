"""GPU tier: the "braid" torch.distributed backend with CUDA tensors (plain dist.* calls, DDP,
functional collectives, FSDP2), against references every rank computes locally.

Skips without a GPU (on one GPU its 2 ranks share it). Run on a GPU machine:  python3 -m pytest tests/gpu/test_gpu_backend.py -q
"""
from __future__ import annotations

import contextlib
import datetime
import os
import sys
import traceback

import pytest
import torch

from gpu_world import BASE_ENV, _port, needs, start_rank

NEEDS = needs(2)
SIZES = [7, 1023, 1_000_003, 3 << 20]


def _data(seed: int, n: int, dtype, dev) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(n, generator=g) * 3 + 0.5) * (torch.randint(0, 2, (n,), generator=g) * 2 - 1)
    if not dtype.is_floating_point:
        x = (x * 1000).round()
    return x.to(dtype).to(dev)


def _close(got, want, what):
    tol = {torch.bfloat16: 2e-2, torch.float16: 2e-3}.get(got.dtype, 1e-5)
    if got.dtype.is_floating_point:
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol, msg=what)
    else:
        assert torch.equal(got, want), what


def _cases(rank, w, dev, pg):
    import torch.distributed as dist
    R = dist.ReduceOp

    def backend_name():
        assert dist.get_backend() == "braid", dist.get_backend()
        assert type(pg).__name__ == "BraidProcessGroup", type(pg)
    yield "backend_name", backend_name

    def batch(tag, sizes):
        # torch's batch_isend_irecv on this group: both ranks isend first, then irecv (issued one
        # by one for a Python group; braid queues GPU sends/recvs and posts them as one group)
        def run():
            for n in sizes:
                x = _data(900 + rank + n, n, torch.float32, dev)
                got = torch.empty_like(x)
                ops = [dist.P2POp(dist.isend, x, 1 - rank), dist.P2POp(dist.irecv, got, 1 - rank)]
                for wk in dist.batch_isend_irecv(ops):
                    wk.wait()
                _close(got, _data(900 + 1 - rank + n, n, torch.float32, dev), f"batch_isend_irecv {tag} n={n}")
        return run

    yield "batch_first", batch("before any collective", [4097])

    def batch_first_state():
        assert pg._comm is None
    yield "batch_first_state", batch_first_state

    def p2p_first():
        x = _data(10 + rank, 4097, torch.float32, dev)
        got = torch.empty_like(x)
        # rank 0 sends first, rank 1 receives first: NCCL connects a pair on its first send/recv,
        # and two first sends facing each other wait for each other
        ws = [dist.isend(x, 1 - rank), dist.irecv(got, 1 - rank)] if rank == 0 else \
            [dist.irecv(got, 1 - rank), dist.isend(x, 1 - rank)]
        for wk in ws:
            wk.wait()
        _close(got, _data(10 + 1 - rank, 4097, torch.float32, dev), "isend/irecv before any collective")
        assert pg._comm is None
    yield "p2p_first", p2p_first

    def reductions():
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            for n in SIZES:
                parts = [_data(100 + r + n, n, dtype, dev) for r in range(w)]
                ops = [("sum", R.SUM), ("max", R.MAX)] + ([("avg", R.AVG)] if dtype.is_floating_point else [])
                for name, op in ops:
                    t = parts[rank].clone()
                    dist.all_reduce(t, op=op)
                    st = torch.stack([p.double() for p in parts])
                    ref = {"sum": st.sum(0), "max": st.amax(0), "avg": st.mean(0)}[name].to(dtype)
                    _close(t, ref, f"all_reduce {name} {dtype} n={n}")
                m = n // w
                out = torch.empty(m, dtype=dtype, device=dev)
                dist.reduce_scatter_tensor(out, parts[rank][: m * w].clone())
                ref = torch.stack([p[rank * m:(rank + 1) * m].double() for p in parts]).sum(0).to(dtype)
                _close(out, ref, f"reduce_scatter_tensor {dtype} n={n}")
        assert pg._comm is not None and pg._comm.cuda
    yield "reductions", reductions

    def premul_sum():       # not a braid op: the inner NCCL group runs it
        t = _data(7, 1023, torch.float32, dev) * (rank + 1)
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
        ref = sum(_data(7, 1023, torch.float32, dev) * (r + 1) for r in range(w)) * 0.5
        _close(t, ref, "premul-sum")
    yield "premul_sum", premul_sum

    def moves():
        for dtype in (torch.float32, torch.bfloat16, torch.uint8):
            for n in SIZES:
                parts = [_data(300 + r + n, n, dtype, dev) for r in range(w)]
                out = torch.empty(n * w, dtype=dtype, device=dev)
                dist.all_gather_into_tensor(out, parts[rank])
                assert torch.equal(out, torch.cat(parts)), f"all_gather_into_tensor {dtype} n={n}"
                outs = [torch.empty(n, dtype=dtype, device=dev) for _ in range(w)]
                dist.all_gather(outs, parts[rank])
                assert torch.equal(torch.cat(outs), torch.cat(parts)), f"all_gather {dtype} n={n}"
                b = parts[rank].clone()
                dist.broadcast(b, src=w - 1)
                assert torch.equal(b, parts[w - 1]), f"broadcast {dtype} n={n}"
        rows = [[(s + 2 * d + 1) * 1000 for d in range(w)] for s in range(w)]
        ins = [_data(500 + s, sum(rows[s]) * 4, torch.float32, dev).view(-1, 4) for s in range(w)]
        out = torch.empty(sum(rows[s][rank] for s in range(w)), 4, device=dev)
        dist.all_to_all_single(out, ins[rank], [rows[s][rank] for s in range(w)], rows[rank])
        assert torch.equal(out, torch.cat([ins[s].split(rows[s])[rank] for s in range(w)])), "all_to_all_single"
    yield "moves", moves

    def p2p_after():
        for n in (4097, 3 << 20):
            x = _data(20 + rank + n, n, torch.float32, dev)
            got = torch.empty_like(x)
            before = pg._comm.last_handle
            ws = [dist.isend(x, 1 - rank), dist.irecv(got, 1 - rank)] if rank == 0 else \
                [dist.irecv(got, 1 - rank), dist.isend(x, 1 - rank)]
            for wk in ws:
                wk.wait()
            # braid's own send/recv where braid would split the message; else NCCL (queued, one group)
            split = not pg._comm.policy.native_for("send_recv", n * 4)
            assert (pg._comm.last_handle is not before) == split, (n, split)
            _close(got, _data(20 + 1 - rank + n, n, torch.float32, dev), f"isend/irecv n={n}")
    yield "p2p_after", p2p_after
    yield "batch_after", batch("after a collective", [4097, 3 << 20])

    def async_and_future():
        t = _data(40 + rank, 3 << 20, torch.float32, dev)
        ref = _data(40, 3 << 20, torch.float32, dev) + _data(41, 3 << 20, torch.float32, dev)
        work = dist.all_reduce(t, async_op=True)
        val = work.get_future().wait()[0]
        _close(val, ref, "future value")
        work.wait()
        _close(t, ref, "async all_reduce")
    yield "async_and_future", async_and_future

    def async_dropped():
        # an async split call whose caller drops its tensors before the wait (the handle keeps
        # them, no record_stream): new allocations of the same size, filled at once, must not
        # land on them; a handle dropped unwaited keeps them until its end, then a later call
        # lets them go
        from braid import executor
        n = 3 << 20
        for i in range(6):
            x = _data(500 + i + rank, n, torch.float32, dev)
            out = torch.empty(n * w, device=dev)
            h = dist.all_gather_into_tensor(out, x, async_op=True)
            y = _data(520 + i + rank, n, torch.float32, dev)
            h2 = dist.all_reduce(y, async_op=True)
            del x
            junk = [torch.full((n,), -7.0, device=dev) for _ in range(4)]
            h.wait()
            want = torch.cat([_data(500 + i + r, n, torch.float32, dev) for r in range(w)])
            _close(out, want, f"async all_gather, its input dropped, call {i}")
            if i % 2:
                del h2          # never waited: the call's tensors stay alive to its end
                del y
                torch.cuda.synchronize()
            else:
                h2.wait()
                _close(y, sum(_data(520 + i + r, n, torch.float32, dev) for r in range(w)), f"async all_reduce, call {i}")
            del junk
        torch.cuda.synchronize()
        z = torch.ones(8, device=dev)
        dist.all_reduce(z, async_op=True).wait()        # small: whole; a split call sweeps
        executor.sweep()
        assert not executor._UNWAITED, f"{len(executor._UNWAITED)} dropped calls still held after their end"
    yield "async_dropped", async_dropped

    def objects_barrier():
        objs = [None] * w
        dist.all_gather_object(objs, {"r": rank})
        assert objs == [{"r": r} for r in range(w)], objs
        dist.barrier()
    yield "objects_barrier", objects_barrier

    def cpu_tensors():
        # CPU tensors on the GPU communicator: whole calls through the node segment (an area of
        # their own), the all_reduce in native threads; object collectives and the barrier too
        comm = pg._comm
        assert comm is not None and comm.cuda and comm._cpu is not None, "no segment path for CPU tensors"
        for n in (5, 70_001, 1_000_003):
            for dt in (torch.float32, torch.bfloat16, torch.int64):
                xs = [_data(60 + r + n, n, dt, "cpu") for r in range(w)]
                t = xs[rank].clone()
                dist.all_reduce(t)
                _close(t, sum(x.double() for x in xs).to(dt) if dt.is_floating_point else sum(xs), f"cpu all_reduce {dt} n={n}")
                assert comm.last_call[-1] == "shm", comm.last_call
                out = torch.empty(n * w, dtype=dt)
                dist.all_gather_into_tensor(out, xs[rank])
                assert torch.equal(out, torch.cat(xs)), f"cpu all_gather {dt} n={n}"
                t = xs[rank].clone()
                dist.broadcast(t, 1)
                assert torch.equal(t, xs[1]), f"cpu broadcast {dt} n={n}"
        assert comm._cpu.native_calls >= 2, comm._cpu.native_calls
        g = _data(7, 3 << 20, torch.float32, dev)       # GPU calls still run between them
        dist.all_reduce(g)
        _close(g, _data(7, 3 << 20, torch.float32, dev) * w, "gpu all_reduce between cpu calls")
        box = [{"big": list(range(50_000)), "r": 1}] if rank == 1 else [None]
        dist.broadcast_object_list(box, src=1)
        assert box[0]["r"] == 1 and len(box[0]["big"]) == 50_000
        objs = [None] * w
        dist.all_gather_object(objs, ("rank", rank, "x" * (1000 * rank)))
        assert objs == [("rank", r, "x" * (1000 * r)) for r in range(w)], objs
        dist.barrier()
    yield "cpu_tensors", cpu_tensors

    def ddp():
        import copy
        from torch.nn.parallel import DistributedDataParallel as DDP
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 32).to(dev)
        ref = copy.deepcopy(model)
        ddp_model = DDP(model, device_ids=[dev.index])
        xs = [_data(60 + r, 8 * 64, torch.float32, dev).view(8, 64) for r in range(w)]
        (ddp_model(xs[rank]) ** 2).sum().backward()
        grads = []
        for r in range(w):
            ref.zero_grad()
            (ref(xs[r]) ** 2).sum().backward()
            grads.append([p.grad.clone() for p in ref.parameters()])
        for i, p in enumerate(model.parameters()):
            _close(p.grad, sum(g[i] for g in grads) / w, f"DDP grad {i}")
    yield "ddp", ddp

    def functional():
        import torch.distributed._functional_collectives as fc
        x = _data(80 + rank, 1023, torch.float32, dev)
        y = fc.all_reduce(x, "sum", dist.group.WORLD)
        _close(y, _data(80, 1023, torch.float32, dev) + _data(81, 1023, torch.float32, dev), "functional all_reduce")
    yield "functional", functional

    def fsdp2():
        from torch.distributed.device_mesh import init_device_mesh
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:
            from torch.distributed._composable.fsdp import fully_shard
        mesh = init_device_mesh("cuda", (w,))
        torch.manual_seed(0)
        mod = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4)).to(dev)
        fully_shard(mod, mesh=mesh)
        loss = mod(_data(90 + rank, 3 * 32, torch.float32, dev).view(3, 32)).sum()
        loss.backward()
        assert all(p.grad is not None for p in mod.parameters())
    yield "fsdp2", fsdp2

    def took_graphs(counters, what):
        # torch's CUDA graphs took the compiled step (no skip), reported once
        skips = dict(counters["inductor"]).get("cudagraph_skips", 0)
        assert not skips, f"torch's CUDA graphs skipped the step ({skips})"
        if rank == 0:
            print(f"compiled (reduce-overhead) {what}: right; last call {pg._comm.last_call}", flush=True)

    def compiled():
        # torch.compile(mode="reduce-overhead") of a step with a functional all_reduce on this
        # group, under each lane set (None: the built-in model's split): every replay right with
        # new data in the same input (4 MiB), and torch's CUDA graphs took the step (no skip)
        import gc
        import re
        import torch._inductor.config as icfg
        import torch.distributed._functional_collectives as fc
        from torch._dynamo.utils import counters
        icfg.triton.cudagraph_trees_history_recording = True     # a failure names where its tensor came from
        comm = pg._comm

        def step(x):
            return fc.all_reduce(x * 2, "sum", dist.group.WORLD) + 1

        def holders(exc) -> str:
            # who holds the tensors torch's pool check named (a failure's diagnosis): each holder
            # named by its type and, through a dict or a tuple, by the object and key above it
            addrs = {int(a) for a in re.findall(r"Data Pointer: (\d+)", str(exc))}

            def name(r, depth=0) -> str:
                if depth > 3:
                    return type(r).__name__
                if isinstance(r, dict):
                    for u in gc.get_referrers(r):
                        if getattr(u, "__dict__", None) is r:
                            return f"{type(u).__name__}.__dict__"
                if isinstance(r, (dict, tuple, list)):
                    ups = [u for u in gc.get_referrers(r) if not isinstance(u, type(sys._getframe()))][:3]
                    return f"{type(r).__name__}<-[{', '.join(name(u, depth + 1) for u in ups)}]"
                return type(r).__name__
            found = []
            for o in gc.get_objects():
                try:
                    hit = isinstance(o, torch.Tensor) and o.is_cuda and o.untyped_storage().data_ptr() in addrs
                except Exception:
                    continue
                if hit:
                    found.append(f"{tuple(o.shape)} {o.dtype} held by {[name(r) for r in gc.get_referrers(o)][:6]}")
            return f"pointers {sorted(addrs)}; Python tensors there: {found or 'none'}"
        bad = []
        n = 1 << 20
        for shares in ({"ce": 1.0}, {"ce": 0.5, "host": 0.5}, {"nccl": 0.5, "ce": 0.5}, {"host": 1.0}, None):
            torch._dynamo.reset()
            counters.clear()
            f = torch.compile(step, mode="reduce-overhead")
            x = torch.empty(n, device=dev)
            try:
                with (comm.fixed_shares(shares, op="all_reduce") if shares else contextlib.nullcontext()):
                    for i in range(5):
                        x.copy_(_data(300 + 10 * i + rank, n, torch.float32, dev))
                        got = f(x).clone()
                        want = 2 * (_data(300 + 10 * i, n, torch.float32, dev) + _data(301 + 10 * i, n, torch.float32, dev)) + 1
                        _close(got, want, f"compiled step, call {i}")
                        if i == 0:
                            assert comm.last_call is not None
                took_graphs(counters, f"on {shares}")
            except Exception as exc:
                msg = str(exc)
                i = msg.find("Allocations:")
                last = comm.ledger.last_handle
                bad.append(f"{shares}: {type(exc).__name__}: {msg[:160]} {msg[i: i + 1200] if i >= 0 else msg[-1500:]}"
                           f"\nlast call {comm.last_call}, its shares {getattr(last, 'shares', None)}\n{holders(exc)}")
        # the graphs go before destroy: NCCL's communicator destroy waits until every graph that
        # captured one of its calls is freed (the step's whole call was NCCL's), on any backend
        torch._dynamo.reset()
        gc.collect()
        assert not bad, "\n".join(bad)
    yield "compiled", compiled

    def compiled_more():
        # the same under torch.compile(mode="reduce-overhead") for the other functional
        # collectives a compiled step traces: all_gather, reduce_scatter and all_to_all_single in
        # one step (4 MiB each rank), every replay right with new data in the same input, on the
        # copy engines, a split with the host lane and the built-in model's choice
        import gc
        import torch.distributed._functional_collectives as fc
        from torch._dynamo.utils import counters
        comm, grp = pg._comm, dist.group.WORLD
        n = 1 << 20

        def step(x):
            g = fc.all_gather_tensor(x * 2, 0, grp) + 1
            rs = fc.reduce_scatter_tensor(x, "sum", 0, grp)
            a2a = fc.all_to_all_single(x + 3, None, None, grp)
            return g, rs, a2a
        bad = []
        for shares in ({"ce": 1.0}, {"ce": 0.5, "host": 0.5}, None):
            torch._dynamo.reset()
            counters.clear()
            f = torch.compile(step, mode="reduce-overhead")
            x = torch.empty(n, device=dev)
            try:
                with (comm.fixed_shares(shares) if shares else contextlib.nullcontext()):
                    wrong = []      # every rank makes every call (one that stopped at a wrong result
                    for i in range(5):      # would leave its peer waiting in the next one)
                        x.copy_(_data(700 + 10 * i + rank, n, torch.float32, dev))
                        g, rs, a2a = (t.clone() for t in f(x))
                        xs = [_data(700 + 10 * i + r, n, torch.float32, dev) for r in range(w)]
                        part = n // w
                        for what, got, want in (
                                ("all_gather", g, torch.cat([2 * v + 1 for v in xs])),
                                ("reduce_scatter", rs, sum(xs)[rank * part:(rank + 1) * part]),
                                ("all_to_all_single", a2a, torch.cat([(v + 3)[rank * part:(rank + 1) * part] for v in xs]))):
                            bad_at = (got - want).abs() > 1e-4 * want.abs() + 1e-4
                            if bad_at.any():
                                idx = bad_at.nonzero().flatten()
                                wrong.append(f"{what} call {i}: {idx.numel()} of {got.numel()} wrong, "
                                             f"first {int(idx[0])} last {int(idx[-1])}")
                    assert not wrong, "; ".join(wrong)
                took_graphs(counters, f"gather/scatter/a2a on {shares}")
            except Exception as exc:
                last = comm.ledger.last_handle
                bad.append(f"{shares}: {type(exc).__name__}: {str(exc)[:1500]}\nlast call {comm.last_call}, "
                           f"its shares {getattr(last, 'shares', None)}")
        torch._dynamo.reset()
        gc.collect()
        assert not bad, "\n".join(bad)
    yield "compiled_more", compiled_more

    def destroy():
        comm = pg._comm
        dist.destroy_process_group()
        assert comm.closed
        left = [ln for ln in open("/proc/self/maps") if "/braid-" in ln]
        assert not left, left
    yield "destroy", destroy


def _bound_cases(rank, w, dev, pg):
    """init_process_group(..., device_id=...): torch connects the inner NCCL group eagerly."""
    import torch.distributed as dist

    def collectives():
        for n in (1023, 3 << 20):
            t = _data(700 + rank + n, n, torch.float32, dev)
            dist.all_reduce(t)
            _close(t, sum(_data(700 + r + n, n, torch.float32, dev) for r in range(w)), f"all_reduce n={n}")
        dist.barrier()
        assert pg._comm is not None and pg._comm.cuda
    yield "collectives", collectives

    def destroy():
        comm = pg._comm
        dist.destroy_process_group()
        assert comm.closed
    yield "destroy", destroy


def _four_cases(rank, w, dev, pg):
    """Four ranks, queues that differ: rank 1's isend to 0 (not waited yet) is posted with its
    next send, to 3, while 0 and 3 post their recvs alone. Both messages must travel on the
    same NCCL communicator as their recvs (it hung for good when rank 1's pair went as a group
    on the communicator of all ranks and the recvs alone on their pairs' own)."""
    import torch.distributed as dist

    def uneven_queues():
        t = torch.ones(1, device=dev)
        dist.all_reduce(t)                          # braid's Communicator: made at the first collective
        comm = pg.ensure_communicator()
        with comm.fixed_shares({"nccl": 1.0}):      # every send/recv is NCCL's (the backend's queue)
            for it in range(4):
                n = (4099, 1 << 20)[it % 2]
                x0, x3 = _data(800 + it, n, torch.float32, dev), _data(810 + it, n, torch.float32, dev)
                if rank == 1:
                    h = dist.isend(x0, 0)
                    dist.send(x3, 3)
                    h.wait()
                elif rank in (0, 3):
                    got = torch.empty(n, device=dev)
                    dist.recv(got, 1)
                    _close(got, x0 if rank == 0 else x3, f"recv {it} from rank 1 on rank {rank}")
                dist.barrier()
        assert pg._p2p_world
    yield "uneven_queues", uneven_queues


def _entry(rank, world, port, out_dir, bound=False):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **BASE_ENV, BRAID_MIN_SPLIT_KB="1")
    import torch.distributed as dist
    import braid  # noqa: F401
    dev = start_rank(rank, world)
    dist.init_process_group("braid", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120),
                            **({"device_id": dev} if bound else {}))
    pg = dist.distributed_c10d._get_default_group()
    report = {}
    import json
    cases = _four_cases if world == 4 else _bound_cases if bound else _cases
    for name, fn in cases(rank, world, dev, pg):
        try:
            fn()
            torch.cuda.synchronize()
            report[name] = "ok"
        except Exception:
            report[name] = traceback.format_exc()[-9000:]
        with open(os.path.join(out_dir, f"r{rank}.json"), "w") as f:     # after every case: a
            json.dump(report, f)                  # rank that dies later still tells what ran


def _spawn(tmp_path_factory, bound: bool, world: int = 2):
    import json
    import torch.multiprocessing as mp
    out = tmp_path_factory.mktemp("backend")
    try:
        mp.spawn(_entry, args=(world, _port(), str(out), bound), nprocs=world)
    except mp.ProcessExitedException as exc:       # the cases each rank finished, then the end
        done = [(out / f"r{r}.json").read_text() if (out / f"r{r}.json").exists() else "{}" for r in range(world)]
        pytest.fail(f"a rank ended ({exc}); the cases' reports so far:\n" + "\n".join(done))
    return [json.loads((out / f"r{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return _spawn(tmp_path_factory, bound=False)


@pytest.fixture(scope="module")
def bound_reports(tmp_path_factory):
    return _spawn(tmp_path_factory, bound=True)


@NEEDS
@pytest.mark.parametrize("case", ["backend_name", "batch_first", "batch_first_state", "p2p_first", "reductions", "premul_sum", "moves", "p2p_after",
                                  "batch_after", "async_and_future", "async_dropped", "objects_barrier", "cpu_tensors", "ddp", "functional", "fsdp2",
                                  "compiled", "compiled_more",
                                  "destroy"])
def test_gpu_backend(reports, case):
    bad = {r: rep.get(case, "not run") for r, rep in enumerate(reports) if rep.get(case) != "ok"}
    assert not bad, f"{case}:\n" + "\n".join(f"rank {r}: {v}" for r, v in bad.items())


@NEEDS
@pytest.mark.parametrize("case", ["collectives", "destroy"])
def test_gpu_backend_with_device_id(bound_reports, case):
    bad = {r: rep.get(case, "not run") for r, rep in enumerate(bound_reports) if rep.get(case) != "ok"}
    assert not bad, f"{case}:\n" + "\n".join(f"rank {r}: {v}" for r, v in bad.items())


@needs(4)
def test_gpu_backend_four_ranks_queues_that_differ(tmp_path_factory):
    reports = _spawn(tmp_path_factory, bound=False, world=4)
    bad = {r: rep.get("uneven_queues", "not run") for r, rep in enumerate(reports) if rep.get("uneven_queues") != "ok"}
    assert not bad, "\n".join(f"rank {r}: {v}" for r, v in bad.items())
