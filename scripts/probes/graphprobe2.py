"""Kept beside graphprobe.py: what a CUDA graph replay costs on the host, against posting directly.

Probe: host cost of replaying a CUDA graph by content (torch add / D2D memcpy / stream memory
operations on host-mapped memory / peer memcpy), 50 replays back to back, host us per replay and
wall us per replay."""
import ctypes, mmap, sys, time
import torch
sys.path.insert(0, "src")
from braid.lanes import _cuda

def main():
    torch.cuda.set_device(0)
    mm = mmap.mmap(-1, 4096)
    buf = (ctypes.c_uint32 * 1024).from_buffer(mm)
    host = ctypes.addressof(buf)
    dptr = _cuda.host_register(host, 4096)
    buf[0] = 1
    for mb in (1, 64):
        n = mb << 20
        x = torch.randn(n // 4, device="cuda"); y = torch.empty_like(x); z = torch.empty_like(x)
        peer = torch.empty(n // 4, device="cuda:1")
        def content(kind, s):
            if kind in ("add", "all"):
                torch.add(x, x, out=z)
            if kind in ("memcpy", "all"):
                _cuda.memcpy_async(y.data_ptr(), x.data_ptr(), n, s)
            if kind in ("memop", "all"):
                for i in range(8):
                    _cuda.wait_value(s, dptr, 1); _cuda.write_value(s, dptr + 4, i)
            if kind in ("peer", "all"):
                _cuda.memcpy_async(peer.data_ptr(), x.data_ptr(), n, s)
        for kind in ("add", "memcpy", "memop", "peer", "all"):
            g = torch.cuda.CUDAGraph()
            cap = torch.cuda.Stream()
            with torch.cuda.graph(g, stream=cap):
                content(kind, torch.cuda.current_stream().cuda_stream)
            g.replay(); torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(50):
                g.replay()
            t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
            # the same content posted directly (eager)
            s = torch.cuda.current_stream().cuda_stream
            torch.cuda.synchronize()
            e0 = time.perf_counter()
            for _ in range(50):
                content(kind, s)
            e1 = time.perf_counter(); torch.cuda.synchronize(); e2 = time.perf_counter()
            print(f"{mb} MiB {kind:6s}: graph host {(t1-t0)/50*1e6:7.1f} wall {(t2-t0)/50*1e6:7.1f} | eager host "
                  f"{(e1-e0)/50*1e6:7.1f} wall {(e2-e0)/50*1e6:7.1f} us", flush=True)
    _cuda.host_unregister(host)

main()
