"""Device probe: each lane alone and together vs NCCL, for a few ops and sizes (one spawn per world).

    python3 scripts/gpu_probe.py --nproc 2 --ops send_recv,all_gather --sizes 1M,64M,256M,1G
Prints a table (rank 0) of time_us per configuration; used to learn lane speeds before tuning.
"""
import argparse, os, sys, time, socket
import torch, torch.distributed as dist, torch.multiprocessing as mp

def parse_size(s):
    s = s.strip().upper(); m = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * m[s[-1]]) if s[-1] in m else int(s)

def worker(rank, world, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0",
                      TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    import braid
    from braid.calibrate import time_call, calibrate
    from braid.workloads import make, BUS_FACTOR
    from braid.lanes import _cuda
    comm = braid.init()
    # micro costs
    x = torch.empty(1 << 20, device="cuda")
    t0 = time.perf_counter()
    for _ in range(100):
        b, _ = _cuda.address_range(x.data_ptr()); h = _cuda.ipc_handle(b)
    t_ipc = (time.perf_counter() - t0) / 100 * 1e6
    t0 = time.perf_counter()
    for _ in range(100):
        comm.segment.exchange_collective({"op": "x"}, list(range(world)))
    t_ex = (time.perf_counter() - t0) / 100 * 1e6
    if rank == 0:
        print(f"world {world}: ipc handle+range {t_ipc:.1f} us/call; descriptor exchange {t_ex:.1f} us/call", flush=True)
    t0 = time.perf_counter()
    table = calibrate(comm, ops=sorted({"all_to_all_single" if o == "hot" else o for o in args.ops.split(",")}), save_to_disk=False)
    if rank == 0:
        print(f"calibration {time.perf_counter()-t0:.1f}s", flush=True)
        for op, lanes in table.items():
            print("  ", op, {k: (round(v['latency_us'], 1), round(v['bw_gbps'], 1), round(v['floor_us'], 1)) for k, v in lanes.items()}, flush=True)
    configs = [("model", None), ("ce", {"ce": 1.0}), ("host", {"host": 1.0}), ("nccl-p2p", {"nccl": 1.0}),
               ("ce+host", "model-ce-host")]
    for op in args.ops.split(","):
        for n in [parse_size(s) for s in args.sizes.split(",")]:
            if op == "hot":
                wl = make(comm, "all_to_all_single", n, torch.bfloat16, hot_nbytes=n, cold_nbytes=8 << 20)
            else:
                wl = make(comm, op, n, torch.bfloat16)
            row = {}
            wl.baseline(); wl.braid(); torch.cuda.synchronize()
            wrong = int(torch.tensor(wl.wrong()))
            tb = min(time_call(comm, wl.baseline, args.iters) for _ in range(2))
            row["nccl"] = tb
            for name, sh in configs:
                if sh == "model-ce-host":
                    continue
                if name == "nccl-p2p":
                    comm.check = True
                    with comm.fixed_shares(sh):
                        row[name] = time_call(comm, wl.braid, args.iters)
                    comm.check = False
                    continue
                with comm.fixed_shares(sh) if sh else _null():
                    row[name] = min(time_call(comm, wl.braid, args.iters) for _ in range(2))
                    shares = comm.last_handle.shares if wl.participates else {}
                    if name == "model":
                        model_shares = shares
            if rank == 0:
                bf = BUS_FACTOR["all_to_all_single" if op == "hot" else op](world)
                cells = " ".join(f"{k}={v:8.0f}us({wl.algbytes/v/1e3*bf:6.1f})" for k, v in row.items())
                print(f"{op:18s} {n>>20:5d}MiB wrong={wrong} ratio(model)={row['nccl']/row['model']:.3f} shares={ {k: round(v,3) for k,v in model_shares.items()} } | {cells}", flush=True)
    braid.close(); dist.destroy_process_group()

class _null:
    def __enter__(self): return self
    def __exit__(self, *a): return False

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2); ap.add_argument("--ops", default="send_recv,all_gather")
    ap.add_argument("--sizes", default="1M,64M,256M,1G"); ap.add_argument("--iters", type=int, default=5)
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    mp.spawn(worker, args=(a.nproc, port, a), nprocs=a.nproc)
