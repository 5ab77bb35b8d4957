"""Ready-to-run ops for the calibration and the bench: braid's call and the baseline's, on the same
buffers, with a check of braid's output against the baseline's.

`nbytes` is the per-rank input of all_gather (nccl-tests prints the gathered output instead; the
bus bandwidth is the same), the whole buffer of broadcast and send/recv, and the per-rank input of
all_to_all_single. With `hot_nbytes` (all_to_all only) rank 0 sends hot_nbytes to rank 1 and every
other pair `cold_nbytes`; with `hot_fraction` h every rank sends h of its nbytes to the last rank
and spreads the rest evenly over the others. `moe` is one MoE layer's token exchange: dispatch
(all_to_all_single with the splits of a Zipf-skewed expert load) then combine (the reverse).
`wrong()` counts bytes that differ from the baseline's output.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from .planner.traffic import hot_matrix  # noqa: F401  (the bench's skew; also used by the simulator)

BUS_FACTOR = {  # nccl-tests PERFORMANCE.md
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "reduce": lambda n: 1.0,
    "all_gather": lambda n: (n - 1) / n,
    "all_to_all_single": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "send_recv": lambda n: 1.0,
    "moe": lambda n: (n - 1) / n,
}


@dataclass
class Workload:
    op: str
    nbytes: int            # reported size
    algbytes: int          # bytes counted for algbw (nccl-tests: per-rank size * n for all_gather)
    braid: Callable[[], object]
    baseline: Callable[[], object]
    wrong: Callable[[], int]        # bytes where braid differs from the baseline (run both first)
    participates: bool = True


def _rand(numel: int, dtype: torch.dtype, device, gen_seed: int) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(gen_seed)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g, dtype=torch.float32).to(dtype).to(device)
    if dtype == torch.bool:
        return (torch.randint(0, 2, (numel,), generator=g) > 0).to(device)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), (numel,), generator=g, dtype=torch.int64).to(dtype).to(device)


def moe_matrix(world: int, tokens: int, experts_per_rank: int = 4, zipf: float = 1.2,
               seed: int = 0) -> list[list[int]]:
    """Tokens each rank sends each rank in one MoE dispatch: every rank routes `tokens` tokens to
    experts drawn from a Zipf(zipf) law over world*experts_per_rank experts (expert e lives on rank
    e % world). Every rank computes the same matrix from the seed."""
    g = torch.Generator().manual_seed(seed)
    n = world * experts_per_rank
    weights = torch.tensor([1.0 / (k + 1) ** zipf for k in range(n)])
    perm = torch.randperm(n, generator=g)               # which experts are hot: not just rank 0's
    weights = weights[perm]
    rows = []
    for _ in range(world):
        picks = torch.multinomial(weights, tokens, replacement=True, generator=g)
        rows.append(torch.bincount(picks % world, minlength=world).tolist())
    return rows


def make(comm, op: str, nbytes: int, dtype: torch.dtype = torch.bfloat16, device=None,
         hot_nbytes: int | None = None, cold_nbytes: int | None = None, seed: int = 0,
         hot_fraction: float | None = None, hidden: int = 4096) -> Workload:
    """Buffers and callables for one op at one size on this rank."""
    build = _BUILDERS.get("reduction" if op in ("all_reduce", "reduce", "reduce_scatter") else op)
    if build is None:
        raise ValueError(f"unknown op {op!r}; known: {sorted(BUS_FACTOR)}")
    device = device or comm.device
    esz = torch.empty(0, dtype=dtype).element_size()
    at = _At(comm, op, max(nbytes // esz, 1), esz, dtype, device, seed * 1000 + comm.rank)
    return build(at, hot_nbytes=hot_nbytes, cold_nbytes=cold_nbytes, hot_fraction=hot_fraction, hidden=hidden)


@dataclass
class _At:
    """What every op's builder starts from: the communicator, the op, the per-rank element count,
    the element size and dtype, the device, and this rank's seed."""
    comm: object
    op: str
    numel: int
    esz: int
    dtype: torch.dtype
    device: object
    seed: int

    def rand(self, numel: int, seed: int | None = None) -> torch.Tensor:
        return _rand(numel, self.dtype, self.device, self.seed if seed is None else seed)

    def empty(self, numel: int) -> torch.Tensor:
        return torch.empty(numel, dtype=self.dtype, device=self.device)


CHECK_CHUNK = 16 << 20      # bytes a check of data movement compares at once
CHECK_CHUNK_ELEMS = 1 << 20  # elements a check of a reduction compares at once (in float64)


def _count(mask: torch.Tensor) -> int:
    # not mask.sum(): that sums a bool tensor through an int64 copy of it, 8 bytes per element
    # (the 64 MiB all_gather on 16 CPU ranks: 9 GiB a rank, and the kernel killed one)
    return int(torch.count_nonzero(mask))


def _differ(a: torch.Tensor, b: torch.Tensor, chunk: int = CHECK_CHUNK) -> int:
    """Bytes where `a` and `b` differ, compared `chunk` bytes at a time (no mask the size of the
    output beside it)."""
    a, b = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    return sum(_count(a[i:i + chunk] != b[i:i + chunk]) for i in range(0, a.numel(), chunk))


def _beyond(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor | None, tol: float,
            chunk: int = CHECK_CHUNK_ELEMS) -> int:
    """Elements where `a` and `b` differ by more than tol * scale + 1e-3 (in float64), or differ
    at all with `scale` None (in their own dtype), `chunk` elements at a time (no float64 copy of
    the whole tensors)."""
    a, b = a.reshape(-1), b.reshape(-1)
    bad = 0
    for i in range(0, a.numel(), chunk):
        x, y = a[i:i + chunk], b[i:i + chunk]
        if scale is None:
            bad += _count(x != y)
        else:
            bad += _count((x.double() - y.double()).abs() > tol * scale[i:i + chunk] + 1e-3)
    return bad


def footprint(op: str, nbytes: int, world: int, esz: int) -> int:
    """Bytes of memory one rank's point of `make(op, nbytes)` holds at its peak, roughly: braid's
    and the baseline's buffers, the baseline's own copy of a gathered output (gloo's all_gather
    gathers into a flat buffer of its own first), a reduction check's float64 scale, and the
    check's pieces (CHECK_SLACK)."""
    n = max(nbytes, esz)
    if op == "all_gather":
        own = n + 3 * n * world
    elif op in ("all_reduce", "reduce", "reduce_scatter"):
        own = 3 * n + 2 * 8 * (n // esz)       # x, braid's and the baseline's; the float64 scale and gloo's copy of it
    elif op in ("all_to_all_single", "moe"):
        own = 6 * n                            # x, out, ref (moe: mid, back and their refs) and a skew's excess
    else:
        own = 3 * n                            # broadcast, send_recv
    return own + CHECK_SLACK


CHECK_SLACK = 64 << 20      # a check's pieces at once: 16 MiB of mask, or float64 pieces of 1 Mi elements


def _all_gather(at: _At, **_) -> Workload:
    comm, numel, esz, w = at.comm, at.numel, at.esz, at.comm.world_size
    x = at.rand(numel)
    out = at.empty(numel * w)
    ref = torch.empty_like(out)
    return Workload(at.op, numel * esz, numel * esz * w,
                    lambda: comm.all_gather_into_tensor(out, x),
                    lambda: dist.all_gather_into_tensor(ref, x),
                    lambda: _differ(out, ref))


def _broadcast(at: _At, **_) -> Workload:
    """Timed calls broadcast the same buffer again (no refill: the host time is the call's own);
    the check refills first (zeros off the root) and runs one call each."""
    comm, r = at.comm, at.comm.rank
    x = at.rand(at.numel, 7 + at.seed - r)
    buf, ref = x.clone(), x.clone()

    def wrong() -> int:
        for b in (buf, ref):
            b.copy_(x) if r == 0 else b.fill_(0)
        comm.broadcast(buf, 0)
        dist.broadcast(ref, 0)
        return _differ(buf, ref)
    return Workload(at.op, at.numel * at.esz, at.numel * at.esz, lambda: comm.broadcast(buf, 0),
                    lambda: dist.broadcast(ref, 0), wrong)


def _send_recv(at: _At, **_) -> Workload:
    comm, r, size = at.comm, at.comm.rank, at.numel * at.esz
    x = at.rand(at.numel)
    out = torch.empty_like(x)
    ref = torch.empty_like(x)
    if r == 0:
        return Workload(at.op, size, size, lambda: comm.send(x, 1), lambda: dist.send(x, 1), lambda: 0)
    if r == 1:
        return Workload(at.op, size, size, lambda: comm.recv(out, 0), lambda: dist.recv(ref, 0),
                        lambda: _differ(out, ref))
    return Workload(at.op, size, size, lambda: None, lambda: None, lambda: 0, participates=False)


def _all_to_all(at: _At, hot_nbytes=None, cold_nbytes=None, hot_fraction=None, **_) -> Workload:
    comm, w, r, esz = at.comm, at.comm.world_size, at.comm.rank, at.esz
    if hot_nbytes is not None:
        cold = (cold_nbytes or 0) // esz
        mat = [[0 if s == d else cold for d in range(w)] for s in range(w)]
        mat[0][1] = hot_nbytes // esz
    elif hot_fraction is not None:
        mat = hot_matrix(w, at.numel, hot_fraction)
    else:
        per = max(at.numel // w, 1)
        mat = [[per] * w for _ in range(w)]
    ins, outs = mat[r], [mat[s][r] for s in range(w)]
    x = at.rand(sum(ins))
    out = at.empty(sum(outs))
    ref = torch.empty_like(out)
    size = max(sum(row) for row in mat) * esz
    skewed = hot_nbytes is not None or hot_fraction is not None
    splits = (outs, ins) if skewed else (None, None)   # balanced: no split sizes
    return Workload(at.op, size, size,
                    lambda: comm.all_to_all_single(out, x, *splits),
                    lambda: dist.all_to_all_single(ref, x, *splits),
                    lambda: _differ(out, ref))


def _moe(at: _At, hidden: int = 4096, **_) -> Workload:
    comm, w, r = at.comm, at.comm.world_size, at.comm.rank
    # nbytes per rank of dispatched activations: tokens x hidden elements
    tokens = max(at.numel // hidden, 1)
    mat = moe_matrix(w, tokens, seed=at.seed // 1000 + 17)
    ins = [c * hidden for c in mat[r]]
    outs = [mat[s][r] * hidden for s in range(w)]
    x = at.rand(sum(ins))
    mid = at.empty(sum(outs))
    back = torch.empty_like(x)
    mid_ref, back_ref = torch.empty_like(mid), torch.empty_like(x)

    def layer(a2a, m, b):
        def run():
            a2a(m, x, outs, ins)          # dispatch: tokens to their experts' ranks
            a2a(b, m, ins, outs)          # combine: expert outputs back (identity experts)
        return run
    size = max(sum(ins), sum(outs)) * at.esz
    return Workload(at.op, size, size, layer(comm.all_to_all_single, mid, back),
                    layer(dist.all_to_all_single, mid_ref, back_ref),
                    lambda: _differ(back, back_ref) + _differ(mid, mid_ref))


def _reduction(at: _At, **_) -> Workload:
    """all_reduce, reduce, reduce_scatter: timed calls reduce in place without resetting (as
    nccl-tests do); the check resets first and compares with a tolerance (braid reduces in rank
    order, NCCL in ring order)."""
    comm, op, w, r, numel, esz, dtype = at.comm, at.op, at.comm.world_size, at.comm.rank, at.numel, at.esz, at.dtype
    x = at.rand(numel)
    if op == "reduce_scatter":
        per = max(numel // w, 1)
        x = x[: per * w].contiguous() if x.numel() >= per * w else at.rand(per * w)
        out = at.empty(per)
        ref = torch.empty_like(out)
        run_braid = lambda: comm.reduce_scatter_tensor(out, x)          # noqa: E731
        run_base = lambda: dist.reduce_scatter_tensor(ref, x)           # noqa: E731
        size = x.numel() * esz
        check = (out, ref)
    else:
        buf, rbuf = x.clone(), x.clone()
        if op == "all_reduce":
            run_braid = lambda: comm.all_reduce(buf)                    # noqa: E731
            run_base = lambda: dist.all_reduce(rbuf)                    # noqa: E731
        else:
            run_braid = lambda: comm.reduce(buf, 0)                     # noqa: E731
            run_base = lambda: dist.reduce(rbuf, 0)                     # noqa: E731
        size = numel * esz
        check = (buf, rbuf)

    def wrong() -> int:
        a, b = check
        if op != "reduce_scatter":   # fresh inputs, one call each
            a.copy_(x)
            b.copy_(x)
            run_braid()
            run_base()
        # rounding error of a sum scales with sum_i |x_i| (cancellation), not with |sum|;
        # a collective, so every rank computes it before any rank returns
        scale = x.abs().double()
        dist.all_reduce(scale)
        if op == "reduce" and r != 0:
            return _beyond(a, x, None, 0.0)            # non-root tensors must be left unchanged
        if not dtype.is_floating_point:
            return _beyond(a, b, None, 0.0)
        if op == "reduce_scatter":
            per = a.numel()
            scale = scale[r * per:(r + 1) * per]     # this rank's chunk of sum_i |x_i|
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        return _beyond(a, b, scale, tol)
    return Workload(op, size, size, run_braid, run_base, wrong)


_BUILDERS = {"all_gather": _all_gather, "broadcast": _broadcast, "send_recv": _send_recv,
             "all_to_all_single": _all_to_all, "moe": _moe, "reduction": _reduction}
