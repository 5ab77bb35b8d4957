"""Kept to price a split call's host work on a new machine: host time of one post of each primitive, one GPU.

A split call on 2-4 GPUs at 64-256 MiB is bound by host-side posting (4 x H200, 2026-11-22: 0.7-1.7 ms
of Python and driver calls per call against ~0.5-0.9 ms of GPU work). This prints what each kind
of post costs on this machine's host, so a call's post count can be turned into host time (and a
CUDA graph's replay compared with it). Every primitive is posted on a stream held by a long
`torch.cuda._sleep`, so the GPU never drains the queue and no post waits for the GPU.

    python3 scripts/probes/post_cost.py [--calls 500] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("post_cost: needs a GPU", file=sys.stderr)
        return 2
    sys.path.insert(0, "src")
    from braid.collectives.reduce import reduce_pair
    from braid.lanes import _cuda
    from braid.node import Layout, NodeSegment

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    layout = Layout(1, host_buffer_bytes=1 << 20, chunk_bytes=1 << 18)
    seg = NodeSegment(NodeSegment.new_name(), layout, rank=0, create=True)
    seg_dev = _cuda.host_register(seg.address, layout.total_bytes)
    ctr = seg_dev + layout.counter("ce_arrive", 0)
    s = torch.cuda.Stream()
    src = torch.randn(1 << 20, device=dev)
    dst = torch.empty_like(src)
    a, b, out = torch.randn(4096, device=dev), torch.randn(4096, device=dev), torch.empty(4096, device=dev)
    ev = torch.cuda.Event()
    ev_t = torch.cuda.Event(enable_timing=True)
    sp, dp = src.data_ptr(), dst.data_ptr()
    cs = s.cuda_stream

    def memcpy():
        _cuda.memcpy_async(dp, sp, 4096, cs)

    def write():
        _cuda.write_value(cs, ctr, 1)

    def wait():
        _cuda.wait_value(cs, ctr, 0)

    def record():
        ev.record(s)

    def record_timing():
        ev_t.record(s)

    def wait_event():
        s.wait_event(ev)

    def add_kernel():                    # the held stream is the current one (set below)
        reduce_pair(a, b, "sum", out)

    def copy_kernel():
        dst[:4096].copy_(src[:4096])

    dst_v, src_v = dst[:4096], src[:4096]

    def copy_view():
        dst_v.copy_(src_v)

    def stream_ctx():
        with torch.cuda.stream(s):
            pass

    def record_stream():
        dst.record_stream(s)

    def current_stream():
        torch.cuda.current_stream(dev)

    def current_stream_noarg():
        torch.cuda.current_stream()

    def new_event():
        torch.cuda.Event(enable_timing=True)

    cases = [("cuMemcpyAsync (ctypes)", memcpy), ("cuStreamWriteValue32 (ctypes)", write),
             ("cuStreamWaitValue32 (ctypes)", wait), ("Event.record", record),
             ("Event.record (timing)", record_timing), ("Stream.wait_event", wait_event),
             ("reduce_pair sum, 4096 elements", add_kernel), ("slice + copy_, 4096 elements", copy_kernel),
             ("copy_ of kept views", copy_view), ("with torch.cuda.stream(s): (enter + exit)", stream_ctx),
             ("Tensor.record_stream", record_stream), ("torch.cuda.current_stream(dev)", current_stream),
             ("torch.cuda.current_stream()", current_stream_noarg), ("torch.cuda.Event(enable_timing=True)", new_event)]
    rows = []
    for name, fn in cases:
        best = float("inf")
        for _ in range(3):
            with torch.cuda.stream(s):
                torch.cuda._sleep(2_000_000_000)     # hold the stream (~1 s): posts only queue
            ev.record(s)
            torch.cuda.set_stream(s)
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            dt = (time.perf_counter() - t0) / args.calls * 1e6
            torch.cuda.set_stream(torch.cuda.default_stream(dev))
            best = min(best, dt)
            seg.set(layout.counter("ce_arrive", 0), 1)
            s.synchronize()
        rows.append({"primitive": name, "host_us_per_post": round(best, 2)})
    _cuda.host_unregister(seg.address)
    seg.close()
    seg.unlink()
    info = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "calls": args.calls,
            "date": time.strftime("%Y-%m-%d"), "rows": rows}
    print(f"{info['gpu']}, torch {info['torch']}: host time per post (best of 3 x {args.calls})")
    for r in rows:
        print(f"  {r['primitive']:<44}{r['host_us_per_post']:>8.2f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(info, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
