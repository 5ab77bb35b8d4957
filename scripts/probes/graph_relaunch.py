"""Does a CUDA graph launch wait on the host when the same executable graph's previous launch has
not run yet? braid replays one graph per prepared call shape; in DDP each bucket's graph is
launched once a step, so a launch that waits for the previous step's launch would hold the host
within a step of its GPU (braid's host was measured within 0.8-1.9 ms of its GPU in DDP's steps on
2 x H200, NCCL's 16-30 ms ahead). Per kind of graph (a device copy; a kernel; stream memory
operations on a host-mapped flag, as braid's programs hold; all three), the host time of:

- a launch on an idle stream;
- a launch queued behind a long kernel (the stream busy for --busy-ms);
- a second launch of the same graph right after it (its first launch not run yet);
- a launch of a second instantiation of the same capture (another executable graph);
- a launch of the same graph on another, idle stream while its first launch waits.

    python3 scripts/probes/graph_relaunch.py [--busy-ms 50] [--mib 16] [--repeat 3]

A second launch that takes about --busy-ms of host time waits for the first; one of a few us
does not.
"""
from __future__ import annotations

import argparse
import ctypes
import mmap
import time

import torch

from braid.lanes import _cuda

KINDS = ("copy", "kernel", "memops", "copy+kernel+memops")


def capture(kind: str, a: torch.Tensor, b: torch.Tensor, flag: int) -> torch.cuda.CUDAGraph:
    s = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        g.capture_begin(capture_error_mode="thread_local")
        try:
            if "copy" in kind:
                _cuda.memcpy_async(b.data_ptr(), a.data_ptr(), a.nbytes, s.cuda_stream)
            if "kernel" in kind:
                b.add_(1.0)
            if "memops" in kind:
                # write the flag, then wait for it to be >= 1 (already true): a write and a wait
                _cuda.memops(s.cuda_stream, [(False, flag, 1), (True, flag, 1)])
        finally:
            g.capture_end()
    return g


def host_us(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def exec_of(g: torch.cuda.CUDAGraph) -> int:
    raw = getattr(g, "raw_cuda_graph_exec", None)
    if raw is None:
        raise SystemExit("this torch has no CUDAGraph.raw_cuda_graph_exec")
    return int(raw())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--busy-ms", type=float, default=50.0)
    ap.add_argument("--mib", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    a_ = ap.parse_args()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    n = (a_.mib << 20) // 4
    a = torch.randn(n, device=dev)
    b = torch.empty_like(a)
    page = mmap.mmap(-1, 4096)
    host = ctypes.addressof(ctypes.c_char.from_buffer(page))
    flag = _cuda.host_register(host, 4096)
    # a kernel of about --busy-ms: calibrate torch's sleep kernel
    s = torch.cuda.Stream()
    cycles = 1_000_000
    with torch.cuda.stream(s):
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ev0.record()
        torch.cuda._sleep(cycles)
        ev1.record()
    ev1.synchronize()
    per_ms = cycles / max(ev0.elapsed_time(ev1), 1e-3)
    busy = int(per_ms * a_.busy_ms)
    other = torch.cuda.Stream()
    print(f"GPU {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, busy kernel {a_.busy_ms} ms, "
          f"copy {a_.mib} MiB; host us per launch (median of {a_.repeat})")
    print(f"{'graph':>20} {'idle':>8} {'behind busy':>12} {'same again':>11} {'2nd instance':>13} {'same, idle stream':>18}")
    for kind in KINDS:
        g1, g2 = capture(kind, a, b, flag), capture(kind, a, b, flag)
        e1, e2 = exec_of(g1), exec_of(g2)
        rows = []
        for _ in range(a_.repeat):
            torch.cuda.synchronize()
            idle = host_us(lambda: _cuda.graph_launch(e1, s.cuda_stream))
            torch.cuda.synchronize()
            with torch.cuda.stream(s):
                torch.cuda._sleep(busy)
            behind = host_us(lambda: _cuda.graph_launch(e1, s.cuda_stream))
            again = host_us(lambda: _cuda.graph_launch(e1, s.cuda_stream))
            second = host_us(lambda: _cuda.graph_launch(e2, s.cuda_stream))
            torch.cuda.synchronize()
            with torch.cuda.stream(s):
                torch.cuda._sleep(busy)
            _cuda.graph_launch(e1, s.cuda_stream)
            elsewhere = host_us(lambda: _cuda.graph_launch(e1, other.cuda_stream))
            torch.cuda.synchronize()
            rows.append((idle, behind, again, second, elsewhere))
        med = [sorted(col)[len(col) // 2] for col in zip(*rows)]
        print(f"{kind:>20} " + " ".join(f"{v:>{w}.1f}" for v, w in zip(med, (8, 12, 11, 13, 18))))
        del g1, g2
    _cuda.host_unregister(host)


if __name__ == "__main__":
    main()
