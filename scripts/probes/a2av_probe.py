"""Kept to measure what braid adds to a small skewed all_to_all (still below NCCL's speed), section by section.

Small skewed all_to_all_single (1 MiB per rank, hot fraction h): torch's NCCL call against braid's,
in alternating windows of 200 calls (host us = time to issue, wall us = until the GPU is done), then
braid's host time section by section. 4 ranks (or --nproc)."""
import argparse, collections, functools, os, socket, statistics, sys, time
import torch, torch.distributed as dist, torch.multiprocessing as mp
sys.path.insert(0, "src")

def worker(rank, world, port, nbytes):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    from braid.planner.traffic import hot_matrix
    import braid
    comm = braid.init()
    out = {}
    for h in (0.4, 0.7, 1.0):
        mat = hot_matrix(world, nbytes // 2, h)
        ins = mat[rank]; outs = [mat[s][rank] for s in range(world)]
        x = torch.randn(sum(ins), device="cuda").to(torch.bfloat16)
        y = torch.empty(sum(outs), dtype=torch.bfloat16, device="cuda")
        fns = {"nccl": lambda: dist.all_to_all_single(y, x, outs, ins),
               "braid": lambda: comm.all_to_all_single(y, x, outs, ins),
               "native_fast only": lambda: comm._native_fast("alltoall_base", (y, x, list(outs), list(ins)),
                                                             "alltoall", False),
               "agree only": lambda: comm.segment.read_values(comm.segment.post_values([5]), "p")}
        res = collections.defaultdict(list)
        for rep in range(5):
            for name, fn in fns.items():
                for _ in range(20): fn()
                torch.cuda.synchronize(); dist.barrier()
                t0 = time.perf_counter()
                for _ in range(200): fn()
                host = (time.perf_counter() - t0) / 200 * 1e6
                torch.cuda.synchronize()
                res[name].append((host, (time.perf_counter() - t0) / 200 * 1e6))
        out[h] = {k: (round(statistics.median(a for a, _ in v), 1), round(statistics.median(b for _, b in v), 1))
                  for k, v in res.items()}
        acc = collections.Counter()
        saved = []
        def timed(name, obj, attr):
            fn = getattr(obj, attr)
            saved.append((obj, attr, fn, attr in vars(obj)))
            @functools.wraps(fn)
            def w(*a, **k):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    acc[name] += time.perf_counter() - t0
            setattr(obj, attr, w)
        timed("post_values", comm.segment, "post_values")
        timed("read_values", comm.segment, "read_values")
        timed("native_fast", comm._calls, "native_fast")     # the uneven call's, from its part
        timed("exchange_collective", comm.segment, "exchange_collective")
        timed("total", comm, "all_to_all_single")
        torch.cuda.synchronize(); dist.barrier()
        for _ in range(400): fns["braid"]()
        torch.cuda.synchronize()
        for obj, attr, fn, own in reversed(saved):
            if own:
                setattr(obj, attr, fn)
            else:
                delattr(obj, attr)
        out[h]["sections"] = {k: round(v / 400 * 1e6, 1) for k, v in acc.items()}
    if rank == 0:
        for h, v in out.items():
            print(f"a2av probe w={world} h={h} (host, wall) us: {v}  ratio {v['nccl'][1] / v['braid'][1]:.2f}", flush=True)
    braid.close()
    dist.destroy_process_group()

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--bytes", type=int, default=1 << 20)
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    mp.spawn(worker, args=(a.nproc, port, a.bytes), nprocs=a.nproc)
