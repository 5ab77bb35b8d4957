"""Kept for a second look at CUDA graphs for repeated split calls (docs/design.md, not built yet).

Probe: can braid's per-call GPU work (stream memory operations on host-mapped counters, raw
cuMemcpyAsync, torch adds, two streams forked and joined, timing events) be captured into a CUDA
graph and replayed? One process, GPU 0 (and GPU 1 for a peer copy when present)."""
import mmap
import sys
import time

import torch

sys.path.insert(0, "src")
from braid.lanes import _cuda  # noqa: E402


def main():
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    mm = mmap.mmap(-1, 4096)
    buf = (ctypes_c_uint32 * 1024).from_buffer(mm)
    host = ctypes_addressof(buf)
    dptr = _cuda.host_register(host, 4096)
    n = 64 << 20
    x = torch.randn(n // 4, device=dev)
    y = torch.empty_like(x)
    z = torch.empty_like(x)
    peer = None
    if torch.cuda.device_count() > 1:
        peer = torch.empty_like(x, device="cuda:1")
    s = torch.cuda.Stream()
    s2 = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    e0 = torch.cuda.Event(enable_timing=True, external=True)
    e1 = torch.cuda.Event(enable_timing=True, external=True)
    fork, join = torch.cuda.Event(), torch.cuda.Event()
    results = {}
    try:
        with torch.cuda.graph(g, stream=s):
            cs = torch.cuda.current_stream()
            e0.record(cs)
            _cuda.wait_value(cs.cuda_stream, dptr, 1)                 # wait host flag
            _cuda.memcpy_async(y.data_ptr(), x.data_ptr(), n, cs.cuda_stream)
            fork.record(cs)
            s2.wait_event(fork)
            with torch.cuda.stream(s2):
                torch.add(x, y, out=z)
                if peer is not None:
                    _cuda.memcpy_async(peer.data_ptr(), z.data_ptr(), n, s2.cuda_stream)
                _cuda.write_value(s2.cuda_stream, dptr + 4, 7)
            join.record(s2)
            cs.wait_event(join)
            e1.record(cs)
        results["capture"] = "ok"
    except Exception as exc:  # noqa: BLE001
        print("capture failed:", type(exc).__name__, exc)
        return
    buf[0] = 0
    buf[1] = 0
    g.replay()
    time.sleep(0.2)
    results["blocked while flag 0"] = not e1.query()
    buf[0] = 1
    torch.cuda.synchronize()
    results["write seen"] = buf[1] == 7
    results["y == x"] = torch.equal(y, x)
    results["z == 2x"] = torch.equal(z, x + x)
    if peer is not None:
        results["peer == z"] = torch.equal(peer.cpu(), z.cpu())
    try:
        results["graph time us"] = round(e0.elapsed_time(e1) * 1000, 1)
    except Exception as exc:  # noqa: BLE001
        results["graph time us"] = f"failed: {exc}"
    # replay again: the flag stays 1, so it runs through
    buf[1] = 0
    x.mul_(2)
    g.replay()
    torch.cuda.synchronize()
    results["second replay ok"] = buf[1] == 7 and torch.equal(z, x + x)
    # host cost of a replay
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        g.replay()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    results["replay host us"] = round((t1 - t0) / 50 * 1e6, 1)
    for k, v in results.items():
        print(f"{k}: {v}")
    _cuda.host_unregister(host)


import ctypes  # noqa: E402
ctypes_c_uint32 = ctypes.c_uint32
ctypes_addressof = ctypes.addressof

if __name__ == "__main__":
    main()
