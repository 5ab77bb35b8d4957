"""Kept to measure what a copy-engine call's cross-GPU handshake costs on the GPU, by where its
flags live.

Probe (one process, 2 GPUs, peer access on): stream memory operations ordering two GPUs,
(1) a ping-pong (GPU0 writes X, GPU1 waits X and writes Y, GPU0 waits Y), GPU time per round
trip; (2) an all_gather of S bytes per rank as braid's copy-engine program does it (ready, wait
peer's ready, pull the peer's shard, done, wait peer's done), per call, against the same pulls
with no flags and NCCL's own all_gather (torch.cuda.nccl, one process). Flags either in pinned,
mapped host memory (as braid's node segment) or in GPU memory: each GPU waits on a word of its
own memory, which the peer writes through its peer mapping.

    python3 scripts/probes/flag_latency.py [--iters 200] [--sizes 1,4,16,64]
"""
from __future__ import annotations

import argparse
import ctypes
import sys
import time

import torch

sys.path.insert(0, "src")
from braid.lanes import _cuda  # noqa: E402


PTX = r"""
.version 7.0
.target sm_70
.address_size 64
.visible .entry braid_signal(.param .u64 wr, .param .u32 wv, .param .u64 wt, .param .u32 tv)
{
    .reg .pred p;
    .reg .u64 a, b;
    .reg .u32 v, w, x;
    ld.param.u64 a, [wr];
    ld.param.u32 v, [wv];
    ld.param.u64 b, [wt];
    ld.param.u32 w, [tv];
    setp.eq.u64 p, a, 0;
    @p bra WAIT;
    st.release.sys.global.u32 [a], v;
WAIT:
    setp.eq.u64 p, b, 0;
    @p bra DONE;
LOOP:
    ld.acquire.sys.global.u32 x, [b];
    sub.u32 x, x, w;
    setp.gt.u32 p, x, 2147483647;
    @p bra LOOP;
DONE:
    ret;
}
"""


class Kernel:
    """The spin kernel, loaded from PTX by the driver (one per device), launched with ctypes."""

    def __init__(self):
        cu = _cuda.lib()
        cu.cuModuleLoadData.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p]
        cu.cuModuleGetFunction.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p]
        cu.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 6 + [ctypes.c_uint, ctypes.c_void_p,
                                                                                   ctypes.c_void_p, ctypes.c_void_p]
        self.cu = cu
        self.fn = {}
        for d in range(2):
            torch.cuda.set_device(d)
            torch.cuda.current_stream().synchronize()
            mod = ctypes.c_void_p()
            _cuda.check(cu.cuModuleLoadData(ctypes.byref(mod), PTX.encode()), "cuModuleLoadData")
            fn = ctypes.c_void_p()
            _cuda.check(cu.cuModuleGetFunction(ctypes.byref(fn), mod, b"braid_signal"), "cuModuleGetFunction")
            self.fn[d] = fn
        torch.cuda.set_device(0)

    def launch(self, dev, stream, wr, wv, wt, tv):
        a = (ctypes.c_uint64(wr), ctypes.c_uint32(wv), ctypes.c_uint64(wt), ctypes.c_uint32(tv))
        arr = (ctypes.c_void_p * 4)(*[ctypes.cast(ctypes.byref(x), ctypes.c_void_p) for x in a])
        _cuda.check(self.cu.cuLaunchKernel(self.fn[dev], 1, 1, 1, 1, 1, 1, 0, stream, arr, None), "cuLaunchKernel")


def enable_peer():
    torch.ones(1, device="cuda:0").copy_(torch.ones(1, device="cuda:1"))   # both contexts made
    from cuda.bindings import runtime as rt
    for d, p in ((0, 1), (1, 0)):
        rt.cudaSetDevice(d)
        err = rt.cudaDeviceEnablePeerAccess(p, 0)[0]
        if int(err) not in (0, 704):    # 704: already enabled
            raise RuntimeError(f"cudaDeviceEnablePeerAccess({d}->{p}): {err}")


class HostFlags:
    def __init__(self, words: int):
        self.buf = (ctypes.c_uint32 * words)()
        ctypes.memset(self.buf, 0, 4 * words)
        self.dptr = _cuda.host_register(ctypes.addressof(self.buf), 4 * words)

    def addr(self, owner: int, i: int) -> int:      # the same word whoever waits
        return self.dptr + 4 * i


class DevFlags:
    def __init__(self, words: int):
        self.t = [torch.zeros(words, dtype=torch.int32, device=f"cuda:{d}") for d in range(2)]

    def addr(self, owner: int, i: int) -> int:      # word i in the memory of the GPU that waits on it
        return self.t[owner].data_ptr() + 4 * i


def pingpong(flags, iters: int, s0, s1, kern=None) -> float:
    return timed(lambda: _pingpong(flags, iters, s0, s1, kern), iters)


def _pingpong(flags, iters: int, s0, s1, kern=None) -> None:
    X, Y = 0, 1
    base = pingpong.base
    for i in range(base + 1, base + iters + 1):
        if kern is not None:
            kern.launch(0, s0, flags.addr(1, X), i, flags.addr(0, Y), i)
            kern.launch(1, s1, 0, 0, flags.addr(1, X), i)
            kern.launch(1, s1, flags.addr(0, Y), i, 0, 0)
            continue
        _cuda.write_value(s0, flags.addr(1, X), i)
        _cuda.wait_value(s0, flags.addr(0, Y), i)
        _cuda.wait_value(s1, flags.addr(1, X), i)
        _cuda.write_value(s1, flags.addr(0, Y), i)
    pingpong.base = base + iters


pingpong.base = 0


def ag_program(flags, shard, out, iters, streams, base, with_flags=True, kern=None):
    """Rising counters: word 2*r = r's ready (waited by the peer), 2*r+1 = r's done."""
    nb = shard[0].numel() * shard[0].element_size()
    for i in range(base + 1, base + iters + 1):
        for me in (0, 1):
            p = 1 - me
            sh = streams[me]
            if kern is not None:
                kern.launch(me, sh, flags.addr(p, 2 * me), i, flags.addr(me, 2 * p), i)
                _cuda.memcpy_async(out[me].data_ptr() + p * nb, shard[p].data_ptr(), nb, sh)
                kern.launch(me, sh, flags.addr(p, 2 * me + 1), i, flags.addr(me, 2 * p + 1), i)
                continue
            if with_flags:
                _cuda.write_value(sh, flags.addr(p, 2 * me), i)          # ready
                _cuda.wait_value(sh, flags.addr(me, 2 * p), i)           # peer ready
            _cuda.memcpy_async(out[me].data_ptr() + p * nb, shard[p].data_ptr(), nb, sh)
            if with_flags:
                _cuda.write_value(sh, flags.addr(p, 2 * me + 1), i)      # done reading the peer
                _cuda.wait_value(sh, flags.addr(me, 2 * p + 1), i)       # peer done reading me
    return base + iters


GATE = {}


def timed(fn, iters):
    """GPU time per iteration: both streams held at a gate (a host word) while the host posts
    every iteration, then released; host posting speed does not enter the figure."""
    torch.cuda.synchronize(0); torch.cuda.synchronize(1)
    g = GATE["flags"]
    GATE["n"] += 1
    n = GATE["n"]
    for sh in GATE["streams"]:
        _cuda.wait_value(sh, g.addr(0, 63), n)
    fn()
    time.sleep(0.002)
    t = time.perf_counter()
    g.buf[63] = n
    torch.cuda.synchronize(0); torch.cuda.synchronize(1)
    return (time.perf_counter() - t) / iters * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--sizes", default="1,4,16,64")
    args = ap.parse_args()
    enable_peer()
    s = [torch.cuda.Stream(device=d) for d in range(2)]
    raw = [x.cuda_stream for x in s]
    kinds = {"host": HostFlags(64), "device": DevFlags(64)}
    GATE.update(flags=kinds["host"], n=0, streams=raw)
    kern = Kernel()
    for rep in range(3):
        print("ping-pong round trip, us:", ", ".join(
            f"{k} {pingpong(f, args.iters, raw[0], raw[1]):.2f}" for k, f in kinds.items()), ", ".join(
            f"kernel-{k} {pingpong(f, args.iters, raw[0], raw[1], kern):.2f}" for k, f in kinds.items()), flush=True)

    print("all_gather, 2 GPUs, per-rank shard MiB: us per call (flags in host memory / in GPU memory / "
          "pulls alone / NCCL)")
    bases = {k: 1 << 20 for k in kinds}   # ping-pong used the low values of words 0-1
    kb = {k: 1 << 24 for k in kinds}
    for mb in [int(x) for x in args.sizes.split(",")]:
        n = (mb << 20) // 2
        shard = [torch.randn(n, device=f"cuda:{d}").to(torch.bfloat16) for d in range(2)]
        out = [torch.empty(2 * n, dtype=torch.bfloat16, device=f"cuda:{d}") for d in range(2)]
        for d in range(2):
            out[d][d * n:(d + 1) * n].copy_(shard[d])
        it = 100
        res = {}
        for rep in range(3):
            for k, f in kinds.items():
                def go(k=k, f=f):
                    bases[k] = ag_program(f, shard, out, it, raw, bases[k])
                res.setdefault(k, []).append(timed(go, it))
            for k, f in kinds.items():
                def gok(k=k, f=f):
                    kb[k] = ag_program(f, shard, out, it, raw, kb[k], kern=kern)
                res.setdefault("k" + k, []).append(timed(gok, it))
            res.setdefault("pulls", []).append(timed(lambda: ag_program(None, shard, out, it, raw, 0, False), it))
            nin = [x for x in shard]
            nout = [torch.empty_like(o) for o in out]
            torch.cuda.synchronize(0); torch.cuda.synchronize(1)
            t = time.perf_counter()
            for _ in range(it):
                torch.cuda.nccl.all_gather(nin, nout)
            torch.cuda.synchronize(0); torch.cuda.synchronize(1)
            res.setdefault("nccl", []).append((time.perf_counter() - t) / it * 1e6)
        for d in range(2):
            assert torch.equal(out[d][:n].cpu(), shard[0].cpu()) and torch.equal(out[d][n:].cpu(), shard[1].cpu())
        med = {k: sorted(v)[1] for k, v in res.items()}
        print(f"  {mb:4d} MiB: host {med['host']:7.1f}  device {med['device']:7.1f}  pulls {med['pulls']:7.1f}  "
              f"nccl {med['nccl']:7.1f}  kernel-host {med['khost']:7.1f}  kernel-device {med['kdevice']:7.1f}  (NCCL / host-flag {med['nccl'] / med['host']:.2f}, "
              f"NCCL / device-flag {med['nccl'] / med['device']:.2f})", flush=True)


if __name__ == "__main__":
    main()
