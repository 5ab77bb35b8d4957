"""Device probe: what a small braid call costs next to NCCL's own, and where the difference lives
(host enqueue time vs GPU time). Variants per size: NCCL on the default group, NCCL on braid's own
group (sync, and async + wait), and braid's call. Prints one line per (op, size, variant).

    python3 scripts/fastpath_probe.py --nproc 2 --sizes 64K,1M,4M
"""
import argparse
import os
import time

import torch
import torch.distributed as dist

from profile_call import spawn


def _time(fn, n):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / n * 1e6
    return host, wall


def worker(rank, world, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0",
                      TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    import braid
    from braid.bench import parse_size
    comm = braid.init()
    g = comm.nccl_group
    rows = []
    for size in args.sizes.split(","):
        nb = parse_size(size)
        x = torch.randn(nb // 2, dtype=torch.bfloat16, device="cuda")
        out = torch.empty(x.numel() // world, dtype=x.dtype, device="cuda")
        variants = {
            "all_reduce": {
                "nccl default group": lambda: dist.all_reduce(x),
                "nccl braid group": lambda: dist.all_reduce(x, group=g),
                "nccl group async+wait": lambda: dist.all_reduce(x, group=g, async_op=True).wait(),
                "braid": lambda: comm.all_reduce(x),
            },
            "reduce_scatter": {
                "nccl default group": lambda: dist.reduce_scatter_tensor(out, x),
                "nccl braid group": lambda: dist.reduce_scatter_tensor(out, x, group=g),
                "braid": lambda: comm.reduce_scatter_tensor(out, x),
            },
        }
        for op, vs in variants.items():
            for name, fn in vs.items():
                host, wall = _time(fn, args.iters)
                t = torch.tensor([host, wall], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=comm.gloo_group)
                rows.append((op, size, name, *t.tolist()))
    if rank == 0:
        print(f"{'op':<15}{'size':>6}  {'variant':<24}{'host us/call':>13}{'wall us/call':>13}")
        for op, size, name, host, wall in rows:
            print(f"{op:<15}{size:>6}  {name:<24}{host:>13.1f}{wall:>13.1f}", flush=True)
    braid.close()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--sizes", default="64K,1M,4M")
    ap.add_argument("--iters", type=int, default=300)
    spawn(worker, ap.parse_args())


if __name__ == "__main__":
    main()
