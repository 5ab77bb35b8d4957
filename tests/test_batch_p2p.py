"""Batched send/recv (Communicator.batch_isend_irecv): one routed uneven all_to_all under the hood.
CPU ranks (shm + gloo lanes), random skewed batches, several ops per pair, mixed dtypes, bitwise
against the data sent; bad batches raise on every rank instead of hanging."""
from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from conftest import run_world


def _data(src, dst, k, n, dtype):
    g = torch.Generator().manual_seed(src * 7919 + dst * 104729 + k * 13 + n)
    x = torch.randn(n, generator=g) * 100
    return x.to(dtype)


def _batch(w, seed):
    """[(src, dst, sizes, dtype)] per pair: a hot destination and a few cold pairs, odd sizes."""
    rng = random.Random(seed)
    hot = rng.randrange(w)
    pairs = []
    for s in range(w):
        for d in range(w):
            if s == d or (d != hot and rng.random() < 0.4):
                continue
            n_ops = rng.randint(1, 3)
            big = d == hot
            sizes = [rng.randint(1, (300_000 if big else 20_000)) for _ in range(n_ops)]
            pairs.append((s, d, sizes, rng.choice(["float32", "bfloat16", "int64"])))
    return pairs


def _worker(rank, w, seeds, one_buffer):
    """Each seed's batch on this rank. one_buffer: the sends (by destination, then order) are
    views of one tensor, and so are the receives (by source): braid may route them; otherwise
    separate tensors, which go to the native batch."""
    import braid
    comm = braid.init()
    out = []
    for seed in seeds:
        pairs = _batch(w, seed)
        if one_buffer:       # one buffer holds one dtype (element offsets stay aligned)
            pairs = [(s, d, sizes, ["float32", "bfloat16", "int64"][seed % 3]) for s, d, sizes, _ in pairs]
        sends, recvs = [], []              # (peer, k, n, dtype) in (peer, order) order
        for s, d, sizes, dt in sorted(pairs, key=lambda p: (p[1], p[0])):
            if s == rank:
                sends += [(d, k, n, getattr(torch, dt)) for k, n in enumerate(sizes)]
        for s, d, sizes, dt in sorted(pairs):
            if d == rank:
                recvs += [(s, k, n, getattr(torch, dt)) for k, n in enumerate(sizes)]
        send_t = [_data(rank, d, k, n, dt) for d, k, n, dt in sends]
        expect = [_data(s, rank, k, n, dt) for s, k, n, dt in recvs]
        recv_t = [torch.full((n,), 7, dtype=dt) for _, _, n, dt in recvs]
        if one_buffer:       # the same values, as views of one send and one receive buffer
            sbuf = torch.cat([t.view(torch.uint8) for t in send_t]) if send_t else torch.empty(0, dtype=torch.uint8)
            rbuf = torch.full((sum(t.numel() * t.element_size() for t in recv_t),), 7, dtype=torch.uint8)
            send_t, recv_t, at, bt = [], [], 0, 0
            for _, _, n, dt in sends:
                nb = n * torch.empty((), dtype=dt).element_size()
                send_t.append(sbuf[at: at + nb].view(dt))
                at += nb
            for _, _, n, dt in recvs:
                nb = n * torch.empty((), dtype=dt).element_size()
                recv_t.append(rbuf[bt: bt + nb].view(dt))
                bt += nb
        ops = [dist.P2POp(dist.isend, t, d) for t, (d, _, _, _) in zip(send_t, sends)]
        ops += [dist.P2POp(dist.irecv, t, s) for t, (s, _, _, _) in zip(recv_t, recvs)]
        # interleave peers and directions at random, keeping each (peer, direction)'s own order
        groups: dict = {}
        for o in ops:
            groups.setdefault((o.peer, o.op is dist.irecv), []).append(o)
        keys = [(o.peer, o.op is dist.irecv) for o in ops]
        random.Random(seed * 31 + rank).shuffle(keys)
        ops = [groups[k].pop(0) for k in keys]
        reqs = comm.batch_isend_irecv(ops)
        for r in reqs:
            r.wait()
        ok = all(torch.equal(t.view(torch.uint8), e.view(torch.uint8)) for t, e in zip(recv_t, expect))
        h = reqs[0]
        out.append((ok, sorted(h.plan.lanes) if h.plan is not None else ["native"]))
    # a rank with nothing to move still takes part
    comm.batch_isend_irecv([])[0].wait()
    braid.close()
    return out


@pytest.mark.parametrize("w", [3, 4])
def test_routed_batch_is_bitwise_on_cpu_lanes(w):
    res = run_world(_worker, w, [1, 2, 3], True, env={"BRAID_ROUTE": "on", "BRAID_HOST_BUFFER_MB": "2",
                                                      "BRAID_HOST_CHUNK_KB": "64"})
    for per_rank in res:
        assert all(ok for ok, _ in per_rank), per_rank
        # the router's plan ran on both CPU lanes for at least one batch
        assert any(lanes == ["gloo", "shm"] for _, lanes in per_rank), per_rank


def test_separate_tensors_take_the_native_batch():
    """Sends that are not one buffer: NCCL's / gloo's own batch, routing or not."""
    res = run_world(_worker, 3, [4, 5], False, env={"BRAID_ROUTE": "on"})
    assert all(ok and lanes == ["native"] for per_rank in res for ok, lanes in per_rank), res


def test_batch_without_routing_is_bitwise_too():
    res = run_world(_worker, 3, [4], True, env={"BRAID_ROUTE": "off"})
    assert all(ok for per_rank in res for ok, _ in per_rank)


def _bad_worker(rank, w, case):
    import braid
    from braid import MisuseError, PeerMismatchError
    comm = braid.init()
    x = torch.ones(100)
    try:
        if case == "self":
            comm.batch_isend_irecv([dist.P2POp(dist.isend, x, rank)])
        elif case == "op":
            comm.batch_isend_irecv([(dist.all_reduce, x, (rank + 1) % w)])
        elif case == "not_list":
            comm.batch_isend_irecv(dist.P2POp(dist.isend, x, (rank + 1) % w))
        elif case == "sizes":
            # rank 0 sends 100 floats to rank 1, which expects 101
            ops = []
            if rank == 0:
                ops = [dist.P2POp(dist.isend, x, 1)]
            elif rank == 1:
                ops = [dist.P2POp(dist.irecv, torch.empty(101), 0)]
            comm.batch_isend_irecv(ops)[0].wait()
    except PeerMismatchError as exc:
        return ("mismatch", str(exc))
    except MisuseError as exc:
        return ("misuse", str(exc))
    finally:
        braid.close()
    return ("none", "")


@pytest.mark.parametrize("case, kind, words", [
    ("self", "misuse", "this rank itself"),
    ("op", "misuse", "dist.isend or dist.irecv"),
    ("not_list", "misuse", "expected a list"),
    ("sizes", "mismatch", "expects"),
])
def test_bad_batches_raise_on_every_rank(case, kind, words):
    res = run_world(_bad_worker, 3, case, env={"BRAID_ROUTE": "on"})
    if kind == "mismatch":
        assert all(r[0] == "mismatch" and words in r[1] for r in res), res
    else:
        assert all(r[0] == kind and words in r[1] for r in res), res


def test_adjacent_views_make_one_buffer_only_when_back_to_back():
    from braid.comm.p2p import _adjacent
    buf = torch.arange(100, dtype=torch.uint8)
    cpu = torch.device("cpu")
    one = _adjacent([buf[0:10], buf[10:10], buf[10:40], buf[40:41]], cpu)
    assert one is not None and one.data_ptr() == buf.data_ptr() and one.numel() == 41
    assert torch.equal(one, buf[:41])
    one[0] = 200                                   # a view: writes land in the caller's buffer
    assert buf[0] == 200
    assert _adjacent([buf[10:20], buf[0:10]], cpu) is None          # out of order
    assert _adjacent([buf[0:10], buf[11:20]], cpu) is None          # a gap
    assert _adjacent([buf[0:10], torch.zeros(5, dtype=torch.uint8)], cpu) is None   # two allocations
    assert _adjacent([], cpu).numel() == 0
