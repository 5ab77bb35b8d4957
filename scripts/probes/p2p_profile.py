"""Host time of a repeated send/recv on the copy engines, braid against NCCL's own call, each
side on its own (rank 0 sends, rank 1 receives), 2 ranks sharing one GPU; then where braid's
time goes (cProfile of a second loop, its own overhead included).

    PYTHONPATH=src python3 scripts/probes/p2p_profile.py [--nbytes 1048576] [--calls 300]
"""
import argparse
import cProfile
import io
import os
import pstats
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, world, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), BRAID_SHARED_GPU="1")
    import braid
    braid.share_gpu(rank)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    comm = braid.init()
    n = args.nbytes // 2
    torch.manual_seed(0)                      # the same x on both ranks: rank 1 checks what it got
    x = torch.randn(n, device="cuda").to(torch.bfloat16)
    out = torch.empty_like(x)
    mode = args.mode

    def b():
        if mode == "sync":
            comm.send(x, 1) if rank == 0 else comm.recv(out, 0)
        else:
            (comm.send(x, 1, async_op=True) if rank == 0 else comm.recv(out, 0, async_op=True)).wait()

    def nc():
        if mode == "sync":
            dist.send(x, 1) if rank == 0 else dist.recv(out, 0)
        else:
            (dist.isend(x, 1) if rank == 0 else dist.irecv(out, 0)).wait()

    def window(fn):
        dist.barrier()
        ts = []
        for _ in range(args.calls):
            t0 = time.perf_counter_ns()
            fn()
            ts.append(time.perf_counter_ns() - t0)
        torch.cuda.synchronize()
        return statistics.median(ts) / 1e3

    with comm.fixed_shares({"ce": 1.0}):
        for _ in range(10):
            b()
            nc()
        torch.cuda.synchronize()
        got = {"braid": [], "nccl": []}
        for _ in range(args.windows):
            got["braid"].append(window(b))
            got["nccl"].append(window(nc))
        ok = rank == 0 or torch.equal(out, x)
        side = "send" if rank == 0 else "recv"
        med = {k: statistics.median(v) for k, v in got.items()}
        print(f"rank {rank} ({side}, {mode}, {args.nbytes} B): host per call braid {med['braid']:.1f} us, "
              f"NCCL {med['nccl']:.1f} us, ratio {med['braid'] / med['nccl']:.2f} (windows: braid "
              f"{[round(v, 1) for v in got['braid']]}, nccl {[round(v, 1) for v in got['nccl']]}) ok={ok}",
              flush=True)
        st = comm._prepared.stats
        print(f"rank {rank}: p2p built {st['p2p_built']}, hits {st['p2p_hits']}", flush=True)
        prof = cProfile.Profile()
        dist.barrier()
        prof.enable()
        for _ in range(args.calls):
            b()
        prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
        print(f"--- rank {rank} profile ({args.calls} calls)\n" + "\n".join(s.getvalue().splitlines()[6:30]), flush=True)
    dist.barrier()
    braid.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--nbytes", type=int, default=1 << 20)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--windows", type=int, default=5)
    ap.add_argument("--mode", choices=("sync", "async"), default="sync")
    a = ap.parse_args()
    mp.spawn(worker, args=(2, 29400 + os.getpid() % 500, a), nprocs=2)
