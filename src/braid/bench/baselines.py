"""The other baselines of `braid bench`: torch's own collectives that are not NCCL's, timed beside
NCCL's call and braid's in the same alternating windows, so that each point reports braid against
the best of them, not only against NCCL.

Each alternative names the op it replaces, says whether it can run here (and why not), and, where
it can, builds its own buffers: torch's symmetric-memory ops need their input in a symmetric buffer
(`torch.distributed._symmetric_memory.empty` + `rendezvous`), so the timed call runs on such a
buffer, and the copy from a user's tensor into it is timed on its own (`copy_in`): a user whose
buffer is not symmetric pays both. An alternative that cannot run (no GPU, a torch without the op,
NVLink multicast needed and off) or that fails is reported with the reason, never dropped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist


@dataclass
class Prepared:
    run: Callable[[], object]             # the op on its own buffers
    copy_in: Callable[[], object]         # a user tensor's copy into those buffers
    check: Callable[[], str]              # "" when its output matches NCCL's on the same input


def _mismatch(got: torch.Tensor, want: torch.Tensor) -> str:
    """"" when `got` matches `want` (reductions to bf16 rounding: the order of the sum may differ)."""
    if got.shape != want.shape:
        return f"output shape {tuple(got.shape)}, NCCL's {tuple(want.shape)}"
    if not torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2):
        bad = int(torch.count_nonzero(~torch.isclose(got.float(), want.float(), rtol=2e-2, atol=2e-2)))
        return f"{bad} of {want.numel()} elements differ from NCCL's output"
    return ""


@dataclass(frozen=True)
class Alternative:
    name: str
    op: str            # the bench op it stands beside
    kernel: str        # torch.ops.symm_mem.<kernel>

    def why_not(self, comm, dtype: torch.dtype) -> str:
        """"" when it can run on this world, else the reason."""
        if not comm.cuda:
            return "needs CUDA tensors (symmetric memory is GPU memory)"
        try:
            import torch.distributed._symmetric_memory  # noqa: F401
        except ImportError as exc:
            return f"torch {torch.__version__} has no symmetric memory ({exc})"
        ops = getattr(torch.ops, "symm_mem", None)
        if ops is None or not hasattr(ops, self.kernel):
            return f"torch {torch.__version__} has no torch.ops.symm_mem.{self.kernel}"
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return f"{self.kernel} takes bf16, fp16 and fp32 (got {dtype})"
        return ""

    def prepare(self, comm, nbytes: int, dtype: torch.dtype) -> Prepared:
        """Symmetric buffers for one point (every rank, collective: rendezvous)."""
        import torch.distributed._symmetric_memory as symm_mem
        esz = torch.empty(0, dtype=dtype).element_size()
        w, dev = comm.world_size, comm.device
        group = comm.nccl_group if comm.nccl_group is not None else dist.group.WORLD
        name = group.group_name
        n = max(1, nbytes // esz)
        user = torch.randn(n * (w if self.op == "reduce_scatter" else 1), device=dev).to(dtype)
        buf = symm_mem.empty(user.numel(), dtype=dtype, device=dev)
        symm_mem.rendezvous(buf, name)
        kernel = getattr(torch.ops.symm_mem, self.kernel)
        if self.op == "all_reduce":                   # two_shot in place, one_shot returns a tensor
            run = lambda: kernel(buf, "sum", name)                                      # noqa: E731
            inplace = self.kernel.endswith("_")
            out = (lambda: (run(), buf)[1]) if inplace else run                         # noqa: E731
            want = user.clone()
            dist.all_reduce(want, group=group)
        elif self.op == "all_gather":                 # returns the gathered tensor
            run = out = lambda: kernel(buf, name)                                       # noqa: E731
            want = torch.empty(n * w, dtype=dtype, device=dev)
            dist.all_gather_into_tensor(want, user, group=group)
        else:                                         # reduce_scatter: returns this rank's part
            run = out = lambda: kernel(buf, "sum", name)                                # noqa: E731
            want = torch.empty(n, dtype=dtype, device=dev)
            dist.reduce_scatter_tensor(want, user, group=group)

        def check() -> str:
            buf.copy_(user)
            got = out()
            torch.cuda.synchronize(dev)
            return _mismatch(got.reshape(-1), want)
        return Prepared(run=run, copy_in=lambda: buf.copy_(user), check=check)


# torch's symmetric-memory kernels (SM kernels reading and writing peers' memory over NVLink)
ALTERNATIVES: tuple[Alternative, ...] = (
    Alternative("symm_mem two_shot", "all_reduce", "two_shot_all_reduce_"),
    Alternative("symm_mem one_shot", "all_reduce", "one_shot_all_reduce"),
    Alternative("symm_mem low_contention", "all_gather", "_low_contention_all_gather"),
    Alternative("symm_mem low_contention", "reduce_scatter", "_low_contention_reduce_scatter"),
)


def for_op(op: str) -> list[Alternative]:
    return [a for a in ALTERNATIVES if a.op == op]


def statuses(comm, op: str, dtype: torch.dtype) -> dict[str, str]:
    """name -> "" (can run) or why not, for every alternative of `op` (the same on every rank)."""
    return {a.name: a.why_not(comm, dtype) for a in for_op(op)}
