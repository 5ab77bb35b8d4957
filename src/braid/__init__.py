"""braid: one collective, every path between GPUs at once.

    import torch.distributed as dist, braid
    dist.init_process_group("nccl")            # or "gloo" for CPU tensors
    braid.init()                               # the default communicator over the world group
    braid.all_gather_into_tensor(out, x)       # split across NVLink copy engines, NCCL, PCIe...

Every op also exists as a method of `braid.Communicator`. Or, as a torch.distributed backend:

    import braid; dist.init_process_group("braid")   # then plain dist.all_reduce(t), DDP...
"""
from __future__ import annotations

import torch.distributed as _dist

from .comm import Communicator
from .errors import (BraidError, BraidTimeoutError, LaneFailureError, LaneUnavailableError, MisuseError,
                     PeerMismatchError)
from .collectives.reduce import PremulSum
from .executor import Handle
from ._version import __version__
from . import backend      # registers the "braid" torch.distributed backend
from . import envs as _envs
from .envs import share_gpu   # several ranks on one GPU (BRAID_SHARED_GPU): call before NCCL starts

# BRAID_SHARED_GPU=1 under torchrun: this rank's own NCCL_HOSTID, before the caller starts NCCL
_envs.share_gpu_under_torchrun()

_SUM = _dist.ReduceOp.SUM

_default: Communicator | None = None


def init(lanes: list[str] | None = None) -> Communicator:
    """Create (or return) the default communicator over the torch.distributed world. Under
    init_process_group("braid") this is the backend's own communicator (`lanes` is then ignored
    if a collective already made it)."""
    global _default
    if _default is None or _default.closed:
        pg = backend.world_group()
        if pg is not None:
            _default = pg.ensure_communicator(lanes)
        else:
            _default = Communicator(lanes=lanes)
    return _default


def default() -> Communicator:
    if _default is None or _default.closed:
        raise MisuseError("no braid communicator: call braid.init() after dist.init_process_group()")
    return _default


def abort(reason: str = "abort() was called") -> None:
    """Abort the default communicator on this rank and tell its peers (Communicator.abort): ranks
    waiting for this one raise at once, no rank stays blocked in NCCL because of braid. The
    communicator is unusable afterwards; close() still releases its memory. Not collective."""
    if _default is not None:
        _default.abort(reason)


def close() -> None:
    global _default
    if _default is not None:
        if not getattr(_default, "_braid_backend_owned", False):   # the backend's: destroy_process_group closes it
            _default.close()
        _default = None


def all_reduce(tensor, op=_SUM, async_op=False):
    return default().all_reduce(tensor, op, async_op=async_op)


def reduce_scatter_tensor(output, input, op=_SUM, async_op=False):
    return default().reduce_scatter_tensor(output, input, op, async_op=async_op)


def reduce_scatter(output, input_list, op=_SUM, async_op=False):
    return default().reduce_scatter(output, input_list, op, async_op=async_op)


def reduce(tensor, dst=0, op=_SUM, async_op=False):
    return default().reduce(tensor, dst, op, async_op=async_op)


def send(tensor, dst, async_op=False):
    return default().send(tensor, dst, async_op=async_op)


def recv(tensor, src, async_op=False):
    return default().recv(tensor, src, async_op=async_op)


def batch_isend_irecv(p2p_op_list, device=None):
    return default().batch_isend_irecv(p2p_op_list, device=device)


def broadcast(tensor, src=0, async_op=False):
    return default().broadcast(tensor, src, async_op=async_op)


def all_gather_into_tensor(output, input, async_op=False):
    return default().all_gather_into_tensor(output, input, async_op=async_op)


def all_gather(output_list, input, async_op=False):
    return default().all_gather(output_list, input, async_op=async_op)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, async_op=False):
    return default().all_to_all_single(output, input, output_split_sizes, input_split_sizes, async_op=async_op)


__all__ = [
    "Communicator", "Handle", "init", "default", "close", "abort",
    "send", "recv", "batch_isend_irecv", "broadcast", "all_gather_into_tensor", "all_gather", "all_to_all_single",
    "all_reduce", "reduce_scatter_tensor", "reduce_scatter", "reduce", "PremulSum",
    "BraidError", "BraidTimeoutError", "LaneFailureError", "LaneUnavailableError", "MisuseError",
    "PeerMismatchError", "share_gpu",
]
