"""Kept to re-measure the tapered chunk ends (BRAID_CE_TAPER) against even pieces on a new machine.

Probe: the copy engines' pipelined reduction with and without the tapered tail
(BRAID_CE_TAPER), against NCCL, in alternating windows in one process (the VM's host speed
changes between process starts, not within one). Fixed shares per case; bf16. Per variant: the
median over REPS windows of the slowest rank's wall time per call (20 calls a window). Also checks
that both cuts give bitwise the same result (the reduction order per element does not change)."""
import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, "src")
REPS, CALLS = 5, 20


def window(fn) -> float:
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(CALLS):
        fn()
    torch.cuda.synchronize()
    t = torch.tensor([(time.perf_counter() - t0) / CALLS * 1e6], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def worker(rank, world, port, cases):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    import braid
    from braid import envs
    from braid.bench import parse_shares, parse_size
    comm = braid.init()
    for case in cases:
        op, size, shares = case.split(":")
        n = parse_size(size) // 2
        shares = parse_shares(shares)
        g = torch.Generator(device="cuda").manual_seed(1234 + rank)
        x = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
        if op == "reduce_scatter":
            out = torch.empty(n // world, dtype=torch.bfloat16, device="cuda")
            ref = torch.empty_like(out)
            run_b = lambda: comm.reduce_scatter_tensor(out, x)          # noqa: E731
            run_n = lambda: dist.reduce_scatter_tensor(ref, x)          # noqa: E731
        else:
            out = x.clone()
            ref = x.clone()
            run_b = lambda: comm.all_reduce(out)                         # noqa: E731
            run_n = lambda: dist.all_reduce(ref)                         # noqa: E731
        variants = {"nccl": (run_n, None), "flat": (run_b, 0), "taper": (run_b, 1)}
        res = {k: [] for k in variants}
        got = {}
        with comm.fixed_shares(shares):
            for rep in range(REPS + 1):
                for name, (fn, tail) in variants.items():
                    ctx = envs.override(BRAID_CE_TAPER=tail) if tail is not None else None
                    if ctx:
                        ctx.__enter__()
                    try:
                        if op == "all_reduce":
                            out.copy_(x)
                            fn()
                            torch.cuda.synchronize()
                            if name != "nccl":
                                got[name] = out.clone()
                        t = window(fn)
                        if op == "reduce_scatter" and name != "nccl":
                            got[name] = out.clone()
                    finally:
                        if ctx:
                            ctx.__exit__(None, None, None)
                    if rep:                       # rep 0 warms every variant
                        res[name].append(t)
        same = torch.equal(got["flat"], got["taper"])
        med = {k: statistics.median(v) for k, v in res.items()}
        if rank == 0:
            print(f"{op} {size} w={world} {shares}: nccl {med['nccl']:.0f} us, flat {med['flat']:.0f} "
                  f"({med['nccl'] / med['flat']:.3f}), taper {med['taper']:.0f} ({med['nccl'] / med['taper']:.3f}); "
                  f"flat == taper bitwise: {same}; windows {dict((k, [round(t) for t in v]) for k, v in res.items())}",
                  flush=True)
        x = out = ref = got = None     # free the buffers before the next case (the lambdas hold names, not tensors)
        torch.cuda.empty_cache()
    braid.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("cases", nargs="+", help="op:size:shares, e.g. reduce_scatter:1G:ce=0.92,host=0.08")
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(a.nproc, port, a.cases), nprocs=a.nproc)
