"""A prepared all_reduce's program on the copy engines: how many graph nodes of which kind, and
what one launch costs the host, on 2 GPUs (a GPU per rank).

Both ranks replay the same program the same number of times (its flags pair replay k with the
peer's replay k), in these modes: each launch after the GPU drained, back to back, on the ce
lane's stream or on the caller's, and after cuGraphUpload to the stream it is launched on.

    PYTHONPATH=src python3 scripts/probes/graph_nodes.py [--nbytes 26214400] [--launches 100]
"""
import argparse
import collections
import ctypes
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty", 6: "wait event",
         7: "event record", 8: "ext sem signal", 9: "ext sem wait", 10: "mem alloc", 11: "mem free",
         12: "batch mem op", 13: "conditional"}


def worker(rank, world, port, a):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    import braid
    from braid.lanes import _cuda
    comm = braid.init()
    y = torch.randn(a.nbytes // 2, device="cuda").to(torch.bfloat16)
    cu = _cuda.lib()
    with comm.fixed_shares({"ce": 1.0}):
        for _ in range(5):
            comm.all_reduce(y)
        torch.cuda.synchronize()
        entry = next(e for e in comm._prepared.entries.values() if e.exec_ptr)
        kinds = collections.Counter()
        n = ctypes.c_size_t(0)
        raw = getattr(entry.graph, "raw_cuda_graph", None)
        try:                    # the graph itself is kept only where torch was asked to (keep_graph)
            graph = int(raw())
            cu.cuGraphGetNodes(ctypes.c_void_p(graph), None, ctypes.byref(n))
            nodes = (ctypes.c_void_p * n.value)()
            cu.cuGraphGetNodes(ctypes.c_void_p(graph), nodes, ctypes.byref(n))
            for nd in nodes:
                t = ctypes.c_int(0)
                cu.cuGraphNodeGetType(ctypes.c_void_p(nd), ctypes.byref(t))
                kinds[TYPES.get(t.value, t.value)] += 1
        except (RuntimeError, TypeError):
            pass
        ex = entry.exec_ptr
        ce = comm._lanes["ce"].stream.cuda_stream
        caller = torch.cuda.current_stream().cuda_stream
        out = {}
        for mode in ("drained, ce stream", "back to back, ce stream", "drained, caller's stream",
                     "back to back, caller's stream", "uploaded to ce stream, drained", "uploaded, back to back"):
            s = caller if "caller" in mode else ce
            if mode.startswith("uploaded") and mode.endswith("drained"):
                cu.cuGraphUpload(ctypes.c_void_p(ex), ctypes.c_void_p(ce))
                torch.cuda.synchronize()
            dist.barrier()
            ts = []
            for _ in range(a.launches):
                if "drained" in mode:
                    torch.cuda.synchronize()
                t0 = time.perf_counter_ns()
                _cuda.graph_launch(ex, s)
                ts.append((time.perf_counter_ns() - t0) / 1e3)
            torch.cuda.synchronize()
            out[mode] = (statistics.median(ts), sorted(ts)[len(ts) * 9 // 10])
        # as inside a training step: the caller's stream busy (a queued 2 ms kernel), then the
        # async replay's fork (event on the caller's stream, the ce stream waits for it), launch, end event
        prep = comm._prepared
        for mode in ("fork from a busy caller, launch", "fork from an idle caller, launch"):
            dist.barrier()
            ts, tf = [], []
            for _ in range(a.launches):
                torch.cuda.synchronize()
                if "busy" in mode:
                    torch.cuda._sleep(2_000_000)
                t0 = time.perf_counter_ns()
                prep.fork(comm._lanes["ce"].stream)
                t1 = time.perf_counter_ns()
                _cuda.graph_launch(ex, ce)
                ts.append((time.perf_counter_ns() - t1) / 1e3)
                tf.append((t1 - t0) / 1e3)
            torch.cuda.synchronize()
            out[mode] = (statistics.median(ts), sorted(ts)[len(ts) * 9 // 10])
            out[mode.replace("launch", "the fork")] = (statistics.median(tf), sorted(tf)[len(tf) * 9 // 10])
        # the whole call, as the op sweep makes it
        dist.barrier()
        ts = []
        for _ in range(a.launches):
            t0 = time.perf_counter_ns()
            comm.all_reduce(y)
            ts.append((time.perf_counter_ns() - t0) / 1e3)
        torch.cuda.synchronize()
        out["the whole call (sync)"] = (statistics.median(ts), sorted(ts)[len(ts) * 9 // 10])
        for busy in (False, True):         # async, with the caller's stream busy or idle, as DDP calls it
            dist.barrier()
            ts = []
            for _ in range(a.launches):
                torch.cuda.synchronize()
                if busy:
                    torch.cuda._sleep(2_000_000)
                t0 = time.perf_counter_ns()
                comm.all_reduce(y, async_op=True).wait()
                ts.append((time.perf_counter_ns() - t0) / 1e3)
            torch.cuda.synchronize()
            out[f"the whole call (async, caller {'busy' if busy else 'idle'})"] = (statistics.median(ts), sorted(ts)[len(ts) * 9 // 10])
    if rank == 0:
        print(f"all_reduce {a.nbytes} B on the copy engines, {world} GPUs: {n.value} graph nodes {dict(kinds)}")
        for k, (m, p90) in out.items():
            print(f"  {k:32s} host us median {m:7.1f} p90 {p90:7.1f}")
    braid.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--nbytes", type=int, default=25 << 20)
    ap.add_argument("--launches", type=int, default=100)
    a = ap.parse_args()
    mp.spawn(worker, args=(2, 29611, a), nprocs=2)
