"""Time per call of braid's CPU collectives through the node segment (direct API, one intra-op
thread per rank), back to back with the same tensors: what a small call costs on the host.

    python3 scripts/probes/cpu_call_cost.py [--nproc 2] [--sizes 1024,16384,262144] (float32 elements)
"""
import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank: int, world: int, port: int, sizes: list[int]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import braid
    dist.init_process_group("gloo", rank=rank, world_size=world)
    comm = braid.init()
    for n in sizes:
        x, y, z = torch.randn(n), torch.empty(n // world), torch.empty(n // world * world)
        ops = {"all_reduce": lambda: comm.all_reduce(x),
               "reduce_scatter": lambda: comm.reduce_scatter_tensor(y, x[: n // world * world]),
               "all_gather": lambda: comm.all_gather_into_tensor(z, y),
               "broadcast": lambda: comm.broadcast(x, 0)}
        cells = []
        for name, fn in ops.items():
            windows = []
            for _ in range(5):
                for _ in range(30):
                    fn()
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(500):
                    fn()
                windows.append((time.perf_counter() - t0) / 500 * 1e6)
            cells.append(f"{name} {statistics.median(windows):.1f}")
        if rank == 0:
            print(f"{world} ranks, {n * 4} B: us per call: " + ", ".join(cells), flush=True)
    braid.close()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--sizes", default="1024,16384,262144")
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(a.nproc, port, [int(v) for v in a.sizes.split(",")]), nprocs=a.nproc)


if __name__ == "__main__":
    main()
