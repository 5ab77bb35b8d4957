"""Where does a native uneven all_to_all_single's host time go? 4 ranks, 1 MiB hot (h=0.7)."""
import os, socket, time, sys
import torch, torch.distributed as dist, torch.multiprocessing as mp
sys.path.insert(0, "src")

def worker(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    from braid.planner.traffic import hot_matrix
    import braid
    comm = braid.init()
    numel = 1 << 19
    mat = hot_matrix(world, numel, 0.7)
    ins = mat[rank]; outs = [mat[s][rank] for s in range(world)]
    x = torch.randn(sum(ins), device="cuda").to(torch.bfloat16); y = torch.empty(sum(outs), dtype=torch.bfloat16, device="cuda")
    xb, yb = x.view(torch.uint8), y.view(torch.uint8)
    insb, outsb = [2 * v for v in ins], [2 * v for v in outs]
    g2 = dist.new_group(backend="nccl")
    def a(): dist.all_to_all_single(y, x, outs, ins)
    def b(): dist.all_to_all_single(y, x, outs, ins, async_op=True).wait()
    def c(): dist.all_to_all_single(yb, xb, outsb, insb, async_op=True).wait()
    def d(): dist.all_to_all_single(yb, xb, outsb, insb)
    def e(): dist.all_to_all_single(yb, xb, outsb, insb, group=g2, async_op=True).wait()
    def f():
        ev = torch.cuda.Event(enable_timing=True); ev.record()
        dist.all_to_all_single(yb, xb, outsb, insb, async_op=True).wait()
    def g(): comm.all_to_all_single(y, x, outs, ins)
    res = {}
    for fn in (a, b, c, d, e, f, g, a, b, c, d, e, f, g):
        for _ in range(20): fn()
        torch.cuda.synchronize(); dist.barrier()
        t0 = time.perf_counter()
        for _ in range(200): fn()
        host = (time.perf_counter() - t0) / 200 * 1e6
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / 200 * 1e6
        res.setdefault(fn.__name__, []).append((round(host), round(wall)))
    # braid's call, section by section (host time, us per call)
    import collections, functools, braid.comm as bc, braid.executor as ex
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
    comm._exchange = timed("exchange", comm._exchange)
    comm.segment.exchange_collective = timed("exchange_collective", comm.segment.exchange_collective)
    comm.segment.wait_geq = timed("wait_geq", comm.segment.wait_geq)
    comm.segment._write = timed("seg write", comm.segment._write)
    comm.segment._read = timed("seg read", comm.segment._read)
    comm._lanes["ce"].descriptor = timed("ce descriptor", comm._lanes["ce"].descriptor)
    import threading
    if rank == 0:
        print("a2a probe threads", [t.name for t in threading.enumerate()], flush=True)
    dist.all_to_all_single = timed("nccl a2a", dist.all_to_all_single)
    ex.Handle.wait = timed("handle.wait", ex.Handle.wait)
    bc._Cycle.__init__ = timed("cycle", bc._Cycle.__init__)
    comm._routed_observation = timed("observation", comm._routed_observation)
    comm.shares_for = timed("shares_for", comm.shares_for)
    comm._agree = timed("agree", comm._agree)
    comm.all_to_all_single = timed("total", comm.all_to_all_single)
    torch.cuda.synchronize(); dist.barrier()
    for _ in range(200): g()
    torch.cuda.synchronize()
    if rank == 0:
        for k, v in res.items(): print("a2a probe", k, v, flush=True)
        print("a2a probe sections", {k: round(v / 200 * 1e6, 1) for k, v in acc.items()}, flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    mp.spawn(worker, args=(4, port), nprocs=4)
