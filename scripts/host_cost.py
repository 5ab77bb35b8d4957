"""Host time per call of braid's call paths against NCCL's (gloo's on CPU), for calls that the
native library takes whole, measured in one process in alternating windows.

The default group is braid's (`init_process_group("braid")`); NCCL's own group is a second group
of the same ranks (`new_group(backend="nccl")`). Per op, the layers of a call:
  nccl      dist.<op>(..., group=<NCCL group>)      torch's call on NCCL: the baseline
  braid     dist.<op>(...)                          torch's call on backend braid
  pg        <braid process group>.<method>(..., opts)   braid's backend method alone
  inner     <its inner NCCL group>.<method>(..., opts)  the raw NCCL backend it forwards to
  direct    braid.<op>(...)                         braid's own API
Host time = the caller's clock per call over `--iters` calls with no synchronisation inside, the
median of `--windows` windows per layer (layers rotate their order each window).

    torchrun --nproc-per-node 2 scripts/host_cost.py --json host.json      # or plain python: 1 rank

With one rank (one GPU) braid gives every call to NCCL whole (nothing to split), so the
differences are exactly braid's call-path cost. Without a GPU the same runs on gloo.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

LAYERS = ("nccl", "braid", "pg", "inner", "direct")


def _ops(dist, torch, braid, pg, native, dev, nbytes: int) -> dict:
    """op -> {layer: callable}."""
    n = nbytes // 2
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    w = dist.get_world_size()
    x = torch.randn(n, device=dev).to(dt)
    ag_out = torch.empty(n * w, device=dev, dtype=dt)
    rs_in = torch.randn(n * w, device=dev).to(dt)
    rs_out = torch.empty(n, device=dev, dtype=dt)
    a2a_out = torch.empty_like(x)
    inner = pg.nccl if dev.type == "cuda" else pg.gloo
    C = torch.distributed.distributed_c10d
    ar_opts = C.AllreduceOptions()
    ar_opts.asyncOp = False

    def ar_future(fn):
        def run():
            fn(x, async_op=True).get_future()
        return run
    return {
        "all_reduce": {"nccl": lambda: dist.all_reduce(x, group=native), "braid": lambda: dist.all_reduce(x),
                       "pg": lambda: pg.allreduce([x], ar_opts), "inner": lambda: inner.allreduce([x], ar_opts),
                       "direct": lambda: braid.all_reduce(x)},
        "all_reduce_async_future": {
            "nccl": lambda: dist.all_reduce(x, group=native, async_op=True).get_future(),
            "braid": ar_future(dist.all_reduce), "direct": lambda: braid.all_reduce(x, async_op=True).wait()},
        "all_gather": {"nccl": lambda: dist.all_gather_into_tensor(ag_out, x, group=native),
                       "braid": lambda: dist.all_gather_into_tensor(ag_out, x),
                       "direct": lambda: braid.all_gather_into_tensor(ag_out, x)},
        "reduce_scatter": {"nccl": lambda: dist.reduce_scatter_tensor(rs_out, rs_in, group=native),
                           "braid": lambda: dist.reduce_scatter_tensor(rs_out, rs_in),
                           "direct": lambda: braid.reduce_scatter_tensor(rs_out, rs_in)},
        "broadcast": {"nccl": lambda: dist.broadcast(x, 0, group=native), "braid": lambda: dist.broadcast(x, 0),
                      "direct": lambda: braid.broadcast(x, 0)},
        "all_to_all": {"nccl": lambda: dist.all_to_all_single(a2a_out, x, group=native),
                       "braid": lambda: dist.all_to_all_single(a2a_out, x),
                       "direct": lambda: braid.all_to_all_single(a2a_out, x)},
    }


def _time(fn, iters: int, sync) -> float:
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    took = (time.perf_counter() - t0) * 1e6 / iters
    sync()
    return took


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nbytes", type=int, default=1 << 20)
    p.add_argument("--iters", type=int, default=1000)
    p.add_argument("--windows", type=int, default=15)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    import torch
    import torch.distributed as dist
    import braid
    cuda = torch.cuda.is_available()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("braid", rank=rank, world_size=world)
    native = dist.new_group(backend="nccl" if cuda else "gloo")
    braid.init()
    pg = dist.distributed_c10d._get_default_group()
    ops = _ops(dist, torch, braid, pg, native, dev, a.nbytes)
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    res: dict = {}
    for op, layers in ops.items():
        for fn in layers.values():            # warm up: the first call of a shape takes braid's full path
            for _ in range(20):
                fn()
        names = list(layers)
        got = {k: [] for k in names}
        for wdx in range(a.windows):
            k = wdx % len(names)
            for name in names[k:] + names[:k]:
                got[name].append(_time(layers[name], a.iters, sync))
        res[op] = {k: statistics.median(v) for k, v in got.items()}
        # paired: each window's braid minus the same window's nccl, median
        res[op]["braid_minus_nccl_paired"] = statistics.median(
            b - n for b, n in zip(got["braid"], got["nccl"]))
    if rank == 0:
        base = "nccl" if cuda else "gloo"
        print(f"host us per call, {a.nbytes} B, {world} rank(s), median of {a.windows} alternating windows x "
              f"{a.iters} calls; 'nccl' = torch's call on {base}")
        print(f"{'op':<26}" + "".join(f"{x:>9}" for x in LAYERS) + f"{'braid-nccl':>12}{'paired':>9}")
        for op, r in res.items():
            cells = "".join(f"{r[x]:9.2f}" if x in r else f"{'':>9}" for x in LAYERS)
            print(f"{op:<26}{cells}{r['braid'] - r['nccl']:12.2f}{r['braid_minus_nccl_paired']:9.2f}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"nbytes": a.nbytes, "world_size": world, "device": torch.cuda.get_device_name(dev)
                           if cuda else "cpu", "torch": torch.__version__, "median_us": res}, f, indent=1)
    braid.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
