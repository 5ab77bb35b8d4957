"""Host time per call of torch.distributed's collectives through the `braid` backend against the
same calls on an NCCL group, in alternating windows: what a CPU-bound job (FSDP2's hooks) pays per
call for going through braid. With BRAID_LANES=nccl braid forwards every call to NCCL whole, so the
difference is the backend's own cost.

    torchrun --nproc-per-node 2 scripts/probes/backend_host_cost.py [--mib 1] [--calls 200] [--windows 7]
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import braid  # noqa: F401  (registers the backend)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=float, default=1.0, help="all_gather input / reduce_scatter output, MiB")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--windows", type=int, default=7)
    a = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("braid", device_id=dev)
    groups = {"braid": dist.group.WORLD, "nccl": dist.new_group(backend="nccl")}
    n = int(a.mib * (1 << 20)) // 2
    x = torch.randn(n, dtype=torch.bfloat16, device=dev)
    big = torch.empty(n * world, dtype=torch.bfloat16, device=dev)
    avg = dist.ReduceOp.AVG
    calls = {
        "all_gather sync": lambda g: dist.all_gather_into_tensor(big, x, group=g),
        "all_gather async+wait": lambda g: dist.all_gather_into_tensor(big, x, group=g, async_op=True).wait(),
        "reduce_scatter avg sync": lambda g: dist.reduce_scatter_tensor(x, big, op=avg, group=g),
        "all_reduce async+wait": lambda g: dist.all_reduce(x, group=g, async_op=True).wait(),
    }
    for name, fn in calls.items():
        host = {k: [] for k in groups}
        for w in range(a.windows):
            for k in (("nccl", "braid") if w % 2 == 0 else ("braid", "nccl")):
                g = groups[k]
                for _ in range(5):
                    fn(g)
                torch.cuda.synchronize()
                dist.barrier(group=groups["nccl"])
                t0 = time.perf_counter()
                for _ in range(a.calls):
                    fn(g)
                host[k].append((time.perf_counter() - t0) * 1e6 / a.calls)
                torch.cuda.synchronize()
        med = {k: statistics.median(v) for k, v in host.items()}
        t = torch.tensor([med["braid"], med["nccl"]], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=groups["nccl"])
        if rank == 0:
            print(f"{name:26s} {a.mib:g} MiB: host us per call braid {t[0]:.1f}  nccl {t[1]:.1f}  "
                  f"(+{t[0] - t[1]:.1f})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
