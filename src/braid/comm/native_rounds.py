"""The native side of repeated prepared calls (`_rounds.c`), built on first use with the system's C
compiler and loaded with ctypes:
- the launcher of deferred calls (Launcher): its thread waits for the peers' words, checks them and
  launches without Python's interpreter lock (comm/rounds.py says why that matters); what it cannot
  decide it hands back to the rounds thread in Python;
- the caller's own repeated call (FastCalls): the word, its post, the read and compare of every
  rank's word and the launch, in one call (comm/callpath.py CallPath.fast_prepared).
No compiler, or a build that fails: None, and Python does everything (one log line says why)."""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import tempfile

from .. import envs

log = logging.getLogger("braid")

SOURCE = pathlib.Path(__file__).with_name("_rounds.c")
_u64, _vp, _i64 = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_int64
HANDED_ONLY = 2**64 - 1    # poll: wait only for a hand-over (as `_rounds.c` names it)
_lib = None
_tried = False


def compile_c(source: pathlib.Path, stem: str, flags: list[str], key: str = "") -> ctypes.CDLL:
    """`source` compiled once per text (and `key`: what else the build depends on) into the cache
    directory with the system's C compiler, loaded. Raises OSError or SubprocessError."""
    text = source.read_bytes()
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise OSError("no C compiler (cc or gcc) on the PATH")
    base = envs.get("BRAID_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "braid")
    digest = hashlib.sha1(text + " ".join(flags).encode() + key.encode()).hexdigest()[:16]
    out = pathlib.Path(base) / "native" / f"{stem}-{digest}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            so = pathlib.Path(tmp) / out.name
            subprocess.run([cc, *flags, "-shared", "-fPIC", "-pthread", "-o", str(so), str(source)],
                           check=True, capture_output=True, timeout=120)
            os.replace(so, out)         # atomic: another rank may build the same file
    return ctypes.CDLL(str(out))


def compile_or_none(source: pathlib.Path, stem: str, flag_sets: list[list[str]], key: str, what: str,
                    instead: str) -> ctypes.CDLL | None:
    """compile_c with the first of `flag_sets` the compiler takes; None where none builds (one log
    line: `what` is not available, `instead` runs)."""
    try:
        for i, flags in enumerate(flag_sets):
            try:
                return compile_c(source, stem, flags, key)
            except subprocess.CalledProcessError:
                if i == len(flag_sets) - 1:
                    raise
    except (OSError, subprocess.SubprocessError) as exc:
        err = getattr(exc, "stderr", b"") or b""
        log.info("braid: could not build %s (%s%s); %s", what, exc,
                 (": " + err.decode(errors="replace")[:200]) if err else "", instead)
    return None


def build() -> ctypes.CDLL | None:
    """The launcher's library, compiled once per source text into the cache directory."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    lib = compile_or_none(SOURCE, "rounds", [["-O2"]], "", "the native launcher of deferred calls",
                          "its Python thread launches them")
    if lib is None:
        return None
    lib.rounds_new.restype = _vp
    lib.rounds_new.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, _u64,
                               ctypes.POINTER(_u64), ctypes.POINTER(_u64), _vp, _vp, _u64, _vp, _vp, _vp, _vp, _i64]
    lib.rounds_push.restype = ctypes.c_int
    lib.rounds_push.argtypes = [_vp, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32, ctypes.POINTER(_u64), _vp, _vp]
    lib.rounds_poll.restype = _u64
    lib.rounds_poll.argtypes = [_vp, _u64, _i64, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int),
                                ctypes.POINTER(_i64)]
    for name in ("rounds_resume", "rounds_handback", "rounds_clear", "rounds_free", "fast_free"):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = None, [_vp]
    lib.fast_new.restype = _vp
    lib.fast_new.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, _u64, ctypes.POINTER(_u64),
                             ctypes.POINTER(_u64), _vp, _vp, _vp, _vp, _vp]
    lib.fast_call.restype = ctypes.c_int
    lib.fast_call.argtypes = [_vp, ctypes.POINTER(TicketC), ctypes.c_uint32, _u64, _vp, _vp, ctypes.c_int, _i64,
                              ctypes.POINTER(_u64), ctypes.POINTER(ctypes.c_int), ctypes.POINTER(_i64)]
    lib.fast_call_vals.restype = ctypes.c_int
    lib.fast_call_vals.argtypes = [_vp, ctypes.POINTER(TicketC), ctypes.c_uint32, _u64, _vp, _vp, ctypes.c_int, _i64,
                                   ctypes.POINTER(_u64), ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                   ctypes.POINTER(_u64), ctypes.POINTER(ctypes.c_int), ctypes.POINTER(_i64)]
    lib.fast_set_post.restype = None
    lib.fast_set_post.argtypes = [_vp, _vp, _vp, _vp, _vp]
    lib.uneven_post.restype = ctypes.c_int
    lib.uneven_post.argtypes = [_vp, ctypes.c_uint32, ctypes.c_int, ctypes.c_int, ctypes.POINTER(_u64),
                                ctypes.POINTER(_u64), ctypes.POINTER(_u64), ctypes.c_uint32, _u64, _u64, _vp, _vp,
                                _vp, _vp, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
    lib.uneven_round.restype = ctypes.c_int
    lib.uneven_round.argtypes = [_vp, ctypes.c_uint32, ctypes.POINTER(_u64), ctypes.c_int, ctypes.c_int, _u64,
                                 ctypes.POINTER(_u64), _i64, ctypes.POINTER(_u64), ctypes.POINTER(ctypes.c_int)]
    lib.mix_word.restype = _u64
    lib.mix_word.argtypes = [_u64, _u64]
    _lib = lib
    return lib


class Launcher:
    """One communicator's native thread (see `_rounds.c`)."""

    def __init__(self, lib, world: int, me: int, nslots: int, nvals: int, slot_bytes: int, ctr_addrs: list[int],
                 slot_addrs: list[int], stream: int, ctx: int, end_addr: int, fns: dict, handoff_s: float):
        self.lib, self.world = lib, world
        arr = _u64 * world
        self._h = lib.rounds_new(world, me, nslots, nvals, slot_bytes, arr(*ctr_addrs), arr(*slot_addrs), stream,
                                 ctx, end_addr, fns["wait_event"], fns["graph_launch"], fns["write_value"],
                                 fns.get("set_ctx"), int(handoff_s * 1e9))
        if not self._h:
            raise OSError("the native launcher's thread could not start")
        self._expect = arr()

    def push(self, seq: int, slot: int, n: int, expect, start: int, exec_ptr: int) -> bool:
        e = self._expect
        for i, w in enumerate(expect):
            e[i] = w
        return self.lib.rounds_push(self._h, seq & 0xFFFFFFFF, slot, n & 0xFFFFFFFF, e, start, exec_ptr) == 0

    def poll(self, seen: int | None, timeout_s: float) -> tuple[int, int, int, int]:
        """(jobs finished, why the next was handed back or 0, its driver error code, the launched
        jobs' summed push-to-launch ns), after waiting up to `timeout_s` while nothing was handed
        back and `seen` jobs are finished (None: while nothing was handed back). Two threads may
        poll at once (the out-values are each call's own)."""
        why, rc, ns = ctypes.c_int(0), ctypes.c_int(0), _i64(0)
        done = self.lib.rounds_poll(self._h, HANDED_ONLY if seen is None else seen, int(timeout_s * 1e9),
                                    ctypes.byref(why), ctypes.byref(rc), ctypes.byref(ns))
        return done, why.value, rc.value, ns.value

    def resume(self) -> None:
        self.lib.rounds_resume(self._h)

    def handback(self) -> None:
        """Every job pushed so far goes to Python undecided (a rebuild changed the cache)."""
        self.lib.rounds_handback(self._h)

    def clear(self) -> None:
        self.lib.rounds_clear(self._h)

    def close(self) -> None:
        if self._h:
            self.lib.rounds_free(self._h)
            self._h = None


MAXW = 64       # ranks a node segment's round holds (`_rounds.c` MAXW)
M64 = (1 << 64) - 1
# what fast_call returns (`_rounds.c` FAST_*)
HIT, DIFF, LATE, ID_ERR, CAPTURING, LAUNCH_ERR = range(6)
TOO_MANY = -1       # fast_call_vals: more values than a slot holds (nothing posted)


class TicketC(ctypes.Structure):
    """One call shape as `_rounds.c`'s ticket_t: the word's base, the program, the lane stream,
    the fork's event and every rank's word the program was built for."""
    _fields_ = [("base", _u64), ("exec", _vp), ("stream", _vp), ("start", _vp), ("expect", _u64 * MAXW)]


class FastCalls:
    """One communicator's native repeated calls (`_rounds.c` fast_call) over its node segment's
    round of words. `fns`: the driver functions as addresses (lanes/_cuda.native_fns)."""

    def __init__(self, lib, world: int, me: int, nslots: int, nvals: int, slot_bytes: int, ctr_addrs: list[int],
                 slot_addrs: list[int], fns: dict, spin_s: float):
        if world > MAXW:
            raise OSError(f"the native call holds at most {MAXW} ranks")
        self.lib = lib
        arr = _u64 * world
        self._h = lib.fast_new(world, me, nslots, nvals, slot_bytes, arr(*ctr_addrs), arr(*slot_addrs),
                               fns["ptr_attr"], fns["event_record"], fns["wait_event"], fns["graph_launch"],
                               fns["is_capturing"])
        if not self._h:
            raise OSError("the native call's state could not be made")
        self.posts = bool(fns.get("memcpy") and fns.get("wait_value") and fns.get("write_value"))
        if self.posts:              # uneven_post's driver calls
            lib.fast_set_post(self._h, fns["memcpy"], fns["wait_value"], fns["write_value"], fns.get("batch") or None)
        self.spin_ns = int(spin_s * 1e9)
        self._ur: dict = {}         # uneven_round's arrays per count of values
        self.ur_out = None
        # out-arguments made once (the caller's thread only)
        self.word, self.rc, self.round_ns = _u64(), ctypes.c_int(), _i64()
        self._refs = (ctypes.byref(self.word), ctypes.byref(self.rc), ctypes.byref(self.round_ns))

    @staticmethod
    def ticket(base: int, exec_ptr: int, stream: int, start: int, expect) -> TicketC:
        t = TicketC(base & M64, exec_ptr, stream, start)
        for i, w in enumerate(expect):
            t.expect[i] = w & M64
        return t

    def call(self, t: TicketC, seq: int, inp: int, caller: int, end: int, mode: int) -> int:
        """One round `seq` of ticket `t` (see `_rounds.c` fast_call); the word posted, the driver's
        error code and the round's ns are then in self.word, self.rc and self.round_ns."""
        w, rc, rn = self._refs
        return self.lib.fast_call(self._h, t, seq & 0xFFFFFFFF, inp, caller, end, mode, self.spin_ns, w, rc, rn)

    @staticmethod
    def values(vals) -> ctypes.Array:
        """A round's values as call_vals takes them (made once per call shape)."""
        return (_u64 * len(vals))(*[v & M64 for v in vals])

    def call_vals(self, t: TicketC, seq: int, inp: int, caller: int, end: int, mode: int, vals: ctypes.Array,
                  wpos: int, ipos: int) -> int:
        """call() in a round of the values `vals` (from values()) whose word is at `wpos` and the
        input's own word at `ipos` (`_rounds.c` fast_call_vals); -1: more values than a slot holds."""
        w, rc, rn = self._refs
        return self.lib.fast_call_vals(self._h, t, seq & 0xFFFFFFFF, inp, caller, end, mode, self.spin_ns, vals,
                                       len(vals), wpos, ipos, w, rc, rn)

    UP_DRIVER = 3                   # uneven_post: a driver call failed (its code in self.rc)
    UP_ERRORS = {1: "a slot of the round holds another count of values", 2: "a source has no mapped input",
                 UP_DRIVER: "a driver call failed"}
    UR_OK, UR_DIFF, UR_LATE, UR_ID_ERR = 0, 1, 2, 3     # uneven_round's answers (`_rounds.c`)

    def uneven_round(self, seq: int, vals: list[int], ipos: int, inp: int, recv: list[int]) -> int:
        """An uneven all_to_all's round `seq` of `vals` (the input's word at `ipos` made here from
        `inp`, -1: none) with its checks against `recv` (`_rounds.c` uneven_round); on UR_OK
        self.ur_out holds [largest demand, size, even, every rank's input word...]."""
        n, w = len(vals), len(recv)
        bufs = self._ur.get(n)
        if bufs is None:            # made once per count (the caller's thread only)
            bufs = self._ur[n] = ((_u64 * n)(), (_u64 * w)(), (_u64 * (3 + w))())
        v, r, self.ur_out = bufs
        v[:] = vals                 # (every value is a non-negative 64-bit word)
        r[:] = recv
        return self.lib.uneven_round(self._h, seq & 0xFFFFFFFF, v, n, ipos, inp, r, self.spin_ns, self.ur_out,
                                     self._refs[1])

    def uneven_post(self, seq: int, n: int, roff: int, peers, arrive, finish, cseq: int, inp: int, out: int,
                    caller: int, lane: int, start: int, end: int, sync: bool) -> int:
        """An uneven all_to_all's posting on the copy engines from the matrix in round `seq`'s
        slots (`_rounds.c` uneven_post; `peers`, `arrive`, `finish`: arrays of world words): 0,
        or one of UP_ERRORS (the driver's code then in self.rc)."""
        return self.lib.uneven_post(self._h, seq & 0xFFFFFFFF, n, roff, peers, arrive, finish, cseq & 0xFFFFFFFF,
                                    inp, out, caller, lane, start, end, 1 if sync else 0, self._refs[1])

    def close(self) -> None:
        if self._h:
            self.lib.fast_free(self._h)
            self._h = None
