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
_NAMES = {"sum": "sum", "avg": "avg", "product": "product", "prod": "product", "min": "min", "max": "max",
          "band": "band", "bor": "bor", "bxor": "bxor"}
BITWISE = ("band", "bor", "bxor")
_BITWISE_FN = {"band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}


@dataclass(frozen=True)
class PremulSum:
    """Multiply every input by `factor` before summing (torch's premul-sum)."""
    factor: float


_TORCH_OPS = (("sum", "SUM"), ("avg", "AVG"), ("product", "PRODUCT"), ("min", "MIN"), ("max", "MAX"),
              ("band", "BAND"), ("bor", "BOR"), ("bxor", "BXOR"))


def _torch_premul_factor(op):
    """The factor of torch's premul-sum op (dist._make_nccl_premul_sum), or None for other ops."""
    try:
        kind = op.op
    except AttributeError:
        return None
    if str(kind).rsplit(".", 1)[-1] != "PREMUL_SUM":
        return None
    factor = getattr(op, "factor", None)
    if factor is None:
        factor = op.__getstate__()[1]
    return factor


def op_name(op) -> str:
    """braid's name for a reduction: torch.distributed.ReduceOp (torch's premul-sum included), a
    string, or PremulSum."""
    if isinstance(op, PremulSum):
        return "premul_sum"
    if isinstance(op, str):
        name = _NAMES.get(op.lower())
    elif _torch_premul_factor(op) is not None:
        name = "premul_sum"
    else:
        name = None
        for key, attr in _TORCH_OPS:
            try:
                if op == getattr(dist.ReduceOp, attr):
                    name = key
                    break
            except TypeError:
                continue
    if name is None:
        raise MisuseError(f"unsupported reduction {op!r}: use dist.ReduceOp.SUM/AVG/PRODUCT/MIN/MAX/BAND/BOR/BXOR, "
                          f"'sum'/'avg'/'product'/'min'/'max'/'band'/'bor'/'bxor', or braid.PremulSum(factor)")
    return name


def reduce_factor(op) -> float:
    """premul-sum's factor (braid.PremulSum or torch's op; a one-element tensor is read), else 1."""
    factor = op.factor if isinstance(op, PremulSum) else _torch_premul_factor(op)
    if factor is None:
        return 1.0
    return float(factor.item() if isinstance(factor, torch.Tensor) else factor)


def check_reduce_dtype(dtype: torch.dtype, name: str, opname: str, cuda: bool = False) -> str:
    """Refuse what NCCL refuses (and on CPU tensors what gloo does), naming the op, the dtype and
    what to use instead; return the reduction braid runs (on bool tensors sum is a logical or and
    product a logical and, as NCCL does them through torch)."""
    if dtype is torch.bool:
        if name in ("avg", "premul_sum"):
            raise MisuseError(f"{opname}: {name} of a {dtype} tensor is not defined; reduce a float or "
                              f"integer copy (t.to(torch.float32)) instead")
        if cuda and name in BITWISE:
            raise MisuseError(f"{opname}: {name} of a {dtype} tensor is not offered on CUDA tensors (no "
                              f"bitwise reductions on GPUs); use ReduceOp.MAX for or, ReduceOp.MIN for and")
        return {"sum": "max", "product": "min"}.get(name, name)
    if dtype not in REDUCE_DTYPES:
        if dtype.is_complex:
            raise MisuseError(f"{opname}: {name} of a {dtype} tensor is not supported by braid; reduce "
                              f"torch.view_as_real(t) with sum, avg or premul_sum instead (the same "
                              f"reduction of the real and imaginary parts)")
        raise MisuseError(f"{opname}: {name} of a {dtype} tensor is not supported by braid; use a copy in "
                          f"one of the supported dtypes instead: bool, "
                          f"{', '.join(str(d).replace('torch.', '') for d in REDUCE_DTYPES)}")
    if name == "premul_sum" and not dtype.is_floating_point:
        raise MisuseError(f"{opname}: premul_sum needs a floating-point tensor (got {dtype}); for "
                          f"integers multiply by the factor first and use ReduceOp.SUM instead")
    if name in BITWISE:
        if dtype.is_floating_point:
            raise MisuseError(f"{opname}: {name} needs an integer or bool tensor (got {dtype}); use an "
                              f"integer copy instead, or ReduceOp.MAX/MIN")
        if cuda:
            raise MisuseError(f"{opname}: {name} of a {dtype} tensor is not offered on CUDA tensors (no "
                              f"bitwise reductions on GPUs); reduce a CPU copy instead, or use MAX/MIN on "
                              f"0/1 flags")
    return name


def torch_op(op, name: str):
    """The torch.distributed op for NCCL's/gloo's own call."""
    if name == "premul_sum":
        return dist._make_nccl_premul_sum(reduce_factor(op))
    return getattr(dist.ReduceOp, dict(_TORCH_OPS)[name])


def _writing(out: torch.Tensor):
    """The mode in which braid writes a result into `out`: never recorded by autograd, whatever the
    grad mode of the thread that finishes the call; inference mode for an inference tensor (torch
    lets only code in inference mode update one in place, and the mode is per thread)."""
    if out.is_inference() and not torch.is_inference_mode_enabled():
        return torch.inference_mode()
    return torch.no_grad()


def divide(out: torch.Tensor, n: int) -> None:
    """avg's last step, in place: floats divide; integers divide truncating toward zero, as NCCL's
    integer average does (the sum wraps around in the tensor's own type first)."""
    with _writing(out):
        if out.dtype.is_floating_point:
            out.div_(n)
        else:
            out.div_(n, rounding_mode="trunc")


def reduce_slots(slots: torch.Tensor, world_size: int, name: str, out: torch.Tensor, factor: float = 1.0) -> None:
    """out = slot[0] (op) slot[1] (op) ... in rank order. slots: [world_size, numel(out)] (rows may
    be strided) or flat [world_size * numel(out)]. Sums of half-precision inputs accumulate in
    float32 inside the reduction kernel and round once into `out` (no float32 temporary)."""
    m = out.numel()
    if m == 0:
        return
    if out.is_inference() and not torch.is_inference_mode_enabled():
        with torch.inference_mode():
            return reduce_slots(slots, world_size, name, out, factor)
    x = slots if slots.dim() == 2 else slots[: world_size * m].view(world_size, m)
    half = out.dtype in (torch.float16, torch.bfloat16)
    acc = torch.float32 if half else out.dtype
    if name in ("sum", "avg"):
        torch.sum(x, 0, out=out)
        if name == "avg":
            divide(out, world_size)
    elif name == "premul_sum":
        out.copy_((x.to(acc) * factor if half else x * factor).sum(0, dtype=acc))
    elif name == "product":
        out.copy_(x.prod(0, dtype=acc))
    elif name == "min":
        torch.amin(x, 0, out=out)
    elif name == "max":
        torch.amax(x, 0, out=out)
    elif name in BITWISE:
        fn = _BITWISE_FN[name]
        out.copy_(x[0])
        for row in range(1, world_size):
            fn(out, x[row], out=out)
    else:  # pragma: no cover - op_name() guards this
        raise MisuseError(f"unknown reduction {name}")


def reduce_pair(x0: torch.Tensor, x1: torch.Tensor, name: str, out: torch.Tensor, factor: float = 1.0) -> None:
    """out = x0 (op) x1 for two ranks, in one elementwise kernel where the op allows. Gives the
    same bits as reduce_slots on the stacked pair: a half-precision add or multiply is computed
    exactly and rounded once, like the float32 accumulation. `out` may alias x0 or x1."""
    if out.numel() == 0:
        return
    if out.is_inference() and not torch.is_inference_mode_enabled():
        with torch.inference_mode():
            return reduce_pair(x0, x1, name, out, factor)
    if name in ("sum", "avg"):
        torch.add(x0, x1, out=out)
        if name == "avg":
            divide(out, 2)
    elif name == "product":
        torch.mul(x0, x1, out=out)
    elif name == "min":
        torch.minimum(x0, x1, out=out)
    elif name == "max":
        torch.maximum(x0, x1, out=out)
    elif name in BITWISE:
        _BITWISE_FN[name](x0, x1, out=out)
    elif name == "premul_sum":
        half = out.dtype in (torch.float16, torch.bfloat16)
        if half:
            out.copy_(x0.float() * factor + x1.float() * factor)
        else:
            out.copy_(x0 * factor + x1 * factor)
    else:  # pragma: no cover
        raise MisuseError(f"unknown reduction {name}")
