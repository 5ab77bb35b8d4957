"""2-GPU reduce_scatter 256 MiB on the copy engines alone: per-call host time in the timed loop,
torch's sync debug mode on (warnings counted by origin), and time spent in a few suspects."""
import collections, functools, os, socket, sys, time, warnings
import torch, torch.distributed as dist, torch.multiprocessing as mp
sys.path.insert(0, "scripts")
from profile_call import setup, warm

class A: op = "reduce_scatter"; size = "256M"; shares = "ce=1"; hot = None

def worker(rank, world, port):
    braid, comm, wl, shares = setup(rank, world, port, A)
    acc = collections.Counter()
    import braid.lanes._cuda as cu
    from braid import node
    def timed(name, obj, attr):
        fn = getattr(obj, attr)
        @functools.wraps(fn)
        def w(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[name] += time.perf_counter() - t0
        setattr(obj, attr, w)
    for name in ("memcpy_async", "write_value", "wait_value"):
        if hasattr(cu, name):
            timed(name, cu, name)
    timed("wait_geq", node.NodeSegment, "wait_geq")
    timed("exchange_collective", node.NodeSegment, "exchange_collective")
    timed("event.record", torch.cuda.Event, "record")
    with comm.fixed_shares(shares):
        warm(wl, 5)
        acc.clear()
        torch.cuda.set_sync_debug_mode(1)
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            ts = []
            t0 = time.perf_counter()
            for _ in range(30):
                t = time.perf_counter(); wl.braid(); ts.append((time.perf_counter() - t) * 1e6)
            host = (time.perf_counter() - t0) / 30 * 1e6
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / 30 * 1e6
        torch.cuda.set_sync_debug_mode(0)
    origins = collections.Counter(str(w.message)[:80] + " @ " + os.path.basename(w.filename) + ":" + str(w.lineno) for w in ws)
    print(f"rank {rank}: host {host:.0f} wall {wall:.0f} us/call; per call {[round(x) for x in ts[:12]]}; "
          f"sections us/call { {k: round(v / 30 * 1e6) for k, v in acc.items()} }; syncs {dict(origins)}", flush=True)
    braid.close(); dist.destroy_process_group()

if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    mp.spawn(worker, args=(2, port), nprocs=2)
