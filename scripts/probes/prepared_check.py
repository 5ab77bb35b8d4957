"""Prepared calls with ranks sharing one GPU: right results on repeated calls (buffers kept,
reallocated, the same address as a new allocation), async calls, a user's CUDA graph capture,
and the host time per call of braid's split call (prepared on and off) against NCCL's own call.

    PYTHONPATH=src python3 scripts/probes/prepared_check.py --nproc 2 [--json out.json]

Each rank builds its inputs from seeds every rank knows, so the expected output is computed
locally and independently (reductions: rank order, float32 accumulation, as braid reduces).
"""
import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

OPS = ("all_gather", "all_reduce", "reduce_scatter", "broadcast")


def data(rank: int, it: int, n: int, dtype, dev):
    g = torch.Generator().manual_seed(1000 * it + rank + 1)
    return torch.randn(n, generator=g).to(dtype).to(dev)


def expected(op: str, it: int, n: int, dtype, world: int, rank: int, dev):
    xs = [data(r, it, n, dtype, dev) for r in range(world)]
    if op == "all_gather":
        return torch.cat(xs)
    if op == "broadcast":
        return xs[0]
    acc = xs[0].float()
    for x in xs[1:]:
        acc = acc + x.float()
    red = acc.to(dtype)
    if op == "reduce_scatter":
        m = n // world
        return red[rank * m:(rank + 1) * m]
    return red


class Call:
    """Buffers and braid's / NCCL's call for one op and size on this rank."""

    def __init__(self, braid, op, n, dtype, world, rank, dev):
        self.op, self.n, self.dtype, self.world, self.rank, self.dev = op, n, dtype, world, rank, dev
        self.braid = braid
        self.alloc()

    def alloc(self):
        n, w, dev, dt = self.n, self.world, self.dev, self.dtype
        if self.op == "all_gather":
            self.inp, self.out = torch.empty(n, dtype=dt, device=dev), torch.empty(n * w, dtype=dt, device=dev)
        elif self.op == "reduce_scatter":
            self.inp, self.out = torch.empty(n, dtype=dt, device=dev), torch.empty(n // w, dtype=dt, device=dev)
        else:
            self.inp = self.out = torch.empty(n, dtype=dt, device=dev)

    def fill(self, it):
        self.inp.copy_(data(self.rank, it, self.n, self.dtype, self.dev))

    def run(self, async_op=False, nccl=False):
        b = dist if nccl else self.braid
        if self.op == "all_gather":
            return b.all_gather_into_tensor(self.out, self.inp, async_op=async_op)
        if self.op == "reduce_scatter":
            return b.reduce_scatter_tensor(self.out, self.inp, async_op=async_op)
        if self.op == "broadcast":
            return b.broadcast(self.inp, 0, async_op=async_op)
        return b.all_reduce(self.inp, async_op=async_op)

    def check(self, it) -> int:
        exp = expected(self.op, it, self.n, self.dtype, self.world, self.rank, self.dev)
        return int((self.out.view(-1).view(torch.uint8) != exp.view(torch.uint8)).sum().item())


def worker(rank, world, port, args, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), BRAID_SHARED_GPU="1")
    import braid
    braid.share_gpu(rank)
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    comm = braid.init()
    prep = comm._prepared
    out = {"wrong": 0, "checks": 0, "host": [], "errors": []}
    sizes = [int(s) for s in args.sizes.split(",")]
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]

    def log(msg):
        if rank == 0:
            print(msg, flush=True)

    def bad(what, n):
        out["checks"] += 1
        if n:
            out["wrong"] += n
            out["errors"].append(f"{what}: {n} wrong bytes")
            print(f"rank {rank} WRONG {what}: {n} bytes", flush=True)

    with comm.fixed_shares({"ce": 1.0}):
        for op in OPS:
            for n in sizes:
                n = n - n % (world * 8) + world * 3 if op == "reduce_scatter" else n
                for dt in dtypes:
                    tag = f"{op} n={n} {dt}"
                    try:
                        c = Call(braid, op, n, dt, world, rank, dev)
                        for it in range(args.iters):              # same buffers, fresh data
                            c.fill(it)
                            c.run()
                            bad(f"{tag} it {it}", c.check(it))
                        c.fill(99)                                  # async, waited later
                        h = c.run(async_op=True)
                        h.wait()
                        bad(f"{tag} async", c.check(99))
                        for it in range(3):                         # new buffers each call
                            c.alloc()
                            c.fill(200 + it)
                            c.run()
                            bad(f"{tag} realloc {it}", c.check(200 + it))
                        # the same address, a new allocation: free everything cached, allocate again
                        ptr = c.inp.data_ptr()
                        c.inp = c.out = None
                        torch.cuda.synchronize()
                        torch.cuda.empty_cache()
                        c.alloc()
                        same = c.inp.data_ptr() == ptr
                        c.fill(300)
                        c.run()
                        bad(f"{tag} new allocation (same address: {same})", c.check(300))
                    except Exception as exc:                        # noqa: BLE001
                        out["errors"].append(f"{tag}: {type(exc).__name__}: {exc}")
                        traceback.print_exc()
                        out["wrong"] += 1
        log(f"correctness done: stats {prep.stats}")
        # a user's CUDA graph capture of split calls, replayed with new data
        for op in OPS:
            try:
                n = sizes[0] - sizes[0] % (world * 8) if op == "reduce_scatter" else sizes[0]
                c = Call(braid, op, n, torch.float32, world, rank, dev)
                c.fill(0)
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    c.run()                                  # warm (prepares)
                torch.cuda.current_stream().wait_stream(s)
                torch.cuda.synchronize()
                dist.barrier()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    c.run()
                torch.cuda.synchronize()
                dist.barrier()
                for it in range(5):
                    c.fill(400 + it)
                    g.replay()
                    torch.cuda.synchronize()
                    bad(f"user graph {op} replay {it}", c.check(400 + it))
                del g
            except Exception as exc:                         # noqa: BLE001
                out["errors"].append(f"user graph {op}: {type(exc).__name__}: {exc}")
                traceback.print_exc()
                out["wrong"] += 1
        log(f"user graphs done: stats {prep.stats}")

        # host time per call: prepared, not prepared, NCCL's own call (alternating windows)
        for op in OPS:
            for n in [int(s) for s in args.time_sizes.split(",")]:
                c = Call(braid, op, n, torch.bfloat16, world, rank, dev)
                c.fill(0)
                res = {"prepared": [], "unprepared": [], "nccl": []}
                for w in range(args.windows):
                    for mode in ("prepared", "unprepared", "nccl"):
                        prep.enabled = mode != "unprepared"
                        for _ in range(3):
                            c.run(nccl=mode == "nccl")
                        torch.cuda.synchronize()
                        dist.barrier()
                        ts = []
                        for _ in range(args.calls):
                            t0 = time.perf_counter()
                            c.run(nccl=mode == "nccl")
                            ts.append(time.perf_counter() - t0)
                        torch.cuda.synchronize()
                        res[mode].append(statistics.median(ts) * 1e6)
                prep.enabled = True
                row = {"op": op, "nbytes": n * 2, **{k: statistics.median(v) for k, v in res.items()}}
                out["host"].append(row)
                log(f"host us {op:15s} {n * 2 >> 20:5d} MiB  prepared {row['prepared']:7.1f}  "
                    f"unprepared {row['unprepared']:7.1f}  nccl {row['nccl']:6.1f}  "
                    f"ratio {row['prepared'] / row['nccl']:.2f}")
    out["stats"] = dict(prep.stats)
    q.put((rank, out))
    braid.close()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--sizes", default="1000003,4194304,16777221")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--time-sizes", default="524288,8388608,33554432")
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--json")
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, a.nproc, 29500 + os.getpid() % 1000, a, q)) for r in range(a.nproc)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        r, res = q.get(timeout=1800)
        results[r] = res
    for p in procs:
        p.join()
    wrong = sum(r["wrong"] for r in results.values())
    checks = sum(r["checks"] for r in results.values())
    print(f"nproc {a.nproc}: {checks} checks, {wrong} wrong; errors: {[e for r in results.values() for e in r['errors']][:10]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"nproc": a.nproc, "results": results}, f, indent=1)
    sys.exit(1 if wrong else 0)


if __name__ == "__main__":
    main()
