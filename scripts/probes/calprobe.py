"""Kept to check on a new machine that the calibration's timing windows match the bench's.

Device probe: a lane's time per call as the calibration times it (few calls, one warm-up)
against the bench's way (20 calls after 5 warm-up), for the copy engines and NCCL, 2 GPUs.
On 4 x H200 (2026-11-22) the short windows added ~100-180 us a call to the copy engines (the
host-side start of each window is exposed), which kept NCCL at 256 MiB where the copy engines are
faster; the calibration has timed its points like the bench since.

    python3 scripts/probes/calprobe.py --nproc 2
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # profile_call.py
from profile_call import init_rank, spawn  # noqa: E402


def worker(rank, world, port, args):
    braid, comm = init_rank(rank, world, port)
    from braid import calibrate as cal
    from braid.workloads import make
    out = []
    for op in ("reduce_scatter", "all_reduce"):
        for n in (64 << 20, 512 << 20, 256 << 20):
            load = make(comm, op, n, torch.bfloat16)
            for lane in ("ce", "nccl"):
                with comm.fixed_shares({lane: 1.0}):
                    a = [round(cal.time_call(comm, load.braid, 5)) for _ in range(3)]
                    b = [round(cal.time_call(comm, load.braid, 20, 5)) for _ in range(2)]
                    c = [round(cal.time_call(comm, load.braid, 5, 3)) for _ in range(2)]
                out.append(f"{op} {n >> 20}M {lane}: iters5/warm1 {a}  iters20/warm5 {b}  iters5/warm3 {c}")
            del load
    if rank == 0:
        print("\n".join(out), flush=True)
    braid.close()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    spawn(worker, ap.parse_args())


if __name__ == "__main__":
    main()
