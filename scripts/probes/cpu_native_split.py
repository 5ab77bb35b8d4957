"""Where a native CPU collective's time goes: per call, the whole call against the time spent in
the C call alone (with the header round that agrees on the call where it runs in C) and in
the header round in Python (the rest: the call's own Python), on every rank, back to back with the same tensors.

    python3 scripts/probes/cpu_native_split.py [--nproc 8] [--ops all_reduce,reduce,reduce_scatter,all_gather,all_to_all_single,broadcast]
        [--sizes 262144,1048576,4194304,16777216] (bytes of the input)

Each rank takes torch's intra-op threads as `braid bench --cpu` gives them (cores / ranks).
Prints per op and size, medians over windows: the call, the C part, the rest, how far the
ranks' C parts spread (the slowest rank's median against the fastest's), the slow yields the
native waits counted per call and the share of calls made under the busy offer (large chunks;
native_cpu.NativePool.after_call), means over ranks and windows.
"""
import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank: int, world: int, port: int, ops: list[str], sizes: list[int], q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    import braid
    from braid.comm import native_cpu
    dist.init_process_group("gloo", rank=rank, world_size=world)
    comm = braid.init()
    from braid.comm import cpushm
    spent, rnd = [0.0], [0.0]

    def timing(cls, name, into):
        """cls.name, its time added to into[0] (absent in an older tree: left out)."""
        orig = getattr(cls, name, None)
        if orig is None:
            return

        def timed(self, *a, **k):
            t0 = time.perf_counter()
            r = orig(self, *a, **k)
            into[0] += time.perf_counter() - t0
            return r
        setattr(cls, name, timed)
    timing(cpushm.CpuShm, "_round", rnd)
    timing(cpushm.CpuShm, "_words", rnd)
    for name in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "call", "run"):
        timing(native_cpu.NativePool, name, spent)
    busy = [0, 0]      # slow yields the native calls counted; calls made under the busy offer
    orig_after = native_cpu.NativePool.after_call

    def counted_after(self):
        busy[0] += self.lib.cpucoll_busy(self._h)
        busy[1] += self.offer is self.busy_offer or getattr(self, "crowded", False)
        return orig_after(self)
    native_cpu.NativePool.after_call = counted_after
    rows = []
    for nbytes in sizes:
        n = nbytes // 4 // world * world
        x = torch.randn(n)
        y, z = torch.empty(n // world), torch.empty(n)
        fns = {"all_reduce": lambda: comm.all_reduce(x),
               "reduce_scatter": lambda: comm.reduce_scatter_tensor(y, x),
               "all_gather": lambda: comm.all_gather_into_tensor(z, y),
               "all_to_all_single": lambda: comm.all_to_all_single(z, x),
               "broadcast": lambda: comm.broadcast(x, 0),
               "reduce": lambda: comm.reduce(x, 0)}
        for op in ops:
            fn = fns[op]
            iters = max(5, min(200, (64 << 20) // max(nbytes, 1)))
            tot, cpart, rpart, bpart = [], [], [], []
            for _ in range(7):
                for _ in range(3):
                    fn()
                dist.barrier()
                spent[0] = rnd[0] = 0.0
                busy[0] = busy[1] = 0
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                tot.append((time.perf_counter() - t0) / iters * 1e6)
                cpart.append(spent[0] / iters * 1e6)
                rpart.append(rnd[0] / iters * 1e6)
                bpart.append((busy[0] / iters, busy[1] / iters))
            rows.append((op, nbytes, statistics.median(tot), statistics.median(cpart), statistics.median(rpart),
                         sum(b[0] for b in bpart) / len(bpart), sum(b[1] for b in bpart) / len(bpart)))
    q.put((rank, rows))
    braid.close()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=8)
    ap.add_argument("--ops", default="all_reduce,reduce_scatter,all_gather")
    ap.add_argument("--sizes", default="262144,1048576,4194304,16777216")
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    mp.spawn(worker, args=(a.nproc, port, a.ops.split(","), [int(v) for v in a.sizes.split(",")], q), nprocs=a.nproc)
    got = dict(q.get() for _ in range(a.nproc))
    env = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("BRAID_CPU"))
    print(f"{a.nproc} ranks {env or '(defaults)'}: us per call, medians of 7 windows")
    for i, (op, nbytes, *_) in enumerate(got[0]):
        tot = [got[r][i][2] for r in range(a.nproc)]
        cp = [got[r][i][3] for r in range(a.nproc)]
        rd = statistics.median(got[r][i][4] for r in range(a.nproc))
        yields = sum(got[r][i][5] for r in range(a.nproc)) / a.nproc
        offered = sum(got[r][i][6] for r in range(a.nproc)) / a.nproc
        print(f"  {op:15s} {nbytes >> 10:7d} KiB  call {statistics.median(tot):8.1f}  C {statistics.median(cp):8.1f}"
              f"  round {rd:7.1f}  rest {statistics.median(tot) - statistics.median(cp) - rd:7.1f}  C min-max {min(cp):.1f}-{max(cp):.1f}"
              f"  slow yields/call {yields:.2f}  busy offer {offered:.0%}",
              flush=True)


if __name__ == "__main__":
    main()
