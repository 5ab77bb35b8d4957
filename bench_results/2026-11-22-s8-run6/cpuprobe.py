"""Probe: does the host cost of CUDA calls depend on which vCPU the process runs on (and which GPU
it drives)? One process; for each vCPU (pinned with sched_setaffinity) and GPU: host us per
event record, per small kernel launch (torch.add on 1 KiB), and per stream write into host-mapped
memory, medians of 5 runs of 300 calls."""
import ctypes, mmap, os, statistics, sys, time
import torch
sys.path.insert(0, "src")
from braid.lanes import _cuda

ngpu = torch.cuda.device_count()
mm = mmap.mmap(-1, 4096)
buf = (ctypes.c_uint32 * 1024).from_buffer(mm)
host = ctypes.addressof(buf)
state = {}
for g in range(ngpu):
    torch.cuda.set_device(g)
    s = torch.cuda.Stream()
    x = torch.ones(256, device=f"cuda:{g}")
    state[g] = (s, x, torch.cuda.Event())
    torch.cuda.synchronize()
torch.cuda.set_device(0)
dptr = _cuda.host_register(host, 4096)

def per_call(fn, n=300):
    out = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(out)

cpus = sorted(os.sched_getaffinity(0))
print("cpus", len(cpus), "gpus", ngpu, flush=True)
rows = []
for cpu in cpus:
    os.sched_setaffinity(0, {cpu})
    cells = []
    for g in range(ngpu):
        torch.cuda.set_device(g)
        s, x, ev = state[g]
        with torch.cuda.stream(s):
            rec = per_call(lambda: ev.record(s))
            add = per_call(lambda: x.add_(1.0))
            wv = per_call(lambda: _cuda.write_value(s.cuda_stream, dptr, 1))
        torch.cuda.synchronize()
        cells.append((rec, add, wv))
    rows.append((cpu, cells))
    print(f"cpu {cpu:3d}: " + "  ".join(f"g{g} rec {c[0]:5.1f} add {c[1]:5.1f} wv {c[2]:5.1f}" for g, c in enumerate(cells)), flush=True)
_cuda.host_unregister(host)
