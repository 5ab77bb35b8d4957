"""GPU tier: prepared send/recv (comm/p2p.py, PreparedP2P).

- 600 mixed send/recv on the copy engines alone, 2 and 4 ranks: blocking pairs and ring shifts of
  isend + irecv (the recv posted first or last), several dtypes and odd sizes, buffers kept,
  reallocated elsewhere and reallocated at the same address (the receiver must never read a new
  allocation through an old mapping), async calls waited later; every message bitwise against data
  both ranks derive from seeds; the calls really came from the cache (its counts);
- the same shapes over other lane sets (ce + host, host alone), 2 and 4 ranks: agreed from the
  cache, repeats run as programs on the pair flags (the sender runs ahead), right;
- a user's torch.cuda.graph capture of a ring shift on the copy engines, and on the copy engines
  and the host lane, replayed with new data.
Runs with any GPU (ranks share it where there are fewer GPUs than ranks: gpu_world.py).
"""
from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from gpu_world import needs, run

ENV = {"BRAID_MIN_SPLIT_KB": "1"}
DTYPES = (torch.bfloat16, torch.float32, torch.int32, torch.uint8)
SIZES = (1, 4097, 65_539, 1_000_003)


def _data(key, n, dtype, dev):
    g = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:7], "little"))
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g) * 2).to(dtype).to(dev)
    return torch.randint(0, 200, (n,), generator=g).to(dtype).to(dev)


def _same(a, b) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


class _Bufs:
    """A shape's send and receive buffers on this rank."""

    def __init__(self, n, dtype, dev):
        self.n, self.dtype, self.dev = n, dtype, dev
        self.alloc()

    def alloc(self):
        self.x = torch.empty(self.n, dtype=self.dtype, device=self.dev)
        self.out = torch.empty(self.n, dtype=self.dtype, device=self.dev)


def _mixed(rank, world, comm, dev, calls=600, seed=3):
    g = torch.Generator().manual_seed(seed)              # the same sequence on every rank
    pick = lambda seq: seq[int(torch.randint(len(seq), (1,), generator=g))]     # noqa: E731
    pairs = [(s, d) for s in range(world) for d in range(world) if s != d]
    bufs, wrong = {}, []
    for i in range(calls):
        n, dt = pick(SIZES), pick(DTYPES)
        what = int(torch.randint(10, (1,), generator=g))
        kind = int(torch.randint(3, (1,), generator=g))
        b = bufs.get((n, dt))
        if b is None:
            b = bufs[(n, dt)] = _Bufs(n, dt, dev)
        elif what == 0:                                  # new buffers (another address)
            b.alloc()
        elif what == 1:                                  # a new allocation, the same address wanted
            b.x = b.out = None
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            b.alloc()
        b.out.fill_(0)
        if kind == 0:                                    # one blocking send/recv
            src, dst = pick(pairs)
            if rank == src:
                b.x.copy_(_data(("p", seed, i), n, dt, dev))
                comm.send(b.x, dst)
            elif rank == dst:
                comm.recv(b.out, src)
                if not _same(b.out, _data(("p", seed, i), n, dt, dev)):
                    wrong.append((i, "pair", src, dst, n, str(dt), what))
            continue
        shift = 1 + int(torch.randint(world - 1, (1,), generator=g))
        nxt, prv = (rank + shift) % world, (rank - shift) % world
        b.x.copy_(_data(("s", seed, i, rank), n, dt, dev))
        if kind == 1:
            hs = [comm.recv(b.out, prv, async_op=True), comm.send(b.x, nxt, async_op=True)]
        else:
            hs = [comm.send(b.x, nxt, async_op=True), comm.recv(b.out, prv, async_op=True)]
        for h in hs:
            h.wait()
        if not _same(b.out, _data(("s", seed, i, prv), n, dt, dev)):
            wrong.append((i, "shift", shift, n, str(dt), what))
    torch.cuda.synchronize()
    return wrong


def _repeated(rank, world, comm, dev):
    with comm.fixed_shares({"ce": 1.0}):
        wrong = _mixed(rank, world, comm, dev)
    assert not wrong, f"rank {rank}: {len(wrong)} messages wrong, first {wrong[:5]}"
    st = comm._prepared.stats
    assert st["p2p_hits"] > 100 and st["p2p_built"] > 0, st


@needs(2)
def test_mixed_send_recv_two_ranks(tmp_path):
    run(2, tmp_path, _repeated, ENV)


@needs(4)
def test_mixed_send_recv_four_ranks(tmp_path):
    run(4, tmp_path, _repeated, ENV)


def _other_lanes(rank, world, comm, dev, calls=200):
    pairs = comm._p2p.pairs
    for k, shares in enumerate(({"ce": 0.5, "host": 0.5}, {"ce": 0.9, "host": 0.1}, {"host": 1.0})):
        with comm.fixed_shares(shares):
            wrong = _mixed(rank, world, comm, dev, calls=calls, seed=100 + k)
        assert not wrong, (shares, wrong[:5])
        # repeats ran as programs on the pair flags with the host lane's share (no reply waited for)
        staged = [e for side in pairs.recvs.values() for e in side.slots.values() if e.flags and e.host]
        assert any(set(e.shares) == set(shares) for e in staged), (shares, len(staged))
    assert comm._prepared.stats["p2p_hits"] > calls
    # the calibration's balancing (fixed_shares(..., timed=True)): every split call posts its
    # lanes and times them, a send/recv and a collective alike
    x = torch.randn(1 << 20, device=dev)
    out = torch.empty_like(x)
    g = torch.empty(world * x.numel(), device=dev)
    with comm.fixed_shares({"ce": 0.5, "host": 0.5}, timed=True):
        for _ in range(3):
            if rank < 2:
                if rank == 0:
                    comm.send(x, 1)
                else:
                    comm.recv(out, 0)
                torch.cuda.synchronize()
                assert set(comm.last_handle.lane_times_us()) == {"ce", "host"}, comm.last_handle
            comm.all_gather_into_tensor(g, x)
            torch.cuda.synchronize()
            assert set(comm.last_handle.lane_times_us()) == {"ce", "host"}, comm.last_handle


@needs(2)
def test_send_recv_over_other_lane_sets(tmp_path):
    run(2, tmp_path, _other_lanes, ENV)


@needs(4)
def test_send_recv_over_other_lane_sets_four_ranks(tmp_path):
    run(4, tmp_path, _other_lanes, ENV)


def _user_graph(rank, world, comm, dev):
    n = 1_000_003
    x = torch.empty(n, dtype=torch.float32, device=dev)
    out = torch.zeros(n, dtype=torch.float32, device=dev)
    nxt, prv = (rank + 1) % world, (rank - 1) % world

    def shift():
        hs = [comm.send(x, nxt, async_op=True), comm.recv(out, prv, async_op=True)]
        for h in hs:
            h.wait()

    for shares in ({"ce": 1.0}, {"ce": 0.6, "host": 0.4}):
        with comm.fixed_shares(shares):
            x.copy_(_data(("warm", rank), n, torch.float32, dev))
            shift()                                          # prepared before the capture
            assert _same(out, _data(("warm", prv), n, torch.float32, dev))
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                shift()
            torch.cuda.synchronize()
            dist.barrier()
            for i in range(5):
                x.copy_(_data(("replay", i, rank), n, torch.float32, dev))
                out.fill_(0)
                graph.replay()
                torch.cuda.synchronize()
                assert _same(out, _data(("replay", i, prv), n, torch.float32, dev)), (shares, i)
            del graph
        torch.cuda.synchronize()
        dist.barrier()


@needs(2)
def test_user_cuda_graph_capture_of_send_recv(tmp_path):
    run(2, tmp_path, _user_graph, ENV)


def _mismatch_ahead(rank, world, comm, dev):
    """Rank 0's send runs ahead (a cached shape on the copy engines); rank 1 posts a recv of
    another size: rank 1 raises in its call and drains rank 0's program (no GPU wait is left),
    rank 0 raises at its next send to rank 1, and the pair goes on."""
    from braid.errors import PeerMismatchError
    n = 65_539
    x = torch.empty(n, dtype=torch.float32, device=dev)
    with comm.fixed_shares({"ce": 1.0}):
        for i in range(3):
            if rank == 0:
                x.copy_(_data(("mm", i), n, torch.float32, dev))
                comm.send(x, 1)
            else:
                out = torch.empty(n, dtype=torch.float32, device=dev)
                comm.recv(out, 0)
                assert _same(out, _data(("mm", i), n, torch.float32, dev))
        if rank == 0:
            comm.send(x, 1)                              # returns: the program runs ahead
            torch.cuda.synchronize()                     # released by rank 1's drain
            dist.barrier(group=comm.gloo_group)
            try:
                comm.send(x, 1)
            except PeerMismatchError as exc:
                assert "65540" in str(exc) or "262160" in str(exc), exc
            else:
                raise AssertionError("rank 0 did not report rank 1's refusal")
            x.copy_(_data(("mm", 9), n, torch.float32, dev))
            comm.send(x, 1)
        else:
            bad = torch.empty(n + 1, dtype=torch.float32, device=dev)
            try:
                comm.recv(bad, 0)
            except PeerMismatchError as exc:
                assert "262156 bytes" in str(exc), exc
            else:
                raise AssertionError("rank 1 did not raise")
            torch.cuda.synchronize()
            dist.barrier(group=comm.gloo_group)
            out = torch.empty(n, dtype=torch.float32, device=dev)
            comm.recv(out, 0)
            assert _same(out, _data(("mm", 9), n, torch.float32, dev))
    torch.cuda.synchronize()


@needs(2)
def test_a_mismatched_recv_releases_a_send_that_ran_ahead(tmp_path):
    run(2, tmp_path, _mismatch_ahead, ENV)
