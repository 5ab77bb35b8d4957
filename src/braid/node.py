"""The node segment: one POSIX shared-memory segment per communicator and node.

It holds everything ranks of one node share:
- counters (u32, one per 64-byte line): mailbox sequence numbers, the `ce` lane's arrive/finish
  counters, the host rings' full/done counters. GPUs write and wait on them with stream memory
  operations (the segment is pinned and mapped); CPUs poll them.
- mailboxes: each rank posts a small JSON descriptor of its call (sizes, dtype, IPC handle); every
  rank reads all, checks that they agree, and plans from the same facts.
- ring slots for the `host` and `shm` lanes (see planner/rings.py).
- the relay lane's staging slots for CPU tensors, one ring per rank (see planner/relay.py; GPU
  relays stage in device memory instead, so GPU communicators keep this area small).

Hygiene: the segment is created by local rank 0 with O_CREAT|O_EXCL, mode 0600 and a random name,
opened by the others, and unlinked as soon as everyone has mapped it, so nothing is left in
/dev/shm after a crash; the mappings go away with the processes or at `close()`.

Counters compare wrap-aware (as the GPU's GEQ wait does): a >= b iff (a - b) mod 2^32 < 2^31.
"""
from __future__ import annotations

import json
import logging
import mmap
import os
import secrets
import struct
import time
from dataclasses import dataclass

import numpy as np

from . import envs
from .errors import BraidTimeoutError, LaneFailureError, PeerMismatchError
from .planner.pieces import MAX_PIECES
from .planner.relay import geometry as relay_geometry

log = logging.getLogger("braid")

GRAPH_SLOTS = 4            # slots of each rank's graph ring (the host lane's captured programs)
LINE = 64                  # bytes between counters (no false sharing between writers)
COLL_MBOX_BYTES = 16384    # one collective descriptor (all_to_all splits for large worlds fit)
# A rank's collective mailboxes, used in turn. Writing exchange t reuses the slot of t - 3, which
# every peer has read once it posted t - 2. A rank that waited at t - 1 or t - 2 for every peer's
# post knows that; a post that is not read (post_values without read_values, exchange_values with
# wait=False) is always followed by an exchange that waits, and a deferred read (defer) is done
# before the rank's next post. Two slots were not enough: after a non-waiting post, the next exchange reused the
# slot that a slow peer was still reading (a 3-rank CPU test read a later descriptor): 3 are.
# A communicator whose rounds of words are read by its rounds thread (comm/rounds.py) may post up
# to DEFER_DEPTH of them before the first is read: a rank posts t once it has read t - D, and a
# peer posted t - D only after reading t - 2D, so 2D slots more.
DEFER_DEPTH = 4
COLL_SLOTS = 2 * DEFER_DEPTH + 3
_VALUE_FMT = [f"<I{n}Q" for n in range(9)]   # exchange_values' record: count, then the values
REDO_SLOTS = 3              # the second channel: read before the next post, as the first was
P2P_MBOX_BYTES = 2048
P2P_DEPTH = 4               # send/recv descriptors a direction may have posted and not yet read
WORD_MARK = 0xFFFFFFFF      # a mailbox slot holding a word (post_pair(int)), not JSON
P2P_ROLES = 4               # mailboxes per ordered pair: (sender, receiver) x (channel 0, channel 1)
PAGE = 4096
MAGIC = 0x42524149         # "BRAI"
# A rank's status record: its collective calls so far and the last one (published by the
# communicator's watchdog a few times a second, and before each descriptor exchange), then, once
# it aborts, why. Peers read it to tell a mismatch from a slow rank and to name both calls.
STATUS_BYTES = 1024
_STATUS_FMT = "<IId48s16s16s"      # calls, sequence of the record, time, op, dtype, path
_STATUS_HEAD = struct.calcsize(_STATUS_FMT) + 8     # + the element count (u64)
_STATUS = struct.Struct(_STATUS_FMT + "Q")
_U32 = struct.Struct("<I")
_WORDS: dict = {}          # (op, dtype, path) -> their encoded fields of a status record
ABORT_KINDS = {1: PeerMismatchError, 2: BraidTimeoutError, 3: LaneFailureError, 4: LaneFailureError}


def geq(a: int, b: int) -> bool:
    return ((a - b) & 0xFFFFFFFF) < 0x80000000


def _align(n: int, a: int = PAGE) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class RingGeometry:
    offset: int        # byte offset of slot 0 in the segment
    num_slots: int
    slot_bytes: int

    def slot_offset(self, slot: int) -> int:
        return self.offset + slot * self.slot_bytes


class Layout:
    """Where everything lives in the segment, computed identically on every rank."""

    def __init__(self, world_size: int, host_buffer_bytes: int, chunk_bytes: int, relay_buffer_bytes: int = 0,
                 cpu_area_bytes: int = 0, graph_rings: bool = False):
        n = world_size
        self.world_size = n
        # abort() pushes every counter before `pid`; `pid` and the abort flags after it stay
        names = [("mbox_coll", n), ("mbox_p2p", n * n * P2P_ROLES), ("mbox_p2p_ack", n * n * P2P_ROLES),
                 ("ce_arrive", n), ("ce_finish", n), ("ce_red", n), ("ce_p2p_arrive", n * n), ("ce_p2p_finish", n * n),
                 ("coll_full", n), ("coll_done", n * n), ("pair_full", n * n), ("pair_done", n * n),
                 ("relay_arrive", n), ("relay_finish", n), ("relay_full", n), ("relay_done", n * n),
                 # replay-safe flags of prepared calls (lanes/signals.py): one per ordered pair of
                 # ranks (and piece, for the reductions' pieces); 0 at rest, the waiter resets
                 ("flag_ready", n * n), ("flag_done", n * n), ("flag_piece", n * n * MAX_PIECES),
                 # the same for prepared send/recv on the copy engines, per direction (src, dst)
                 ("flag_p2p_ready", n * n), ("flag_p2p_done", n * n),
                 # the same for the host lane's captured programs (lanes/host.py emit): per
                 # producer, slot of its graph ring and consumer, "full" (staged) and "free" (read)
                 ("flag_host_full", n * GRAPH_SLOTS * n), ("flag_host_free", n * GRAPH_SLOTS * n),
                 # and for a prepared send/recv's host share: per direction (src, dst) and slot of
                 # the direction's graph ring
                 ("flag_pair_full", n * n * GRAPH_SLOTS), ("flag_pair_free", n * n * GRAPH_SLOTS),
                 # rounds of the CPU communicators' whole calls through the segment (comm/cpushm.py)
                 ("cpu_ready", n),
                 # the end of each deferred prepared call, raised on the copy engines' stream
                 # (comm/rounds.py); a second mailbox channel for the exchanges such a call makes
                 # off the caller's thread
                 ("defer_end", n), ("mbox_redo", n),
                 ("pid", n), ("abort", n),
                 # whole CPU send/recv (comm/cpup2p.py), bytes per ordered pair: after `abort`, so
                 # that an abort, which pushes every counter before `pid`, never reads as data
                 ("p2p_written", n * n), ("p2p_taken", n * n),
                 # the native CPU collectives (comm/_cpucoll.c): 64-bit, per rank, thread and step
                 ("cpu_native", n * 32 * 3)]
        self.counter_base: dict[str, int] = {}
        idx = 0
        for name, count in names:
            self.counter_base[name] = idx
            idx += count
        self.num_counters = idx
        off = _align(PAGE + idx * LINE)
        self.status_off = off            # each rank's status record (see NodeSegment.publish)
        off = _align(off + n * STATUS_BYTES)
        self.mbox_coll_off = off
        off = _align(off + n * COLL_SLOTS * COLL_MBOX_BYTES)
        self.mbox_redo_off = off
        off = _align(off + n * REDO_SLOTS * COLL_MBOX_BYTES)
        self.mbox_p2p_off = off
        off = _align(off + n * n * P2P_ROLES * P2P_DEPTH * P2P_MBOX_BYTES)
        # rings: per rank half the budget for the collective ring, half split over pair rings
        half = max(host_buffer_bytes // 2, 2 * PAGE)
        coll_chunk = max(PAGE, min(chunk_bytes, half // 2) // PAGE * PAGE)
        pair_budget = half // max(n - 1, 1)
        pair_chunk = max(PAGE, min(chunk_bytes, pair_budget // 4) // PAGE * PAGE)
        self.coll_rings: list[RingGeometry] = []
        self.pair_rings: dict[tuple[int, int], RingGeometry] = {}
        for r in range(n):
            slots = max(2, half // coll_chunk)
            self.coll_rings.append(RingGeometry(off, slots, coll_chunk))
            off = _align(off + slots * coll_chunk)
            for d in range(n):
                if d == r:
                    continue
                pslots = max(2, pair_budget // pair_chunk)
                self.pair_rings[(r, d)] = RingGeometry(off, pslots, pair_chunk)
                off = _align(off + pslots * pair_chunk)
        # the host lane's captured programs (GPU communicators) stage through rings of their own
        # (GRAPH_SLOTS slots of the collective ring's size per rank): a replay starts at slot 0 every time, beside the
        # posted calls' rings, whose slots and counters move on from call to call
        self.graph_rings: list[RingGeometry] = []
        for r in range(n if graph_rings else 0):
            self.graph_rings.append(RingGeometry(off, GRAPH_SLOTS, coll_chunk))
            off = _align(off + GRAPH_SLOTS * coll_chunk)
        # and a prepared send/recv's host share, per direction (GRAPH_SLOTS slots of the pair
        # rings' size): a rank's sends and receives of different directions may run at once
        self.pair_graph_rings: dict[tuple[int, int], RingGeometry] = {}
        for r in range(n if graph_rings else 0):
            for d in range(n):
                if d != r:
                    self.pair_graph_rings[(r, d)] = RingGeometry(off, GRAPH_SLOTS, pair_chunk)
                    off = _align(off + GRAPH_SLOTS * pair_chunk)
        # relay staging for CPU tensors: one ring per relay rank (planner/relay.py's geometry)
        self.relay_rings: list[RingGeometry] = []
        if relay_buffer_bytes > 0:
            rslots, rslot = relay_geometry(relay_buffer_bytes)
            for r in range(n):
                self.relay_rings.append(RingGeometry(off, rslots, rslot))
                off = _align(off + rslots * rslot)
        # whole CPU send/recv: one byte ring per ordered pair (comm/cpup2p.py)
        # (32 MiB in all, and at least 512 KiB a pair up to 128 MiB: with 16 ranks on one 16-vCPU
        # host, 2026-11-27, 128 KiB rings left the sender and receiver taking turns, 0.59-0.84x gloo
        # at 256 KiB-16 MiB)
        pairs = max(n * (n - 1), 1)
        total = max(32 << 20, min(128 << 20, pairs * (512 << 10)))
        self.p2p_ring = max(64 << 10, min(4 << 20, host_buffer_bytes // 4, total // pairs) // PAGE * PAGE)
        self.p2p_rings: dict[tuple[int, int], int] = {}
        for s in range(n):
            for d in range(n):
                if s != d:
                    self.p2p_rings[(s, d)] = off
                    off = _align(off + self.p2p_ring)
        # a GPU communicator's whole calls on CPU tensors (comm/cpushm.py): an area per rank of its
        # own (a CPU communicator's take its collective rings, which its lanes use only when asked)
        self.cpu_rings: list[RingGeometry] = []
        if cpu_area_bytes > 0:
            area = _align(cpu_area_bytes)
            for r in range(n):
                self.cpu_rings.append(RingGeometry(off, 1, area))
                off += area
        self.data_offset = self.mbox_coll_off
        self.total_bytes = off

    def counter(self, name: str, *index: int) -> int:
        """Byte offset of a counter; 2-D counters take (row, col), 3-D (row, col, piece)."""
        if len(index) == 1:
            flat = index[0]
        elif len(index) == 2:
            flat = index[0] * self.world_size + index[1]
        else:
            flat = (index[0] * self.world_size + index[1]) * MAX_PIECES + index[2]
        return PAGE + (self.counter_base[name] + flat) * LINE

    def host_flag(self, name: str, producer: int, slot: int, consumer: int) -> int:
        """Byte offset of a host-lane graph flag ("flag_host_full" or "flag_host_free") of
        `producer`'s graph ring slot `slot` and reader `consumer`."""
        return self.counter(name, (producer * GRAPH_SLOTS + slot) * self.world_size + consumer)

    def pair_flag(self, name: str, src: int, dst: int, slot: int) -> int:
        """Byte offset of a send/recv graph flag ("flag_pair_full" or "flag_pair_free") of the
        direction `src` -> `dst` and slot `slot` of its graph ring."""
        return self.counter(name, (src * self.world_size + dst) * GRAPH_SLOTS + slot)

    def ring(self, rid: tuple) -> RingGeometry:
        return self.coll_rings[rid[1]] if rid[0] == "coll" else self.pair_rings[(rid[1], rid[2])]

    def full_counter(self, rid: tuple) -> int:
        return self.counter("coll_full", rid[1]) if rid[0] == "coll" else self.counter("pair_full", rid[1], rid[2])

    def done_counter(self, rid: tuple, consumer: int) -> int:
        if rid[0] == "coll":
            return self.counter("coll_done", rid[1], consumer)
        return self.counter("pair_done", rid[1], rid[2])


class NodeSegment:
    """The mapped segment plus the mailbox protocol. One per communicator per process."""

    def __init__(self, name: str, layout: Layout, rank: int, create: bool, spin_s: float = 0.002):
        self.spin_s = spin_s   # how long waits spin before sleeping (short where cores are few)
        self.name = name
        self.layout = layout
        self.rank = rank
        path = f"/dev/shm/{name}"
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, layout.total_bytes)
            self.mm = mmap.mmap(fd, layout.total_bytes)
        finally:
            os.close(fd)
        self.buf = np.frombuffer(self.mm, dtype=np.uint8)
        self.u32 = np.frombuffer(self.mm, dtype=np.uint32, count=(PAGE + layout.num_counters * LINE) // 4)
        if create:
            struct.pack_into("<II", self.mm, 0, MAGIC, layout.world_size)
        self.set(layout.counter("pid", rank), os.getpid())
        self.coll_seq = 0
        self.p2p_seq: dict[tuple[int, int], int] = {}
        self._p2p_offs: dict[tuple, int] = {}        # mailbox counter offsets, computed once each
        self.closed = False
        # hooks of the communicator that owns this segment: called while a wait lasts (every
        # ~35 ms) and when it times out, with (peer, what); each may raise a better error
        self.on_wait = None
        self.on_timeout = None
        # called before every post but a deferred call's own: lets the communicator's queue of
        # deferred calls drain first (comm/rounds.py), so that posts stay in call order
        self.before_post = None
        import threading
        self._publish_lock = threading.Lock()
        self._status_seq = 0
        # offsets the small-call exchange (post_values / read_values) needs on every call
        self._coll_ctr = [layout.counter("mbox_coll", r) for r in range(layout.world_size)]
        self._deferred: tuple | None = None          # a post whose read is put off (see defer)
        self.deferred_values: list | None = None
        self._coll_slots = [[layout.mbox_coll_off + (r * COLL_SLOTS + k) * COLL_MBOX_BYTES for k in range(COLL_SLOTS)]
                            for r in range(layout.world_size)]
        # channel 1: the exchanges of a deferred call rebuilt off the caller's thread (comm/rounds.py)
        self.redo_seq = 0
        self._redo_ctr = [layout.counter("mbox_redo", r) for r in range(layout.world_size)]
        self._redo_slots = [[layout.mbox_redo_off + (r * REDO_SLOTS + k) * COLL_MBOX_BYTES for k in range(REDO_SLOTS)]
                            for r in range(layout.world_size)]

    @staticmethod
    def new_name() -> str:
        return f"braid-{os.getpid()}-{secrets.token_hex(12)}"

    def unlink(self) -> None:
        try:
            os.unlink(f"/dev/shm/{self.name}")
        except FileNotFoundError:
            pass

    @property
    def address(self) -> int:
        return int(self.buf.ctypes.data)

    # counters -------------------------------------------------------------------------------
    def get(self, off: int) -> int:
        return int(self.u32[off // 4])

    def set(self, off: int, value: int) -> None:
        self.u32[off // 4] = value & 0xFFFFFFFF

    def wait_geq(self, off: int, value: int, what: str, peer: int, deadline: float | None,
                 spin_s: float | None = None, sleep=None) -> None:
        """Poll a counter until it reaches value; raise on timeout or a dead peer (deadline None:
        BRAID_TIMEOUT_S from the first check).

        Spins for the first `spin_s` (peers usually arrive within microseconds, and a sleep costs
        60-80 us on Linux however short it is asked to be), then sleeps in 0.5 ms steps (or calls
        `sleep()`, which returns at the latest ~1 ms later: comm/cpushm.py's sleep on the counter).
        CPU-only communicators spin briefly: their ranks share few cores with the lanes' own threads."""
        if geq(self.get(off), value):
            return
        if deadline is None:
            deadline = time.monotonic() + envs.get("BRAID_TIMEOUT_S")
        idx = off // 4
        u32 = self.u32
        spin_until = time.perf_counter() + (self.spin_s if spin_s is None else spin_s)
        while time.perf_counter() < spin_until:
            for _ in range(64):
                if ((int(u32[idx]) - value) & 0xFFFFFFFF) < 0x80000000:
                    return
        checks = 0
        while not geq(self.get(off), value):
            if sleep is None:
                time.sleep(0.0005)
            else:
                sleep()
            checks += 1
            if checks % 64 == 0 and not geq(self.get(off), value):
                self.check_alive(peer)
                self.raise_if_peer_aborted()
                if self.on_wait is not None:       # the communicator's mismatch check
                    self.on_wait(peer, what, lambda: geq(self.get(off), value))
                if time.monotonic() > deadline:
                    raise self.timed_out(peer, what)

    def timed_out(self, peer: int, what: str) -> BraidTimeoutError:
        """The error of a wait for `peer` that lasted BRAID_TIMEOUT_S (the owner's hook may raise a
        better one first: a peer that made another call)."""
        if self.on_timeout is not None:
            self.on_timeout(peer, what)
        return BraidTimeoutError(
            f"rank {self.rank} waited {envs.get('BRAID_TIMEOUT_S'):.0f} s for rank {peer} "
            f"({what}); the peer did not make the matching call. Check that every rank "
            f"issues the same collectives in the same order (BRAID_TIMEOUT_S to change the limit).")

    def check_alive(self, peer: int) -> None:
        pid = self.get(self.layout.counter("pid", peer))
        if pid and pid != os.getpid():
            dead = False
            try:
                os.kill(pid, 0)
                with open(f"/proc/{pid}/stat") as f:      # an exited child its parent has not reaped
                    dead = f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
            except ProcessLookupError:
                dead = True
            except (PermissionError, OSError, IndexError):
                pass
            if dead:
                self.raise_if_peer_aborted()     # it aborted, then exited: its cause says more
                raise LaneFailureError(f"rank {peer} (pid {pid}) has exited; braid cannot complete "
                                       f"the call on rank {self.rank}")

    def abort(self) -> None:
        """Release every waiter (GPU stream waits included): push every counter far ahead."""
        for i in range(self.layout.counter_base["pid"]):
            idx = (PAGE + i * LINE) // 4
            self.u32[idx] = (int(self.u32[idx]) + 0x40000000) & 0xFFFFFFFF

    def release_flags(self) -> None:
        """Set every replay-safe flag (lanes/signals.py) far above the 1 its waiters wait for.
        A replayed program resets each flag it waited on, so a second program queued behind the
        first would wait again: after an abort the watchdog repeats this until the end (unlike
        `abort`, repeating it never moves a flag back below its waiters)."""
        lay = self.layout
        first, last = lay.counter_base["flag_ready"], lay.counter_base["pid"]
        for i in range(first, last):
            self.u32[(PAGE + i * LINE) // 4] = 0x40000000

    # status and abort flags -------------------------------------------------------------------
    def publish(self, calls: int, op: str, nbytes: int, dtype: str, path: str) -> None:
        """This rank's status record: `calls` collective calls so far, the last one `op` of
        `nbytes` bytes of `dtype`, taken by `path` ("whole": the native library's own call;
        "split": braid's lanes, which start with a descriptor exchange). Two threads publish (the
        caller before an exchange, the watchdog now and then): a lock keeps their records whole,
        and a sequence number (odd while writing) lets readers in other processes skip a record
        caught half written."""
        off = self.layout.status_off + self.rank * STATUS_BYTES
        words = _WORDS.get((op, dtype, path))
        if words is None:       # the encoded names, kept (a call publishes on every call)
            if len(_WORDS) > 4096:
                _WORDS.clear()
            words = _WORDS[(op, dtype, path)] = (op.encode()[:48], dtype.encode()[:16], path.encode()[:16])
        with self._publish_lock:
            self._status_seq += 2
            seq = self._status_seq
            _U32.pack_into(self.mm, off + 4, seq - 1)
            _STATUS.pack_into(self.mm, off, calls & 0xFFFFFFFF, seq - 1, time.time(), *words, max(int(nbytes), 0))
            _U32.pack_into(self.mm, off + 4, seq)

    def status(self, rank: int) -> dict | None:
        """What `rank` last published (None: nothing yet, or no whole record after a few tries)."""
        off = self.layout.status_off + rank * STATUS_BYTES
        for _ in range(8):
            calls, seq, when, op, dtype, path, nbytes = _STATUS.unpack_from(self.mm, off)
            if seq % 2 == 0 and _U32.unpack_from(self.mm, off + 4)[0] == seq:
                break
        else:
            return None
        if when == 0.0:
            return None
        text = lambda b: b.rstrip(b"\0").decode(errors="replace")
        return {"calls": calls, "time": when, "op": text(op), "dtype": text(dtype), "path": text(path),
                "nbytes": nbytes}

    def mark_aborted(self, kind: int, cause: str) -> None:
        """This rank gave up (kind: 1 mismatch, 2 timeout, 3 lane failure, 4 abort() called):
        peers waiting on it raise at once, with `cause`."""
        off = self.layout.status_off + self.rank * STATUS_BYTES + _STATUS_HEAD
        data = cause.encode()[:STATUS_BYTES - _STATUS_HEAD - 4]
        struct.pack_into("<I", self.mm, off, len(data))
        self.mm[off + 4: off + 4 + len(data)] = data
        self.set(self.layout.counter("abort", self.rank), kind)

    def aborted(self) -> tuple[int, int, str] | None:
        """(rank, kind, cause) of the first peer that marked itself aborted, else None."""
        lay = self.layout
        for r in range(lay.world_size):
            if r == self.rank:
                continue
            kind = self.get(lay.counter("abort", r))
            if kind:
                off = lay.status_off + r * STATUS_BYTES + _STATUS_HEAD
                (n,) = struct.unpack_from("<I", self.mm, off)
                cause = bytes(self.mm[off + 4: off + 4 + min(n, STATUS_BYTES)]).decode(errors="replace")
                return r, kind, cause
        return None

    def raise_if_peer_aborted(self) -> None:
        hit = self.aborted()
        if hit is not None:
            r, kind, cause = hit
            raise ABORT_KINDS.get(kind, LaneFailureError)(f"rank {r} aborted: {cause}")

    # mailboxes ----------------------------------------------------------------------------------
    def _coll_round(self, post, read, participants, what: str, wait: bool = True, channel: int = 0) -> list | None:
        """One collective exchange: `post(offset)` writes this rank's slot, then (unless not
        `wait`) `read(rank, offset, seq)` reads each participant's once it has posted. Channel 1
        is a sequence of its own (the redo exchanges of comm/rounds.py), read at once."""
        if channel:
            self.redo_seq += 1
            seq, slots, ctrs, label = self.redo_seq, self._redo_slots, self._redo_ctr, "rebuild"
            k = seq % REDO_SLOTS
        else:
            if self.before_post is not None:
                self.before_post()
            self._settle_deferred()
            self.coll_seq += 1
            seq, slots, ctrs, label = self.coll_seq, self._coll_slots, self._coll_ctr, "collective"
            k = seq % COLL_SLOTS
        post(slots[self.rank][k])
        self.u32[ctrs[self.rank] // 4] = seq & 0xFFFFFFFF
        if not wait:
            return None
        deadline = time.monotonic() + envs.get("BRAID_TIMEOUT_S")
        out = []
        for r in participants:
            if r != self.rank:
                self.wait_geq(ctrs[r], seq, f"{label} #{seq} {what}", r, deadline)
            out.append(read(r, slots[r][k], seq))
        return out

    def exchange_collective(self, desc: dict, participants: list[int], channel: int = 0) -> list[dict]:
        """Post this rank's descriptor for the next collective and read every rank's."""
        return self._coll_round(lambda off: self._write(off, COLL_MBOX_BYTES, desc),
                                lambda r, off, seq: self._read(off), participants, desc.get("op"), channel=channel)

    def exchange_values(self, values: list[int], what: str, wait: bool = True) -> list[list[int]] | None:
        """Every rank's few non-negative integers for the next collective, without JSON: the
        same mailboxes and sequence as exchange_collective (one call of either per collective),
        for the decisions that must be agreed before a small call (a few microseconds, against
        ~150 for a descriptor). wait=False posts this rank's values and returns None at once: for
        a rank that already knows the outcome (its own values decide it); its next exchange must
        wait (see COLL_SLOTS)."""
        token = self.post_values(values)
        return self.read_values(token, what) if wait else None

    def post_values(self, values: list[int], hook: bool = True) -> tuple:
        """The first half of exchange_values: post this rank's values and return the token that
        read_values takes. A caller may do its own work between the two (the peers' posts land
        meanwhile); every post must be read or followed by a waiting exchange (see COLL_SLOTS).
        `hook` False: not through before_post (the deferred call's own post)."""
        seq = self.next_seq(hook)
        n = len(values)
        struct.pack_into(_VALUE_FMT[n] if n < len(_VALUE_FMT) else f"<I{n}Q", self.mm,
                         self._coll_slots[self.rank][seq % COLL_SLOTS], n, *values)
        self.u32[self._coll_ctr[self.rank] // 4] = seq & 0xFFFFFFFF
        return seq, n

    def next_seq(self, hook: bool = True) -> int:
        """The sequence number of this rank's next post, taken (post_values, and the native call
        that writes its post itself: comm/native_rounds.py FastCalls)."""
        if hook and self.before_post is not None:
            self.before_post()
        self._settle_deferred()
        self.coll_seq += 1
        return self.coll_seq

    def posted(self, token: tuple) -> bool:
        """Has every rank posted the exchange `token` (read_values would not wait)?"""
        seq = token[0]
        u32 = self.u32
        return all(((int(u32[c // 4]) - seq) & 0xFFFFFFFF) < 0x80000000 for c in self._coll_ctr)

    def read_values(self, token: tuple, what: str, spin_s: float | None = None) -> list[list[int]]:
        """Every rank's values of the exchange `token` (from post_values), in rank order, once
        each has posted them (a wait spins `spin_s`, default the segment's, then sleeps)."""
        seq, n = token
        fmt = _VALUE_FMT[n] if n < len(_VALUE_FMT) else f"<I{n}Q"
        k = seq % COLL_SLOTS
        u32, mm, me = self.u32, self.mm, self.rank
        out = []
        for r, ctr in enumerate(self._coll_ctr):
            if r != me and ((int(u32[ctr // 4]) - seq) & 0xFFFFFFFF) >= 0x80000000:
                self.wait_geq(ctr, seq, f"collective #{seq} {what}", r, None, spin_s)
            got = struct.unpack_from(fmt, mm, self._coll_slots[r][k])
            if got[0] != n:
                raise PeerMismatchError(f"{what}: rank {r} made a different call at collective #{seq} "
                                        f"(every rank must issue the same collectives in the same order)")
            out.append(list(got[1:]))
        return out

    def defer(self, token: tuple, what: str) -> None:
        """Put off reading the values of post `token` until the next exchange of any kind (or
        settle()): the peers' posts are read one collective late, when they have long landed. The
        slot rule (COLL_SLOTS) holds: the next post first reads this one, so every peer had posted
        it, and so had read everything before it."""
        self._deferred = (token, what)

    def _settle_deferred(self) -> None:
        if self._deferred is not None:
            token, what = self._deferred
            self._deferred = None
            self.deferred_values = self.read_values(token, what)

    def settle(self) -> list[list[int]] | None:
        """The values of the last deferred post (read now if no exchange has read them since),
        once; None if there was none."""
        self._settle_deferred()
        got, self.deferred_values = self.deferred_values, None
        return got

    # Point-to-point descriptors are matched per direction: rank a's k-th send to b meets b's k-th
    # recv from a, whatever else the two exchange in between (b's own sends to a use other
    # mailboxes). Mailbox (writer, reader, role): role 0 is written by the direction's sender,
    # role 1 by its receiver, P2P_DEPTH slots each (seq % depth); roles 2 and 3 are the same for
    # a second channel with sequence numbers of its own (a prepared send posts one message a call
    # on channel 0, its receiver's replies come back on channel 1 in call order, comm/pairs.py:
    # replies never take a place in the sequence of the sends). The reader
    # acknowledges each descriptor it read; a writer reuses a slot only once its previous occupant
    # was acknowledged, so up to P2P_DEPTH calls per direction may be posted ahead of the peer.
    def _p2p_slot(self, writer: int, reader: int, role: int, seq: int) -> int:
        lay = self.layout
        idx = ((writer * lay.world_size + reader) * P2P_ROLES + role) * P2P_DEPTH + seq % P2P_DEPTH
        return lay.mbox_p2p_off + idx * P2P_MBOX_BYTES

    def _p2p_counter(self, writer: int, reader: int, role: int, name: str = "mbox_p2p") -> int:
        key = (writer, reader, role, name)
        off = self._p2p_offs.get(key)
        if off is None:
            off = self._p2p_offs[key] = self.layout.counter(name, (writer * self.layout.world_size + reader) * P2P_ROLES + role)
        return off

    def post_pair(self, desc: dict | int, peer: int, sending: bool, channel: int = 0) -> tuple:
        """Post this rank's descriptor for its next call in the direction (src, dst) on `channel`
        (0 or 1); returns the token that `poll_pair`/`wait_pair` read the peer's matching
        descriptor with."""
        if self.before_post is not None:
            self.before_post()
        direction = (self.rank, peer) if sending else (peer, self.rank)
        key = (direction, channel)
        seq = self.p2p_seq.get(key, 0) + 1
        role = (0 if sending else 1) + 2 * channel
        if seq > P2P_DEPTH:       # the slot's previous descriptor must have been read by the peer
            ack = self._p2p_counter(self.rank, peer, role, "mbox_p2p_ack")
            if not geq(self.get(ack), seq - P2P_DEPTH):        # (most often it was: no wait to set up)
                self.wait_geq(ack, seq - P2P_DEPTH,
                              f"{'send_recv' if isinstance(desc, int) else desc.get('op')} #{seq - P2P_DEPTH} "
                              f"(posted {P2P_DEPTH} ahead)", peer, None)
        self.p2p_seq[key] = seq
        off = self._p2p_slot(self.rank, peer, role, seq)
        if isinstance(desc, int):       # a word (prepared send/recv): 12 bytes, no JSON
            struct.pack_into("<Iq", self.mm, off, WORD_MARK, desc)
        else:
            self._write(off, P2P_MBOX_BYTES, desc)
        self.set(self._p2p_counter(self.rank, peer, role), seq)
        return self.pair_token(peer, not sending, channel, seq, "send_recv" if isinstance(desc, int) else desc.get("op"))

    @staticmethod
    def pair_token(peer: int, from_sender: bool, channel: int, seq: int, what: str = "send_recv") -> tuple:
        """The token of message `seq` that `peer` posted to this rank on `channel` as the sender
        (from_sender) or the receiver of the direction, for poll_pair/wait_pair (the same as
        this rank's own post_pair of the other side returns)."""
        return peer, (0 if from_sender else 1) + 2 * channel, seq, what

    def pair_read(self, peer: int, sending: bool, channel: int = 0) -> int:
        """How many of this rank's messages to `peer` on `channel` (as the direction's sender, or
        its receiver) the peer has read."""
        return self.get(self._p2p_counter(self.rank, peer, (0 if sending else 1) + 2 * channel, "mbox_p2p_ack"))

    def _take(self, token: tuple) -> dict:
        peer, role, seq, _ = token
        got = self._read(self._p2p_slot(peer, self.rank, role, seq))
        self.set(self._p2p_counter(peer, self.rank, role, "mbox_p2p_ack"), seq)
        return got

    def poll_pair(self, token: tuple) -> dict | None:
        """The peer's matching descriptor if it has been posted, else None (never blocks)."""
        peer, role, seq, _ = token
        if not geq(self.get(self._p2p_counter(peer, self.rank, role)), seq):
            return None
        return self._take(token)

    def wait_pair(self, token: tuple) -> dict:
        peer, role, seq, what = token
        deadline = time.monotonic() + envs.get("BRAID_TIMEOUT_S")
        self.wait_geq(self._p2p_counter(peer, self.rank, role), seq, f"{what} #{seq}", peer, deadline)
        return self._take(token)

    def exchange_pair(self, desc: dict, peer: int, sending: bool) -> dict:
        """Post this rank's descriptor for the next call with `peer` and wait for the peer's."""
        return self.wait_pair(self.post_pair(desc, peer, sending))

    def _write(self, off: int, cap: int, desc: dict) -> None:
        data = json.dumps(desc, separators=(",", ":")).encode()
        if len(data) + 4 > cap:
            raise PeerMismatchError(f"call descriptor of {len(data)} bytes exceeds the mailbox ({cap})")
        struct.pack_into("<I", self.mm, off, len(data))
        self.mm[off + 4: off + 4 + len(data)] = data

    def _read(self, off: int) -> dict:
        (n,) = struct.unpack_from("<I", self.mm, off)
        if n == WORD_MARK:
            return {"e": struct.unpack_from("<q", self.mm, off + 4)[0]}
        return json.loads(bytes(self.mm[off + 4: off + 4 + n]))

    def close(self, quiet: bool = False) -> None:
        """Unmap the segment. Where views of it are still alive the mapping stays until they go
        (or the process exits): a warning, or a debug line with `quiet` (at interpreter exit,
        where the exit releases it)."""
        if self.closed:
            return
        self.closed = True
        self.u32 = None
        self.buf = None
        try:
            self.mm.close()
        except BufferError:
            (log.debug if quiet else log.warning)("braid: node segment still referenced at close; it is freed at exit")
