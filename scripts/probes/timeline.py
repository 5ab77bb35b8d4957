"""Kept to see where a call's GPU and host time go, copy by copy and kernel by kernel.

Device probe: the GPU timeline of braid calls (torch.profiler / CUPTI on rank 0): every copy and
kernel of the last profiled call, by stream, with its start, length and rate, and where the host
time of each call goes (first launch to last launch, and the gaps where the GPU had nothing).

    python3 scripts/probes/timeline.py --nproc 2 --op all_reduce --size 1G --shares ce=1 [--env BRAID_CE_PIECE_MB=128]
Writes the Chrome trace to --out (gzip) when given.
"""
import argparse
import gzip
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # profile_call.py
from profile_call import baseline_us, setup, spawn, warm  # noqa: E402


def summarize(trace: dict, calls: int) -> None:
    evs = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not evs:
        print("no GPU events recorded")
        return
    evs.sort(key=lambda e: e["ts"])
    t0 = evs[0]["ts"]
    end = max(e["ts"] + e["dur"] for e in evs)
    span = end - t0
    print(f"GPU span of {calls} calls: {span:.0f} us ({span / calls:.0f} per call), {len(evs)} GPU events")
    # busy union over all streams: idle gaps are where no engine did anything
    busy, cur_s, cur_e = 0.0, None, None
    gaps = []
    for e in evs:
        s, f = e["ts"], e["ts"] + e["dur"]
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
                gaps.append((cur_e - t0, s - cur_e))
            cur_s, cur_e = s, f
        else:
            cur_e = max(cur_e, f)
    busy += cur_e - cur_s
    big = sorted(gaps, key=lambda g: -g[1])[:8]
    print(f"some engine busy {busy:.0f} us of {span:.0f}; largest idle gaps (at, length): "
          + ", ".join(f"({a:.0f}, {b:.0f})" for a, b in sorted(big)))
    # the last call: from the last 1/calls of the span
    last_from = end - span / calls * 1.05
    print("last call, by stream: start(us from its first event) dur(us) GB/s name")
    tail = [e for e in evs if e["ts"] >= last_from]
    base = tail[0]["ts"] if tail else t0
    streams = {}
    for e in tail:
        streams.setdefault(e.get("args", {}).get("stream", "?"), []).append(e)
    for sid, lst in sorted(streams.items(), key=lambda kv: kv[1][0]["ts"]):
        tot = sum(e["dur"] for e in lst)
        nb = sum(e.get("args", {}).get("bytes", 0) for e in lst)
        print(f"  stream {sid}: {len(lst)} events, busy {tot:.0f} us, {nb / 1e6:.0f} MB"
              + (f" ({nb / tot / 1e3:.0f} GB/s while busy)" if nb and tot else ""))
        for e in lst[:40]:
            b = e.get("args", {}).get("bytes", 0)
            rate = f"{b / e['dur'] / 1e3:7.0f}" if b and e["dur"] else "       "
            print(f"    {e['ts'] - base:8.0f} {e['dur']:8.0f} {rate}  {e['name'][:60]}")


def worker(rank, world, port, args):
    braid, comm, wl, shares = setup(rank, world, port, args, args.env)
    with comm.fixed_shares(shares):
        warm(wl)
        n = args.calls
        if rank == 0:
            from torch.profiler import ProfilerActivity, profile
            prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            prof.__enter__()
        t0 = time.perf_counter()
        stamps = []
        for _ in range(n):
            wl.braid()
            stamps.append(time.perf_counter())
        host = (stamps[-1] - t0) / n * 1e6
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / n * 1e6
        if rank == 0:
            prof.__exit__(None, None, None)
        dist.barrier()
        nccl = baseline_us(wl, n)
    if rank == 0:
        print(f"{args.op} {args.size} {shares} {args.env}: host {host:.0f} us/call, wall {wall:.0f} us/call "
              f"(with the profiler on), NCCL {nccl:.0f} us/call", flush=True)
        path = "/tmp/braid_timeline.json"
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
        summarize(trace, n)
        if args.out:
            with gzip.open(args.out, "wt") as f:
                json.dump(trace, f)
    braid.close()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--op", default="all_reduce")
    ap.add_argument("--size", default="1G")
    ap.add_argument("--shares", default="ce=1")
    ap.add_argument("--hot", type=float, default=None, help="all_to_all_single: this fraction of every rank's bytes to the last rank")
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE set in every rank")
    ap.add_argument("--out", default="")
    spawn(worker, ap.parse_args())


if __name__ == "__main__":
    main()
