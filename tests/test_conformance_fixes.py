"""Focused tests for what torch's own distributed tests (tests/test_conformance.py) needed of the
braid backend: a receive from any source (dist.recv / dist.irecv without src).

Once braid's communicator exists, an untagged send of a CPU tensor goes over braid's lanes, which
gloo's any-source receive never sees; in a world of 2 ranks braid serves the receive from the
other rank and reports it as the sender. In a larger world it refuses with braid.MisuseError
(rather than wait forever).
"""
from __future__ import annotations

import datetime

from conftest import run_world

ENV = {"CUDA_VISIBLE_DEVICES": "", "BRAID_MIN_SPLIT_KB": "1"}


def _init(rank: int, w: int):
    import torch.distributed as dist

    import braid  # noqa: F401  registers the backend
    from braid.backend import world_group
    dist.init_process_group("braid", rank=rank, world_size=w, timeout=datetime.timedelta(seconds=60))
    return world_group()


def _any_source_two_ranks(rank: int, w: int) -> dict:
    import torch
    import torch.distributed as dist

    pg = _init(rank, w)
    out: dict = {}
    n = 4099                                  # more than BRAID_MIN_SPLIT_KB: braid may split it

    # before braid's first collective: the inner gloo group serves it
    if rank == 1:
        dist.send(torch.full((n,), 3.0), 0)
    else:
        t = torch.zeros(n)
        out["before_src"] = dist.recv(t)
        out["before_ok"] = bool(torch.equal(t, torch.full((n,), 3.0)))
    assert pg._comm is None, "a send/recv made braid's communicator"

    x = torch.ones(8)
    dist.all_reduce(x)                        # makes braid's communicator
    comm = pg._comm
    assert comm is not None, "the first all_reduce did not make braid's communicator"

    for how in ("recv", "irecv"):
        payload = torch.arange(n, dtype=torch.float32) + (7 if how == "recv" else 11)
        if rank == 1:
            dist.send(payload, 0)
            continue
        before = comm.last_handle
        t = torch.zeros(n)
        if how == "recv":
            out["recv_src"] = dist.recv(t)
        else:
            work = dist.irecv(t)
            work.wait()
            out["irecv_src"] = work._source_rank()
        out[f"{how}_ok"] = bool(torch.equal(t, payload))
        out[f"{how}_on_braid"] = comm.last_handle is not before
    dist.barrier()
    return out


def test_recv_from_any_source_two_ranks():
    res = run_world(_any_source_two_ranks, 2, env=ENV, init_pg=False)[0]
    assert res["before_src"] == 1 and res["before_ok"], res
    assert res["recv_src"] == 1, f"dist.recv without src reported sender {res['recv_src']}, want 1"
    assert res["irecv_src"] == 1, f"irecv without src: Work._source_rank() = {res['irecv_src']}, want 1"
    assert res["recv_ok"] and res["irecv_ok"], f"received data differ: {res}"
    assert res["recv_on_braid"] and res["irecv_on_braid"], f"the receives did not run on braid: {res}"


def _any_source_three_ranks(rank: int, w: int) -> str:
    import torch
    import torch.distributed as dist

    import braid
    _init(rank, w)
    dist.all_reduce(torch.ones(4))            # makes braid's communicator
    msg = ""
    if rank == 0:
        try:
            dist.recv(torch.zeros(4))
        except braid.MisuseError as exc:
            msg = str(exc)
        else:
            raise AssertionError("recv without src in a 3-rank world did not raise braid.MisuseError")
    dist.barrier()
    return msg


def test_recv_from_any_source_refused_beyond_two_ranks():
    msg = run_world(_any_source_three_ranks, 3, env=ENV, init_pg=False)[0]
    assert "2 ranks" in msg and "src=" in msg, f"the error should name the limit and the fix: {msg!r}"
