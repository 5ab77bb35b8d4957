"""Where an uneven all_to_all (one MoE layer: dispatch + combine) spends its host time in braid
against NCCL's own call: alternating windows of host time (to issue) and wall time (until the GPU
is done) per layer, after a calibration of all_to_all_single as `braid bench` makes it, then a
cProfile of braid's layers on rank 0.

    python3 scripts/probes/moe_host_profile.py [--nproc 2] [--sizes 1,4,16] [--profile-mb 4]
"""
import argparse
import cProfile
import io
import os
import pstats
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, "src")


def worker(rank, world, port, sizes, profile_mb, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    import braid
    from braid import calibrate as cal
    from braid.workloads import make
    comm = braid.init()
    cal.calibrate(comm, ops=["all_to_all_single"], save_to_disk=False)

    def window(fn, n=100):
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        host = (time.perf_counter() - t0) / n * 1e6
        torch.cuda.synchronize()
        return host, (time.perf_counter() - t0) / n * 1e6

    for mb in sizes:
        wl = make(comm, "moe", mb << 20, torch.bfloat16)
        for _ in range(30):
            wl.braid()
            wl.baseline()
        got = {"braid": [], "nccl": []}
        for k in range(6):
            for name in (("nccl", "braid") if k % 2 == 0 else ("braid", "nccl")):
                got[name].append(window(wl.braid if name == "braid" else wl.baseline))
        if rank == 0:
            line = []
            for name, ws in got.items():
                line.append(f"{name} host {statistics.median(h for h, _ in ws):.0f} us wall "
                            f"{statistics.median(w for _, w in ws):.0f} us")
            print(f"moe {mb} MiB per layer: " + ", ".join(line) + f" | small_run {comm.uneven.small_run}"
                  f" last {comm.last_call}", flush=True)
        if mb == profile_mb:
            torch.cuda.synchronize()
            dist.barrier()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                wl.braid()
            prof.disable()
            torch.cuda.synchronize()
            if rank == 0:
                buf = io.StringIO()
                st = pstats.Stats(prof, stream=buf)
                st.sort_stats("tottime").print_stats(25)
                st.sort_stats("cumulative").print_stats(30)
                with open(os.path.join(out, "moe_host_profile.txt"), "w") as f:
                    f.write(buf.getvalue())
                print(buf.getvalue()[:6000], flush=True)
    braid.close()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--sizes", default="1,4,16")
    ap.add_argument("--profile-mb", type=int, default=4)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sizes = [int(x) for x in a.sizes.split(",")]
    mp.spawn(worker, args=(a.nproc, port, sizes, a.profile_mb, a.out), nprocs=a.nproc)


if __name__ == "__main__":
    main()
