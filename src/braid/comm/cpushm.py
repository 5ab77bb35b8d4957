"""Whole collectives on CPU tensors through the node segment, without gloo and without lanes.

On one host the ranks of a CPU communicator share the node segment, so a collective needs no
sockets: each rank copies its part into its own area of the segment, raises a stamp, waits for
the other ranks' stamps, and reads what it needs from theirs. gloo's loopback TCP reached 0.5-2
GB/s on the 16-vCPU machine and took ~1.5 ms for a 64 KiB all_reduce on 2 cores; a round here is
two memory copies and a few stamp reads.

Areas: each rank's collective ring of the segment (Layout.coll_rings; half of BRAID_HOST_BUFFER_MB
per rank), cut into two halves used by alternate rounds. A round is: write this rank's data and a
header (op, size, dtype, detail) into its half of this round's parity, stamp `cpu_ready` with the
round's number, wait until every rank's stamp reaches it, compare the headers (a disagreement
raises PeerMismatchError on every rank, each sees every header), read. A rank writes a half again
only two rounds later, after every rank stamped the round in between, so nobody still reads it.

- all_reduce: per chunk, each rank reduces its slice of the chunk over every rank's copy in rank
  order 0..N-1 (`collectives.reduce.reduce_slots`, vectorised by torch) into its other half, and a
  second round lets every rank copy every slice out. Chunks up to SMALL_REDUCE bytes take one
  round: every rank reduces the whole chunk itself, in the same order. Each element is reduced in
  rank order either way, so every rank gets the same bits, run after run.
- reduce_scatter: per chunk, each rank writes its input's part for every destination, and reduces
  its own part over every rank in rank order.
- Two ranks: each copies in only the part its peer reduces and reduces its own from its own tensor
  and the peer's copy in one elementwise kernel (reduce_pair, the bits reduce_slots gives); the
  all_reduce hands its reduced half over and copies the peer's in (2 cores, 2026-11-26: 64 MiB
  45.6-47.9 -> 33.0-33.9 ms, 16 MiB 13.2-14.7 -> 8.6-8.8, 4 MiB 2.9-3.2 -> 1.5-1.7).
- all_gather, broadcast: one round per chunk, then copies (broadcast in pieces of BCAST_CHUNK, so
  that the root's writing and the others' reading overlap).

The waits are the segment's (`NodeSegment.wait_geq`): a dead peer, an abort or BRAID_TIMEOUT_S
end them with a braid error on every rank.
"""
from __future__ import annotations

import contextlib
import os
import time

import numpy as np
import torch
import torch.distributed as dist

from .. import envs
from ..collectives.reduce import _writing, check_reduce_dtype, op_name, reduce_factor, reduce_pair, reduce_slots
from ..errors import MisuseError, PeerMismatchError
from .native_cpu import LATE, MISMATCH

HEADER = 64                 # bytes before each half's data: the round's header
SMALL_REDUCE = 256 << 10    # all_reduce chunks up to this size: one round, every rank reduces all
NATIVE_MIN = 256 << 10      # every op from this size (its input): the native pool (comm/_cpucoll.c)
NATIVE_AREA_MIN = 256 << 10     # a half smaller than this: no native calls
NATIVE_BIT = 1 << 40        # in a header's detail: the call runs native (ranks that differ raise)
A2A_BLOCK = 64 << 10        # a native all_to_all's least bytes per destination and chunk
# an op's native call (_cpucoll.c cpucoll_call): its kind, its chunk divided by the world (or
# not), its least chunk
_NATIVE_WHAT = {"all_reduce": (0, False, 1), "reduce": (0, False, 1), "reduce_scatter": (1, True, 1),
                "all_to_all_single": (2, True, A2A_BLOCK), "all_gather": (3, False, 1), "broadcast": (4, False, 1)}
# broadcast's pieces: the root's copy in and the others' copies out overlap piece by piece (2 ranks
# on 2 cores, 2026-11-26, `braid bench --cpu --op broadcast --sizes 4M:64M --repeat 5`, two runs:
# 16 MiB 9.9-10.1 ms in one 16 MiB piece, 6.7-6.8 ms in 2 MiB pieces; 64 MiB 27.8-28.0 -> 25.6-26.1;
# 4 MiB 1.78-1.86 -> 1.58-1.68). The symmetric ops gain nothing from pieces (every rank copies alike).
BCAST_CHUNK = 2 << 20
YIELD_S = 0.05              # a wait spins (yielding the core) this long before it sleeps...
# ...or until a yield gives the core away for BRAID_CPU_SLOW_YIELD_US (other threads want it: then
# it, and the next BUSY_WAITS waits, sleep on the stamp, woken by its rank)
BUSY_WAITS = 16
SLEEP_NS = 1_000_000        # the longest sleep on a stamp between two looks at aborts and peers
_OPS = {"all_reduce": 1, "all_gather": 2, "reduce_scatter": 3, "broadcast": 4, "reduce": 5,
        "all_to_all_single": 6, "barrier": 7}
_NAMES = {"sum": 1, "avg": 2, "product": 3, "min": 4, "max": 5, "band": 6, "bor": 7, "bxor": 8, "premul_sum": 9}
_DTYPES: dict = {}
_RED_T = type(dist.ReduceOp.SUM)
_PLAIN: dict = {}
_PLAIN_WRITE = contextlib.nullcontext()


def crowded(world: int) -> bool:
    """Whether a world of `world` ranks has more ranks than this process's cores: each rank's
    turn on a core is then time its peers wait for."""
    return world > len(os.sched_getaffinity(0))


def c_round_in_c(world: int) -> bool:
    """Whether a native call's header round runs in C with the call in a world of `world` ranks
    (BRAID_CPU_C_ROUND_RANKS): up to 4 ranks, and in a crowded world, where a round in Python
    costs each rank a turn on a core its peers wait for."""
    limit = envs.get("BRAID_CPU_C_ROUND_RANKS")
    if limit is None:
        return world <= 4 or crowded(world)
    return world <= limit


def _guard(out: torch.Tensor):
    """The mode in which a call here writes `out` (reduce._writing) where it needs one: a tensor
    that requires grad or an inference tensor. Every other write needs none (what is read here is
    the segment or a tensor without grad), and torch.no_grad()'s enter and exit cost ~5 us of a
    4 KiB call (2-core container)."""
    return _writing(out) if out.requires_grad or out.is_inference() else _PLAIN_WRITE


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, flat (no view where it already is one)."""
    flat = t if t.dim() == 1 else t.view(-1)
    return flat if flat.dtype is torch.uint8 else flat.view(torch.uint8)


try:
    from torch.autograd.graph import increment_version as _written
except ImportError:     # pragma: no cover - torch without it
    def _written(t: torch.Tensor) -> None:
        return None

_WORDS = ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2))


def _as_words(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A contiguous tensor's bytes as the widest integers that divide them, flat, and their size:
    torch splits a copy over its threads from 32 Ki elements, which for a 64 KiB copy costs more
    in waking them than it saves (bytes: 64 Ki elements; words of 8: 8 Ki)."""
    b = _as_bytes(t)
    n = b.numel()
    for dt, size in _WORDS:
        if n % size == 0 and t.data_ptr() % size == 0:
            return b.view(dt), size
    return b, 1


def _dtype_code(dtype: torch.dtype) -> int:
    code = _DTYPES.get(dtype)
    if code is None:
        code = _DTYPES[dtype] = (sum(map(ord, str(dtype))) << 8) | (torch.empty(0, dtype=dtype).element_size())
    return code


def _cut(threads: int, chunk_kb: int, stripe_kb: int, per: int, esz: int) -> tuple[int, int]:
    """A native call's stripes (one a thread, at least `stripe_kb` of the `per` bytes a thread
    works through each) and its chunk in elements, from the offer every rank agreed on."""
    return max(1, min(threads, per // (max(stripe_kb, 1) << 10))), (chunk_kb << 10) // esz


class NativeCall:
    """What a native call is, made once per shape (CpuShm._native_call) and run by
    CpuShm.native_run: its op, NativePool.args, its header words, the dtype of its header, the
    bytes a thread works through (`per`), its chunk's divisor and least size, the element size
    of its tensors as passed, the reduction, whether it writes this rank's output (`writes`: a
    reduce's root alone, a broadcast's other ranks) and whether it moves the tensors' bytes
    (all_to_all, all_gather, broadcast: byte views)."""
    __slots__ = ("op", "args", "header", "dtype", "per", "div", "least", "esz", "name", "writes", "as_bytes")

    def __init__(self, op, args, header, dtype, per, div, least, esz, name, writes, as_bytes):
        self.op, self.args, self.header, self.dtype, self.per = op, args, header, dtype, per
        self.div, self.least, self.esz, self.name, self.writes, self.as_bytes = div, least, esz, name, writes, as_bytes


class CpuShm:
    """The whole-call collectives of one CPU communicator (every rank of one node)."""

    def __init__(self, seg, lay, mem: torch.Tensor, rank: int, world: int, rings=None):
        self.seg, self.lay, self.rank, self.world = seg, lay, rank, world
        rings = rings or lay.coll_rings
        offs = [g.offset for g in rings]
        cap = min(g.num_slots * g.slot_bytes for g in rings)
        self.stride = offs[1] - offs[0] if world > 1 else 0
        self.ok = world > 1 and all(o == offs[0] + r * self.stride for r, o in enumerate(offs))
        self.base = offs[0]
        self.half = (cap // 2) // 4096 * 4096
        self.data = self.half - HEADER
        # data per rank and round of all_reduce and reduce_scatter (BRAID_CPU_ROUND_KB; 0: a half)
        kb = envs.get("BRAID_CPU_ROUND_KB")
        self.round_bytes = min(self.data, kb << 10) if kb else self.data
        self.mem = mem
        self.head = np.frombuffer(seg.mm, dtype=np.int64, count=len(seg.mm) // 8)
        self._typed: dict = {}
        self._views: dict = {}      # (parity, dtype, start, m) -> [world, m] view (repeated calls)
        self._rowv: dict = {}       # (parity, dtype, start, m, rank) -> that rank's row of it
        self._accepted: dict = {}   # (dtype, reduction, op) -> the reduction braid runs
        self._esz: dict = {}
        self.seq = 0
        self.ready = [lay.counter("cpu_ready", r) for r in range(world)]
        self.p2p = None             # the communicator's CpuP2P: pending sends/recvs move while we wait
        # the round's fixed places: each rank's stamp (a u32 index) and, per parity, the byte
        # offsets of every rank's header (words 1-4 are compared as bytes: one slice each)
        self._stamp = [off // 4 for off in self.ready]
        self._others = [r for r in range(world) if r != rank]
        self._hdr = [[self._off(r, q) for r in range(world)] for q in (0, 1)] if self.ok else []
        # the native all_reduce and reduce_scatter (comm/native_cpu.py): their area is each rank's
        # half 0 past the first page (the headers of both parities stay out of it); made on first use
        self._native = None
        self._busy_waits = 0        # waits left that sleep on the stamp at once (_wait)
        self._slow_yield_s = envs.get("BRAID_CPU_SLOW_YIELD_US") / 1e6 or float("inf")
        self.native_calls = 0       # calls the native pool ran
        self.late_rounds = 0        # ...whose header round began in C and was finished in Python
        self.recording = False      # keep the next native call in `recorded` (CpuCalls.call)
        self.recorded = None
        self.publish = None         # the call ledger's publish (CpuCalls), before a round waits in Python
        self._native_tried = not (self.ok and envs.get("BRAID_CPU_NATIVE") and self.half >= NATIVE_AREA_MIN)

    def close(self) -> None:
        """Drop every view of the segment (it can be unmapped only when none is left) and stop
        the native pool (its threads hold no view, but read the segment until they end)."""
        if self._native is not None:
            self._native.close()
            self._native = None
        self._native_tried = True
        self.head = self.mem = self.p2p = None
        self._typed.clear()
        self._views.clear()
        self._rowv.clear()

    # areas -----------------------------------------------------------------------------------
    def _off(self, r: int, parity: int) -> int:
        return self.base + r * self.stride + parity * self.half

    def _rows(self, parity: int, dtype: torch.dtype, start: int, m: int) -> torch.Tensor:
        """[world, m] view of every rank's half `parity`, elements start..start+m of its data."""
        key = (parity, dtype, start, m)
        v = self._views.get(key)
        if v is not None:
            return v
        t = self._typed.get(dtype)
        esz = self.esz(dtype)
        if t is None:
            t = self._typed[dtype] = self.mem[: self.mem.numel() // esz * esz].view(dtype)
        first = (self._off(0, parity) + HEADER) // esz + start
        v = torch.as_strided(t, (self.world, m), (self.stride // esz, 1), first)
        if len(self._views) > 512:
            self._views.clear()
        self._views[key] = v
        return v

    def esz(self, dtype: torch.dtype) -> int:
        e = self._esz.get(dtype)
        if e is None:
            e = self._esz[dtype] = torch.empty(0, dtype=dtype).element_size()
        return e

    def _row(self, parity: int, dtype: torch.dtype, start: int, m: int, r: int) -> torch.Tensor:
        """Rank r's row of _rows (kept: indexing a tensor costs microseconds of Python)."""
        key = (parity, dtype, start, m, r)
        v = self._rowv.get(key)
        return v if v is not None else self._kept(key, lambda: self._rows(parity, dtype, start, m)[r])

    def _mine(self, parity: int, dtype: torch.dtype, start: int, m: int) -> torch.Tensor:
        return self._row(parity, dtype, start, m, self.rank)

    def _kept(self, key, make):
        """A view of the segment (or a tuple of views) kept under `key`, made by `make()` the
        first time (at most 512 kept: a new shape beyond that starts the cache over)."""
        v = self._rowv.get(key)
        if v is None:
            if len(self._rowv) > 512:
                self._rowv.clear()
            v = self._rowv[key] = make()
        return v

    def checked(self, dtype: torch.dtype, name: str, op: str) -> str:
        """check_reduce_dtype's answer, kept per (dtype, reduction, op) once it accepted."""
        key = (dtype, name, op)
        got = self._accepted.get(key)
        if got is None:
            got = self._accepted[key] = check_reduce_dtype(dtype, name, op)
        return got

    # one round -------------------------------------------------------------------------------
    def _round(self, op: str, nbytes: int, dtype: torch.dtype, detail: int, extra: tuple = ()) -> int:
        """Stamp this rank's half of the round (its data already written), wait for every rank's,
        compare the headers. Returns the round's parity (the half that was read). `extra`: words
        after the compared ones, each rank's own (read back with `_words`). A native call may run
        the same round in C (NativePool.run), which meets this one alike."""
        s = self.seq = self.seq + 1
        h = self._hdr[s & 1][self.rank]
        self.head[h // 8: h // 8 + 5 + len(extra)] = (s, _OPS[op], nbytes, _dtype_code(dtype), detail, *extra)
        u32, me = self.seg.u32, self._stamp[self.rank]
        u32[me] = s & 0xFFFFFFFF
        # a peer sleeps on the stamp (_wait): wake it (a wake missed between the store and this
        # look costs the sleeper SLEEP_NS at most, after which it looks again; so does a rank
        # without the native library, BRAID_CPU_NATIVE=0, whose peer sleeps in it)
        if u32[me + 1] and (lib := self._lib32()) is not None:
            lib.cpucoll_wake32(self.seg.address + 4 * me)
        return self._gather(s, op)

    def _gather(self, s: int, op: str) -> int:
        """The rest of round s once this rank's stamp is up: wait for every rank's, compare the
        headers (a difference raises PeerMismatchError on every rank). Returns the parity."""
        p = s & 1
        u32, stamp = self.seg.u32, self._stamp
        far = False
        for r in self._others:
            d = (int(u32[stamp[r]]) - s) & 0xFFFFFFFF
            if d >= 0x80000000:                 # not there yet
                self._wait(r, s, op)
                d = (int(u32[stamp[r]]) - s) & 0xFFFFFFFF
            far = far or d > 1                  # a peer is at most one round ahead, unless aborted
        if far:
            # an abort pushes every counter far ahead (a GPU communicator's): the peer's data is
            # not there, its abort is the error
            self.seg.raise_if_peer_aborted()
        hdr, mm = self._hdr[p], self.seg.mm
        mine = mm[hdr[self.rank] + 8: hdr[self.rank] + 40]
        if any(mm[o + 8: o + 40] != mine for o in hdr):
            self._mismatch(op, p)
        return p

    def _mismatch(self, op: str, p: int) -> None:
        """Raise PeerMismatchError naming every rank's header of the round of parity p."""
        head, step = self.head, self.stride // 8
        first = self._off(0, p) // 8
        heads = [tuple(int(v) for v in head[first + r * step: first + r * step + 5]) for r in range(self.world)]
        calls = "; ".join(f"rank {r}: {self._say(x)}" for r, x in enumerate(heads))
        raise PeerMismatchError(f"{op}: the ranks made different calls ({calls}); every rank must "
                                f"issue the same collective with the same size, dtype and root or reduction")

    def _words(self, p: int, first: int, count: int) -> list[tuple[int, ...]]:
        """Every rank's header words first..first+count-1 of the round of parity p."""
        head = self.head
        return [tuple(int(v) for v in head[o // 8 + first: o // 8 + first + count]) for o in self._hdr[p]]

    @staticmethod
    def _lib32():
        """The native library (its sleep and wake on the segment's stamps), None where it cannot
        be built: the waits then sleep in steps."""
        from . import native_cpu
        return native_cpu.build() if envs.get("BRAID_CPU_NATIVE") else None

    def _wait(self, r: int, s: int, op: str) -> None:
        """Until rank r stamped round s: spin, giving the core away between looks (ranks may
        outnumber cores), for up to YIELD_S; then the segment's wait (sleeps, a dead peer, an
        abort, BRAID_TIMEOUT_S). A look whose yield gave the core away for a time slice (other
        processes busy on the host) makes the wait, and the next BUSY_WAITS waits, sleep on the
        stamp, which its rank's `_round` wakes (2 ranks on 2 busy cores: each yield had given the
        peer's turn away); the first wait after them yields again, and renews them if its core is
        still wanted."""
        off = self.ready[r]
        u32, idx = self.seg.u32, off // 4
        busy = self._busy_waits > 0            # a recent wait found the core wanted: no yields
        if busy:
            self._busy_waits -= 1              # counted per wait: the mode ends unless a yield renews it
        now = time.perf_counter()
        end = now + YIELD_S
        p2p = self.p2p
        slow = False
        while True:
            for _ in range(16):
                if ((int(u32[idx]) - s) & 0xFFFFFFFF) < 0x80000000:
                    return
            if p2p is not None and p2p.pending:
                p2p.progress()
            if busy or now > end:
                break
            os.sched_yield()
            t = time.perf_counter()
            if t - now > self._slow_yield_s:    # the core went to another thread for a time slice
                slow = True
                break
            now = t
        if p2p is not None and p2p.pending:
            # a peer may be waiting in a recv for this rank's pending send before it gets here
            p2p.wait_while(lambda: ((int(u32[idx]) - s) & 0xFFFFFFFF) >= 0x80000000, r, op)
            return
        if slow:
            self._busy_waits = BUSY_WAITS
        lib = self._lib32() if slow or busy else None
        if lib is None:
            self.seg.wait_geq(off, s, op, r, None)
            return
        # other threads want the cores: sleep on the stamp until its rank raises it (and wakes us)
        addr, value = self.seg.address + off, s & 0xFFFFFFFF
        self.seg.wait_geq(off, s, op, r, None, spin_s=0.0, sleep=lambda: lib.cpucoll_sleep32(addr, value, SLEEP_NS))

    @staticmethod
    def _say(x: tuple) -> str:
        op = {v: k for k, v in _OPS.items()}.get(x[1], "?")
        how = ", in native code" if x[4] & NATIVE_BIT else ""
        return f"{op} of {x[2]} bytes (dtype code {x[3]}, detail {x[4] & (NATIVE_BIT - 1)}{how})"

    # ops -------------------------------------------------------------------------------------
    def reduction(self, op) -> tuple[str, float] | None:
        """(braid's name, factor) of a reduction this path runs, or None (the full path decides
        and explains)."""
        if type(op) is _RED_T:           # torch's plain ReduceOp values: cached by value
            hit = _PLAIN.get(op)
            if hit is not None:
                return hit
        try:
            red = op_name(op), reduce_factor(op)
        except (MisuseError, TypeError, ValueError):
            return None
        if type(op) is _RED_T and red[0] != "premul_sum":
            _PLAIN[op] = red
        return red

    def all_reduce(self, t: torch.Tensor, name: str, factor: float, root: int | None = None) -> None:
        """In place; with `root`, a reduce: only rank `root` writes the result (the others'
        tensors stay as they were)."""
        flat = t if t.dim() == 1 else t.view(-1)
        op = "all_reduce" if root is None else "reduce"
        dt, n = t.dtype, flat.numel()
        name = self.checked(dt, name, op)
        esz = self.esz(dt)
        cap = self.round_bytes // esz
        code = _NAMES[name] + (0 if root is None else 100 * (root + 1))
        lands = root is None or root == self.rank
        nat = self._native_pool() if n * esz >= NATIVE_MIN or self.world > 2 else None
        if n * esz >= NATIVE_MIN and nat is not None and nat.takes(dt, name):
            with _guard(t):
                return self._native_call(nat, op, flat, None, name, code, root)
        # two ranks, a chunk above SMALL_REDUCE: each copies in only the half its peer reduces
        pair = self.world == 2
        rows_c = self._small_c(nat, dt, name)
        if rows_c is not None:
            code |= NATIVE_BIT
        with _guard(t):
            for start in range(0, max(n, 1), cap):
                c = min(cap, n - start)
                p = (self.seq + 1) & 1
                part = flat if c == n else flat[start: start + c]
                if pair and c * esz > SMALL_REDUCE:
                    other = 1 - self.rank
                    a, b = c * other // 2, c * (other + 1) // 2
                    self._mine(p, dt, a, b - a).copy_(part[a: b])
                else:
                    self._mine(p, dt, 0, c).copy_(part)
                self._round(op, n * esz, dt, code)
                if c * esz <= SMALL_REDUCE:
                    if lands and pair:      # one elementwise kernel: torch.sum over 2 rows took 1.8x its time
                        reduce_pair(self._row(p, dt, 0, c, 0), self._row(p, dt, 0, c, 1), name, part, factor)
                    elif lands and rows_c is not None:
                        rows_c(self._rows(p, dt, 0, c), part, name)
                    elif lands:
                        reduce_slots(self._rows(p, dt, 0, c), self.world, name, part, factor)
                    continue
                bounds = [c * r // self.world for r in range(self.world + 1)]
                lo, hi = bounds[self.rank], bounds[self.rank + 1]
                if pair:
                    self._pair_reduce(flat, start, p, bounds, name, factor, lands)
                    q = self._round(op, n * esz, dt, code)
                    if lands:               # the peer's reduced half
                        a, b = bounds[1 - self.rank], bounds[2 - self.rank]
                        flat[start + a: start + b].copy_(self._rows(q, dt, a, b - a)[1 - self.rank])
                    continue
                reduce_slots(self._rows(p, dt, lo, hi - lo), self.world, name, self._mine(1 - p, dt, lo, hi - lo), factor)
                q = self._round(op, n * esz, dt, code)
                if lands:
                    rows = self._rows(q, dt, 0, c)
                    for r in range(self.world):
                        a, b = bounds[r], bounds[r + 1]
                        flat[start + a: start + b].copy_(rows[r, a:b])

    def all_reduce_floor(self, scratch: torch.Tensor, name: str = "sum") -> bool:
        """The native all_reduce's copies and reductions of a tensor like `scratch` (which ends
        with garbage), with the stripes and chunk of this rank's idle offer and no wait: every rank
        runs it at once for the bench's floor. False where the native pool does not take the call."""
        flat = scratch.view(-1)
        nbytes = flat.numel() * flat.element_size()
        nat = self._native_pool()
        if nbytes < NATIVE_MIN or nat is None or not nat.takes(flat.dtype, name):
            return False
        nat.all_reduce_floor(flat, name, *_cut(*nat.idle_offer, nbytes, flat.element_size()))
        return True

    def warm(self) -> None:
        """The native collectives built (once per machine: a C compile), loaded and their pool's
        threads started now, at the communicator's creation, not inside its first call (1.3 s
        of a first 1 MiB all_reduce on 2 cores where nothing was built yet, 14 ms where it was)."""
        if envs.get("BRAID_CPU_NATIVE"):
            self._native_pool()

    def _native_pool(self):
        """The native pool of this communicator, made on first use (None: not here)."""
        if self._native_tried:
            return self._native
        self._native_tried = True
        from . import native_cpu
        lib = native_cpu.build()
        if lib is None:
            return None
        lay, seg = self.lay, self.seg
        want = envs.get("BRAID_CPU_THREADS") or max(1, min(torch.get_num_threads(),
                                                             len(os.sched_getaffinity(0)) // self.world))
        try:
            self._native = native_cpu.NativePool(
                lib, self.world, self.rank, [seg.address + self._off(r, 0) + 4096 for r in range(self.world)],
                [seg.address + lay.counter("cpu_native", r * native_cpu.MAX_THREADS * 3) for r in range(self.world)],
                self.half - 4096, [seg.address + lay.counter("abort", r) for r in range(self.world)],
                [seg.address + lay.counter("pid", r) for r in range(self.world)], envs.get("BRAID_TIMEOUT_S"),
                want - 1, crowded(self.world))
            if self.ok and c_round_in_c(self.world):   # the round's places
                self._native.set_round([seg.address + o for o in self._hdr[0]], [seg.address + o for o in self._hdr[1]],
                                       [seg.address + o for o in self.ready])
        except OSError as exc:
            import logging
            logging.getLogger("braid").info("braid: %s; the rounds in Python run the CPU collectives", exc)
        return self._native

    def _native_call(self, nat, op: str, out: torch.Tensor, inp: torch.Tensor | None, name: str, code: int,
                     root: int | None = None, dtype: torch.dtype | None = None) -> None:
        """One header round (the ranks agree on the call, the stripes and the chunk), then the
        native pool moves and reduces every byte (comm/_cpucoll.c): an all_reduce (or, with
        `root`, a reduce) of `out` in place, or (`inp` given) a reduce_scatter of `inp` into
        `out`, or an all_to_all or all_gather of `inp`'s bytes into `out`'s, or a broadcast of
        `out`'s bytes from `root` (`dtype`: the tensors' own, for the header). What the call is
        (NativeCall) is made here; `native_run` runs it, and runs it again for a repeated call
        (CpuCalls.replay). While `recording`, the call is kept in `recorded` (False once a
        second one came)."""
        esz = out.element_size()
        nbytes = (inp if inp is not None else out).numel() * esz
        # a reduce_scatter's threads by its output: per byte of it a thread waits on every rank's
        # block (one H200 host's 16 vCPUs, 4 and 8 ranks, 2026-11-27: threads by the input ran
        # 256 KiB-1 MiB at 435-1052 us, one thread at 145-370); an all_to_all's likewise
        per = nbytes if inp is None or op == "all_gather" else nbytes // self.world
        # the chunk in elements per destination block: a reduce_scatter's a world's part; an
        # all_to_all's at least A2A_BLOCK (16 ranks on 16 vCPUs, 2026-11-27, 16 KiB blocks ran
        # 0.99-1.10x gloo at 16-64 MiB, 64 KiB blocks 1.32-1.65x)
        what, div, least = _NATIVE_WHAT[op]
        rootn = -1 if root is None else root
        dt = dtype or out.dtype
        writes = root is None or (root == self.rank) != (what == 4)
        c = NativeCall(op, nat.args(what, out, inp, name, rootn), (_OPS[op], nbytes, _dtype_code(dt), code | NATIVE_BIT),
                       dt, per, self.world if div else 1, least, esz, name, writes, what >= 2)
        if self.recording:
            self.recorded = c if self.recorded is None else False
        self.native_run(c, out, inp)

    def native_run(self, c: "NativeCall", out: torch.Tensor, inp: torch.Tensor | None) -> None:
        """Native call `c` on `out` and `inp` (the caller's tensors, or their byte views for an
        all_to_all, all_gather or broadcast). Where c_round_in_c says so the round runs in C
        with the call (one native call, no Python between the round and the data),
        unless a peer is slow to come (then Python finishes the round, with its waits that tell
        a peer's other call from a slow peer) or sends/recvs are pending (they move while Python
        waits). The stripes and chunk made here for a round in Python are the ones cpucoll_call
        makes in C: the two must agree."""
        nat = self._native
        rc, peer = LATE, -1
        if nat.rounds and (self.p2p is None or not self.p2p.pending):
            s = self.seq = self.seq + 1
            src = out if inp is None else inp
            rc, peer = nat.run(c.args, src.data_ptr(), out.data_ptr(), s, c.header, c.per, c.div, c.least)
            if rc == LATE:
                self.late_rounds += 1
                if self.publish is not None:
                    self.publish()
                p = self._gather(s, c.op)
        else:
            p = self._round(c.op, c.header[1], c.dtype, c.header[3], nat.offer_for(c.args[0]))
        if rc == LATE:
            threads, chunk_kb, stripe_kb = (min(col) for col in zip(*self._words(p, 5, 3)))     # every rank's least
            stripes, chunk = _cut(threads, chunk_kb, stripe_kb, c.per, c.esz)
            chunk = max(1, chunk // c.div, c.least)
            what = c.args[0]
            if c.as_bytes:          # a replay's tensors as the byte views the first call had
                out, inp = _as_bytes(out), None if inp is None else _as_bytes(inp.detach())
            if what == 4:
                rc, peer = nat.broadcast(out, c.args[5], self.seq, stripes, chunk)
            elif what == 2:
                rc, peer = nat.all_to_all(out, inp, self.seq, stripes, chunk)
            elif what == 3:
                rc, peer = nat.all_gather(out, inp, self.seq, stripes, chunk)
            elif what == 0:
                rc, peer = nat.all_reduce(out, c.name, self.seq, stripes, chunk, c.args[5])
            else:
                rc, peer = nat.reduce_scatter(out, inp, c.name, self.seq, stripes, chunk)
        self.native_calls += 1
        nat.after_call()
        if c.writes:
            _written(out)       # C wrote it: autograd's count of in-place writes, as torch's own ops keep
        if rc:
            if rc == MISMATCH:
                self._mismatch(c.op, self.seq & 1)
            self._native_failed(rc, peer, c.op)

    def _native_failed(self, rc: int, peer: int, op: str) -> None:
        from .native_cpu import ABORTED, DEAD, TIMEOUT
        from ..errors import LaneFailureError
        seg = self.seg
        if rc == ABORTED:
            seg.raise_if_peer_aborted()
            raise LaneFailureError(f"{op}: rank {self.rank} was aborted during the call")
        if rc == DEAD:
            seg.check_alive(peer)
            raise LaneFailureError(f"rank {peer} has exited; braid cannot complete the call on rank {self.rank}")
        if rc == TIMEOUT:
            raise seg.timed_out(peer, op)
        raise LaneFailureError(f"{op}: the native CPU path could not run here (code {rc}); a "
                               f"process that forked from the one that made the communicator cannot use it")

    def _pair_reduce(self, flat, start: int, p: int, bounds, name: str, factor: float, lands: bool) -> None:
        """A two-rank chunk between its rounds: reduce this rank's half from its own tensor and
        the peer's copy (rank order; reduce_pair gives the bits reduce_slots gives) and hand it to
        the peer through the segment. With the peer's half copied in alone before and copied out
        alone after, each byte of data costs 4.5 bytes of memory traffic against 5.5 when every
        rank copies in and out the whole chunk."""
        dt, me = flat.dtype, self.rank
        lo, hi = bounds[me], bounds[me + 1]
        mine = flat[start + lo: start + hi]
        theirs = self._rows(p, dt, lo, hi - lo)[1 - me]
        x0, x1 = (mine, theirs) if me == 0 else (theirs, mine)
        handed = self._mine(1 - p, dt, lo, hi - lo)
        if lands:                   # in place, then a copy for the peer
            reduce_pair(x0, x1, name, mine, factor)
            handed.copy_(mine)
        else:                       # a reduce's other rank: its tensor stays as it was
            reduce_pair(x0, x1, name, handed, factor)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """Balanced all_to_all_single: block d of every rank's input to rank d, in rounds that
        move the next part of every block; this rank's own block goes straight from its input to
        its output (2 ranks on 2 cores, 2026-11-26: 64 MiB 32.0-32.1 -> 23.4-25.0 ms, 0.90x gloo
        -> 1.21-1.25x; 16 MiB 7.0-7.7 -> 5.7-6.0 ms)."""
        w = self.world
        src, dst = _as_bytes(inp), _as_bytes(out)
        b = src.numel() // w                        # bytes per (source, destination) block
        cap = self.data // w
        me = self.rank
        if src.numel() >= NATIVE_MIN and (nat := self._native_pool()) is not None:
            with _guard(out):
                return self._native_call(nat, "all_to_all_single", dst, src, "sum", 0, dtype=inp.dtype)
        s2, d2 = src.view(w, b), dst.view(w, b)
        u8 = torch.uint8
        with _guard(out):
            for start in range(0, max(b, 1), cap):
                c = min(cap, b - start)
                p = (self.seq + 1) & 1
                # every block as a row, each side's rows in one call (indexing costs us apiece)
                sr = (s2 if c == b else s2[:, start: start + c]).unbind(0)
                dr = (d2 if c == b else d2[:, start: start + c]).unbind(0)
                mine = self._kept((p, c, "a2a"), lambda: self._mine(p, u8, 0, w * c).view(w, c).unbind(0))
                for d in range(w):          # the blocks of the others (this rank's own goes direct)
                    if d != me:
                        mine[d].copy_(sr[d])
                self._round("all_to_all_single", src.numel(), inp.dtype, 0)
                rows = self._kept((p, c, "a2a-in"), lambda: self._rows(p, u8, me * c, c).unbind(0))
                for r in range(w):
                    dr[r].copy_(sr[me] if r == me else rows[r])

    def all_to_all_v(self, ob: torch.Tensor, ib: torch.Tensor, ins: list[int], outs: list[int], dtype) -> bool:
        """Uneven all_to_all_single on byte views: a first round posts every rank's send and
        receive sizes (every rank then checks every pair alike), a second moves the data where
        every rank's input fits its half, else rounds of parts of every block. Returns True."""
        w, me = self.world, self.rank
        p = (self.seq + 1) & 1
        self._mine(p, torch.int64, 0, 2 * w).copy_(torch.tensor(list(ins) + list(outs), dtype=torch.int64))
        self._round("all_to_all_single", 0, dtype, 1)
        table = self._rows(p, torch.int64, 0, 2 * w).tolist()
        sends = [row[:w] for row in table]
        wrong = [(r, d) for r in range(w) for d in range(w) if sends[r][d] != table[d][w + r]]
        if wrong:
            r, d = wrong[0]
            raise PeerMismatchError(f"all_to_all_single: rank {r} sends {sends[r][d]} bytes to rank {d}, which "
                                    f"expects {table[d][w + r]} ({len(wrong)} pairs disagree); the split sizes "
                                    f"of every rank must match")
        with _writing(ob):
            if max(sum(row) for row in sends) > self.data:
                self._a2av_rounds(ob, ib, list(ins), list(outs), max(max(row) for row in sends), dtype)
                return True
            q = (self.seq + 1) & 1
            self._mine(q, torch.uint8, 0, ib.numel()).copy_(ib)
            self._round("all_to_all_single", 0, dtype, 2)
            rows = self._rows(q, torch.uint8, 0, max(sum(row) for row in sends))
            at = 0
            for r in range(w):
                off, n = sum(sends[r][:me]), sends[r][me]
                ob[at: at + n].copy_(rows[r, off: off + n])
                at += n
        return True

    def _a2av_rounds(self, ob, ib, ins: list[int], outs: list[int], biggest: int, dtype) -> None:
        """An uneven all_to_all larger than a half: rounds that each move the next part (up to
        a w-th of a half) of every (source, destination) block, as many as the biggest block needs
        (the same count on every rank: it comes from the agreed table)."""
        w, me = self.world, self.rank
        cap = self.data // w
        in_at = [sum(ins[:d]) for d in range(w)]
        out_at = [sum(outs[:r]) for r in range(w)]
        for k in range(-(-biggest // cap)):
            lo = k * cap
            p = (self.seq + 1) & 1
            mine = self._mine(p, torch.uint8, 0, w * cap)
            for d in range(w):
                n = min(cap, ins[d] - lo)
                if n > 0:
                    mine[d * cap: d * cap + n].copy_(ib[in_at[d] + lo: in_at[d] + lo + n])
            self._round("all_to_all_single", 0, dtype, 3)
            rows = self._rows(p, torch.uint8, me * cap, cap)
            for r in range(w):
                n = min(cap, outs[r] - lo)
                if n > 0:
                    ob[out_at[r] + lo: out_at[r] + lo + n].copy_(rows[r, :n])

    def barrier(self) -> None:
        self._round("barrier", 0, torch.uint8, 0)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, name: str, factor: float) -> None:
        dt, m, w = out.dtype, out.numel(), self.world
        name = self.checked(dt, name, "reduce_scatter")
        esz = self.esz(dt)
        nat = self._native_pool() if w * m * esz >= NATIVE_MIN or w > 2 else None
        if w * m * esz >= NATIVE_MIN and nat is not None and nat.takes(dt, name):
            with _guard(out):
                return self._native_call(nat, "reduce_scatter", out, inp, name, _NAMES[name])
        src = inp.view(w, m)
        dst = out if out.dim() == 1 else out.view(-1)
        cap = self.round_bytes // esz // w
        code = _NAMES[name]
        rows_c = self._small_c(nat, dt, name)
        if rows_c is not None:
            code |= NATIVE_BIT
        me = self.rank
        with _guard(out):
            for start in range(0, max(m, 1), cap):
                c = min(cap, m - start)
                p = (self.seq + 1) & 1
                part = src if c == m else src[:, start: start + c]
                if w == 2:              # only the part the peer reduces; mine is read from `inp`
                    peer = 1 - me
                    parts = part.unbind(0)          # both rows in one call
                    self._kept((p, dt, c, "rs", peer), lambda: self._mine(p, dt, 0, w * c).view(w, c)[peer]).copy_(
                        parts[peer])
                else:
                    self._kept((p, dt, c, "rs"), lambda: self._mine(p, dt, 0, w * c).view(w, c)).copy_(part)
                self._round("reduce_scatter", inp.numel() * esz, dt, code)
                into = dst if c == m else dst[start: start + c]
                if w == 2:
                    own = parts[me]
                    theirs = self._row(p, dt, me * c, c, 1 - me)
                    x0, x1 = (own, theirs) if me == 0 else (theirs, own)
                    reduce_pair(x0, x1, name, into, factor)
                elif rows_c is not None:
                    rows_c(self._rows(p, dt, me * c, c), into, name)
                else:
                    reduce_slots(self._rows(p, dt, me * c, c), w, name, into, factor)

    def _small_c(self, nat, dt: torch.dtype, name: str):
        """The native library's reduction on this thread for a call of more than two ranks below
        the pool's size (its header carries NATIVE_BIT, so ranks that differ raise), or None."""
        if nat is None or self.world == 2 or not nat.takes(dt, name):
            return None
        return nat.reduce_rows

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        if inp.numel() * inp.element_size() >= NATIVE_MIN and (nat := self._native_pool()) is not None:
            with _guard(out):
                return self._native_call(nat, "all_gather", _as_bytes(out), _as_bytes(inp), "sum", 0, dtype=inp.dtype)
        src, esz = _as_words(inp)
        wd, n = src.dtype, src.numel()
        if _as_words(out)[1] < esz:
            src, esz, wd, n = _as_bytes(inp), 1, torch.uint8, src.numel() * esz
        dst = (_as_bytes(out) if esz == 1 else _as_bytes(out).view(wd)).view(self.world, n)
        per = self.data // esz
        with _guard(out):
            for start in range(0, max(n, 1), per):
                c = min(per, n - start)
                p = (self.seq + 1) & 1
                self._mine(p, wd, 0, c).copy_(src if c == n else src[start: start + c])
                self._round("all_gather", n * esz, inp.dtype, 0)
                rows = self._rows(p, wd, 0, c)
                (dst if c == n else dst[:, start: start + c]).copy_(rows)

    def broadcast(self, t: torch.Tensor, root: int) -> None:
        if t.numel() * t.element_size() >= NATIVE_MIN and (nat := self._native_pool()) is not None:
            with _guard(t):
                return self._native_call(nat, "broadcast", _as_bytes(t), None, "sum", root, root, dtype=t.dtype)
        flat, esz = _as_words(t)
        wd, n = flat.dtype, flat.numel()
        step = min(self.data, BCAST_CHUNK) // esz    # the root writes piece k+1 while the others copy piece k
        with _guard(t):
            for start in range(0, max(n, 1), step):
                c = min(step, n - start)
                p = (self.seq + 1) & 1
                part = flat if c == n else flat[start: start + c]
                if self.rank == root:
                    self._mine(p, wd, 0, c).copy_(part)
                self._round("broadcast", n * esz, t.dtype, root)
                if self.rank != root:
                    part.copy_(self._row(p, wd, 0, c, root))
