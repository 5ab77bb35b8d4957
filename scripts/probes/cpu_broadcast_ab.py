"""Time per call of braid's CPU broadcast (direct API, one intra-op thread per rank), back to back
with the same tensor, the root taking turns between windows: what a tree's broadcast costs, to
compare trees in alternating runs (PYTHONPATH=<tree>/src).

    python3 scripts/probes/cpu_broadcast_ab.py [--nproc 2] [--sizes 262144,1048576,4194304,16777216] (bytes)

Prints one line: per size, the median over 7 windows of us per call (rank 0's clock).
"""
import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank: int, world: int, port: int, sizes: list[int], q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import braid
    dist.init_process_group("gloo", rank=rank, world_size=world)
    comm = braid.init()
    out = []
    for nbytes in sizes:
        x = torch.randn(nbytes // 4)
        times = []
        for i in range(7):
            root = i % world
            for _ in range(2):
                comm.broadcast(x, root)
            dist.barrier()
            iters = max(10, min(300, (32 << 20) // nbytes))
            t0 = time.perf_counter()
            for _ in range(iters):
                comm.broadcast(x, root)
            times.append((time.perf_counter() - t0) / iters * 1e6)
        out.append((nbytes >> 10, statistics.median(times)))
    if rank == 0:
        q.put(out)
    braid.close()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--sizes", default="262144,1048576,4194304,16777216")
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    q = mp.get_context("spawn").Queue()
    mp.spawn(worker, args=(a.nproc, port, [int(v) for v in a.sizes.split(",")], q), nprocs=a.nproc)
    print(" ".join(f"{kib}K {us:.0f}" for kib, us in q.get()))


if __name__ == "__main__":
    main()
