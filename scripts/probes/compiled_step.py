"""torch.compile(mode="reduce-overhead") of a step with a functional all_reduce, on braid's backend
(under chosen lane sets) or on NCCL's, 2 ranks (sharing the GPU where there is one). Prints per
lane set whether every call was right and torch's CUDA graphs took the step, or the error.

    python3 scripts/probes/compiled_step.py --backend braid --shares ce=1 ce=0.5,host=0.5 whole
    python3 scripts/probes/compiled_step.py --backend nccl
"""
from __future__ import annotations

import argparse
import contextlib
import os
import socket

import torch
import torch.multiprocessing as mp


def _shares(text: str):
    if text in ("model", "whole"):
        return text
    return {k: float(v) for k, v in (p.split("=") for p in text.split(","))}


def _rank(rank: int, world: int, port: int, backend: str, sets: list[str], n: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), BRAID_MIN_SPLIT_KB="1")
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc
    from torch._dynamo.utils import counters
    import braid  # noqa: F401  (registers the backend)
    from braid.bench.config import placement
    gpu, env = placement(rank, world, torch.cuda.device_count())
    os.environ.update(env)
    torch.cuda.set_device(gpu)
    dev = torch.device("cuda", gpu)
    dist.init_process_group(backend, rank=rank, world_size=world)
    pg = dist.distributed_c10d._get_default_group()
    dist.all_reduce(torch.ones(4, device=dev))          # braid's communicator made
    comm = getattr(pg, "_comm", None)

    def step(x):
        return fc.all_reduce(x * 2, "sum", dist.group.WORLD) + 1
    for text in (sets if comm is not None else ["nccl"]):
        torch._dynamo.reset()
        counters.clear()
        f = torch.compile(step, mode="reduce-overhead")
        x = torch.empty(n, device=dev)
        sh = _shares(text) if comm is not None else "model"
        ctx = (comm.fixed_shares({"nccl": 1.0} if sh == "whole" else sh, op="all_reduce")
               if comm is not None and sh != "model" else contextlib.nullcontext())
        try:
            with ctx:
                for i in range(6):
                    g = [torch.Generator().manual_seed(100 * i + r) for r in range(world)]
                    xs = [torch.randn(n, generator=gg) for gg in g]
                    x.copy_(xs[rank].to(dev))
                    got = f(x).clone()
                    want = (2 * sum(xs) + 1).to(dev)
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            skips = dict(counters["inductor"]).get("cudagraph_skips", 0)
            what = f"right, {'SKIPPED by cudagraphs' if skips else 'captured by cudagraphs'}"
            if comm is not None:
                what += f"; last call {comm.last_call}"
        except Exception as exc:
            msg = str(exc)
            what = f"FAILED: {type(exc).__name__}: {msg[:200]}"
        if rank == 0:
            print(f"{backend} {text}: {what}", flush=True)
    torch._dynamo.reset()       # the graphs go first: NCCL's destroy waits for every graph holding its calls
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="braid", choices=["braid", "nccl"])
    ap.add_argument("--shares", nargs="*", default=["ce=1", "ce=0.5,host=0.5", "nccl=0.5,ce=0.5", "host=1", "whole", "model"],
                    help="lane sets (lane=share,...), 'whole' (NCCL's own call) or 'model' (braid's choice)")
    ap.add_argument("--numel", type=int, default=1 << 20)
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    mp.spawn(_rank, args=(2, port, a.backend, a.shares, a.numel), nprocs=2)


if __name__ == "__main__":
    main()
