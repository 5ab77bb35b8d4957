"""Can sibling processes read each other's memory with process_vm_readv (cross-memory attach),
and how fast, against a plain copy, with N processes at once?

    python3 scripts/probes/cma_probe.py --nproc 8 --mib 64 --piece-kib 256

Each process owns a buffer of --mib MiB (written once); with --allow it lets any process of its
user attach (prctl PR_SET_PTRACER_ANY, which Yama's ptrace_scope=1 needs). Then every process at
once (a) copies its own buffer into a second local buffer, (b) reads the next rank's buffer in
pieces of --piece-kib into one small local buffer (stays in cache), (c) reads it whole into a
buffer as large as its own. Prints GB/s per process (1 GB = 1e9 B) and any error.
"""
from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import time

import numpy as np

PR_SET_PTRACER = 0x59616D61
PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value


class IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.process_vm_readv.restype = ctypes.c_ssize_t
    libc.process_vm_readv.argtypes = [ctypes.c_int, ctypes.POINTER(IoVec), ctypes.c_ulong,
                                      ctypes.POINTER(IoVec), ctypes.c_ulong, ctypes.c_ulong]
    return libc


def _read(libc, pid, local_addr, remote_addr, n):
    lv, rv = IoVec(local_addr, n), IoVec(remote_addr, n)
    got = libc.process_vm_readv(pid, ctypes.byref(lv), 1, ctypes.byref(rv), 1, 0)
    if got != n:
        e = ctypes.get_errno()
        raise OSError(e, f"process_vm_readv returned {got}: {os.strerror(e)}")


def worker(rank, n, mib, piece, allow, barrier, q_in, q_out, res):
    libc = _libc()
    if allow:
        r = libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(PR_SET_PTRACER_ANY), 0, 0, 0)
        if r != 0:
            # EINVAL where the kernel has no Yama module: then nothing needs allowing
            res.put((rank, "prctl", os.strerror(ctypes.get_errno())))
    nbytes = mib << 20
    mine = np.random.default_rng(rank).integers(0, 255, nbytes, dtype=np.uint8)
    other = np.empty(nbytes, np.uint8)
    other[:] = 1
    small = np.empty(piece, np.uint8)
    small[:] = 1
    q_out[rank].put((os.getpid(), mine.ctypes.data))
    peer = (rank + 1) % n
    pid, addr = q_in[peer].get()
    q_in[peer].put((pid, addr))         # leave it for anyone else who asks
    out = {}
    for name in ("copy", "cma_pieces", "cma_whole", "copy", "cma_pieces", "cma_whole"):
        barrier.wait()
        t0 = time.perf_counter()
        try:
            if name == "copy":
                np.copyto(other, mine)
            elif name == "cma_pieces":
                for off in range(0, nbytes, piece):
                    _read(libc, pid, small.ctypes.data, addr + off, min(piece, nbytes - off))
            else:
                for off in range(0, nbytes, 8 << 20):
                    m = min(8 << 20, nbytes - off)
                    _read(libc, pid, other.ctypes.data + off, addr + off, m)
            dt = time.perf_counter() - t0
            out[name] = max(out.get(name, 0.0), nbytes / dt / 1e9)
        except OSError as exc:
            out[name] = f"error: {exc}"
        barrier.wait()
    if isinstance(out.get("cma_whole"), float):
        _read(libc, pid, other.ctypes.data, addr, nbytes)
        want = np.random.default_rng(peer).integers(0, 255, nbytes, dtype=np.uint8)
        out["right"] = bool(np.array_equal(other, want))
    res.put((rank, "result", out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--piece-kib", type=int, default=256)
    ap.add_argument("--allow", type=int, default=1)
    a = ap.parse_args()
    try:
        print("ptrace_scope:", open("/proc/sys/kernel/yama/ptrace_scope").read().strip())
    except OSError as exc:
        print("ptrace_scope: unreadable", exc)
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(a.nproc)
    qs = [ctx.Queue() for _ in range(a.nproc)]
    res = ctx.Queue()
    ps = [ctx.Process(target=worker, args=(r, a.nproc, a.mib, a.piece_kib << 10, a.allow, barrier, qs, qs, res))
          for r in range(a.nproc)]
    for p in ps:
        p.start()
    rows = []
    while sum(r[1] == "result" for r in rows) < a.nproc:
        rows.append(res.get(timeout=300))
    for p in ps:
        p.join(30)
    for r in sorted(rows, key=lambda x: x[0]):
        print(r)
    ok = [r[2] for r in rows if r[1] == "result"]
    for k in ("copy", "cma_pieces", "cma_whole"):
        v = [o[k] for o in ok if isinstance(o.get(k), float)]
        if v:
            print(f"{a.nproc} procs {a.mib} MiB allow={a.allow} {k}: median {sorted(v)[len(v) // 2]:.2f} GB/s per process")


if __name__ == "__main__":
    main()
