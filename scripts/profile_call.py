"""Device probe: where one braid call's time goes on the host (CPU time per call, a cProfile of
rank 0) and on the GPU (calls enqueued back to back, timed with events).

    python3 scripts/profile_call.py --nproc 2 --op all_reduce --size 16M --shares ce=1
    python3 scripts/profile_call.py --nproc 4 --op moe --size 64M --shares auto
    python3 scripts/profile_call.py --nproc 4 --op all_to_all_single --hot 0.7 --size 1M --shares auto
"""
import argparse
import cProfile
import io
import os
import pstats
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def init_rank(rank, world, port, env=()):
    """One rank of a local NCCL world with braid on top: (the braid module, its communicator).
    `env`: NAME=VALUE settings for this rank, set before braid starts."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0",
                      TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    for kv in env:
        k, v = kv.split("=", 1)
        os.environ[k] = v
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    import braid
    return braid, braid.init()


def setup(rank, world, port, args, env=()):
    """One rank: NCCL world, braid, the op's workload and the shares to hold (None: braid's own)."""
    braid, comm = init_rank(rank, world, port, env)
    from braid.bench import parse_shares, parse_size
    from braid.workloads import make
    wl = make(comm, args.op, parse_size(args.size), torch.bfloat16, hot_fraction=args.hot)
    return braid, comm, wl, None if args.shares == "auto" else parse_shares(args.shares)


def warm(wl, calls: int = 5) -> None:
    for _ in range(calls):
        wl.braid()
    torch.cuda.synchronize()
    dist.barrier()


def baseline_us(wl, n: int) -> float:
    """Wall time per call of the workload's baseline (NCCL), n calls back to back."""
    t0 = time.perf_counter()
    for _ in range(n):
        wl.baseline()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def worker(rank, world, port, args):
    braid, comm, wl, shares = setup(rank, world, port, args)
    with comm.fixed_shares(shares):
        warm(wl)
        n = 30
        t0 = time.perf_counter()
        for _ in range(n):
            wl.braid()
        cpu = (time.perf_counter() - t0) / n * 1e6
        torch.cuda.synchronize()
        gpu_total = (time.perf_counter() - t0) / n * 1e6
        dist.barrier()
        prof = cProfile.Profile() if rank == 0 else None
        if prof:
            prof.enable()
        for _ in range(n):
            wl.braid()
        if prof:
            prof.disable()
        torch.cuda.synchronize()
        dist.barrier()
        nccl = baseline_us(wl, n)
    if rank == 0:
        print(f"{args.op} {args.size} {shares}: host time per call {cpu:.0f} us, wall per call {gpu_total:.0f} us, "
              f"nccl wall per call {nccl:.0f} us", flush=True)
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
        print(s.getvalue()[-4500:], flush=True)
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(35)
        print(s.getvalue()[-7000:], flush=True)
    braid.close()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--op", default="all_reduce")
    ap.add_argument("--size", default="16M")
    ap.add_argument("--shares", default="ce=1", help="fixed shares, or 'auto' (braid's own choice)")
    ap.add_argument("--hot", type=float, default=None, help="all_to_all_single: this fraction of every rank's bytes to the last rank")
    spawn(worker, ap.parse_args())


def spawn(worker, args) -> None:
    """worker(rank, world, port, args) in args.nproc processes on a free local port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args.nproc, port, args), nprocs=args.nproc)


if __name__ == "__main__":
    main()
