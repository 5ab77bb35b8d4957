"""The floor of a call that agrees with its peers on the host and then launches one CUDA graph,
ranks sharing one GPU, in the loop prepared_profile.py times (`--sync-every 1`: the caller's
stream drained after every call, no barrier between calls).

Each rank, in alternating windows of one run:
  launch        one graph replay (a copy of --nbytes inside the GPU), no round
  round         a round of one word through shared memory (each rank writes its call number
                and spins until every peer's has reached it), no GPU work
  round+launch  the round, then the replay: what a replayed split call cannot go below
  round+memop   the round, then the replay of a graph of one stream memory write to pinned
                host memory (no copy, no kernel: the launch's host cost and the round's wait
                without the GPU's time-slicing of the processes' copies)

The wait for the last peer is in every kind with a round: under this loop the ranks leave
their synchronize at different times (the GPU time-slices between the processes), and a call
that agrees on the host waits for that; NCCL's call does not wait on the host at all.

    PYTHONPATH=src python3 scripts/probes/round_floor.py [--nproc 2] [--nbytes 4194304]
"""
import argparse
import statistics
import time
from multiprocessing import shared_memory

import numpy as np
import torch
import torch.multiprocessing as mp


def worker(rank, world, name, args):
    torch.cuda.set_device(0)
    shm = shared_memory.SharedMemory(name=name)
    ctr = np.ndarray((world * 16,), dtype=np.uint32, buffer=shm.buf)   # one counter per 64 bytes
    me = rank * 16
    peers = [r * 16 for r in range(world) if r != rank]
    x = torch.randn(args.nbytes // 4, device="cuda")
    y = torch.empty_like(x)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        y.copy_(x)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=side):
            y.copy_(x)
    from braid.lanes import _cuda
    flag = torch.zeros(16, dtype=torch.int32, pin_memory=True)
    gm = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        with torch.cuda.graph(gm, stream=side):
            _cuda.write_value(side.cuda_stream, flag.data_ptr(), 1)
    torch.cuda.synchronize()
    seq = [0]

    def round_():
        seq[0] += 1
        s = seq[0]
        ctr[me] = s
        for p in peers:
            while int(ctr[p]) < s:
                pass

    kinds = {"launch": g.replay, "round": round_, "round+launch": lambda: (round_(), g.replay()),
             "round+memop": lambda: (round_(), gm.replay())}
    res = {k: [] for k in kinds}
    for _ in range(20):                 # warm
        for f in kinds.values():
            f()
    torch.cuda.synchronize()
    for _ in range(args.windows):
        for k, f in kinds.items():
            round_()                    # the window starts together on every rank
            ts = []
            for _ in range(args.calls):
                t0 = time.perf_counter_ns()
                f()
                ts.append(time.perf_counter_ns() - t0)
                torch.cuda.synchronize()
            res[k].append(statistics.median(ts) / 1e3)
    torch.cuda.synchronize()
    if rank == 0:
        print(f"{world} ranks sharing one GPU, {args.nbytes} B copy, synchronize after every call; "
              f"per window medians (us), rank 0:")
        for k, v in res.items():
            print(f"  {k:13s} median {statistics.median(v):6.1f}  windows {' '.join(f'{t:.1f}' for t in v)}")
    round_()
    shm.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--nbytes", type=int, default=4 << 20)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--windows", type=int, default=5)
    a = ap.parse_args()
    shm = shared_memory.SharedMemory(create=True, size=64 * a.nproc)
    try:
        np.ndarray((a.nproc * 16,), dtype=np.uint32, buffer=shm.buf)[:] = 0
        mp.spawn(worker, args=(a.nproc, shm.name, a), nprocs=a.nproc)
    finally:
        shm.close()
        shm.unlink()


if __name__ == "__main__":
    main()
