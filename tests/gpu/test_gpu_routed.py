"""GPU tier: skewed all_to_all_single through the router (BRAID_ROUTE=on: per-pair mixes of the
ce and host lanes), bitwise against NCCL's all_to_all_single on the same inputs."""
from __future__ import annotations

import random

import torch
import torch.distributed as dist

from gpu_world import needs, run
from test_gpu_collectives import _same

ENV = {"BRAID_ROUTE": "on"}


def _hot_case(rng, world, rank, case, dev, fractions, totals, jitter, zero_pair=False):
    """One skewed case, the same on every rank (rng seeded alike): a hot rank gets a fraction h
    of every rank's bytes, odd element counts, a random dtype; this rank's input (seeded by case and
    rank), an output filled with a marker, a reference output, and the split sizes."""
    hot = rng.randrange(world)
    h = rng.choice(fractions)
    dtype = rng.choice([torch.bfloat16, torch.float32, torch.int8])
    total = rng.choice(totals) + rng.randrange(*jitter)
    esz = torch.empty((), dtype=dtype).element_size()
    mat = [[0 if zero_pair and (s, d) == (0, world - 1)
            else int(total * (h if d == hot else (1 - h) / max(world - 1, 1)) / esz) + rng.randrange(0, 3)
            for d in range(world)] for s in range(world)]
    ins, outs = mat[rank], [mat[s][rank] for s in range(world)]
    g = torch.Generator().manual_seed(case * 100 + rank)
    x = (torch.randn(sum(ins), generator=g) * 50).to(dtype).to(dev)
    got = torch.full((sum(outs),), 3, dtype=dtype, device=dev)
    return dict(hot=hot, h=h, dtype=dtype, total=total, esz=esz, mat=mat, ins=ins, outs=outs, x=x,
                got=got, ref=torch.empty_like(got))


def _worker(rank, world, comm, dev):
    rng = random.Random(7)               # the same matrices on every rank
    for case in range(8):
        c = _hot_case(rng, world, rank, case, dev, [0.4, 0.7, 0.9, 1.0], [3 << 20, 40 << 20, 200 << 20], (1, 5000))
        hot, h, dtype, total, ins, outs, x, got, ref = (c[k] for k in ("hot", "h", "dtype", "total", "ins", "outs",
                                                                        "x", "got", "ref"))
        comm.all_to_all_single(got, x, outs, ins)
        dist.all_to_all_single(ref, x, outs, ins)
        torch.cuda.synchronize()
        assert _same(got, ref), f"routed all_to_all case {case} (hot {hot}, h {h}, {dtype}) differs from NCCL"
        lanes = sorted(comm.last_handle.plan.lanes) if comm.last_handle.plan is not None else ["native"]
        if rank == 0:
            print(f"case {case}: hot {hot} h {h} {dtype} {total >> 20} MiB/rank lanes {lanes}", flush=True)


@needs(2)
def test_routed_all_to_all_two_gpus(tmp_path):
    run(2, tmp_path, _worker, ENV)


@needs(4)
def test_routed_all_to_all_four_gpus(tmp_path):
    run(4, tmp_path, _worker, ENV)


def _batch_worker(rank, world, comm, dev):
    """Batched send/recv against torch's batch_isend_irecv on NCCL: sends cut from one buffer (by
    destination, then order) and receives into views of one buffer (by source) are routed; the
    last case passes separate tensors (NCCL's own batch)."""
    rng = random.Random(11)
    for case in range(5):
        one_buffer = case < 4
        hot = rng.randrange(world)
        pairs = []
        for s in range(world):
            for d in range(world):
                if s != d:
                    big = (40 << 20) if d == hot else (2 << 20)
                    pairs.append((s, d, [rng.randrange(1, big) for _ in range(rng.randint(1, 3))]))
        dtype = rng.choice([torch.bfloat16, torch.float32])
        sends = [(d, k, n) for s, d, sizes in sorted(pairs, key=lambda p: (p[1], p[0])) if s == rank
                 for k, n in enumerate(sizes)]
        recvs = [(s, k, n) for s, d, sizes in sorted(pairs) if d == rank for k, n in enumerate(sizes)]
        g = torch.Generator().manual_seed(case * 1000 + rank)
        sbuf = (torch.randn(sum(n for _, _, n in sends), generator=g) * 9).to(dtype).to(dev)
        rbuf = torch.zeros(sum(n for _, _, n in recvs), dtype=dtype, device=dev)
        ref = torch.ones_like(rbuf)
        mine, ref_ops, at = [], [], 0
        for d, _, n in sends:
            x = sbuf[at: at + n] if one_buffer else sbuf[at: at + n].clone()
            mine.append(dist.P2POp(dist.isend, x, d))
            ref_ops.append(dist.P2POp(dist.isend, x, d))
            at += n
        at, got_views = 0, []
        for s, _, n in recvs:
            v = rbuf[at: at + n] if one_buffer else torch.zeros(n, dtype=dtype, device=dev)
            got_views.append(v)
            mine.append(dist.P2POp(dist.irecv, v, s))
            ref_ops.append(dist.P2POp(dist.irecv, ref[at: at + n], s))
            at += n
        reqs = comm.batch_isend_irecv(mine)
        for r in reqs:
            r.wait()
        for r in dist.batch_isend_irecv(ref_ops):
            r.wait()
        torch.cuda.synchronize()
        got = torch.cat(got_views) if got_views else rbuf
        assert _same(got, ref), f"batch case {case} (hot {hot}, {dtype}) differs from NCCL's"
        routed = reqs[0].plan is not None
        assert routed == one_buffer, f"batch case {case}: routed {routed}, one buffer {one_buffer}"
    if rank == 0:
        print(f"world {world}: routed send/recv batches equal NCCL's", flush=True)


@needs(2)
def test_routed_batch_two_gpus(tmp_path):
    run(2, tmp_path, _batch_worker, ENV)


@needs(4)
def test_routed_batch_four_gpus(tmp_path):
    run(4, tmp_path, _batch_worker, ENV)


def _auto_worker(rank, world, comm, dev):
    """BRAID_ROUTE=auto: skewed calls whose demands are all at or below the routing threshold agree
    on one number and go to NCCL whole (no descriptor exchange); larger ones take the exchange and
    the decision. Bitwise against NCCL either way, with odd sizes, a zero split and rows of 1-3
    elements."""
    rng = random.Random(11)
    for case in range(10):
        c = _hot_case(rng, world, rank, case, dev, [0.7, 1.0], [64 << 10, 1 << 20, 3 << 20, 24 << 20], (-5000, 1),
                      zero_pair=True)
        hot, h, dtype, total, esz, mat, ins, outs, x, got, ref = (
            c[k] for k in ("hot", "h", "dtype", "total", "esz", "mat", "ins", "outs", "x", "got", "ref"))
        width = 1 + case % 3               # rows of 1, 2 or 3 elements (the splits count rows)
        if width > 1:
            x = torch.stack([x + k for k in range(width)], 1)
            got, ref = (torch.full((sum(outs), width), 3, dtype=dtype, device=dev) for _ in range(2))
        before = comm.segment.coll_seq
        comm.all_to_all_single(got, x, outs, ins)
        dist.all_to_all_single(ref, x, outs, ins)
        torch.cuda.synchronize()
        assert _same(got, ref), f"auto all_to_all case {case} (hot {hot}, h {h}, {dtype}, {total} B) differs from NCCL"
        row = esz * width
        biggest = max(mat[s][d] * row for s in range(world) for d in range(world) if s != d)
        small = biggest <= (1 << 20)
        # one agreement of one number when no demand exceeds 1 MiB (NCCL's call, whole); a
        # descriptor exchange after it otherwise
        assert (comm.segment.coll_seq - before == 1) == small, (case, biggest, comm.segment.coll_seq - before)
    # every rank sends all its rows to the last rank (itself included): the others receive nothing,
    # and their empty outputs take the same one-number agreement
    for width in (1, 3):
        mat = [[0] * (world - 1) + [40000 + 7 * s] for s in range(world)]
        ins, outs = mat[rank], [mat[s][rank] for s in range(world)]
        g = torch.Generator().manual_seed(50 + rank)
        x = torch.randn(sum(ins), width, generator=g).to(torch.bfloat16).to(dev)
        got, ref = (torch.full((sum(outs), width), 3, dtype=torch.bfloat16, device=dev) for _ in range(2))
        before = comm.segment.coll_seq
        comm.all_to_all_single(got, x, outs, ins)
        dist.all_to_all_single(ref, x, outs, ins)
        torch.cuda.synchronize()
        assert _same(got, ref) and (rank == world - 1 or got.numel() == 0), (width, rank)
        assert comm.segment.coll_seq - before == 1, (width, comm.segment.coll_seq - before)
    # a run of small calls: after SMALL_RUN of them the agreement is read one call late, so the
    # first large call after the run is NCCL's whole call (one post), and the next one is
    # decided as usual (a post, then the descriptor exchange); bitwise against NCCL throughout
    from braid.comm import SMALL_RUN
    steps = []
    for i in range(SMALL_RUN + 6):
        large = i >= SMALL_RUN + 2
        per = (3 << 20) if large else (40 << 10) + 2 * i
        mat = [[per + 2 * s + d for d in range(world)] for s in range(world)]
        ins, outs = mat[rank], [mat[s][rank] for s in range(world)]
        g = torch.Generator().manual_seed(900 + 10 * i + rank)
        x = torch.randint(-100, 100, (sum(ins),), generator=g, dtype=torch.int8).to(dev)
        got, ref = (torch.full((sum(outs),), 3, dtype=torch.int8, device=dev) for _ in range(2))
        before = comm.segment.coll_seq
        comm.all_to_all_single(got, x, outs, ins)
        dist.all_to_all_single(ref, x, outs, ins)
        torch.cuda.synchronize()
        assert _same(got, ref), ("run", i)
        steps.append(comm.segment.coll_seq - before)
    assert steps[:SMALL_RUN + 3] == [1] * (SMALL_RUN + 3) and all(n >= 2 for n in steps[SMALL_RUN + 3:]), steps


@needs(2)
def test_auto_all_to_all_small_and_large_two_gpus(tmp_path):
    run(2, tmp_path, _auto_worker, {"BRAID_ROUTE": "auto"})


@needs(4)
def test_auto_all_to_all_small_and_large_four_gpus(tmp_path):
    run(4, tmp_path, _auto_worker, {"BRAID_ROUTE": "auto"})
