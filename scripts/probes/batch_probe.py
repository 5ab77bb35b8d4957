"""Kept because `braid bench` has no batch_isend_irecv mode: times braid's routed batches against torch's.

Device probe: routed send/recv batches (braid.batch_isend_irecv) against torch's
batch_isend_irecv on NCCL, on the bench's hot-fraction pattern: every rank sends a fraction h of
its bytes to the last rank and the rest evenly to the others, each pair's bytes in 2 tensors cut
from one send buffer (and 2 views of one receive buffer), the layout braid routes without copies.

    python3 scripts/probes/batch_probe.py --nproc 4 --sizes 64M,256M,1G --hot 0.7,1.0
Prints one row per (h, size): braid us, NCCL us, ratio, braid's lanes.
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
    from braid.bench import parse_size
    from braid.calibrate import time_call
    from braid.planner.traffic import hot_matrix
    rows = []
    for h in [float(x) for x in args.hot.split(",")]:
        for size in args.sizes.split(","):
            n = parse_size(size) // 2
            m = hot_matrix(world, n, h)              # elements, bf16
            # sends cut from one buffer by destination, receives into views of one buffer by
            # source (what braid can route without copies), each pair's bytes in 2 tensors
            sbuf = torch.randn(sum(m[rank][d] for d in range(world) if d != rank), device="cuda").to(torch.bfloat16)
            rbuf = torch.empty(sum(m[s][rank] for s in range(world) if s != rank), dtype=torch.bfloat16, device="cuda")
            sends, recvs, at, bt = [], [], 0, 0
            for d in range(world):
                k = m[rank][d] if d != rank else 0
                if k:
                    sends += [(sbuf[at: at + k // 2], d), (sbuf[at + k // 2: at + k], d)]
                    at += k
            for s in range(world):
                k = m[s][rank] if s != rank else 0
                if k:
                    recvs += [(rbuf[bt: bt + k // 2], s), (rbuf[bt + k // 2: bt + k], s)]
                    bt += k

            def ops():
                return ([dist.P2POp(dist.isend, t, p) for t, p in sends]
                        + [dist.P2POp(dist.irecv, t, p) for t, p in recvs])

            def run_braid():
                for r in comm.batch_isend_irecv(ops()):
                    r.wait()

            def run_nccl():
                for r in dist.batch_isend_irecv(ops()):
                    r.wait()
            tb = min(time_call(comm, run_braid, 10, 3) for _ in range(2))
            tn = min(time_call(comm, run_nccl, 10, 3) for _ in range(2))
            h_ = comm.last_handle
            lanes = dict(h_.plan.shares) if h_ is not None and h_.plan is not None else {"nccl": 1.0}
            rows.append(f"h {h:.1f} {size:>5}: braid {tb:8.0f} us  NCCL {tn:8.0f} us  ratio {tn / tb:5.2f}  "
                        + " ".join(f"{k}={v:.2f}" for k, v in lanes.items()))
    if rank == 0:
        print("\n".join(rows), flush=True)
    braid.close()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--sizes", default="64M,256M,1G")
    ap.add_argument("--hot", default="0.7,1.0")
    spawn(worker, ap.parse_args())


if __name__ == "__main__":
    main()
