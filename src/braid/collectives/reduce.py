"""Reduction ops and the reduction itself.

Every reducing collective in braid is: reduce-scatter the bytes into per-rank slots (any lane, any
split: the reduction waits for all of them), reduce each chunk ON THE DEVICE in rank order 0..N-1,
then (all_reduce, reduce) move the reduced chunks on. Each element is reduced exactly once, in an
order fixed by rank, so the result is the same run after run and on every rank; it differs from
NCCL's (ring order) only by floating-point rounding. Half-precision sums and products accumulate
in float32 and round once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import MisuseError

REDUCE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                 torch.int8, torch.int32, torch.int64, torch.uint8)
_NAMES = {"sum": "sum", "avg": "avg", "product": "product", "prod": "product", "min": "min", "max": "max"}


@dataclass(frozen=True)
class PremulSum:
    """Multiply every input by `factor` before summing (torch's premul-sum)."""
    factor: float


def op_name(op) -> str:
    """braid's name for a reduction: torch.distributed.ReduceOp, a string, or PremulSum."""
    if isinstance(op, PremulSum):
        return "premul_sum"
    if isinstance(op, str):
        name = _NAMES.get(op.lower())
    else:
        name = None
        for key, torch_op in (("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG),
                              ("product", dist.ReduceOp.PRODUCT), ("min", dist.ReduceOp.MIN),
                              ("max", dist.ReduceOp.MAX)):
            try:
                if op == torch_op:
                    name = key
                    break
            except TypeError:
                continue
    if name is None:
        raise MisuseError(f"unsupported reduction {op!r}: use dist.ReduceOp.SUM/AVG/PRODUCT/MIN/MAX, "
                          f"'sum'/'avg'/'product'/'min'/'max', or braid.PremulSum(factor)")
    return name


def check_reduce_dtype(dtype: torch.dtype, name: str, opname: str) -> None:
    if dtype not in REDUCE_DTYPES:
        raise MisuseError(f"{opname}: dtype {dtype} cannot be reduced by braid; supported: "
                          f"{', '.join(str(d).replace('torch.', '') for d in REDUCE_DTYPES)}")
    if name in ("avg", "premul_sum") and not dtype.is_floating_point:
        raise MisuseError(f"{opname}: {name} needs a floating-point tensor (got {dtype}), as in NCCL")


def torch_op(op, name: str):
    """The torch.distributed op for NCCL's/gloo's own call."""
    if name == "premul_sum":
        return dist._make_nccl_premul_sum(op.factor)
    return {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "product": dist.ReduceOp.PRODUCT,
            "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[name]


def reduce_slots(slots: torch.Tensor, world_size: int, name: str, out: torch.Tensor, factor: float = 1.0) -> None:
    """out = slot[0] (op) slot[1] (op) ... in rank order. slots: [world_size, numel(out)] (rows may
    be strided) or flat [world_size * numel(out)]. Sums of half-precision inputs accumulate in
    float32 inside the reduction kernel and round once into `out` (no float32 temporary)."""
    m = out.numel()
    if m == 0:
        return
    x = slots if slots.dim() == 2 else slots[: world_size * m].view(world_size, m)
    half = out.dtype in (torch.float16, torch.bfloat16)
    acc = torch.float32 if half else out.dtype
    if name in ("sum", "avg"):
        torch.sum(x, 0, out=out)
        if name == "avg":
            out.div_(world_size)
    elif name == "premul_sum":
        out.copy_((x.to(acc) * factor if half else x * factor).sum(0, dtype=acc))
    elif name == "product":
        out.copy_(x.prod(0, dtype=acc))
    elif name == "min":
        torch.amin(x, 0, out=out)
    elif name == "max":
        torch.amax(x, 0, out=out)
    else:  # pragma: no cover - op_name() guards this
        raise MisuseError(f"unknown reduction {name}")


def reduce_pair(x0: torch.Tensor, x1: torch.Tensor, name: str, out: torch.Tensor, factor: float = 1.0) -> None:
    """out = x0 (op) x1 for two ranks, in one elementwise kernel where the op allows. Gives the
    same bits as reduce_slots on the stacked pair: a half-precision add or multiply is computed
    exactly and rounded once, like the float32 accumulation. `out` may alias x0 or x1."""
    if out.numel() == 0:
        return
    if name in ("sum", "avg"):
        torch.add(x0, x1, out=out)
        if name == "avg":
            out.div_(2)
    elif name == "product":
        torch.mul(x0, x1, out=out)
    elif name == "min":
        torch.minimum(x0, x1, out=out)
    elif name == "max":
        torch.maximum(x0, x1, out=out)
    elif name == "premul_sum":
        half = out.dtype in (torch.float16, torch.bfloat16)
        if half:
            out.copy_(x0.float() * factor + x1.float() * factor)
        else:
            out.copy_(x0 * factor + x1 * factor)
    else:  # pragma: no cover
        raise MisuseError(f"unknown reduction {name}")
