"""Why do calibration timings differ from the bench's? time_call with the calibration's settings vs the bench's."""
import os, sys, socket
import torch, torch.distributed as dist
import torch.multiprocessing as mp

def worker(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    import braid
    from braid import calibrate as cal
    from braid.workloads import make
    comm = braid.init()
    out = []
    for op in ("reduce_scatter", "all_reduce"):
        for n in (64 << 20, 512 << 20, 256 << 20):
            load = make(comm, op, n, torch.bfloat16)
            for lane in ("ce", "nccl"):
                with comm.fixed_shares({lane: 1.0}):
                    a = [round(cal.time_call(comm, load.braid, 5)) for _ in range(3)]
                    b = [round(cal.time_call(comm, load.braid, 20, 5)) for _ in range(2)]
                    c = [round(cal.time_call(comm, load.braid, 5, 3)) for _ in range(2)]
                out.append(f"{op} {n >> 20}M {lane}: iters5/warm1 {a}  iters20/warm5 {b}  iters5/warm3 {c}")
            del load
    if rank == 0:
        print("\n".join(out), flush=True)
    braid.close()
    dist.destroy_process_group()

if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    mp.spawn(worker, args=(2, port), nprocs=2)
