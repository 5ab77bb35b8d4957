"""Time the single-GPU test's pieces one by one (s9-run1: was the test slow or hung? It hung; see hang_before_fix_seg.log). Run from the repo root."""
import sys, time
sys.path.insert(0, "src"); sys.path.insert(0, "tests/gpu")
import torch
t0 = time.perf_counter(); torch.zeros(1, device="cuda"); torch.cuda.synchronize()
print(f"cuda init {time.perf_counter()-t0:.2f} s", flush=True)
import test_gpu_single as T
for dtype, op in [(torch.float32, "sum"), (torch.float32, "sum"), (torch.bfloat16, "product"), (torch.int8, "max")]:
    t0 = time.perf_counter()
    T.test_reduction_kernels_match_float64(dtype, op, 4)
    print(f"reduction {dtype} {op}: {time.perf_counter()-t0:.3f} s", flush=True)
t0 = time.perf_counter(); x = T._inputs(4, 4103, torch.float32, "sum", 1); print(f"_inputs {time.perf_counter()-t0:.3f} s", flush=True)
t0 = time.perf_counter(); T._reference(x, "product", 0.3); print(f"_reference {time.perf_counter()-t0:.3f} s", flush=True)
