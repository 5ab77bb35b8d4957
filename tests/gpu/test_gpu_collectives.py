"""GPU tier: every op on every lane combination against NCCL's own result, bitwise.

Skips without a GPU. Run on a GPU machine:  python3 -m pytest tests/gpu -q
(each test spawns one process per rank, up to 4, with the nccl backend; with fewer GPUs than ranks
the ranks share them, see gpu_world.py).
"""
from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from gpu_world import needs, run

NEEDS = needs(2)
ENV = {"BRAID_MIN_SPLIT_KB": "1"}          # every transfer really split
LANE_SETS = [dict.fromkeys(c, 1.0 / len(c)) for n in (1, 2, 3) for c in itertools.combinations(["ce", "nccl", "host"], n)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int32, torch.int64, torch.uint8, torch.bool]
for name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, name):
        DTYPES.append(getattr(torch, name))
SIZES = [0, 1, 7, 4097, 1_000_003, 3 << 20]


def _rand(n, dtype, gen, device):
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=gen).bool().to(device)
    if dtype.is_floating_point:
        return torch.randn(n, generator=gen).to(dtype).to(device)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, (n,), generator=gen).to(dtype).to(device)


def _same(a, b) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _worker(rank, world, comm, dev):
    gen = torch.Generator().manual_seed(1234 + rank)
    cases = 0
    for shares in LANE_SETS:
        with comm.fixed_shares(shares):
            for dtype, n in itertools.product(DTYPES, SIZES):
                if n > 4097 and dtype not in (torch.bfloat16, torch.int8, torch.bool):
                    continue
                x = _rand(n, dtype, gen, dev)
                # all_gather into one tensor and into a list
                out = torch.empty(n * world, dtype=dtype, device=dev)
                ref = torch.empty_like(out)
                comm.all_gather_into_tensor(out, x)
                dist.all_gather_into_tensor(ref, x)
                assert _same(out, ref), f"all_gather {shares} {dtype} n={n}"
                outs = [torch.empty(n, dtype=dtype, device=dev) for _ in range(world)]
                comm.all_gather(outs, x)
                assert _same(torch.cat(outs), ref), f"all_gather list {shares} {dtype} n={n}"
                # broadcast from the last rank
                b = x.clone()
                rb = x.clone()
                comm.broadcast(b, world - 1)
                dist.broadcast(rb, world - 1)
                assert _same(b, rb), f"broadcast {shares} {dtype} n={n}"
                # send/recv ring: even ranks send first
                y = torch.empty_like(x)
                nxt, prv = (rank + 1) % world, (rank - 1) % world
                if world == 2:
                    if rank == 0:
                        comm.send(x, 1)
                    else:
                        comm.recv(y, 0)
                else:
                    if rank % 2 == 0:
                        comm.send(x, nxt)
                        comm.recv(y, prv)
                    else:
                        comm.recv(y, prv)
                        comm.send(x, nxt)
                # reference for the p2p: NCCL send/recv of the same data
                z = torch.empty_like(x)
                ops = [dist.P2POp(dist.isend, x, nxt), dist.P2POp(dist.irecv, z, prv)]
                for w_ in dist.batch_isend_irecv(ops):
                    w_.wait()
                if world > 2 or rank == 1:
                    assert _same(y, z), f"send/recv {shares} {dtype} n={n}"
                # uneven all_to_all_single (some zero splits)
                g2 = torch.Generator().manual_seed(99 + n)
                mat = torch.randint(0, max(n // world, 1) + 1, (world, world), generator=g2)
                mat[0, world - 1] = 0
                ins = mat[rank].tolist()
                outs_s = mat[:, rank].tolist()
                xi = _rand(sum(ins), dtype, gen, dev)
                xo = torch.empty(sum(outs_s), dtype=dtype, device=dev)
                ro = torch.empty_like(xo)
                comm.all_to_all_single(xo, xi, outs_s, ins)
                dist.all_to_all_single(ro, xi, outs_s, ins)
                assert _same(xo, ro), f"all_to_all_single {shares} {dtype} n={n}"
                # non-contiguous input is copied
                if n >= 2:
                    nc = x[::2]
                    o2 = torch.empty(nc.numel() * world, dtype=dtype, device=dev)
                    r2 = torch.empty_like(o2)
                    comm.all_gather_into_tensor(o2, nc)
                    dist.all_gather_into_tensor(r2, nc.contiguous())
                    assert _same(o2, r2), f"non-contiguous {shares} {dtype} n={n}"
                cases += 1
    torch.cuda.synchronize()
    # async handle: returns at once, wait() orders the current stream
    x = _rand(1 << 22, torch.bfloat16, gen, dev)
    out = torch.empty(x.numel() * world, dtype=x.dtype, device=dev)
    with comm.fixed_shares({"ce": 0.7, "host": 0.3}):
        h = comm.all_gather_into_tensor(out, x, async_op=True)
        h.wait()
    ref = torch.empty_like(out)
    dist.all_gather_into_tensor(ref, x)
    assert _same(out, ref), "async all_gather"
    print(f"rank {rank}: {cases} cases passed", flush=True)


@NEEDS
def test_two_gpus(tmp_path):
    run(2, tmp_path, _worker, ENV)


@needs(4)
def test_four_gpus(tmp_path):
    run(4, tmp_path, _worker, ENV)


def _swap_worker(rank, world, comm, dev):
    """Both ranks isend then irecv (split over the lanes: messages above the ring), twice in a row
    each way with waits in reverse order; bitwise against the data each rank generated."""
    peer = 1 - rank
    for shares in ({"ce": 1.0}, {"host": 1.0}, {"ce": 0.8, "host": 0.2}):
        for n in (4097, 30_000_001):
            def data(r, k):
                g = torch.Generator().manual_seed(r * 1000 + k * 7 + n)
                return torch.randn(n, generator=g).to(dev)
            with comm.fixed_shares(shares):
                outs = [torch.zeros(n, device=dev) for _ in range(2)]
                hs = [comm.send(data(rank, 0), peer, async_op=True), comm.send(data(rank, 1), peer, async_op=True),
                      comm.recv(outs[0], peer, async_op=True), comm.recv(outs[1], peer, async_op=True)]
                for h in reversed(hs):
                    h.wait()
            torch.cuda.synchronize()
            for k in range(2):
                assert torch.equal(outs[k], data(peer, k)), f"swap {shares} n={n} message {k}"


@NEEDS
def test_async_send_recv_swap_two_gpus(tmp_path):
    run(2, tmp_path, _swap_worker, ENV)
