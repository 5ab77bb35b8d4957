"""Host time of one cuGraphLaunch (ctypes) by what the graph holds: a copy, stream memory
operations on pinned host memory (one node each, or batched: cuStreamBatchMemOp), both; each launch after the GPU drained (no queue), and back
to back. One process, one GPU.

    PYTHONPATH=src python3 scripts/probes/graph_launch_cost.py
"""
import statistics
import time

import torch

from braid.lanes import _cuda


def main():
    torch.cuda.set_device(0)
    flag = torch.ones(64, dtype=torch.int32, pin_memory=True)       # waits on 1 pass at once
    fp = flag.data_ptr()
    x = torch.randn(1 << 18, device="cuda")
    y = torch.empty_like(x)
    cap = torch.cuda.Stream()

    def memops(sh, n):
        for i in range(n):
            if i % 2:
                _cuda.wait_value(sh, fp, 1)
            else:
                _cuda.write_value(sh, fp + 4 * (1 + i), 1)

    def batch(n):
        return [(True, fp, 1) if i % 2 else (False, fp + 4 * (1 + i), 1) for i in range(n)]

    kinds = {
        "1 copy": lambda sh: _cuda.memcpy_async(y.data_ptr(), x.data_ptr(), x.numel() * 4, sh),
        "6 memops": lambda sh: memops(sh, 6),
        "6 memops + 2 copies": lambda sh: (memops(sh, 3), _cuda.memcpy_async(y.data_ptr(), x.data_ptr(), 4096, sh),
                                           memops(sh, 3), _cuda.memcpy_async(y.data_ptr(), x.data_ptr(), 4096, sh)),
        "12 memops": lambda sh: memops(sh, 12),
        "12 memops, 1 batch": lambda sh: _cuda.memops(sh, batch(12)),
        "12 memops, 6 batches": lambda sh: [_cuda.memops(sh, batch(12)[i: i + 2]) for i in range(0, 12, 2)],
        "27 memops": lambda sh: memops(sh, 27),
        "27 memops, 6 batches": lambda sh: [_cuda.memops(sh, batch(27)[i: i + 5]) for i in range(0, 27, 5)],
        "a kernel": lambda sh: torch.add(x, 1, out=y),
    }
    for name, body in kinds.items():
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(cap):
            g.capture_begin(capture_error_mode="thread_local")
            body(cap.cuda_stream)
            g.capture_end()
        ex = int(g.raw_cuda_graph_exec())
        s = torch.cuda.Stream().cuda_stream
        for _ in range(5):
            _cuda.graph_launch(ex, s)
        torch.cuda.synchronize()
        drained, back = [], []
        for _ in range(100):
            torch.cuda.synchronize()
            t0 = time.perf_counter_ns()
            _cuda.graph_launch(ex, s)
            drained.append(time.perf_counter_ns() - t0)
        torch.cuda.synchronize()
        for _ in range(100):
            t0 = time.perf_counter_ns()
            _cuda.graph_launch(ex, s)
            back.append(time.perf_counter_ns() - t0)
        torch.cuda.synchronize()
        print(f"{name:22s} launch after drain median {statistics.median(drained) / 1e3:6.1f} us, "
              f"back to back median {statistics.median(back) / 1e3:6.1f} us")
    ev = _cuda.event_create()
    ts = []
    for _ in range(200):
        t0 = time.perf_counter_ns()
        _cuda.event_record(ev, s)
        ts.append(time.perf_counter_ns() - t0)
    print(f"event record (ctypes) median {statistics.median(ts) / 1e3:.2f} us")
    ts = []
    for _ in range(200):
        t0 = time.perf_counter_ns()
        _cuda.buffer_id(x.data_ptr())
        ts.append(time.perf_counter_ns() - t0)
    print(f"buffer id (ctypes) median {statistics.median(ts) / 1e3:.2f} us")


if __name__ == "__main__":
    main()
