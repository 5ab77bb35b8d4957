"""The native all_reduce, reduce, reduce_scatter, all_to_all, all_gather and broadcast of CPU
tensors (`_cpucoll.c`): built on first use with the system's C compiler for this machine's CPU,
loaded with ctypes, run without Python's interpreter lock in a pool of threads per communicator. Where it does
not build (no compiler), or a dtype or reduction it does not have, CpuShm's own rounds run the call
(comm/cpushm.py)."""
from __future__ import annotations

import ctypes
import logging
import os
import pathlib

import torch

from .. import envs

SOURCE = pathlib.Path(__file__).with_name("_cpucoll.c")
_u64, _vp, _i64, _int = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
MAX_THREADS = 32            # workers + the caller (MAXT); each rank has 3 counters per thread
BIG_WORLD = 4                # BRAID_CPU_A2A_BIG_MB's all_to_all: in worlds of this many ranks and more
BUSY_CHUNK_KB = 4096        # chunks while the host's cores are wanted by other threads (NativePool.after_call)
BUSY_CALLS = 16             # calls in that offer after waits found their core wanted...
BUSY_YIELDS = 2             # ...this many times in two calls in a row (as _cpucoll.c's: one alone may be noise)
# failure codes of cpucoll_all_reduce; cpucoll_call's header round adds MISMATCH (a peer's header
# differs) and LATE (a peer did not come within the round's spin: Python finishes the round)
OK, TIMEOUT, ABORTED, DEAD, FORKED, ARGS, MISMATCH, LATE = range(8)
OPS = {"sum": 0, "avg": 1, "min": 2, "max": 3, "product": 4}
_lib = None
_tried = False
_DTYPES: dict = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2, torch.int32: 4, torch.int64: 5}


def _machine() -> str:
    """What a build for `-march=native` depends on besides its source: the CPU's model and flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))][:2]
        return "".join(lines)
    except OSError:
        return os.uname().machine


def kinds(ops) -> int:
    """The bits of `_cpucoll.c`'s K_* kinds of call for a set of op names (envs.NATIVE_CPU_OPS)."""
    return sum(1 << envs.NATIVE_CPU_OPS.index(op) for op in ops)


def build() -> ctypes.CDLL | None:
    """The library, or None (one log line says why)."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    from .native_rounds import compile_or_none
    # a compiler without -march=native: the plain build
    lib = compile_or_none(SOURCE, "cpucoll", [["-O3", "-march=native"], ["-O3"]], _machine(),
                          "the native CPU collectives", "rounds in Python run them")
    if lib is None:
        return None
    lib.cpucoll_new.restype = _vp
    lib.cpucoll_new.argtypes = [_int, _int, ctypes.POINTER(_u64), ctypes.POINTER(_u64), _u64, ctypes.POINTER(_u64), ctypes.POINTER(_u64),
                                _i64, _int]
    lib.cpucoll_all_reduce.restype = _int
    lib.cpucoll_all_reduce.argtypes = [_vp, _vp, _i64, _int, _int, _int, _u64, _int, _i64, _int, ctypes.POINTER(_int)]
    lib.cpucoll_all_reduce_floor.restype = _int
    lib.cpucoll_all_reduce_floor.argtypes = [_vp, _vp, _i64, _int, _int, _int, _int, _i64]
    lib.cpucoll_all_to_all.restype = _int
    lib.cpucoll_all_to_all.argtypes = [_vp, _vp, _vp, _i64, _u64, _int, _i64, ctypes.POINTER(_int)]
    lib.cpucoll_all_gather.restype = _int
    lib.cpucoll_all_gather.argtypes = [_vp, _vp, _vp, _i64, _u64, _int, _i64, ctypes.POINTER(_int)]
    lib.cpucoll_broadcast.restype = _int
    lib.cpucoll_broadcast.argtypes = [_vp, _vp, _i64, _int, _u64, _int, _i64, ctypes.POINTER(_int)]
    lib.cpucoll_reduce_scatter.restype = _int
    lib.cpucoll_reduce_scatter.argtypes = [_vp, _vp, _vp, _i64, _int, _int, _int, _u64, _int, _i64, ctypes.POINTER(_int)]
    lib.cpucoll_call.restype = _int
    lib.cpucoll_call.argtypes = [_vp, _int, _vp, _vp, _i64, _int, _int, _int, _int, _u64, ctypes.POINTER(_i64), _i64,
                                 _int, _i64, ctypes.POINTER(_int)]
    lib.cpucoll_set_round.restype = _int
    lib.cpucoll_set_round.argtypes = [_vp, ctypes.POINTER(_u64), ctypes.POINTER(_u64), ctypes.POINTER(_u64)]
    lib.cpucoll_reduce_rows.restype = _int
    lib.cpucoll_reduce_rows.argtypes = [ctypes.POINTER(_u64), _int, _i64, _vp, _int, _int]
    lib.cpucoll_workers.restype = _int
    lib.cpucoll_workers.argtypes = [_vp]
    lib.cpucoll_busy.restype = _u64
    lib.cpucoll_busy.argtypes = [_vp]
    lib.cpucoll_sleep32.restype = _int
    lib.cpucoll_sleep32.argtypes = [_u64, ctypes.c_uint32, _i64]
    lib.cpucoll_wake32.restype = None
    lib.cpucoll_wake32.argtypes = [_u64]
    lib.cpucoll_set_slow_yield.restype = None
    lib.cpucoll_set_slow_yield.argtypes = [_i64]
    lib.cpucoll_set_slow_yield(envs.get("BRAID_CPU_SLOW_YIELD_US") * 1000)
    lib.cpucoll_set_lag.restype = None
    lib.cpucoll_set_lag.argtypes = [_int]
    lib.cpucoll_set_lag(kinds(envs.get("BRAID_CPU_LAG")))
    lib.cpucoll_set_stream.restype = None
    lib.cpucoll_set_stream.argtypes = [_int]
    lib.cpucoll_set_stream(kinds(envs.get("BRAID_CPU_STREAM")))
    lib.cpucoll_last_mode.argtypes = [_vp]
    lib.cpucoll_set_big.restype = None
    lib.cpucoll_set_big.argtypes = [_int, _i64, _int]
    lib.cpucoll_set_big(kinds(("all_to_all",)), envs.get("BRAID_CPU_A2A_BIG_MB") << 20, BIG_WORLD)
    lib.cpucoll_has_f16.restype = _int
    lib.cpucoll_free.restype = None
    lib.cpucoll_free.argtypes = [_vp]
    if lib.cpucoll_has_f16():
        _DTYPES[torch.float16] = 3
    _lib = lib
    return lib


log = logging.getLogger("braid")


class NativePool:
    """One communicator's pool and areas (see `_cpucoll.c`)."""

    def __init__(self, lib, world: int, me: int, areas: list[int], ctrs: list[int], area_bytes: int, abort_addrs: list[int],
                 pid_addrs: list[int], timeout_s: float, workers: int, crowded: bool = False):
        self.lib, self.world = lib, world
        self.crowded = crowded      # more ranks than cores: large chunks always (offer_for)
        arr = _u64 * world
        self._h = lib.cpucoll_new(world, me, arr(*areas), arr(*ctrs), area_bytes, arr(*abort_addrs), arr(*pid_addrs),
                                  int(timeout_s * 1e9), max(0, min(workers, MAX_THREADS - 1)))
        if not self._h:
            raise OSError("the native CPU collectives could not start")
        self.threads = 1 + lib.cpucoll_workers(self._h)
        chunk_kb, stripe_kb = envs.get("BRAID_CPU_CHUNK_KB"), envs.get("BRAID_CPU_STRIPE_KB")
        # what this rank offers in each call's header round (the ranks take the least of each);
        # while the cores are wanted by other threads, large chunks (busy_offer)
        self.idle_offer = (self.threads, chunk_kb, stripe_kb)
        self.busy_offer = (self.threads, max(chunk_kb, BUSY_CHUNK_KB), stripe_kb)
        self.offer = self.idle_offer
        self._busy_calls = 0        # calls left in the busy offer
        self._last_busy = 0         # the last call's waits that found their core wanted
        self._peer = _int(-1)
        self._peer_ref = ctypes.byref(self._peer)
        self._rows: dict = {}       # (first row's address, row step, rows) -> their addresses (ctypes)
        self.rounds = False         # set_round gave the header round's places: `run` may run
        self._words = (_i64 * 7)()  # a call's header words and offer (cpucoll_call)

    def offer_for(self, what: int) -> tuple[int, int, int]:
        """What this rank offers in the header round of a call of kind `what` (`args`): in a
        world of more ranks than cores (`crowded`), the busy offer's large chunks for every kind
        but broadcast, whose copies out would then wait for the root's whole chunk (2 cores:
        all_reduce and reduce_scatter of 1-4 MiB at 8 ranks in 0.55-0.90 of the time with them,
        the reductions and all_to_all at 3-4 ranks 0.62-0.96 in 35 pairs of 36, broadcast of 1-4
        MiB at 4 ranks 1.13-1.29); else `offer`."""
        return self.busy_offer if self.crowded and what != 4 else self.offer

    def after_call(self) -> None:
        """Look at this call's waits: BUSY_YIELDS of them in this call and the one before that
        found their core wanted by other threads (another process busy on the host, more threads
        than cores) switch this rank's offer to BUSY_CHUNK_KB chunks for the next BUSY_CALLS
        calls (every rank must offer them for the ranks to take them: the header takes the
        least). Each hand-off between ranks costs a wake-up there: 2 ranks on 2 busy cores, 1-16
        MiB all_reduce, 256 KiB chunks 0.23-0.70x gloo, 4 MiB chunks 0.86-1.59x (2-core
        container, 2026-11-27)."""
        busy = self.lib.cpucoll_busy(self._h)
        busy, self._last_busy = busy + self._last_busy, busy
        if busy >= BUSY_YIELDS:
            if not self._busy_calls:
                log.debug("braid: %d native waits found their core wanted: %d KiB chunks", busy,
                          self.busy_offer[1])
            self._busy_calls = BUSY_CALLS
        elif self._busy_calls:
            self._busy_calls -= 1
        self.offer = self.busy_offer if self._busy_calls else self.idle_offer

    def set_round(self, hdr0: list[int], hdr1: list[int], stamps: list[int]) -> None:
        """The addresses of every rank's header of either parity and of its stamp (CpuShm's
        round), for `call`."""
        arr = _u64 * self.world
        self.rounds = self.lib.cpucoll_set_round(self._h, arr(*hdr0), arr(*hdr1), arr(*stamps)) == OK

    def args(self, what: int, out: torch.Tensor, inp: torch.Tensor | None, name: str, root: int) -> tuple:
        """The fixed arguments of a native call (`run`): `what` 0 an all_reduce (`root` >= 0: a
        reduce) of `out` in place, 1 a reduce_scatter of `inp` into `out`, 2 an all_to_all and 3 an
        all_gather of their bytes, 4 a broadcast of `out`'s bytes from `root`."""
        count = (out.numel() if what < 2 or what == 4 else out.numel() // self.world if what == 2
                 else inp.numel())
        return what, count, out.element_size(), _DTYPES.get(out.dtype, 0), OPS.get(name, 0), root

    def run(self, args: tuple, src: int, out: int, seq: int, header: tuple, per: int, div: int,
            least: int) -> tuple[int, int]:
        """Round `seq` (this rank's `header` words and its offer) and the call of `args` on the
        buffers at `src` and `out` in one native call (`_cpucoll.c` cpucoll_call). (code, its
        rank): OK, LATE (nothing but the round's writes happened), MISMATCH or a failure."""
        w = self._words
        w[0], w[1], w[2], w[3] = header
        what, count, esz, dt, op, root = args
        w[4], w[5], w[6] = self.offer_for(what)
        rc = self.lib.cpucoll_call(self._h, what, src, out, count, esz, dt, op, root, seq, w, per, div, least,
                                   self._peer_ref)
        return rc, self._peer.value

    @staticmethod
    def takes(dtype: torch.dtype, name: str) -> bool:
        return dtype in _DTYPES and name in OPS

    def all_reduce(self, flat: torch.Tensor, name: str, epoch: int, stripes: int, chunk: int,
                   root: int = -1) -> tuple[int, int]:
        """In place (with `root` >= 0, a reduce: that rank's tensor alone gets the result);
        (failure code, its rank) with (OK, -1) for a call that went through."""
        rc = self.lib.cpucoll_all_reduce(self._h, flat.data_ptr(), flat.numel(), flat.element_size(),
                                         _DTYPES[flat.dtype], OPS[name], epoch, stripes, chunk, root,
                                         ctypes.byref(self._peer))
        return rc, self._peer.value

    def broadcast(self, buf: torch.Tensor, root: int, epoch: int, stripes: int, chunk: int) -> tuple[int, int]:
        """Bytes, in place: rank `root`'s `buf` into every rank's."""
        rc = self.lib.cpucoll_broadcast(self._h, buf.data_ptr(), buf.numel(), root, epoch, stripes, chunk,
                                        ctypes.byref(self._peer))
        return rc, self._peer.value

    def all_reduce_floor(self, scratch: torch.Tensor, name: str, stripes: int, chunk: int) -> None:
        """This rank's copies and reductions of an all_reduce of `scratch` (left with garbage),
        as many bytes each, with no wait, no counter and no byte read from a peer's area: run by
        every rank at once, the memory's floor under the call (the bench's measured ceiling,
        `_cpucoll.c` run_floor)."""
        rc = self.lib.cpucoll_all_reduce_floor(self._h, scratch.data_ptr(), scratch.numel(), scratch.element_size(),
                                               _DTYPES[scratch.dtype], OPS[name], stripes, chunk)
        if rc:
            raise OSError(f"the native all_reduce's floor could not run (code {rc})")

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, epoch: int, stripes: int, chunk: int) -> tuple[int, int]:
        """Byte views, world blocks each: block d of `inp` to rank d, block r of `out` from rank r."""
        rc = self.lib.cpucoll_all_to_all(self._h, out.data_ptr(), inp.data_ptr(), out.numel() // self.world, epoch,
                                         stripes, chunk, ctypes.byref(self._peer))
        return rc, self._peer.value

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, name: str, epoch: int, stripes: int,
                       chunk: int) -> tuple[int, int]:
        """`out` (m elements) = this rank's block of every rank's `inp` (world x m), reduced."""
        rc = self.lib.cpucoll_reduce_scatter(self._h, out.data_ptr(), inp.data_ptr(), out.numel(), out.element_size(),
                                             _DTYPES[out.dtype], OPS[name], epoch, stripes, chunk,
                                             ctypes.byref(self._peer))
        return rc, self._peer.value

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, epoch: int, stripes: int, chunk: int) -> tuple[int, int]:
        """Byte views: `inp` to block `me` of every rank's `out` (world blocks)."""
        rc = self.lib.cpucoll_all_gather(self._h, out.data_ptr(), inp.data_ptr(), inp.numel(), epoch, stripes, chunk,
                                         ctypes.byref(self._peer))
        return rc, self._peer.value

    def reduce_rows(self, rows: torch.Tensor, out: torch.Tensor, name: str) -> None:
        """out = rows[0] (op) rows[1] ... in rank order, on this thread (rows: [world, m], rows
        strided, each contiguous)."""
        key = (rows.data_ptr(), rows.stride(0) * rows.element_size(), rows.size(0))
        ptrs = self._rows.get(key)
        if ptrs is None:
            if len(self._rows) > 256:
                self._rows.clear()
            base, step, n = key
            ptrs = self._rows[key] = (_u64 * n)(*(base + r * step for r in range(n)))
        self.lib.cpucoll_reduce_rows(ptrs, rows.size(0), out.numel(), out.data_ptr(), _DTYPES[out.dtype], OPS[name])

    def close(self) -> None:
        if self._h:
            self.lib.cpucoll_free(self._h)
            self._h = None
