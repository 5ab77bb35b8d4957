"""GPU tier on ONE GPU: the device-side pieces every multi-GPU lane is built from.

The multi-GPU tests (2+ GPUs) check whole collectives against NCCL; these check, on any single
GPU, what those collectives stand on, so a machine with one GPU (and a torch or driver upgrade)
still exercises braid's CUDA code:
- the reduction kernels (`reduce_slots`, `reduce_pair`) against a float64 reference for every
  dtype and op braid claims, and their determinism claims: bitwise the same on repeat, the same
  bits from the two-rank kernel and the general one, from strided slot rows (as `ce_reduce` cuts
  them) and contiguous ones, and from any cut of a chunk into pieces (even or tapered);
- stream memory operations on counters in a pinned, mapped node segment (`lanes/_cuda.py`, the
  `ce` and `host` lanes' only synchronisation): a wait orders a second stream after the first,
  the CPU sees a GPU write, and the segment leaves nothing behind.
Skips without a GPU.
"""
from __future__ import annotations

import os

import pytest
import torch

from braid.collectives.reduce import REDUCE_DTYPES, reduce_pair, reduce_slots
from braid.node import Layout, NodeSegment
from braid.planner.pieces import pieces, tail_elems

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

OPS = ("sum", "avg", "product", "min", "max", "premul_sum")
FLOAT = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _inputs(world: int, n: int, dtype: torch.dtype, op: str, seed: int) -> torch.Tensor:
    """[world, n] fresh random inputs on the GPU, never zeros; products kept in range."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    if dtype.is_floating_point:
        x = torch.rand(world, n, generator=g, dtype=torch.float64) + 0.5       # 0.5 .. 1.5
        x = torch.where(torch.rand(world, n, generator=g) < 0.5, x, -x) if op != "product" else x
    else:
        info = torch.iinfo(dtype)
        hi = 3 if op == "product" else min(info.max // (world + 1), 1000)
        lo = 1 if (op == "product" or info.min == 0) else -hi
        x = torch.randint(lo, hi + 1, (world, n), generator=g, dtype=torch.int64)
        x[x == 0] = 1
    return x.to(dtype).cuda()


def _reference(x: torch.Tensor, op: str, factor: float) -> torch.Tensor:
    """The reduction over dim 0 computed independently on the CPU in float64 (int64 for ints)."""
    w = x.shape[0]
    acc = x.cpu().to(torch.float64 if x.dtype.is_floating_point else torch.int64)
    if op == "sum":
        return acc.sum(0)
    if op == "avg":       # integers: truncated toward zero, as NCCL's integer average
        return acc.sum(0) / w if x.dtype.is_floating_point else torch.div(acc.sum(0), w, rounding_mode="trunc")
    if op == "premul_sum":
        return (acc * factor).sum(0)
    if op == "product":
        out = acc[0].clone()
        for r in range(1, w):
            out = out * acc[r]
        return out
    return acc.amin(0) if op == "min" else acc.amax(0)


def _cases():
    for dtype in REDUCE_DTYPES:
        for op in OPS:
            if op == "premul_sum" and not dtype.is_floating_point:
                continue           # NCCL (through torch) has no integer premul-sum; braid refuses it
            yield pytest.param(dtype, op, id=f"{str(dtype).replace('torch.', '')}-{op}")


@pytest.mark.parametrize("dtype,op", list(_cases()))
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_reduction_kernels_match_float64(dtype, op, world):
    n = 4099 + world                                   # odd, not a multiple of any vector width
    x = _inputs(world, n, dtype, op, seed=world * 131 + len(op))
    factor = 0.37
    out = torch.empty(n, dtype=dtype, device="cuda")
    reduce_slots(x, world, op, out, factor)
    ref = _reference(x, op, factor)
    got = out.cpu().to(ref.dtype)
    if dtype.is_floating_point:
        # one rounding of the exact result into dtype (half precision accumulates in float32)
        scale = ref.abs().clamp_min(1.0)
        err = ((got - ref).abs() / scale).max().item()
        assert err <= TOL[dtype] * world, f"{dtype} {op} w={world}: worst relative error {err:.3g}"
    else:
        if dtype.itemsize < 8:                           # narrow integers wrap on overflow, as NCCL's do
            info = torch.iinfo(dtype)
            ref = ((ref - info.min) % (info.max - info.min + 1)) + info.min
        assert torch.equal(got, ref), f"{dtype} {op} w={world}: integer result differs"
    again = torch.empty_like(out)
    reduce_slots(x, world, op, again, factor)
    assert torch.equal(out.view(torch.uint8), again.view(torch.uint8)), "not bitwise repeatable"


@pytest.mark.parametrize("dtype,op", list(_cases()))
def test_two_rank_kernel_gives_the_general_kernels_bits(dtype, op):
    """`ce_reduce` reduces two ranks with `reduce_pair` and more with `reduce_slots`; the results
    (and so every rank of a 2-GPU call) must not depend on which ran."""
    n = 10007
    x = _inputs(2, n, dtype, op, seed=7)
    a = torch.empty(n, dtype=dtype, device="cuda")
    b = torch.empty(n, dtype=dtype, device="cuda")
    reduce_slots(x, 2, op, a, 0.37)
    reduce_pair(x[0], x[1], op, b, 0.37)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    # in place (out aliases the first input), as an in-place all_reduce does
    c = x[0].clone()
    reduce_pair(c, x[1], op, c, 0.37)
    assert torch.equal(a.view(torch.uint8), c.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int32])
@pytest.mark.parametrize("world", [3, 4, 8])
def test_pieces_and_strided_rows_do_not_change_bits(dtype, world):
    """`ce_reduce` reduces a chunk piece by piece out of strided slot rows (slots[:, a:b]); the
    pieces are even or tapered by size. Any cut must give the bits of one reduction of the whole
    contiguous chunk: every element is reduced once, in rank order, whatever the cut."""
    n = 2 * 16384 + 77
    for op in ("sum", "product", "max", "premul_sum" if dtype.is_floating_point else "min"):
        x = _inputs(world, n, dtype, op, seed=world)
        whole = torch.empty(n, dtype=dtype, device="cuda")
        reduce_slots(x.contiguous(), world, op, whole, 0.37)
        esz = x.element_size()
        per = 16384
        for tail in (0, tail_elems(per, esz, from_bytes=0)):
            cut = pieces(n, per, tail)
            assert cut[0][0] == 0 and cut[-1][1] == n and all(a < b for a, b in cut)
            out = torch.empty(n, dtype=dtype, device="cuda")
            for a, b in cut:
                reduce_slots(x[:, a:b], world, op, out[a:b], 0.37)
            assert torch.equal(whole.view(torch.uint8), out.view(torch.uint8)), f"{op}, tail {tail}"


def _finish(stream, seg, off, seconds: float = 20.0) -> bool:
    """Wait for `stream` without hanging the suite: on timeout, release every wait on the counter
    at `off` (so the stream can drain) and report False."""
    import time
    deadline = time.monotonic() + seconds
    while not stream.query():
        if time.monotonic() > deadline:
            seg.set(off, 0x7FFFFFFF)
            stream.synchronize()
            return False
        time.sleep(0.001)
    return True


@pytest.fixture
def segment():
    """A one-rank node segment, pinned and mapped as a GPU communicator maps it."""
    from braid.lanes import _cuda
    torch.zeros(1, device="cuda")  # the driver calls need torch's context current, as in a communicator
    layout = Layout(1, host_buffer_bytes=1 << 20, chunk_bytes=1 << 18)
    seg = NodeSegment(NodeSegment.new_name(), layout, rank=0, create=True)
    dev = _cuda.host_register(seg.address, layout.total_bytes)
    yield seg, layout, dev
    _cuda.host_unregister(seg.address)
    seg.close()
    seg.unlink()


def test_counter_wait_orders_one_stream_after_another(segment):
    """Stream B waits (cuStreamWaitValue32) for a counter that stream A writes after slow work;
    B's copy must see A's result. No event or CPU wait joins the two streams."""
    from braid.lanes import _cuda
    seg, layout, dev = segment
    ctr = dev + layout.counter("ce_arrive", 0)
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    src = torch.zeros(1 << 22, device="cuda")
    dst = torch.empty_like(src)
    # load every kernel first: with lazy module loading, a kernel's first launch synchronises the
    # context, which would wait for stream B's blocked wait (the pitfall the lanes also avoid)
    torch.cuda._sleep(1000)
    src.fill_(0.5)
    dst.copy_(src)
    torch.cuda.synchronize()
    for seq in range(1, 4):
        with torch.cuda.stream(b):
            _cuda.wait_value(b.cuda_stream, ctr, seq)
            dst.copy_(src)
        with torch.cuda.stream(a):
            torch.cuda._sleep(20_000_000)             # ~10 ms of GPU time before the data is written
            src.fill_(float(seq) + 0.5)
            _cuda.write_value(a.cuda_stream, ctr, seq)
        assert _finish(b, seg, layout.counter("ce_arrive", 0)), f"round {seq}: the wait never passed"
        assert torch.all(dst == float(seq) + 0.5), f"round {seq}: B ran before A's write"
        assert seg.get(layout.counter("ce_arrive", 0)) == seq      # the CPU sees the GPU's write


def test_counter_waits_are_wrap_aware(segment):
    """Counters only grow and wrap at 2**32; a GEQ wait for a value just past the wrap must wait
    for it, and one for a value just before must pass (node.geq, the GPU's comparison)."""
    from braid.lanes import _cuda
    from braid.node import geq
    seg, layout, dev = segment
    off = layout.counter("ce_finish", 0)
    seg.set(off, 0xFFFFFFF0)
    s = torch.cuda.Stream()
    flag = torch.zeros(1, device="cuda")
    flag.fill_(3.0)                                                # loaded before any wait (see above)
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        _cuda.wait_value(s.cuda_stream, dev + off, 0xFFFFFFE0)      # behind: passes at once
        flag.fill_(1.0)
    assert _finish(s, seg, off), "a wait for a value already passed blocked"
    assert flag.item() == 1.0 and geq(0xFFFFFFF0, 0xFFFFFFE0)
    with torch.cuda.stream(s):
        _cuda.wait_value(s.cuda_stream, dev + off, 0x00000005)      # past the wrap: must wait
        flag.fill_(2.0)
    import time
    time.sleep(0.05)
    waited = not s.query()
    seg.set(off, 0x00000006)                                       # the CPU releases it
    assert _finish(s, seg, off), "the CPU's write did not release the GPU's wait"
    assert waited and not geq(0xFFFFFFF0, 5), "a wait for a value past the wrap did not wait"
    assert flag.item() == 2.0


def test_segment_and_pinning_leave_nothing_behind():
    from braid.lanes import _cuda
    torch.zeros(1, device="cuda")
    before = set(os.listdir("/dev/shm"))
    for _ in range(5):
        layout = Layout(2, host_buffer_bytes=4 << 20, chunk_bytes=1 << 20)
        seg = NodeSegment(NodeSegment.new_name(), layout, rank=0, create=True)
        _cuda.host_register(seg.address, layout.total_bytes)
        _cuda.host_unregister(seg.address)
        seg.unlink()
        seg.close()
    assert set(os.listdir("/dev/shm")) == before
    # registering the same pages twice is the driver's error, raised as braid's, naming the call
    from braid.errors import LaneFailureError
    layout = Layout(1, host_buffer_bytes=1 << 20, chunk_bytes=1 << 18)
    seg = NodeSegment(NodeSegment.new_name(), layout, rank=0, create=True)
    try:
        _cuda.host_register(seg.address, layout.total_bytes)
        with pytest.raises(LaneFailureError, match="cuMemHostRegister"):
            _cuda.host_register(seg.address, layout.total_bytes)
        _cuda.host_unregister(seg.address)
    finally:
        seg.unlink()
        seg.close()
