"""Kept for the reduce_scatter share NCCL does not take yet (docs/design.md): what the strided copy costs.

Probe: can NCCL take a share of a reduce_scatter? NCCL's reduce_scatter wants its part of every
chunk contiguous, so its share f of each chunk is first gathered into scratch by a strided copy
(cuMemcpy2DAsync, copy engines) on a side stream, piece by piece, while NCCL reduces the previous
piece. Times per call (events, 20 calls after 3 warm-up), 4 ranks, bf16:
  whole  = NCCL's reduce_scatter of the whole tensor
  part   = NCCL on the share f only, pieces P, with the strided copy
  nocopy = the same NCCL calls on scratch already filled (what the copy costs)
Ideal: part / whole ~= f."""
import ctypes
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class M2D(ctypes.Structure):
    _fields_ = [("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcMemoryType", ctypes.c_int),
                ("srcHost", ctypes.c_void_p), ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
                ("srcPitch", ctypes.c_size_t), ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t),
                ("dstMemoryType", ctypes.c_int), ("dstHost", ctypes.c_void_p), ("dstDevice", ctypes.c_uint64),
                ("dstArray", ctypes.c_void_p), ("dstPitch", ctypes.c_size_t), ("WidthInBytes", ctypes.c_size_t),
                ("Height", ctypes.c_size_t)]


cu = ctypes.CDLL("libcuda.so.1")
cu.cuMemcpy2DAsync_v2.argtypes = [ctypes.POINTER(M2D), ctypes.c_void_p]


def copy2d(dst, dpitch, src, spitch, width, height, stream):
    m = M2D()
    m.srcMemoryType = m.dstMemoryType = 2
    m.srcDevice, m.srcPitch, m.dstDevice, m.dstPitch = src, spitch, dst, dpitch
    m.WidthInBytes, m.Height = width, height
    rc = cu.cuMemcpy2DAsync_v2(ctypes.byref(m), stream)
    assert rc == 0, rc


def timed(fn, n=20, warm=3):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    b.synchronize()
    t = torch.tensor([a.elapsed_time(b) * 1000 / n], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def worker(rank, w, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=w, device_id=torch.device("cuda", rank))
    side = torch.cuda.Stream()
    for size in (256 << 20, 1 << 30):
        n = size // 2
        m = n // w
        inp = torch.randn(n, device="cuda").to(torch.bfloat16)
        out = torch.empty(m, dtype=torch.bfloat16, device="cuda")
        whole = timed(lambda: dist.reduce_scatter_tensor(out, inp))
        ref = out.clone()
        for f in (0.93, 0.96):
            k = int(m * f) // 2048 * 2048
            scratch = torch.empty(w * k, dtype=torch.bfloat16, device="cuda")
            for P in (1, 4, 8):
                bounds = [k * i // P // 2048 * 2048 for i in range(P)] + [k]
                evs = [torch.cuda.Event() for _ in range(P)]

                def part(copy=True):
                    main = torch.cuda.current_stream()
                    side.wait_stream(main)
                    for i in range(P):
                        a, b = bounds[i], bounds[i + 1]
                        if copy:
                            copy2d(scratch.data_ptr() + w * a * 2, (b - a) * 2, inp.data_ptr() + a * 2, m * 2,
                                   (b - a) * 2, w, side.cuda_stream)
                        evs[i].record(side)
                    for i in range(P):
                        a, b = bounds[i], bounds[i + 1]
                        main.wait_event(evs[i])
                        dist.reduce_scatter_tensor(out[a:b], scratch[w * a: w * b])
                t_part = timed(part)
                err = (out[:k].float() - ref[:k].float()).abs().max().item()
                same = torch.equal(out[:k], ref[:k])
                t_nc = timed(lambda: part(False))
                if rank == 0:
                    print(f"rs {size >> 20}M f={f} P={P}: whole {whole:.0f} us, part {t_part:.0f} us "
                          f"({t_part / whole:.3f}), nocopy {t_nc:.0f} us ({t_nc / whole:.3f}); "
                          f"bitwise same as whole: {same}, max err {err:.3g}", flush=True)
            scratch = None     # free it before the next share
    dist.destroy_process_group()


if __name__ == "__main__":
    w = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(w, port), nprocs=w)
