"""How the braid backend posts the GPU sends/recvs it queued for NCCL (BraidProcessGroup.flush_p2p),
checked against a stand-in for the inner NCCL group that records each post.

torch's NCCL group sends a lone op over a communicator of the pair, and an op inside a group over the
communicator of all ranks (unless it was connected eagerly). What a rank's queue holds when it is
posted depends on that rank's own calls, so one rank could post a message inside a group while its
peer posts the matching recv alone: two communicators, and both ranks hang (seen with 4 ranks on
one GPU). Once the communicator of all ranks exists, every post must be a group, even of one op.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from braid.backend import BraidProcessGroup


class _FakeNccl:
    """Records posts: ("send"/"recv", peer) alone, or ("group", [...]) between coalescing calls."""

    def __init__(self):
        self.posts: list = []
        self._open = None
        self.connected = []

    def _start_coalescing(self):
        self._open = []

    def _end_coalescing(self):
        self.posts.append(("group", self._open))
        self._open = None
        return SimpleNamespace(kind="group work")

    def _op(self, kind, peer):
        if self._open is not None:
            self._open.append((kind, peer))
            return None
        self.posts.append((kind, peer))
        return SimpleNamespace(kind=f"{kind} work")

    def send(self, tensors, peer, tag):
        return self._op("send", peer)

    def recv(self, tensors, peer, tag):
        return self._op("recv", peer)

    def eager_connect_single_device(self, device):
        self.connected.append(device)


class _Work:
    def __init__(self):
        self.inner = None

    def _posted(self, work):
        self.inner = work


_GPU_TENSOR = SimpleNamespace(is_cuda=True, device="cuda:0")


def _pg(world_known: bool) -> BraidProcessGroup:
    """A group of one rank over a local store, its inner NCCL group the stand-in."""
    pg = BraidProcessGroup(dist.HashStore(), 0, 1, None, True)
    pg.nccl, pg._p2p_world = _FakeNccl(), world_known
    return pg


def _queue(pg, *ops):
    works = []
    for kind, peer in ops:
        w = _Work()
        pg._p2p_queue.append((kind == "send", [_GPU_TENSOR], peer, 0, w))
        works.append(w)
    return works


def test_before_the_world_communicator_a_lone_op_goes_alone_and_several_as_a_group():
    pg = _pg(world_known=False)
    (w,) = _queue(pg, ("recv", 1))
    pg.flush_p2p()
    assert pg.nccl.posts == [("recv", 1)] and w.inner.kind == "recv work"
    assert not pg._p2p_world
    works = _queue(pg, ("send", 0), ("send", 3))
    pg.flush_p2p()
    assert pg.nccl.posts[-1] == ("group", [("send", 0), ("send", 3)])
    assert all(x.inner.kind == "group work" for x in works)
    assert pg._p2p_world                       # a group made (or used) the communicator of all ranks


@pytest.mark.parametrize("ops", [[("recv", 1)], [("send", 2)], [("send", 0), ("recv", 0)]])
def test_once_the_world_communicator_exists_every_post_is_a_group(ops):
    """The hang's pattern: rank 1 posts [isend to 0, send to 3] together, rank 0 its recv from 1
    alone. With every post a group, both travel on the communicator of all ranks."""
    pg = _pg(world_known=True)
    works = _queue(pg, *ops)
    pg.flush_p2p()
    assert pg.nccl.posts == [("group", list(ops))]
    assert all(x.inner.kind == "group work" for x in works)
    pg.flush_p2p()                                              # nothing queued: nothing posted
    assert len(pg.nccl.posts) == 1


def test_connecting_the_world_communicator_once():
    pg = _pg(world_known=False)
    pg._connect_world("cuda:1")
    assert pg.nccl.connected == ["cuda:1"] and pg._p2p_world
    pg._connect_world("cuda:1")
    assert pg.nccl.connected == ["cuda:1"]                       # once
    bound = _pg(world_known=False)
    bound.bound_device_id = torch.device("cuda", 0)   # init_process_group(device_id=...): torch connected it
    bound._connect_world("cuda:0")
    assert bound.nccl.connected == [] and bound._p2p_world


def test_a_failed_connect_keeps_the_old_rule(caplog):
    pg = _pg(world_known=False)

    def refuse(device):
        raise RuntimeError("NCCL error: unhandled system error")
    pg.nccl.eager_connect_single_device = refuse
    pg._connect_world("cuda:0")
    assert not pg._p2p_world and "connecting the inner NCCL group failed" in caplog.text
    _queue(pg, ("send", 1))
    pg.flush_p2p()
    assert pg.nccl.posts == [("send", 1)]
