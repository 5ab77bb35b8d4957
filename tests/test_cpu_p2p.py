"""send/recv of CPU tensors through the node segment (braid.comm.cpup2p): every dtype, odd, zero
and many-times-the-ring sizes, non-contiguous tensors, isend + irecv both ways in either order,
sends left pending across collectives, the backend's send/recv, a size mismatch and a dead peer
raising on time, nothing left in /dev/shm. The tests' ring per ordered pair is 512 KiB
(BRAID_HOST_BUFFER_MB=2 in conftest), so 300,001 float32 elements wrap it 2-3 times."""
import os
import time

import torch

from conftest import braid_shm_entries, run_world as _run_world

ON = {"BRAID_CPU_SHM": "1"}
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
          torch.int32, torch.int64, torch.bool, torch.complex64]
SIZES = [0, 1, 7, 4099, 300_001]


def run_world(fn, w, *args, env=None, **kw):
    return _run_world(fn, w, *args, env=dict(ON, **(env or {})), **kw)


def data(src, dst, n, dtype, salt):
    """The message from src to dst: fresh random values, rebuilt alike on both ranks."""
    g = torch.Generator().manual_seed(1_000_003 * src + 7919 * n + 31 * dst + salt)
    if dtype is torch.bool:
        return torch.rand(n, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(n, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return ((torch.rand(n, generator=g, dtype=torch.float64) - 0.3) * 4).to(dtype)
    return torch.randint(0, 100, (n,), generator=g, dtype=torch.int64).to(dtype)


def _every_dtype_and_size(rank, w):
    import braid
    comm = braid.init()
    assert comm._cpu_calls.p2p is not None
    bad, salt = [], 0
    for dtype in DTYPES:
        for n in SIZES:
            salt += 1
            # a ring of ranks: each sends to the next and receives from the previous, half of
            # the pairs posting the recv first, in one direction blocking and the other async
            nxt, prv = (rank + 1) % w, (rank - 1) % w
            out = torch.empty(n, dtype=dtype)
            if rank % 2:
                r = comm.recv(out, prv, async_op=True)
                comm.send(data(rank, nxt, n, dtype, salt), nxt)
                r.wait()
            else:
                s = comm.send(data(rank, nxt, n, dtype, salt), nxt, async_op=True)
                comm.recv(out, prv)
                s.wait()
            want = data(prv, rank, n, dtype, salt)
            if not torch.equal(out.view(torch.uint8) if n else out, want.view(torch.uint8) if n else want):
                bad.append((str(dtype), n))
            assert comm.last_handle is None or comm.last_handle.shares in ({"shm": 1.0}, {})
    return {"bad": bad}


def test_every_dtype_and_size_bitwise_in_a_ring_of_ranks():
    for w in (2, 3):
        for res in run_world(_every_dtype_and_size, w, timeout=240):
            assert res["bad"] == [], res


def _swap_and_pending(rank, w):
    import braid
    comm = braid.init()
    peer = 1 - rank
    n = 700_001                                  # ~5x the 512 KiB ring: moves in pieces
    got = {}
    # both ranks isend then irecv, and the reverse order; waits in either order
    for order in ("send_first", "recv_first"):
        x = data(rank, peer, n, torch.float32, 1)
        out = torch.empty(n)
        if order == "send_first":
            s = comm.send(x, peer, async_op=True)
            r = comm.recv(out, peer, async_op=True)
            r.wait()
            s.wait()
        else:
            r = comm.recv(out, peer, async_op=True)
            s = comm.send(x, peer, async_op=True)
            s.wait()
            r.wait()
        got[order] = torch.equal(out, data(peer, rank, n, torch.float32, 1))
    # a send left pending across a collective: rank 0 isends, then both all_reduce, then rank 1
    # receives; rank 0 moves its send while it waits in the all_reduce and at its wait()
    y = torch.ones(5) * (rank + 1)
    big = data(0, 1, n, torch.float64, 2)
    if rank == 0:
        s = comm.send(big, 1, async_op=True)
        comm.all_reduce(y)
        s.wait()
        got["pending"] = True
    else:
        comm.all_reduce(y)
        out = torch.empty(n, dtype=torch.float64)
        comm.recv(out, 0)
        got["pending"] = torch.equal(out, big)
    got["reduced"] = torch.equal(y, torch.full((5,), 3.0))
    # rank 0 isends and enters a collective; rank 1 receives (blocking) first, then the
    # collective: rank 0's send must move while it waits in the collective's round
    if rank == 0:
        s = comm.send(big, 1, async_op=True)
        comm.all_reduce(torch.ones(1))
        s.wait()
    else:
        out = torch.empty(n, dtype=torch.float64)
        comm.recv(out, 0)
        comm.all_reduce(torch.ones(1))
        got["barrier"] = torch.equal(out, big)
    # non-contiguous tensors: a transposed send, a strided recv
    m = torch.arange(12.0).reshape(3, 4) + 10 * rank
    recv_into = torch.zeros(4, 6)[:, ::2]
    s = comm.send(m.t(), peer, async_op=True)
    comm.recv(recv_into, peer)
    s.wait()
    got["strided"] = torch.equal(recv_into, (torch.arange(12.0).reshape(3, 4) + 10 * peer).t())
    # many small messages in both directions, posted before any wait
    sends = [comm.send(torch.full((3,), float(k + 100 * rank)), peer, async_op=True) for k in range(50)]
    outs = [torch.empty(3) for _ in range(50)]
    recvs = [comm.recv(o, peer, async_op=True) for o in outs]
    for h in sends + recvs:
        h.wait()
    got["many"] = all(torch.equal(o, torch.full((3,), float(k + 100 * peer))) for k, o in enumerate(outs))
    return got


def test_swaps_pending_sends_across_collectives_and_strided_tensors():
    for res in run_world(_swap_and_pending, 2, timeout=180):
        assert all(res.values()), res


def _backend_send_recv(rank, w):
    import torch.distributed as dist
    import braid  # noqa: F401
    dist.init_process_group("braid", rank=rank, world_size=w)
    x = torch.ones(4)
    dist.all_reduce(x)                           # braid's communicator now exists
    n = 123_457
    if rank == 0:
        dist.send(data(0, 1, n, torch.bfloat16, 3), 1)
        back = torch.empty(n, dtype=torch.bfloat16)
        dist.recv(back, 1)
        ok = torch.equal(back, data(1, 0, n, torch.bfloat16, 3))
    else:
        got = torch.empty(n, dtype=torch.bfloat16)
        dist.recv(got, 0)
        dist.send(data(1, 0, n, torch.bfloat16, 3), 0)
        ok = torch.equal(got, data(0, 1, n, torch.bfloat16, 3))
    ops = [dist.P2POp(dist.isend, torch.full((9,), float(rank)), 1 - rank),
           dist.P2POp(dist.irecv, buf := torch.empty(9), 1 - rank)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    comm = dist.distributed_c10d._get_default_group()._comm
    return {"ok": ok, "batch": torch.equal(buf, torch.full((9,), float(1 - rank))),
            "shm": comm is not None and comm._cpu_calls.p2p is not None}


def test_backend_send_recv_and_batch_take_the_segment():
    for res in run_world(_backend_send_recv, 2, init_pg=False, timeout=120):
        assert res == {"ok": True, "batch": True, "shm": True}, res


def _mismatch(rank, w):
    import braid
    from braid.errors import BraidError
    comm = braid.init()
    t0 = time.monotonic()
    try:
        if rank == 0:
            comm.send(torch.ones(1000), 1)
            comm.send(torch.ones(200_000), 1)        # bigger than the ring: waits for the receiver
        else:
            comm.recv(torch.empty(999), 0)           # one element short
        return {"raised": None}
    except BraidError as exc:
        return {"raised": type(exc).__name__, "msg": str(exc), "after_s": time.monotonic() - t0}


def test_a_size_mismatch_raises_on_both_ranks_in_time():
    r0, r1 = run_world(_mismatch, 2, env={"BRAID_TIMEOUT_S": "20"}, timeout=90)
    assert r1["raised"] == "PeerMismatchError" and "4000 bytes" in r1["msg"] and "3996" in r1["msg"], r1
    assert r0["raised"] == "PeerMismatchError" and "rank 1 aborted" in r0["msg"], r0
    assert r0["after_s"] < 10 and r1["after_s"] < 10, (r0, r1)


def _dead_sender(rank, w):
    import braid
    from braid.errors import BraidError
    comm = braid.init()
    comm.all_reduce(torch.ones(1))
    if rank == 0:
        os._exit(3)
    t0 = time.monotonic()
    try:
        comm.recv(torch.empty(10), 0)
        return {"raised": None}
    except BraidError as exc:
        return {"raised": type(exc).__name__, "msg": str(exc), "after_s": time.monotonic() - t0}


def _dies_mid_transfer(rank, w):
    import braid
    from braid.errors import BraidError
    comm = braid.init()
    n = 1_000_003                                # ~8x the ring: the sender must wait for room
    if rank == 0:
        comm.send(torch.ones(n), 1, async_op=True)   # the first ring-full goes now
        os._exit(3)                              # killed with the rest unsent
    t0 = time.monotonic()
    try:
        comm.recv(torch.empty(n), 0)
        return {"raised": None}
    except BraidError as exc:
        return {"raised": type(exc).__name__, "msg": str(exc), "after_s": time.monotonic() - t0}


def test_a_dead_peer_ends_a_waiting_recv_between_calls_and_mid_transfer():
    pids = []
    for fn in (_dead_sender, _dies_mid_transfer):
        info: dict = {}
        res = run_world(fn, 2, env={"BRAID_TIMEOUT_S": "30"}, allowed_exit={0: 3}, timeout=90, info=info)
        pids += info["pids"]
        r1 = res[1]
        assert r1["raised"] == "LaneFailureError" and "has exited" in r1["msg"], (fn.__name__, r1)
        assert r1["after_s"] < 10, (fn.__name__, r1)
    time.sleep(0.5)
    # segments are named braid-<pid of the rank that made it>-...: these worlds' ranks left none
    left = {n for n in braid_shm_entries() if any(n.startswith(f"braid-{p}-") for p in pids)}
    assert not left, left
