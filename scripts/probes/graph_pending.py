"""Does cuGraphLaunch hold the host while an earlier launch is still waiting on the GPU?

A graph waits on a flag in pinned host memory (a stream memory operation, as braid's copy-engine
programs wait for a peer), then copies 1 MiB. With its first launch pending (flag unset), the host
times: a second launch of the same graph exec on the same stream, on another stream, and a launch
of another graph holding the same nodes; a thread sets the flag after HOLD_MS. A launch that
returns only after HOLD_MS waited for the pending one. One process, one GPU.

    PYTHONPATH=src python3 scripts/probes/graph_pending.py
"""
import threading
import time

import torch

from braid.lanes import _cuda

HOLD_MS = 200


def main():
    torch.cuda.set_device(0)
    flag = torch.zeros(16, dtype=torch.int32, pin_memory=True)
    x = torch.randn(1 << 18, device="cuda")
    y = torch.empty_like(x)
    cap = torch.cuda.Stream()

    def make():
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(cap):
            g.capture_begin(capture_error_mode="thread_local")
            _cuda.wait_value(cap.cuda_stream, flag.data_ptr(), 1)
            _cuda.memcpy_async(y.data_ptr(), x.data_ptr(), x.numel() * 4, cap.cuda_stream)
            g.capture_end()
        return g, int(g.raw_cuda_graph_exec())

    g1, e1 = make()
    g2, e2 = make()
    s1, s2 = torch.cuda.Stream().cuda_stream, torch.cuda.Stream().cuda_stream
    flag[0] = 1
    for e in (e1, e2):          # uploaded and run once with the flag set
        _cuda.graph_launch(e, s1)
    torch.cuda.synchronize()
    cases = {"same exec, same stream": (e1, s1), "same exec, other stream": (e1, s2), "other exec, other stream": (e2, s2)}
    for name, (e, s) in cases.items():
        flag[0] = 0
        torch.cuda.synchronize()
        _cuda.graph_launch(e1, s1)      # pending: waits for the flag
        t = threading.Timer(HOLD_MS / 1e3, lambda: flag.__setitem__(0, 1))
        t0 = time.perf_counter()
        t.start()
        _cuda.graph_launch(e, s)
        dt = (time.perf_counter() - t0) * 1e3
        t.join()
        torch.cuda.synchronize()
        print(f"{name:26s}: the launch returned after {dt:8.3f} ms (the first launch was released at {HOLD_MS} ms)",
              flush=True)


if __name__ == "__main__":
    main()
