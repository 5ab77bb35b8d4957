"""Kept to find where a 64 MiB MoE layer's host time goes (it still loses to NCCL in short windows).

Where a MoE 64 MiB layer's host time goes in braid (4 ranks): section timers, us per a2a call.
Run from the repository root: python3 scripts/probes/moe_probe.py
"""
import os, socket, time, sys, collections, functools
import torch, torch.distributed as dist, torch.multiprocessing as mp
sys.path.insert(0, "src")

def worker(rank, world, port, size):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    import braid, braid.comm as bc, braid.executor as ex
    from braid.workloads import make
    comm = braid.init()
    wl = make(comm, "moe", size, torch.bfloat16)
    def per_layer(fn, n=60):
        for _ in range(10): fn()
        torch.cuda.synchronize(); dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n): fn()
        host = (time.perf_counter() - t0) / n * 1e6
        torch.cuda.synchronize()
        return round(host), round((time.perf_counter() - t0) / n * 1e6)
    res = [("nccl", per_layer(wl.baseline)), ("braid", per_layer(wl.braid)), ("nccl", per_layer(wl.baseline)), ("braid", per_layer(wl.braid))]
    acc = collections.Counter()
    def timed(name, fn):
        @functools.wraps(fn)
        def w(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[name] += time.perf_counter() - t0
        return w
    comm._exchange.exchange = timed("exchange", comm._exchange.exchange)
    comm.segment.exchange_collective = timed("exchange_collective", comm.segment.exchange_collective)
    comm.segment.exchange_values = timed("exchange_values", comm.segment.exchange_values)
    comm.segment.wait_geq = timed("wait_geq", comm.segment.wait_geq)
    comm.segment._write = timed("seg write", comm.segment._write)
    comm.segment._read = timed("seg read", comm.segment._read)
    comm._lanes["ce"].descriptor = timed("ce descriptor", comm._lanes["ce"].descriptor)
    dist.all_to_all_single = timed("nccl a2a", dist.all_to_all_single)
    ex.Handle.wait = timed("handle.wait", ex.Handle.wait)
    bc._Cycle.__init__ = timed("cycle", bc._Cycle.__init__)
    comm.route_samples.observation = timed("observation", comm.route_samples.observation)
    comm._routed.plan = timed("routed.plan", comm._routed.plan)
    comm._routed.agree = timed("routed.agree", comm._routed.agree)
    bc.exchange.agree = timed("agree", bc.exchange.agree)
    comm.policy.learn = timed("learn", comm.policy.learn)
    comm.all_to_all_single = timed("total", comm.all_to_all_single)
    torch.cuda.synchronize(); dist.barrier()
    n = 60
    for _ in range(n): wl.braid()
    torch.cuda.synchronize()
    if rank == 0:
        print("moe probe", size >> 20, "MiB", res, flush=True)
        print("moe probe sections", {k: round(v / (2 * n) * 1e6, 1) for k, v in acc.items()},
              "shares", comm.last_handle.shares, "route", comm.last_route, flush=True)
    braid.close()
    dist.destroy_process_group()

if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    mp.spawn(worker, args=(4, port, 64 << 20), nprocs=4)
