"""GPU tier: uneven all_to_all_single on the copy engines alone (comm/a2av.py).

Split sizes that change at every call (as an MoE layer's do), zero rows, odd row widths, every
dtype the copy engines move, buffers kept, reallocated elsewhere and reallocated at the same
address, sync and async calls, bitwise against the matrix every rank draws from one seed; the
calls really took the copy engines' per-call path (its counts), posted in one native call (or in
Python, BRAID_NATIVE_CALL=0), and mappings were made once per tuple of buffers. Split sizes that disagree raise PeerMismatchError on every rank. Calls whose
shares are NCCL's go whole and, after a run of them, stop waiting for the round. Runs with any
GPU (ranks share it where there are fewer GPUs than ranks: gpu_world.py).
"""
from __future__ import annotations

import hashlib

import pytest
import torch

from gpu_world import needs, run

ENV = {"BRAID_MIN_SPLIT_KB": "1"}
DTYPES = (torch.bfloat16, torch.float32, torch.int64, torch.uint8)


def _gen(key) -> torch.Generator:
    return torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:7], "little"))


def _matrix(key, world: int, most: int) -> list[list[int]]:
    """Rows rank s sends rank d, the same on every rank; some zero, one row hot."""
    g = _gen(("m", key))
    m = torch.randint(0, most + 1, (world, world), generator=g)
    m[torch.rand(world, world, generator=g) < 0.2] = 0
    hot = int(torch.randint(world, (1,), generator=g))
    m[:, hot] *= 3
    return m.tolist()


def _rows(key, src: int, n: int, width: int, dtype, dev) -> torch.Tensor:
    g = _gen(("x", key, src))
    if dtype.is_floating_point:
        return (torch.randn(n, width, generator=g) * 3).to(dtype).to(dev)
    return torch.randint(0, 120, (n, width), generator=g).to(dtype).to(dev)


def _uneven(rank, world, comm, dev, shares):
    from contextlib import nullcontext
    g = torch.Generator().manual_seed(11)
    bufs = {}
    wrong = []
    calls = 0
    ctx = comm.fixed_shares(shares) if shares else nullcontext()
    with ctx:
        for i in range(300):
            dt = DTYPES[int(torch.randint(len(DTYPES), (1,), generator=g))]
            width = (1, 7, 1031, 4096)[int(torch.randint(4, (1,), generator=g))]
            mat = _matrix(i, world, 600)
            ins = mat[rank]
            outs = [mat[s][rank] for s in range(world)]
            cap = 600 * 3 * world
            what = int(torch.randint(8, (1,), generator=g))
            key = (dt, width)
            if key not in bufs or what == 0:             # (new) buffers at another address
                bufs[key] = (torch.empty(cap * width, dtype=dt, device=dev),
                             torch.empty(cap * width, dtype=dt, device=dev))
            elif what == 1:                              # a new allocation, the same address wanted
                bufs.pop(key)
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                bufs[key] = (torch.empty(cap * width, dtype=dt, device=dev),
                             torch.empty(cap * width, dtype=dt, device=dev))
            xb, yb = bufs[key]
            x = xb[: sum(ins) * width].view(-1, width)
            y = yb[: sum(outs) * width].view(-1, width)
            parts = [_rows((i, rank, d), rank, ins[d], width, dt, dev) for d in range(world)]
            x.copy_(torch.cat(parts))
            if what == 2:
                h = comm.all_to_all_single(y, x, outs, ins, async_op=True)
                h.wait()
            else:
                comm.all_to_all_single(y, x, outs, ins)
            exp = torch.cat([_rows((i, s, rank), s, outs[s], width, dt, dev) for s in range(world)])
            calls += 1
            if not torch.equal(y.reshape(-1).view(torch.uint8), exp.reshape(-1).view(torch.uint8)):
                wrong.append((i, str(dt), width, what))
    assert not wrong, f"rank {rank}: {len(wrong)} of {calls} calls wrong, first {wrong[:5]}"
    lean = comm._routing.a2av_ce
    assert lean is not None and lean.stats["calls"] >= calls // 2, (lean and lean.stats)
    # one mapping exchange per new tuple of buffers, not per call
    assert lean.stats["mapped"] < calls // 2, lean.stats
    # every call on them posted in one native call, or every one in Python where that is off
    from braid import envs
    from braid.comm import native_rounds
    native = bool(envs.get("BRAID_NATIVE_CALL")) and native_rounds.build() is not None
    assert lean.stats["native"] == (lean.stats["calls"] if native else 0), lean.stats


def _uneven_ce(rank, world, comm, dev):
    _uneven(rank, world, comm, dev, {"ce": 1.0})


@needs(2)
def test_uneven_all_to_all_on_the_copy_engines_two_ranks(tmp_path):
    run(2, tmp_path, _uneven_ce, ENV)


@needs(4)
def test_uneven_all_to_all_on_the_copy_engines_four_ranks(tmp_path):
    run(4, tmp_path, _uneven_ce, ENV)


@needs(2)
def test_uneven_all_to_all_posted_in_python_two_ranks(tmp_path):
    """The same calls with the posting in Python (BRAID_NATIVE_CALL=0)."""
    run(2, tmp_path, _uneven_ce, {**ENV, "BRAID_NATIVE_CALL": "0"})


def _changing_calls(rank, world, comm, dev, tag, calls: int, seed: int) -> None:
    """`calls` uneven calls of up to 600 rows (of 1031 float32) per pair, matrix and async changing
    every call, reading views of one buffer; each output checked against every source's rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.empty(600 * 3 * world * 1031, dtype=torch.float32, device=dev)
    y = torch.empty_like(x)
    for i in range(calls):
        mat = _matrix((tag, i), world, 600)
        ins, outs = mat[rank], [mat[s][rank] for s in range(world)]
        xi = x[: sum(ins) * 1031].view(-1, 1031)
        yi = y[: sum(outs) * 1031].view(-1, 1031)
        xi.copy_(torch.cat([_rows((i, rank, d), rank, ins[d], 1031, torch.float32, dev) for d in range(world)]))
        h = comm.all_to_all_single(yi, xi, outs, ins, async_op=bool(torch.randint(2, (1,), generator=g)))
        if h is not None:
            h.wait()
        torch.cuda.current_stream().synchronize()
        exp = torch.cat([_rows((i, s, rank), s, outs[s], 1031, torch.float32, dev) for s in range(world)])
        assert torch.equal(yi, exp), i


def _nccl_whole(rank, world, comm, dev):
    """Shares that give the calls to NCCL: whole, and after SMALL_RUN of them in a row without
    waiting for the round (read one call late); right every call, the copy engines untouched."""
    from braid.comm.uneven import SMALL_RUN
    with comm.fixed_shares({"nccl": 1.0}):
        _changing_calls(rank, world, comm, dev, "n", SMALL_RUN * 3, 3)
    assert comm.uneven.small_run >= SMALL_RUN                       # the round was read late at the end
    assert comm._routing.a2av_ce is None or comm._routing.a2av_ce.stats["calls"] == 0


@needs(2)
def test_uneven_calls_nccl_takes_whole_stop_waiting_for_the_round(tmp_path):
    run(2, tmp_path, _nccl_whole, ENV)


def _pair_alone(rank, world, comm, dev):
    """Two ranks, braid's own shares: uneven calls whose cross traffic is below the copy engines'
    size are NCCL's whole, decided by each rank alone (every PAIR_CHECK-th after a round);
    right every call, with sizes and async changing."""
    from braid.comm.uneven import PAIR_CHECK
    calls = 3 * PAIR_CHECK
    _changing_calls(rank, world, comm, dev, "p", calls, 5)
    assert comm.uneven.pair_calls == calls                      # every call was small enough
    assert comm._routing.a2av_ce is None or comm._routing.a2av_ce.stats["calls"] == 0


@needs(2)
def test_two_ranks_decide_small_uneven_calls_alone(tmp_path):
    run(2, tmp_path, _pair_alone, ENV)


def _mismatch(rank, world, comm, dev):
    from braid.errors import BraidError
    x = torch.arange(8 * 16, dtype=torch.float32, device=dev).view(8, 16)
    y = torch.empty_like(x)
    with comm.fixed_shares({"ce": 1.0}):
        comm.all_to_all_single(y, x, [4, 4], [4, 4])          # agreed: every rank's x is the same
        mine = x[4 * rank: 4 * rank + 4]
        assert torch.equal(y[:4], mine) and torch.equal(y[4:], mine)
        outs = [5, 3] if rank == 0 else [4, 4]               # rank 0 expects 5 rows from itself: wrong
        ins = [5, 3] if rank == 0 else [4, 4]
        with pytest.raises(BraidError, match="split sizes disagree|sends"):
            comm.all_to_all_single(y, x, outs, ins)


@needs(2)
def test_uneven_split_sizes_that_disagree_raise_on_every_rank(tmp_path):
    run(2, tmp_path, _mismatch, ENV)


def _pair_mismatch(rank, world, comm, dev):
    """Two ranks decide small uneven calls alone: split sizes that disagree in one such call (NCCL's
    own call with them may hang on the GPU) raise on both ranks at the next check round, and NCCL
    is aborted (or the process ended), so nothing waits past it."""
    from braid.comm.uneven import PAIR_CHECK
    from braid.errors import BraidError
    x = torch.randn(64, 1031, device=dev)
    y = torch.empty_like(x)
    with pytest.raises(BraidError, match="disagree"):
        for i in range(2 * PAIR_CHECK + 1):
            ins = outs = [32, 32]
            if i == 5 and rank == 1:
                outs = [31, 33]              # rank 1 expects 31 rows from rank 0, which sends 32
            comm.all_to_all_single(y, x, outs, ins)
    assert comm.uneven.pair_calls <= PAIR_CHECK + 1     # raised at the first check after the bad call


@needs(2)
def test_two_ranks_deciding_alone_still_catch_split_sizes_that_disagree(tmp_path):
    # NCCL's abort of the call that waits for the missing rows may not return (2 x H200, NCCL
    # 2.28): braid then ends the process BRAID_ABORT_EXIT_S after the error, as for a dead peer
    run(2, tmp_path, _pair_mismatch, dict(ENV, BRAID_ABORT_EXIT_S="3"), may_end=True)
