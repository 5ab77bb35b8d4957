"""Argument checks shared by the ops, and the byte views every lane works on.

Rules (documented in README): inputs that are not contiguous are copied to a contiguous tensor
first; outputs must be contiguous (braid writes into them in place) or the call is refused.
"""
from __future__ import annotations

import torch

from ..errors import MisuseError


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor as a flat uint8 view of the same memory. torch calls a tensor of 0 or 1
    element contiguous whatever its stride, and a uint8 view needs stride 1: such a tensor is
    viewed with stride 1 at the same offset (the same bytes)."""
    flat = t.reshape(-1)
    if flat.numel() <= 1 and flat.stride(0) != 1:
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8)


def check_tensor(t, what: str, device: torch.device, op: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise MisuseError(f"{op}: {what} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != device.type or (device.type == "cuda" and t.device.index != device.index):
        raise MisuseError(f"{op}: {what} is on {t.device} but this rank's braid device for it is {device}; "
                          f"move the tensor or call torch.cuda.set_device(local_rank) before braid.init()")
    if t.is_sparse:
        raise MisuseError(f"{op}: {what} is sparse; braid moves dense tensors only")


def input_bytes(t: torch.Tensor, what: str, device: torch.device, op: str) -> torch.Tensor:
    check_tensor(t, what, device, op)
    if not t.is_contiguous():
        t = t.contiguous()     # documented: non-contiguous inputs are copied
    return flat_bytes(t)


def output_bytes(t: torch.Tensor, what: str, device: torch.device, op: str) -> torch.Tensor:
    check_tensor(t, what, device, op)
    if not t.is_contiguous():
        raise MisuseError(f"{op}: {what} is not contiguous (shape {tuple(t.shape)}, stride {t.stride()}); "
                          f"braid writes outputs in place, pass a contiguous tensor (e.g. torch.empty(...))")
    return flat_bytes(t)


def same_dtype(a: torch.Tensor, b: torch.Tensor, op: str, names=("input", "output")) -> None:
    if a.dtype != b.dtype:
        raise MisuseError(f"{op}: {names[0]} dtype {a.dtype} differs from {names[1]} dtype {b.dtype}")


def check_rank(r, world_size: int, what: str, op: str, me: int | None = None) -> int:
    if not isinstance(r, int) or isinstance(r, bool):
        raise MisuseError(f"{op}: {what} must be an int rank, got {r!r}")
    if not 0 <= r < world_size:
        raise MisuseError(f"{op}: {what}={r} is out of range for world_size {world_size} (valid: 0..{world_size - 1})")
    if me is not None and r == me:
        raise MisuseError(f"{op}: {what}={r} is this rank itself; send/recv need another rank")
    return r


def split_bytes(splits, t: torch.Tensor, world_size: int, what: str, op: str) -> list[int]:
    """all_to_all_single split sizes (rows of dim 0) -> byte counts; None = equal split."""
    rows = t.shape[0] if t.dim() > 0 else 1
    row_bytes = (t.numel() // rows if rows else 0) * t.element_size()
    if splits is None or len(splits) == 0:
        if rows % world_size:
            raise MisuseError(f"{op}: {what} has {rows} rows in dim 0, not divisible by world_size {world_size}; "
                              f"pass explicit split sizes")
        return [rows // world_size * row_bytes] * world_size
    splits = [int(s) for s in splits]
    if len(splits) != world_size:
        raise MisuseError(f"{op}: {what} split sizes have {len(splits)} entries, need world_size={world_size}")
    if any(s < 0 for s in splits):
        raise MisuseError(f"{op}: {what} split sizes must be >= 0, got {splits}")
    if sum(splits) != rows:
        raise MisuseError(f"{op}: {what} split sizes sum to {sum(splits)} but dim 0 has {rows} rows")
    return [s * row_bytes for s in splits]
