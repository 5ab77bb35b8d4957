"""The Communicator: braid's ops over a torch.distributed world, split across lanes.

Each op: check arguments locally -> decide the split (shares) -> either NCCL's own op when NCCL
alone is best (small messages), or: exchange call descriptors through the node segment (every
rank sees every rank's sizes, dtype, IPC handle), check that they agree, plan, and run the plan on
the lanes. Calls return at once; `async_op=False` makes the current stream wait (GPU) or blocks
until done (CPU), like torch.distributed.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import socket
import time
import weakref
from typing import Iterator

import torch
import torch.distributed as dist

from . import envs
from .collectives import check_rank, flat_bytes, input_bytes, output_bytes, same_dtype, split_bytes
from .errors import BraidTimeoutError, LaneFailureError, LaneUnavailableError, MisuseError, PeerMismatchError
from .collectives.reduce import REDUCE_DTYPES
from .executor import Handle, execute
from .lanes.base import LaneRun
from .node import Layout, NodeSegment
from .planner.model import LaneCost, choose_with_native
from .planner.plan import (CPU_LANES, GPU_LANES, LaneKind, all_gather_movement, all_to_all_movement,
                           Plan, broadcast_movement, p2p_movement, split)
from .planner.rings import COLL, PAIR, RingCursor, ring_id

log = logging.getLogger("braid")

# Lane costs before any calibration (HARDWARE.md orders of magnitude; CPU: a guess the
# calibration replaces). Bandwidth is the op's algorithm bandwidth on that lane alone.
DEFAULT_COSTS = {
    "ce": LaneCost(12.0, 360.0), "nccl": LaneCost(10.0, 320.0), "host": LaneCost(30.0, 30.0),
    "gloo": LaneCost(150.0, 1.0), "shm": LaneCost(60.0, 2.0),
}
P2P_DESC_BYTES = 2048
ROUTE_MIN_BYTES = 1 << 20    # NIMBLE: multipath off at or below 1 MB
DESC_MEMO = 16               # full descriptor exchanges remembered for repeated calls (_exchange_node)
SMALL_RUN = 16               # agreed-small uneven calls in a row after which their agreement is read one call late
_DECLINED = object()         # a skewed call's routing decision: the native collective, not a share split
class _NativeDone(Handle):
    """last_handle after a synchronous fast-path call: the native library (NCCL on GPUs, gloo on a
    CPU communicator) took the whole call, already waited."""

    def __init__(self, lane: str):
        super().__init__(native=None)
        self.native_lane = lane
        self._waited = True

    @property
    def shares(self) -> dict[str, float]:
        return {self.native_lane: 1.0}


_NATIVE_DONE = {True: _NativeDone("nccl"), False: _NativeDone("gloo")}    # by communicator.cuda
NATIVE_SHARE_REDS = ("sum", "avg", "min", "max", "product")   # NCCL's own all_reduce may take a share
# the fast path's kinds as braid's op names (the call ledger speaks braid's names)
_OP_OF = {"allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter",
          "alltoall": "all_to_all_single", "broadcast": "broadcast", "reduce": "reduce"}
_RED_T = type(dist.ReduceOp.SUM)    # plain reduce ops (premul-sum comes as another type); singletons
_FAST_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT)
OPS = ("send_recv", "broadcast", "all_gather", "all_to_all_single", "all_reduce", "reduce_scatter", "reduce")


class Communicator:
    """braid over the default torch.distributed group (one process per GPU, or CPU processes).

    Lanes: nccl, ce and host for CUDA tensors; gloo and shm for CPU tensors. `lanes` (or
    BRAID_LANES) restricts them; unavailable lanes are skipped with one log line.
    """

    def __init__(self, group=None, lanes: list[str] | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise MisuseError("braid.Communicator needs torch.distributed initialised first: "
                              "dist.init_process_group('nccl' or 'gloo') (torchrun sets the rendezvous)")
        if group is not None and group is not dist.group.WORLD and dist.get_world_size(group) != dist.get_world_size():
            raise MisuseError("braid supports the default (world) group in this version; pass group=None")
        level = str(envs.get("BRAID_LOG_LEVEL")).upper()
        log.setLevel(getattr(logging, level, logging.WARNING))
        if not log.handlers and not logging.getLogger().handlers:
            logging.basicConfig(format="%(name)s %(levelname)s: %(message)s")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.closed = False
        self._fixed: dict[str, dict[str, float]] | None = None
        self.last_handle: Handle | None = None
        self.calib: dict[str, dict[str, LaneCost]] = {}
        self.pays: dict[str, dict[int, bool | str | dict]] = {}
        self.calib_digest = "default"
        self._share_cache: dict = {}
        self._native_cache: dict = {}
        self._fast_ar: dict = {}     # the fast path's answers per op (see _fast_put)
        self._fast_rs: dict = {}
        self._fast_ag: dict = {}
        self._fast_a2a: dict = {}
        self._fast_a2av: dict = {}   # uneven all_to_all: (in, out elements) -> shape facts, may agree fast
        self._small_run = 0          # uneven calls in a row agreed small (see _uneven_small)
        self._desc_memo: dict = {}   # every rank's descriptor digest -> those descriptors (recent full exchanges)
        self._fast_bc: dict = {}
        from .planner.balancer import OnlineBalancer
        self.balancer = OnlineBalancer()
        self.adapt = True                    # stage 2 on; comm.adapt = False freezes the shares
        self._pending: dict[str, tuple] = {}   # op -> (bucket key, shares used, handle) of its last split call
        from .collectives.routed import RoutedAllToAll
        self._routed = RoutedAllToAll(self.world_size)
        self._routed_seq = 0                    # skewed calls observed so far (same on every rank)
        self._routed_pending: list = []         # [seq, handle, cycle, times] of each observed call
        self._cycle_open = None                 # the last skewed call's cycle, ended by the next one
        self.routing = envs.get("BRAID_ROUTE")      # skewed all_to_all through the router: auto/on/off
        self.last_route: tuple[float, float] | None = None
        self._p2p_pending: list["PendingP2P"] = []                  # posted, peer's side not read yet
        self._staged_buf = None                 # reductions' slot scratch on GPUs, reused
        self._staged_end = None                 # the last staged reduction's end event
        self._ce_red = None
        self._nccl_stream = None                # NCCL's share of split all_reduces
        self.slowdown: dict[str, float] = {}   # test/bench hook: CPU lane -> time multiplier
        self.check = envs.get("BRAID_CHECK")   # read once, when the communicator is created
        # the call ledger: collective calls made so far (every path), and the last one as
        # (op, bytes, dtype, path); published to the node segment so that peers can tell a
        # mismatch from a slow rank and name both calls (see _on_wait)
        self.ncalls = 0
        self.last_call: tuple = ("", 0, None, "")
        self.aborted = ""                   # why abort() was called (the communicator is unusable)
        self._plan_cache: dict = {}
        wanted = lanes if lanes is not None else envs.get("BRAID_LANES")
        known = [k.value for k in LaneKind]
        unknown = [x for x in (wanted or ()) if str(x) not in known]
        if unknown:
            raise MisuseError(f"unknown lane(s) {unknown} (from {'lanes=' if lanes is not None else 'BRAID_LANES'}); "
                              f"valid lanes: {known}")
        self.wanted = None if wanted is None else {LaneKind(str(x)).value for x in wanted}

        self.gloo_group = dist.new_group(backend="gloo")
        # GPU lanes under an NCCL default group, or under braid's own backend (its default group
        # is braid's: whole calls then go to braid's NCCL group below, never to the default group)
        backend = str(dist.get_backend()).lower()
        self.cuda = torch.cuda.is_available() and dist.is_nccl_available() and ("nccl" in backend or backend == "braid")
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        ids = [None] * self.world_size
        dist.all_gather_object(ids, (socket.gethostname(), _boot_id(), os.getpid(),
                                     self.device.index if self.cuda else -1), group=self.gloo_group)
        self.single_node = len({(h, b) for h, b, _, _ in ids}) == 1
        if self.cuda:
            _check_gpus_per_host(ids)

        self.layout = self.segment = self.segment_tensor = self.seg_dev_ptr = None
        self.ring_cursors: dict[tuple, RingCursor] = {}
        if self.single_node:
            self._open_segment()
        self.nccl_group = None
        if self.cuda:
            self.nccl_group = dist.new_group(backend="nccl")
            warm = torch.zeros(1, device=self.device)
            dist.all_reduce(warm, group=self.nccl_group)   # create the NCCL communicator now
        # where whole calls go to NCCL's own collective: the default group when it is NCCL (the
        # communicator the caller's own NCCL calls use: measured ~10 us per call faster at 1-4 MiB
        # than a second communicator from new_group on 2 and 4 x H200), else braid's group. The
        # nccl lane's share of split calls stays on braid's group, beside the other lanes.
        self.native_group = self.nccl_group
        if self.cuda and "nccl" in str(dist.get_backend()).lower():
            self.native_group = dist.group.WORLD
        self._fast_be = _backend_of(self.native_group, self.device) if self.cuda else None
        # the fast path's library call: NCCL's group on GPUs; on a CPU communicator, gloo's own
        # (never the default group: under init_process_group("braid") that is braid itself)
        self._fast_group = self.native_group if self.cuda else self.gloo_group
        self._fast_opts: dict = {}
        self._native_done = _NATIVE_DONE[self.cuda]     # last_handle after a whole native call
        self._lanes = self._make_lanes()
        self.watchdog = None
        if self.segment is not None:
            me = weakref.ref(self)        # the segment and the watchdog must not keep self alive
            self.segment.on_wait = lambda *a: _call(me, "_on_wait", *a)
            self.segment.on_timeout = lambda *a: _call(me, "_on_timeout", *a)
            self.watchdog = _Watchdog(self.segment, self.rank, self.world_size, self.cuda,
                                      status=lambda: _call(me, "_status"),
                                      on_peer_abort=lambda why: _call(me, "_abort_native", why))
        self._closer = weakref.finalize(self, _finalize, self.segment, self.seg_dev_ptr, self.watchdog)
        self.load_calibration()

    # set-up -----------------------------------------------------------------------------------
    def _open_segment(self) -> None:
        chunk = envs.get("BRAID_HOST_CHUNK_KB") << 10
        wanted_budget = envs.get("BRAID_HOST_BUFFER_MB") << 20   # every rank reads (and rejects) settings
        # CPU relays stage in the segment; GPU relays stage in device memory (a small area here
        # serves CPU tensors passed to a GPU communicator)
        wanted_relay = (1 << 20) if self.cuda else envs.get("BRAID_RELAY_BUFFER_MB") << 20
        box = [None]
        if self.rank == 0:     # decide the size, create the segment, then tell the others its name
            budget, relay = _fit_shm(self.world_size, wanted_budget, chunk, wanted_relay)
            self.layout = Layout(self.world_size, budget, chunk, relay)
            box = [(NodeSegment.new_name(), budget, relay)]
            self.segment = NodeSegment(box[0][0], self.layout, self.rank, create=True, spin_s=self._spin_s())
        dist.broadcast_object_list(box, src=0, group=self.gloo_group)
        name, budget, relay = box[0]
        self.layout = Layout(self.world_size, budget, chunk, relay)
        name = [name]
        try:
            if self.rank != 0:
                self.segment = NodeSegment(name[0], self.layout, self.rank, create=False, spin_s=self._spin_s())
        finally:
            dist.barrier(group=self.gloo_group)
            if self.rank == 0:
                self.segment.unlink()          # nothing stays in /dev/shm, even after a crash
        self.segment_tensor = torch.frombuffer(self.segment.mm, dtype=torch.uint8)
        for r in range(self.world_size):
            self.ring_cursors[ring_id(COLL, r)] = RingCursor(self.layout.coll_rings[r].num_slots)
            for d in range(self.world_size):
                if d != r:
                    self.ring_cursors[ring_id(PAIR, r, d)] = RingCursor(self.layout.pair_rings[(r, d)].num_slots)
        if self.cuda:
            try:
                from .lanes import _cuda
                self.seg_dev_ptr = _cuda.host_register(self.segment.address, self.layout.total_bytes)
            except (OSError, Exception) as exc:   # no driver symbol, registration refused
                log.warning("braid: cannot pin the node segment (%s); ce and host lanes are off", exc)
                self.seg_dev_ptr = None

    def _spin_s(self) -> float:
        return 0.002 if self.cuda else 0.00005

    def _make_lanes(self) -> dict[str, object]:
        from .lanes.gloo import GlooLane
        from .lanes.shm import ShmLane
        lanes: dict[str, object] = {"gloo": GlooLane(self.gloo_group), "shm": ShmLane(self)}
        if self.cuda:
            from .lanes.ce import CeLane
            from .lanes.host import HostLane
            from .lanes.nccl import NcclLane
            lanes["nccl"] = NcclLane(self.nccl_group, self.device)
            lanes["ce"] = CeLane(self, self.device)
            lanes["host"] = HostLane(self, self.device)
        from .lanes.relay import RelayLane     # GPU or CPU engine, picked per call by the tensors
        lanes["relay"] = RelayLane(self, lanes.get("ce"), self.device if self.cuda else None)
        self.unavailable: dict[str, str] = {}
        for name, lane in list(lanes.items()):
            ok, why = lane.available()
            if not ok:
                self.unavailable[name] = why
                if self.wanted is not None and name in self.wanted:    # asked for by name: say so
                    log.warning("braid: lane %s was asked for but is not available: %s", name, why)
                elif self.wanted is None:
                    log.info("braid: lane %s is not available: %s", name, why)
        if self.wanted is not None:
            for name in self.wanted:
                if name not in lanes:
                    self.unavailable[name] = "needs CUDA tensors and an NCCL backend" if name in ("nccl", "ce", "host") else "unknown"
        return lanes

    def lane(self, name: str):
        return self._lanes[name]

    def lanes_for(self, device: torch.device) -> list[str]:
        """Lane names usable here for tensors on `device`, in plan order."""
        kinds = GPU_LANES if device.type == "cuda" else CPU_LANES
        return [k.value for k in kinds if k.value in self._lanes and k.value not in self.unavailable
                and (self.wanted is None or k.value in self.wanted)]

    def ring_chunk(self, p2p: bool) -> int:
        if p2p:
            return next(iter(self.layout.pair_rings.values())).slot_bytes
        return self.layout.coll_rings[0].slot_bytes

    # shares -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def fixed_shares(self, shares: dict[str, float] | None, op: str = "*") -> Iterator[None]:
        """Use these shares for every op (or one op) inside the block (tests, calibration, bench)."""
        old = self._fixed
        self._fixed = None if shares is None else {**(old or {}), op: dict(shares)}
        self._native_cache.clear()
        self._fast_clear()
        try:
            yield
        finally:
            self._fixed = old
            self._fast_clear()

    def shares_for(self, op: str, nbytes: int, lanes: list[str]) -> dict[str, float]:
        if not lanes:
            raise LaneUnavailableError(f"{op}: no lane can move these tensors here "
                                       f"(unavailable: {self.unavailable}, BRAID_LANES={self.wanted})")
        if self._fixed is not None:
            fixed = self._fixed.get(op, self._fixed.get("*"))
            if fixed is not None:
                missing = [k for k, v in fixed.items() if v > 0 and k not in lanes]
                if missing:
                    raise LaneUnavailableError(f"{op}: lanes {missing} were asked for but are not available here: "
                                               f"{ {k: self.unavailable.get(k, 'not usable for this device') for k in missing} }")
                return {k: v for k, v in fixed.items() if v > 0}
        key = (op, nbytes, tuple(lanes), self.calib_digest)
        shares = self._share_cache.get(key)
        if shares is None:
            table = self.calib.get(f"{op}/{self.world_size}", {})
            costs = {k: table.get(k, DEFAULT_COSTS[k]) for k in lanes}
            shares = self.split_rule(op, costs, nbytes)
            if len(shares) > 1:
                verdict = self._split_verdict(op, nbytes)
            elif op in ("all_reduce", "reduce_scatter") and set(shares) <= {"nccl", "gloo"}:
                # the model keeps NCCL alone: a lane measured faster alone in this very size
                # bucket (calibrate.ALONE_CHECK) replaces it; nothing else overrides the model
                verdict = self._split_verdict(op, nbytes, exact=True)
                verdict = verdict if isinstance(verdict, str) else True
            else:
                verdict = True
            if isinstance(verdict, dict):               # the split, balanced at calibration
                if len(shares) > 1 and set(verdict) <= set(lanes):
                    shares = dict(verdict)
            elif isinstance(verdict, str) and verdict in lanes:
                shares = {verdict: 1.0}                 # a lane alone measured fastest here
            elif verdict is not True and ("nccl" in lanes or "gloo" in lanes):
                shares = {next(k for k in ("nccl", "gloo") if k in lanes): 1.0}
            if len(self._share_cache) > 4096:
                self._share_cache.clear()
            self._share_cache[key] = shares
        if len(shares) > 1 and self.adapt:
            bkey = self._bucket(op, nbytes, shares)
            self.balancer.start(bkey, shares)
            return self.balancer.shares(bkey)
        return shares

    def _split_verdict(self, op: str, nbytes: int, exact: bool = False) -> bool | str | dict:
        """The calibration's verdict for the nearest measured size bucket (with `exact`, only this
        size's own bucket): True (nothing measured, or an old table's split), the split's shares as
        balanced there (a dict: the split measured fastest), False (the native lane alone), or the
        name of the lane that alone measured fastest (`calibrate.split_pays`)."""
        pays = self.pays.get(f"{op}/{self.world_size}")
        if not pays:
            return True
        b = max(0, int(math.log2(max(nbytes, 1))))
        if exact:
            return pays.get(b, True)
        nearest = min(pays, key=lambda m: (abs(m - b), -m))
        return pays[nearest]

    def _balancer_key(self, op: str, nbytes: int, lanes: list[str]):
        """The balancer bucket of this call: keyed by the model's split for it (the balancer may
        have parked a lane since, so the shares in use can name fewer lanes)."""
        model = self._share_cache.get((op, nbytes, tuple(lanes), self.calib_digest))
        return self._bucket(op, nbytes, model) if model and len(model) > 1 else None

    @staticmethod
    def _bucket(op: str, nbytes: int, shares: dict[str, float]) -> tuple:
        from .planner.balancer import OnlineBalancer
        return OnlineBalancer.bucket(op, nbytes) + (tuple(sorted(shares)),)

    def _observation(self, op: str):
        """The last split call of this op, if it has finished here: (bucket, shares, lane times)."""
        pending = self._pending.pop(op, None)
        if pending is None:
            return None
        bkey, used, handle = pending
        if not handle.is_completed():
            return None
        return [list(bkey[:2]) + [list(bkey[2])], used, handle.lane_times_us()]

    def _learn(self, descs: list) -> None:
        """Feed the balancer the slowest rank's lane times of the previous split call, when every
        rank reported it (so every rank makes the same move)."""
        obs = [d.get("obs") for d in descs if d is not None]
        if not obs or any(o is None for o in obs):
            return
        first = obs[0]
        if any(o[0] != first[0] or o[1] != first[1] for o in obs):
            return
        bkey = (obs[0][0][0], obs[0][0][1], tuple(obs[0][0][2]))
        times = {k: max(o[2].get(k, 0.0) for o in obs) for k in obs[0][1]}
        self.balancer.observe(bkey, obs[0][1], times)

    def split_rule(self, op: str, costs: dict[str, LaneCost], nbytes: int) -> dict[str, float]:
        """Shares from lane costs. braid's broadcast lanes are stars from the root (every peer
        reads the root), which only pays for 2 ranks; beyond that the copy engines sit out."""
        exclude = ("ce",) if op == "broadcast" and self.world_size > 2 else ()
        return choose_with_native(costs, nbytes, "nccl", exclude,
                                  single_ok=op in ("all_reduce", "reduce_scatter"),
                                  native_share=op == "all_reduce" and self.cuda)

    def _native_ok(self, shares: dict[str, float]) -> bool:
        """One lane that is a library of its own (NCCL, gloo): call its collective directly."""
        return len(shares) == 1 and next(iter(shares)) in ("nccl", "gloo") and not self.check

    def _native_group(self, shares: dict[str, float]):
        return self.native_group if "nccl" in shares else self.gloo_group

    def _native_for(self, op: str, nbytes: int) -> bool:
        """Cached: will this op at this size go to the native library's own call (NCCL on GPUs,
        gloo on CPU communicators)? (the small-message fast path)"""
        if self._fixed is not None or self.check:
            return False
        key = (op, nbytes, self.calib_digest)
        hit = self._native_cache.get(key)
        if hit is None:
            lanes = self.lanes_for(self.device)
            # a world of one rank has nothing to split: the native library's call is a local copy
            hit = bool(lanes) and (self.world_size == 1 or self._native_ok(self.shares_for(op, nbytes, lanes)))
            if len(self._native_cache) > 4096:
                self._native_cache.clear()
            self._native_cache[key] = hit
        return hit

    def _fast_ok(self, *tensors) -> bool:
        """Cheap checks for the fast path: CUDA tensors on our device, contiguous. Anything else
        takes the full path, which validates and explains."""
        if not self.cuda or self.closed:
            return False
        idx = self.device.index
        for t in tensors:
            if type(t) is not torch.Tensor or not t.is_cuda or t.get_device() != idx or not t.is_contiguous():
                return False
        return True

    # the braid backend's forwarding ------------------------------------------------------------
    # Under init_process_group("braid"), a call that the native library takes whole goes from the
    # backend straight to its inner NCCL (gloo) group, with torch's own options object, and the
    # caller gets that library's Work: its future, its stream semantics, no braid object per call.
    # These read the fast path's answer for the call shape; a shape not seen yet answers False, so
    # its first call takes the full path, which fills the answer in (the same facts on every rank).
    def _takes(self, t) -> bool:
        """A tensor the fast path's answers apply to (all_reduce's test is written out in the
        backend: the same as whole_reduce_scatter's, for one tensor)."""
        return (type(t) is torch.Tensor and t.is_cuda is self.cuda and t.is_contiguous() and not self.closed
                and not self.aborted)

    def whole_reduce_scatter(self, out, inp, op) -> bool:
        if not (self._takes(inp) and self._takes(out)):
            return False
        ent = self._fast_rs.get(inp.numel())
        return (ent is not None and ent[-1] and ent[0] is inp.dtype and ent[1] == op
                and ent[2] == out.numel() and out.dtype is inp.dtype)

    def whole_all_gather(self, out, inp) -> bool:
        if not (self._takes(inp) and self._takes(out)):
            return False
        ent = self._fast_ag.get(inp.numel())
        return ent is not None and ent[-1] and ent[0] is inp.dtype and ent[1] == out.numel() and out.dtype is inp.dtype

    def whole_broadcast(self, t, root: int) -> bool:
        if not self._takes(t):
            return False
        ent = self._fast_bc.get(t.numel())
        return ent is not None and ent[-1] and ent[0] is t.dtype and ent[1] == root

    def whole_all_to_all(self, out, inp) -> bool:
        """Balanced all_to_all_single (no split sizes) only: uneven calls agree per call."""
        if not (self._takes(inp) and self._takes(out)) or inp.dim() == 0:
            return False
        ent = self._fast_a2a.get(inp.numel())
        return (ent is not None and ent[-1] and ent[0] is inp.dtype and ent[1] == inp.size(0)
                and ent[2] == out.numel() and out.dtype is inp.dtype)

    def _ipc_maps(self) -> int:
        """Peer buffers the copy-engine lane has opened so far (a routed call that opened one
        paid for it: its host time is not the steady cost)."""
        return len(getattr(self._lanes.get("ce"), "maps", ()))

    def _routed_observation(self) -> list:
        """[seq, lane times] of each observed skewed call that has finished here, oldest first
        (reported in descriptors until every rank has reported it in the same call)."""
        out = []
        for p in self._routed_pending:
            seq, handle, cycle, times = p
            if times is None:
                if not cycle.done() or (handle is not None and not all(r.done() for r in handle.runs)):
                    break
                times = {k: round(v, 1) for k, v in handle.lane_times_us().items()} if handle is not None else {}
                times["cycle"] = round(cycle.elapsed_us(), 1)
                p[1:] = [None, None, times]          # drop the handle and events, keep the numbers
            out.append([seq, times])
        return out

    def _observe(self, handle, cycle) -> None:
        """Time this skewed call (routed: `handle`'s lanes too) when the routing decision wants it
        as a sample (`cycle` was made for it); its cycle ends at the next skewed call's start."""
        rt = self._routed
        self._cycle_open = cycle
        if cycle is None:
            return
        self._routed_seq += 1
        self._routed_pending.append([self._routed_seq, handle, cycle, None])
        rt.expect(self._routed_seq)

    def _fast_put(self, table: dict, n: int, sig: tuple, hit: bool) -> tuple:
        """The fast path (whole calls that the native library's own collective takes: NCCL for
        CUDA tensors, gloo on a CPU communicator; e.g. every small message) costs a few Python
        steps per call: the answer for a call shape
        (element count -> dtype and the other shape facts, then the answer) is computed once
        here, with the full checks, and kept until it may change (fixed shares, a new
        calibration, close). NCCL (gloo) checks device and layout itself, with its own errors."""
        if len(table) > 1024:
            table.clear()
        ent = table[n] = sig + (bool(hit) and not self.closed and not self.aborted,)
        return ent

    def _fast_clear(self) -> None:
        for t in (self._fast_ar, self._fast_rs, self._fast_ag, self._fast_a2a, self._fast_a2av, self._fast_bc):
            t.clear()

    def _finish(self, work, async_op: bool):
        handle = Handle(native=work)
        handle.native_lane = "nccl" if self.cuda else "gloo"
        self.last_handle = handle
        if async_op:
            return handle
        work.wait()
        return None

    def _opts(self, kind: str, async_op: bool, op=None, root: int = 0):
        """torch's options object for a fast-path call, built once per (kind, op, root, async)."""
        key = (kind, op, root, async_op)
        o = self._fast_opts.get(key)
        if o is None:
            o = _OPTS[kind]()
            if op is not None:
                o.reduceOp = op
            if kind in ("broadcast", "reduce"):
                o.rootRank, o.rootTensor = root, 0
            if hasattr(o, "asyncOp"):
                o.asyncOp = async_op     # synchronous: NCCL runs on the caller's stream (torch >= 2.8)
            if len(self._fast_opts) > 256:
                self._fast_opts.clear()
            self._fast_opts[key] = o
        return o

    def _native_fast(self, method: str, args: tuple, kind: str, async_op: bool, op=None, root: int = 0,
                     fallback=None, counted: bool = False):
        """The fast path's call: the NCCL backend's own method with cached options, as
        torch.distributed's wrapper would make it, without the wrapper's per-call checks (the
        fast path made them once per call shape). Without that backend object: `fallback`."""
        x = args[1] if len(args) > 1 else (args[0][0] if type(args[0]) is list else args[0])
        if not counted:
            self.ncalls += 1
        self.last_call = (_OP_OF[kind], x.numel() * x.element_size(), x.dtype, "whole")
        be = self._fast_be
        if be is None:
            if self._p2p_pending and not self.cuda:    # as _run does before a collective (CPU)
                self._flush_p2p()
            work = fallback(async_op)
        else:
            work = getattr(be, method)(*args, self._opts(kind, async_op, op, root))
        if async_op:
            return self._finish(work, True)
        if work is not None:
            work.wait()
        self.last_handle = self._native_done
        return None

    # descriptor exchange --------------------------------------------------------------------------
    def _exchange_node(self, desc: dict) -> list:
        """Every rank's descriptor for a collective through the node segment. A call repeating a
        recently exchanged one on every rank (same shapes, buffers, lanes, nothing new to report:
        a training loop's buckets, a bench loop) needs no JSON round: each rank posts a 63-bit
        digest of its descriptor (`hash` of its repr, stable within the process), and when every
        rank's digests match those of one of the last DESC_MEMO full exchanges, that exchange's
        descriptors are the answer (4 x H200: the JSON round took 50-260 us of a 256 MiB
        reduce_scatter's ~470). Otherwise the full exchange follows. Every rank decides from the
        same posted values and the same memo, so all take the same branch."""
        seg = self.segment
        digest = hash(repr(desc)) & 0x7FFFFFFFFFFFFFFF
        key = tuple(g[0] for g in seg.read_values(seg.post_values([digest]), str(desc.get("op"))))
        memo = self._desc_memo
        hit = memo.get(key)
        if hit is not None:
            return list(hit)
        descs = seg.exchange_collective(desc, list(range(self.world_size)))
        if len(memo) >= DESC_MEMO:
            memo.pop(next(iter(memo)))
        memo[key] = descs
        return descs

    def _exchange(self, desc: dict, inp: torch.Tensor | None, lanes: list[str], peer: int | None = None) -> list:
        desc = dict(desc, lanes=lanes, calib=self.calib_digest, rank=self.rank)
        if "ce" in lanes:
            desc.update(self._lanes["ce"].descriptor(inp))
        if self.segment is not None:
            if peer is None:
                return self._exchange_node(desc)
            got = [None] * self.world_size
            got[self.rank] = desc
            got[peer] = self.segment.exchange_pair(desc, peer, desc.get("src") == self.rank)
            return got
        if peer is not None:   # no shared segment: the pair swaps descriptors through gloo
            got = [None] * self.world_size
            got[self.rank] = desc
            data = json.dumps(desc).encode()
            mine = torch.zeros(P2P_DESC_BYTES, dtype=torch.uint8)
            mine[:4] = torch.tensor(list(len(data).to_bytes(4, "little")), dtype=torch.uint8)
            mine[4:4 + len(data)] = torch.tensor(list(data), dtype=torch.uint8)
            theirs = torch.zeros(P2P_DESC_BYTES, dtype=torch.uint8)
            first = self.rank < peer
            for step in (0, 1):
                if (step == 0) == first:
                    dist.send(mine, peer, group=self.gloo_group)
                else:
                    dist.recv(theirs, peer, group=self.gloo_group)
            raw = bytes(theirs.tolist())
            got[peer] = json.loads(raw[4:4 + int.from_bytes(raw[:4], "little")])
            return got
        got = [None] * self.world_size
        dist.all_gather_object(got, desc, group=self.gloo_group)
        return got

    @staticmethod
    def _agree(op: str, descs: list, keys: tuple[str, ...]) -> None:
        present = [(r, d) for r, d in enumerate(descs) if d is not None]
        for key in keys:
            values = {r: d.get(key) for r, d in present}
            vals = list(values.values())
            if all(v == vals[0] for v in vals):
                continue               # equal as objects (the common case: no serialising)
            if len(set(map(json.dumps, vals))) > 1:       # a tuple and a list may still be equal
                raise PeerMismatchError(f"{op}: ranks disagree on {key}: {values}. Every rank must pass "
                                        f"matching arguments to the same call.")

    @staticmethod
    def _agreed_lanes(descs: list) -> list[str]:
        sets = [set(d["lanes"]) for d in descs if d is not None]
        first = next(d["lanes"] for d in descs if d is not None)
        return [k for k in first if all(k in s for s in sets)]

    # the common path of every op ---------------------------------------------------------------------
    @torch.no_grad()
    def _run(self, op: str, desc: dict, size: int, inp, outs, movement_of, native, agree_keys,
             async_op: bool, peer: int | None = None, always_exchange: bool = False,
             multi=None, route=None, counted: bool = False) -> Handle | None:
        """The full path of every op (see _run_call); a fault it raises is also marked in the
        node segment, so peers waiting for this rank raise at once with its cause. `counted`:
        the call is in the ledger already (it agreed on something before coming here). Nothing
        here is recorded by autograd: a collective writes into its tensors as NCCL does, also
        into tensors that require grad (double backward through DDP reduces such gradients)."""
        try:
            return self._run_call(op, desc, size, inp, outs, movement_of, native, agree_keys, async_op,
                                  peer, always_exchange, multi, route, counted)
        except (PeerMismatchError, BraidTimeoutError, LaneFailureError) as exc:
            self._give_up(exc)
            raise

    def _run_call(self, op: str, desc: dict, size: int, inp, outs, movement_of, native, agree_keys,
                  async_op: bool, peer: int | None, always_exchange: bool, multi, route,
                  counted: bool) -> Handle | None:
        self._check_open()
        if peer is None and self._p2p_pending:
            self._flush_p2p()
        device = (inp if inp is not None else outs[0]).device
        lanes = self.lanes_for(device)
        shares = self.shares_for(op, size, lanes) if not always_exchange else None
        whole = shares is not None and self._native_ok(shares) and native is not None
        if peer is None:
            t = inp if inp is not None else outs[0]
            if not counted:
                self.ncalls += 1
            self.last_call = (op, t.numel() * t.element_size(), desc.get("dtype"), "whole" if whole else "split")
            if not whole and self.segment is not None:
                self._publish()             # peers that wait in the exchange below can read it
        if whole:
            handle = _as_handle(native(self._native_group(shares)), next(iter(shares)))
        else:
            if self.adapt and peer is None:
                desc = dict(desc, obs=self._observation(op), bal=self.balancer.version)
            cycle = None
            descs = self._exchange(desc, inp, lanes, peer)
            if self.adapt and peer is None:
                self._agree(op, descs, ("bal",))
                self._learn(descs)
            if peer is not None and descs[peer].get("src") != desc.get("src"):
                mine = "send" if desc["src"] == self.rank else "recv"
                theirs = "send" if descs[peer].get("src") == peer else "recv"
                raise PeerMismatchError(
                    f"rank {self.rank} called {mine}() with rank {peer}, whose matching call was {theirs}(): "
                    f"braid pairs the send/recv calls of two ranks in call order, with a blocking handshake "
                    f"on split (large) messages. Order them so each send meets a recv (e.g. the lower rank "
                    f"sends first); batched send/recv is not supported yet.")
            self._agree(op, descs, agree_keys + ("calib",))
            size, mkey, build = movement_of(descs)
            agreed = self._agreed_lanes(descs)
            # a routed call's host time: routing and posting. Not the exchange: waiting there for a
            # late peer (one that opened buffers, or allocated) read up to 237 ms on 4 x H200
            t_call = time.perf_counter()
            routed = route(descs, agreed) if route is not None else None
            sample = route is not None and self._routed.wants_sample(len(self._routed_pending))
            if sample or self._cycle_open is not None:
                # a skewed call timed as a sample of its decision (or the one after it): its start
                # on the stream (nothing of this call is enqueued yet) ends the last one's cycle
                cycle = _Cycle(device)
                if self._cycle_open is not None:
                    self._cycle_open.close(cycle)
                    self._cycle_open = None
                if not sample:
                    cycle = None
            if routed is _DECLINED:        # routing measured against the native call and chose it
                routed, shares = None, {"nccl" if device.type == "cuda" else "gloo": 1.0}
            else:
                shares = self.shares_for(op, size, agreed) if routed is None else routed.shares
            if routed is not None:
                opened = self._ipc_maps()
                handle = execute(self, routed, inp, outs, descs, peer)
                self._routed.observe_host((time.perf_counter() - t_call) * 1e6,
                                          cold=self._routed.last_cold or self._ipc_maps() != opened,
                                          cls=self._routed.last_cls)
                self._observe(handle, cycle)
            elif self._native_ok(shares) and native is not None:
                handle = _as_handle(native(self._native_group(shares)), next(iter(shares)))
                if cycle is not None:          # a skewed call that routing declined: timed too
                    self._observe(None, cycle)
            else:
                if route is not None:          # a skewed call split by shares: neither side
                    self._routed.begin()
                if multi is not None:
                    handle = multi(descs, shares, self._plan(mkey, build, shares, size, device), agreed)
                else:
                    handle = execute(self, self._plan(mkey, build, shares, size, device), inp, outs, descs, peer)
            fixed_here = self._fixed is not None and self._fixed.get(op, self._fixed.get("*")) is not None
            if peer is None and self.adapt and not fixed_here and routed is None:
                bkey = self._balancer_key(op, size, agreed)
                if bkey is not None and (len(shares) > 1 or self.balancer.parked(bkey)):
                    self._pending[op] = (bkey, dict(shares), handle)
        self.last_handle = handle
        if async_op:
            return handle
        handle.wait()
        return None

    def _plan(self, mkey, build, shares: dict[str, float], size: int, device: torch.device):
        """Plans are pure functions of the movement and the shares: cache them (splitting a
        large all_gather costs tens of microseconds of Python)."""
        min_split = envs.get("BRAID_MIN_SPLIT_KB") << 10
        align = 4096 if device.type == "cuda" else 64
        key = (mkey, tuple(shares.items()), align, min_split)
        plan = self._plan_cache.get(key)
        if plan is None:
            plan = split(build(), shares, size, align=align, min_split=min_split)
            if len(self._plan_cache) > 256:
                self._plan_cache.clear()
            self._plan_cache[key] = plan
        return plan

    # routed plans -------------------------------------------------------------------------------
    def run_plan(self, plan: Plan, input: torch.Tensor | None, outputs: list[torch.Tensor],
                 async_op: bool = False) -> Handle | None:
        """Run an agreed Plan as it is: every rank passes the same plan (checked by digest), its
        input (bytes at `Transfer.src_off`) and its outputs (`dsts` index them). Tensors are read
        as flat bytes; the plan's lanes must be usable for their device (ce/host/nccl/relay for
        CUDA tensors, shm/gloo/relay for CPU tensors). A transfer with `via` >= 0 travels on the
        `relay` lane only, and the relay lane carries nothing else. A rank with no tensors at all
        (a pure relay) may pass None and []: it takes this communicator's device."""
        op = "run_plan"
        self._check_open()
        if not isinstance(plan, Plan):
            raise MisuseError(f"{op}: plan must be a braid Plan, got {type(plan).__name__}")
        if plan.world_size != self.world_size or plan.p2p:
            raise MisuseError(f"{op}: the plan is for {'send/recv' if plan.p2p else f'a world of {plan.world_size}'}; "
                              f"run_plan runs collective plans over all {self.world_size} ranks")
        outputs = list(outputs or [])
        first = input if input is not None else (outputs[0] if outputs else None)
        dev = self._device_for(first) if first is not None else self.device
        ib = input_bytes(input, "input", dev, op) if input is not None else torch.empty(0, dtype=torch.uint8, device=dev)
        obs = [output_bytes(o, f"outputs[{i}]", dev, op) for i, o in enumerate(outputs)]
        used = [name for name, ts in plan.lanes.items() if ts]
        for name in used:
            if name == "relay":
                ok, why = self._lanes["relay"].available_for(dev.type)
                if self.wanted is not None and "relay" not in self.wanted:
                    ok, why = False, f"BRAID_LANES={sorted(self.wanted)} leaves it out"
            else:
                ok = name in self.lanes_for(dev)
                why = self.unavailable.get(name, f"not a lane for {dev.type} tensors here")
            if not ok:
                raise LaneUnavailableError(f"{op}: the plan uses lane {name!r}, not available here: {why}")
            for t in plan.lanes[name]:
                if (t.via >= 0) != (name == "relay"):
                    raise MisuseError(f"{op}: transfer {t} is on lane {name!r}; relayed transfers (via >= 0) "
                                      f"go on the 'relay' lane and only there")
                if name == "relay":
                    from .planner.relay import check_transfer
                    try:
                        check_transfer(t, self.world_size)
                    except ValueError as exc:
                        raise MisuseError(f"{op}: {exc}") from None
        if self._p2p_pending:
            self._flush_p2p()
        digest = hashlib.sha1(plan.to_json().encode()).hexdigest()[:16]
        desc = {"op": op, "plan": digest, "dev": dev.type, "in": ib.numel(), "outs": [o.numel() for o in obs]}
        if "relay" in used:
            desc.update(self._lanes["relay"].descriptor(ib, dev.type))
        self._enter(op, ib, "split")
        try:
            descs = self._exchange(desc, ib, used)
            self._agree(op, descs, ("op", "plan", "dev") + (("relay_geom",) if "relay" in used else ()))
        except (PeerMismatchError, BraidTimeoutError, LaneFailureError) as exc:
            self._give_up(exc)
            raise
        _check_plan_bounds(plan, descs)
        handle = execute(self, plan, ib, obs, descs)
        self.last_handle = handle
        if async_op:
            return handle
        handle.wait()
        return None

    # ops ----------------------------------------------------------------------------------------
    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        op = "all_gather"
        if (type(input) is torch.Tensor and type(output) is torch.Tensor and input.is_cuda is self.cuda
                and output.is_cuda is self.cuda and input.is_contiguous() and output.is_contiguous()):
            n, dt = input.numel(), input.dtype
            ent = self._fast_ag.get(n)
            if ent is None or ent[0] is not dt or ent[1] != output.numel():
                ent = self._fast_put(self._fast_ag, n, (dt, output.numel()), dt is output.dtype
                                     and output.numel() == n * self.world_size
                                     and self._native_for(op, n * input.element_size()))
            if ent[-1]:
                return self._native_fast("_allgather_base", (output, input), "allgather", async_op, fallback=lambda a:
                                         dist.all_gather_into_tensor(output, input, group=self._fast_group, async_op=a))
        dev = self._device_for(input)
        ib = input_bytes(input, "input", dev, op)
        ob = output_bytes(output, "output", dev, op)
        same_dtype(input, output, op)
        if ob.numel() != ib.numel() * self.world_size:
            raise MisuseError(f"{op}: output has {output.numel()} elements, need input.numel() * world_size = "
                              f"{input.numel()} * {self.world_size}")
        n = ib.numel()
        desc = {"op": op, "dtype": str(input.dtype), "nbytes": n}
        return self._run(op, desc, n, ib, [ob], lambda d: (n, ("ag", n, False), lambda: all_gather_movement(self.world_size, n, False)),
                         lambda g: dist.all_gather_into_tensor(ob, ib, group=g, async_op=True),
                         ("op", "dtype", "nbytes"), async_op)

    def all_gather(self, output_list: list[torch.Tensor], input: torch.Tensor, async_op: bool = False):
        op = "all_gather"
        dev = self._device_for(input)
        ib = input_bytes(input, "input", dev, op)
        if not isinstance(output_list, (list, tuple)) or len(output_list) != self.world_size:
            raise MisuseError(f"{op}: output_list must be a list of world_size={self.world_size} tensors")
        outs = []
        for i, o in enumerate(output_list):
            outs.append(output_bytes(o, f"output_list[{i}]", dev, op))
            same_dtype(input, o, op, ("input", f"output_list[{i}]"))
            if o.numel() != input.numel():
                raise MisuseError(f"{op}: output_list[{i}] has {o.numel()} elements, input has {input.numel()}")
        n = ib.numel()
        desc = {"op": op, "dtype": str(input.dtype), "nbytes": n}
        return self._run(op, desc, n, ib, outs, lambda d: (n, ("ag", n, True), lambda: all_gather_movement(self.world_size, n, True)),
                         lambda g: dist.all_gather(list(outs), ib, group=g, async_op=True),
                         ("op", "dtype", "nbytes"), async_op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False):
        op = "broadcast"
        if type(tensor) is torch.Tensor and type(src) is int and tensor.is_cuda is self.cuda and tensor.is_contiguous():
            n, dt = tensor.numel(), tensor.dtype
            ent = self._fast_bc.get(n)
            if ent is None or ent[0] is not dt or ent[1] != src:
                ent = self._fast_put(self._fast_bc, n, (dt, src), 0 <= src < self.world_size
                                     and self._native_for(op, n * tensor.element_size()))
            if ent[-1]:
                return self._native_fast("broadcast", ([tensor],), "broadcast", async_op, root=src, fallback=lambda a:
                                         dist.broadcast(tensor, src=src, group=self._fast_group, async_op=a))
        dev = self._device_for(tensor)
        check_rank(src, self.world_size, "src", op)
        tb = output_bytes(tensor, "tensor", dev, op)
        n = tb.numel()
        desc = {"op": op, "dtype": str(tensor.dtype), "nbytes": n, "root": src}
        inp = tb if self.rank == src else None
        return self._run(op, desc, n, inp, [tb], lambda d: (n, ("bc", n, src), lambda: broadcast_movement(self.world_size, n, src)),
                         lambda g: dist.broadcast(tb, src=src, group=g, async_op=True),
                         ("op", "dtype", "nbytes", "root"), async_op)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes=None,
                          input_split_sizes=None, async_op: bool = False):
        op = "all_to_all_single"
        if (not input_split_sizes and not output_split_sizes and type(input) is torch.Tensor
                and type(output) is torch.Tensor and input.is_cuda is self.cuda and output.is_cuda is self.cuda
                and input.dim() > 0 and input.is_contiguous() and output.is_contiguous()):
            n, dt, rows = input.numel(), input.dtype, input.size(0)
            ent = self._fast_a2a.get(n)
            if ent is None or ent[0] is not dt or ent[1] != rows or ent[2] != output.numel():
                ent = self._fast_put(self._fast_a2a, n, (dt, rows, output.numel()), dt is output.dtype
                                     and n == output.numel() and rows % self.world_size == 0
                                     and self._native_for(op, n * input.element_size()))
            if ent[-1]:
                return self._native_fast("alltoall_base", (output, input, [], []), "alltoall", async_op, fallback=lambda a:
                                         dist.all_to_all_single(output, input, group=self._fast_group, async_op=a))
        agreed = counted = False           # counted: in the ledger already (see _enter)
        if input_split_sizes and output_split_sizes and type(input) is torch.Tensor \
                and type(output) is torch.Tensor and input.is_cuda and output.is_cuda and input.dim() > 0 \
                and output.dim() > 0 and input.is_contiguous() and output.is_contiguous():
            # uneven splits: each rank knows only its row and column of the matrix. The ranks agree
            # on one number first, the largest demand: when none exceeds the routing threshold
            # (NIMBLE: multipath off at or below 1 MB), the call is NCCL's own, whole, with no
            # descriptor exchange (4 x H200, 1 MiB hot: ~400 us per call with one, NCCL ~45). A
            # rank with a larger demand of its own knows the answer: it posts and does not wait.
            # The shape facts, and whether this communicator agrees this way at all, are kept per
            # call shape, so a call costs a few Python steps besides NCCL's own.
            key = (input.numel(), output.numel())
            ent = self._fast_a2av.get(key)
            dt, rin, rout = input.dtype, input.size(0), output.size(0)
            if ent is None or ent[0] is not dt or ent[1] != rin or ent[2] != rout:
                idx = self.device.index if self.cuda else None
                ok = (dt is output.dtype and self.segment is not None and not self.check
                      and self._fixed is None and self.routing != "on" and input.get_device() == idx
                      and output.get_device() == idx and len(self.lanes_for(self.device)) > 1
                      and "nccl" in self.lanes_for(self.device))
                esz = input.element_size()     # bytes per row; an empty side's splits are all 0
                ent = self._fast_put(self._fast_a2av, key, (dt, rin, rout, key[0] // max(rin, 1) * esz,
                                                             key[1] // max(rout, 1) * esz), ok)
            w = self.world_size
            if ent[-1] and len(input_split_sizes) == w and len(output_split_sizes) == w \
                    and sum(input_split_sizes) == rin and sum(output_split_sizes) == rout \
                    and min(input_split_sizes) >= 0 and min(output_split_sizes) >= 0:
                me = self.rank
                a, b = list(input_split_sizes), list(output_split_sizes)
                a[me] = b[me] = 0
                big = max(max(a) * ent[3], max(b) * ent[4])
                agreed = counted = True
                self._check_open()
                self._enter(op, input, "agreeing")
                if self._uneven_small(big, op):
                    args = (output, input, list(output_split_sizes), list(input_split_sizes))
                    return self._native_fast("alltoall_base", args, "alltoall", async_op, counted=True,
                                             fallback=lambda x: dist.all_to_all_single(
                                                 output, input, args[2], args[3], group=self.native_group,
                                                 async_op=x))
        dev = self._device_for(input)
        ib = input_bytes(input, "input", dev, op)
        ob = output_bytes(output, "output", dev, op)
        same_dtype(input, output, op)
        ins = split_bytes(input_split_sizes, input, self.world_size, "input", op)
        outs = split_bytes(output_split_sizes, output, self.world_size, "output", op)
        balanced = not input_split_sizes and not output_split_sizes
        if not agreed and not balanced and self.segment is not None and dev.type == "cuda" and not self.check \
                and self._fixed is None and self.routing != "on" and len(self.lanes_for(dev)) > 1:
            # the same agreement for the uneven calls the block above leaves (one split list given)
            me = self.rank
            big = max([v for d, v in enumerate(ins) if d != me] + [v for s, v in enumerate(outs) if s != me] + [0])
            if "nccl" in self.lanes_for(dev):
                self._check_open()
                self._enter(op, ib, "agreeing")
                counted = True
                if self._uneven_small(big, op):
                    return self._native_fast("alltoall_base", (ob, ib, list(outs), list(ins)), "alltoall",
                                             async_op, counted=True, fallback=lambda a: dist.all_to_all_single(
                                                 ob, ib, list(outs), list(ins), group=self.native_group, async_op=a))
        desc = {"op": op, "dtype": str(input.dtype), "in": ins, "out": outs,
                **self._routed.report(self._routed_observation())}

        def native(g):
            return dist.all_to_all_single(ob, ib, list(outs), list(ins), group=g, async_op=True)

        movement_of, route = self._a2a_rules(op, dev)

        # Without split sizes the traffic is balanced by contract (as for NCCL), so every rank
        # knows the whole matrix and can pick the path alone; uneven splits must be exchanged first.
        return self._run(op, desc, sum(ins), ib, [ob], movement_of, native, ("op", "dtype"), async_op,
                         always_exchange=not balanced and (len(self.lanes_for(dev)) > 1 or self.check),
                         route=route, counted=counted)

    def _uneven_small(self, big: int, op: str) -> bool:
        """The agreement before an uneven all_to_all on GPUs: does no rank have a demand (to or
        from another rank) over ROUTE_MIN_BYTES? Then the call is NCCL's own, whole.

        Every rank posts its largest demand in the node segment and reads all (a rank whose own
        demand is larger knows the answer and does not wait). That read holds each rank's call
        until the slowest rank has posted: for calls of a few tens of microseconds this lockstep
        was the larger part of braid's cost (4 x H200, 1 MiB hot: ~50 us per call against NCCL's
        ~40). So after SMALL_RUN calls in a row agreed small, the ranks take the next calls as
        small without waiting, and read each call's values at the next call (a peer has long
        posted them by then). When those values show a large demand, that one call has already
        run as NCCL's whole (correct, only not routed) and the ranks go back to waiting from the
        next call. Every step depends only on values every rank read, so all ranks switch at the
        same call."""
        seg = self.segment
        last = seg.settle()
        if last is not None and max(last)[0] > ROUTE_MIN_BYTES:
            self._small_run = 0
        token = seg.post_values([big])
        if self._small_run >= SMALL_RUN:
            seg.defer(token, op)
            return True
        if big > ROUTE_MIN_BYTES:
            self._small_run = 0
            return False
        small = max(seg.read_values(token, op))[0] <= ROUTE_MIN_BYTES
        self._small_run = self._small_run + 1 if small else 0
        return small

    def _a2a_rules(self, op: str, dev: torch.device):
        """The uneven all_to_all's matrix check and routing decision, from the exchanged
        descriptors ("in"/"out" byte counts per rank; "zc": False where a rank cannot hand its
        bytes over as one buffer, which keeps the router out)."""
        w = self.world_size

        def movement_of(descs):
            matrix = [descs[s]["in"] for s in range(w)]
            for d in range(w):
                for s in range(w):
                    if descs[d]["out"][s] != matrix[s][d]:
                        raise PeerMismatchError(
                            f"{op}: rank {s} sends {matrix[s][d]} bytes to rank {d}, but rank {d} expects "
                            f"{descs[d]['out'][s]} bytes from rank {s} (input/output split sizes disagree)")
            size = max(max(sum(row) for row in matrix), max(sum(matrix[s][d] for s in range(w)) for d in range(w)))
            return size, ("a2a", tuple(map(tuple, matrix))), lambda: all_to_all_movement(matrix)

        def route(descs, agreed):
            """A plan from the router when the matrix is skewed (or BRAID_ROUTE=on)."""
            from .collectives.routed import PATH_LANE
            kind = dev.type
            names = PATH_LANE[kind]
            learned = self._routed.agree(descs, names)   # every rank reported these observations
            if learned:
                gone = set(learned)
                self._routed_pending = [p for p in self._routed_pending if p[0] not in gone]
            self._routed.begin()
            mode = self.routing
            if mode == "off" or (mode == "auto" and self._fixed is not None):
                return None
            if not all(n in agreed for n in names.values()):
                return None
            if not all(d.get("zc", True) for d in descs if d is not None):
                return None      # a rank's bytes are not one buffer (batch_isend_irecv)
            matrix = [list(descs[s]["in"]) for s in range(w)]
            off = [matrix[s][d] for s in range(w) for d in range(w) if s != d]
            if mode == "auto" and (not off or max(off) <= ROUTE_MIN_BYTES or max(off) < 1.5 * sum(off) / len(off)):
                return None      # small or balanced: the share-based split (or NCCL) handles it
            table = self.calib.get(f"{op}/{w}", {})
            costs = {k: table.get(k, DEFAULT_COSTS[k]) for k in names.values()}
            native_name = "nccl" if kind == "cuda" else "gloo"
            native_cost = table.get(native_name, DEFAULT_COSTS[native_name]) if native_name in agreed else None
            plan, routed_us, native_us = self._routed.plan(matrix, kind, costs, native_cost, force=mode == "on")
            self.last_route = (routed_us, native_us)
            if log.isEnabledFor(logging.DEBUG):
                rt = self._routed
                st = rt._classes.get(rt.last_cls, {})
                log.debug("route rank %d class %s: routed %.0f us, native %.0f us, host %.0f us, fix %s, "
                          "trial %s, steady %s, in flight %d -> %s",
                          self.rank, rt.last_cls, routed_us, native_us, rt.host_time_us(),
                          rt.fix(rt.last_cls) if rt.last_cls else {}, st.get("trial"), rt.steady,
                          len(rt.in_flight), "routed" if plan is not None else "native")
            if plan is None and self._routed.last_pred is not None and not self.check:
                return _DECLINED           # the side compared with routing: the native call itself
            return plan

        return movement_of, route

    def batch_isend_irecv(self, p2p_op_list, device: torch.device | None = None) -> list:
        """A batch of sends and receives; a skewed batch is routed as one uneven all_to_all (the
        router spreads it over every path; each pair's bytes arrive in order).

        `p2p_op_list`: torch.distributed.P2POp objects (or (op, tensor, peer) tuples) whose op is
        dist.isend / dist.irecv (braid's send/recv are accepted too), on the world group. Unlike
        torch's call this is collective: **every rank of the communicator calls it**, with an empty
        list if it has nothing to move. The bytes a rank sends to a peer, in list order, fill the
        tensors that peer receives from it, in its list order (one byte stream per pair: the totals
        per pair must match, or every rank raises PeerMismatchError). Returns a list with one
        handle; its wait() completes every op (on GPUs: the current stream waits).

        Without copies: braid's lanes move a rank's sends as one buffer, so the batch is routed
        (or split) only when on every rank the send tensors, taken by destination rank and then in
        list order, lie back to back in one allocation, and so do the receive tensors by source
        (a MoE dispatch cut from one buffer does). Otherwise the batch is NCCL's (gloo's) own
        batch_isend_irecv of the same ops: packing would cost two device copies of the batch, and
        measured slower than NCCL's own batch (4 x H200, hot fraction 0.7 at 1 GiB: 8.8 ms
        against 6.7, `scripts/batch_probe.py`, 2026-11-22)."""
        op = "all_to_all_single"          # planned, routed and calibrated as the uneven all_to_all
        what = "batch_isend_irecv"
        sends: dict[int, list[torch.Tensor]] = {}
        recvs: dict[int, list[torch.Tensor]] = {}
        items = []
        dev = device
        if not isinstance(p2p_op_list, (list, tuple)):
            raise MisuseError(f"{what}: expected a list of P2POp, got {type(p2p_op_list).__name__}")
        for i, item in enumerate(p2p_op_list):
            if isinstance(item, tuple) and len(item) == 3:
                fn, tensor, peer = item
                group = None
            elif all(hasattr(item, a) for a in ("op", "tensor", "peer")):
                fn, tensor, peer, group = item.op, item.tensor, item.peer, getattr(item, "group", None)
            else:
                raise MisuseError(f"{what}: item {i} is {item!r}; pass torch.distributed.P2POp(dist.isend or "
                                  f"dist.irecv, tensor, peer) objects")
            if group not in (None, dist.group.WORLD):
                raise MisuseError(f"{what}: item {i} names a process group; braid runs on the world group only")
            name = getattr(fn, "__name__", "")
            if name not in ("isend", "irecv", "send", "recv"):
                raise MisuseError(f"{what}: item {i}'s op is {fn!r}; use dist.isend or dist.irecv")
            sending = name in ("isend", "send")
            check_rank(peer, self.world_size, "peer", what, me=self.rank)
            dev = dev or self._device_for(tensor)
            b = (input_bytes if sending else output_bytes)(tensor, f"item {i}'s tensor", dev, what)
            (sends if sending else recvs).setdefault(peer, []).append(b)
            items.append((sending, b, peer))
        if dev is None:
            dev = self.device if self.cuda else torch.device("cpu")
        self._check_open()
        w = self.world_size
        ins = [sum(t.numel() for t in sends.get(d, [])) for d in range(w)]
        outs = [sum(t.numel() for t in recvs.get(s, [])) for s in range(w)]
        ib = _adjacent([t for d in range(w) for t in sends.get(d, [])], dev)
        ob = _adjacent([t for s in range(w) for t in recvs.get(s, [])], dev)
        zc = ib is not None and ob is not None
        if not zc:
            ib = ob = torch.empty(0, dtype=torch.uint8, device=dev)
        desc = {"op": op, "dtype": str(torch.uint8), "in": ins, "out": outs, "zc": zc,
                **self._routed.report(self._routed_observation())}

        def native(g):
            ops = [dist.P2POp(dist.isend if snd else dist.irecv, t, p, group=g) for snd, t, p in items if t.numel()]
            return _Works(dist.batch_isend_irecv(ops) if ops else [])

        def multi(descs, shares, plan1, agreed):
            """A share-based split moves one buffer per rank: only when every rank has one."""
            if all(d.get("zc", True) for d in descs if d is not None):
                return execute(self, plan1, ib, [ob], descs)
            lane = "nccl" if "nccl" in agreed else "gloo"
            return _as_handle(native(self._native_group({lane: 1.0})), lane)

        movement_of, route = self._a2a_rules(op, dev)
        handle = self._run(op, desc, sum(ins), ib, [ob], movement_of, native, ("op", "dtype"), True,
                           always_exchange=True, multi=multi, route=route)
        return [handle]

    def send(self, tensor: torch.Tensor, dst: int, async_op: bool = False):
        return self._p2p(tensor, dst, sending=True, async_op=async_op)

    def recv(self, tensor: torch.Tensor, src: int, async_op: bool = False):
        return self._p2p(tensor, src, sending=False, async_op=async_op)

    def _p2p(self, tensor, peer, sending: bool, async_op: bool):
        op = "send_recv"
        if (not self._p2p_pending and self._fast_ok(tensor) and type(peer) is int and 0 <= peer < self.world_size
                and peer != self.rank and self._native_for(op, tensor.numel() * tensor.element_size())):
            be = self._fast_be
            if be is not None:           # the backend's own send/recv (tag 0, as torch's isend/irecv)
                work = be.send([tensor], peer, 0) if sending else be.recv([tensor], peer, 0)
            else:
                g = self.native_group
                work = dist.isend(tensor, dst=peer, group=g) if sending else dist.irecv(tensor, src=peer, group=g)
            if async_op:
                return self._finish(work, True)
            work.wait()
            self.last_handle = self._native_done
            return None
        dev = self._device_for(tensor)
        check_rank(peer, self.world_size, "dst" if sending else "src", "send" if sending else "recv", me=self.rank)
        if sending:
            tb = input_bytes(tensor, "tensor", dev, "send")
            inp, outs = tb, []
        else:
            tb = output_bytes(tensor, "tensor", dev, "recv")
            inp, outs = None, [tb]
        n = tb.numel()
        src, dst = (self.rank, peer) if sending else (peer, self.rank)
        desc = {"op": op, "dtype": str(tensor.dtype), "nbytes": n, "src": src, "dst": dst}

        def native(g):
            return (dist.isend(tb, dst=peer, group=g) if sending else dist.irecv(tb, src=peer, group=g))

        if self.segment is None:
            return self._run(op, desc, n, inp, outs, lambda d: (n, ("p2p", src, dst, n), lambda: p2p_movement(self.world_size, src, dst, n)),
                             native, ("op", "dtype", "nbytes", "src", "dst"), async_op, peer=peer)
        self._check_open()
        lanes = self.lanes_for(dev)
        shares = self.shares_for(op, n, lanes)
        if self._native_ok(shares):
            if any((h.src, h.dst) == (src, dst) for h in self._p2p_pending):
                # an earlier split call of this direction has not started: the library's own
                # call waits behind it, else the peer would pair the messages out of order
                handle = PendingP2P(self, None, desc, inp, outs, peer, n, src, dst, dev, None,
                                    native=lambda: native(self._native_group(shares)), lane=next(iter(shares)))
                self._p2p_pending.append(handle)
                self._progress_p2p()
            else:
                handle = _as_handle(native(self._native_group(shares)), next(iter(shares)))
            self.last_handle = handle
            if async_op:
                return handle
            handle.wait()
            return None
        # Split: matched per direction, posted now, run once the peer's matching call is posted
        # (at the latest in wait()). So isend + irecv on both ranks of a pair works, as in
        # torch.distributed: neither call blocks on the other rank. The sender's shares, chosen
        # now, are the pair's: the receiver's balancer and calibration may see it otherwise.
        full = dict(desc, lanes=lanes, calib=self.calib_digest, rank=self.rank,
                    shares=shares if sending else None)
        if "ce" in lanes:
            full.update(self._lanes["ce"].descriptor(inp))
        start_event = None
        if dev.type == "cuda":
            start_event = torch.cuda.Event()
            start_event.record(torch.cuda.current_stream(dev))
        token = self.segment.post_pair(full, peer, sending)
        handle = PendingP2P(self, token, full, inp, outs, peer, n, src, dst, dev, start_event)
        self._p2p_pending.append(handle)
        self._progress_p2p()
        self.last_handle = handle
        if async_op:
            return handle
        handle.wait()
        return None

    def _flush_p2p(self) -> None:
        """Start every pending send/recv (blocking until their peers posted them) before a
        collective posts lane work: every rank then queues the same calls in the same order on
        the lanes' streams, which the cross-rank counters rely on."""
        for h in list(self._p2p_pending):
            h.complete()

    def _progress_p2p(self) -> None:
        """Post the lanes of every pending send/recv whose peer has posted its side (never blocks)."""
        for h in list(self._p2p_pending):
            h.try_complete()

    # reductions -----------------------------------------------------------------------------------
    def _fast_reduce_ok(self, op, dtype) -> bool:
        """The native library's reduction may take the call as is: a plain ReduceOp on a
        reducible dtype (avg: NCCL only, which averages integers as braid does)."""
        if dtype not in REDUCE_DTYPES or type(op) is not type(dist.ReduceOp.SUM):
            return False
        if op in _FAST_OPS:
            return True
        return op == dist.ReduceOp.AVG and self.cuda   # gloo has no AVG

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, async_op: bool = False):
        """In place, like torch.distributed.all_reduce."""
        if type(op) is _RED_T and type(tensor) is torch.Tensor and tensor.is_cuda is self.cuda and tensor.is_contiguous():
            n, dt = tensor.numel(), tensor.dtype
            ent = self._fast_ar.get(n)
            if ent is None or ent[0] is not dt or ent[1] is not op:
                ent = self._fast_put(self._fast_ar, n, (dt, op), self._fast_reduce_ok(op, dt)
                                     and self._native_for("all_reduce", n * tensor.element_size()))
            if ent[-1]:
                return self._native_fast("allreduce", ([tensor],), "allreduce", async_op, op=op, fallback=lambda a:
                                         dist.all_reduce(tensor, op=op, group=self._fast_group, async_op=a))
        return self._reduction("all_reduce", tensor, tensor, op, None, async_op)

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM,
                              async_op: bool = False):
        """output (numel m) = reduction over ranks of input[rank*m:(rank+1)*m]."""
        if (type(op) is _RED_T and type(input) is torch.Tensor and type(output) is torch.Tensor and input.is_cuda is self.cuda
                and output.is_cuda is self.cuda and input.is_contiguous() and output.is_contiguous()):
            n, dt = input.numel(), input.dtype
            ent = self._fast_rs.get(n)
            if ent is None or ent[0] is not dt or ent[1] is not op or ent[2] != output.numel():
                ent = self._fast_put(self._fast_rs, n, (dt, op, output.numel()), dt is output.dtype
                                     and n == output.numel() * self.world_size and self._fast_reduce_ok(op, dt)
                                     and self._native_for("reduce_scatter", n * input.element_size()))
            if ent[-1]:
                return self._native_fast("_reduce_scatter_base", (output, input), "reducescatter", async_op, op=op,
                                         fallback=lambda a: dist.reduce_scatter_tensor(
                                             output, input, op=op, group=self._fast_group, async_op=a))
        return self._reduction("reduce_scatter", output, input, op, None, async_op)

    def reduce_scatter(self, output: torch.Tensor, input_list: list[torch.Tensor], op=dist.ReduceOp.SUM,
                       async_op: bool = False):
        """List form: input_list[d] is this rank's contribution to rank d (copied into one buffer)."""
        if not isinstance(input_list, (list, tuple)) or len(input_list) != self.world_size:
            raise MisuseError(f"reduce_scatter: input_list must hold world_size={self.world_size} tensors")
        for i, t in enumerate(input_list):
            if not isinstance(t, torch.Tensor) or t.numel() != output.numel() or t.dtype != output.dtype:
                raise MisuseError(f"reduce_scatter: input_list[{i}] must be a tensor of {output.numel()} "
                                  f"{output.dtype} elements like the output")
        flat = torch.cat([t.reshape(-1) for t in input_list]) if output.numel() else output.new_empty(0)
        return self._reduction("reduce_scatter", output, flat, op, None, async_op)

    def reduce(self, tensor: torch.Tensor, dst: int = 0, op=dist.ReduceOp.SUM, async_op: bool = False):
        """The reduction lands in `tensor` on rank dst; other ranks' tensors are left unchanged."""
        if (self._fast_ok(tensor) and type(dst) is int and 0 <= dst < self.world_size
                and self._fast_reduce_ok(op, tensor.dtype)
                and self._native_for("reduce", tensor.numel() * tensor.element_size())):
            return self._native_fast("reduce", ([tensor],), "reduce", async_op, op=op, root=dst, fallback=lambda a:
                                     dist.reduce(tensor, dst=dst, op=op, group=self.native_group, async_op=a))
        check_rank(dst, self.world_size, "dst", "reduce")
        return self._reduction("reduce", tensor, tensor, op, dst, async_op)

    @torch.no_grad()
    def _reduction(self, opname: str, output, input, op, root, async_op):
        from .collectives.reduce import check_reduce_dtype, divide, op_name, reduce_factor, reduce_slots, torch_op
        from .planner.plan import (chunk_bounds, cut_points, gather_chunks, reduce_scatter_chunks,
                                   reduce_scatter_movement)
        name = op_name(op)
        dev = self._device_for(input)
        if opname == "all_reduce" or opname == "reduce":
            ob = output_bytes(output, "tensor", dev, opname)
            ib = ob
            numel = output.numel()
        else:
            ib = input_bytes(input, "input", dev, opname)
            ob = output_bytes(output, "output", dev, opname)
            same_dtype(input, output, opname)
            if input.numel() != output.numel() * self.world_size:
                raise MisuseError(f"{opname}: input has {input.numel()} elements, need output.numel() * "
                                  f"world_size = {output.numel()} * {self.world_size}")
            numel = input.numel()
        name = check_reduce_dtype(output.dtype, name, opname, dev.type == "cuda")
        esz = output.element_size()
        w = self.world_size
        bounds = chunk_bounds(numel, w, esz)
        factor = reduce_factor(op)
        desc = {"op": opname, "dtype": str(output.dtype), "nbytes": numel * esz, "red": name,
                "factor": factor, "root": root}
        size = numel * esz

        def native(g):
            if name == "premul_sum" or (g is self.gloo_group and (name == "avg" or opname == "reduce")):
                # gloo has no avg/premul-sum and its reduce writes into non-root tensors; NCCL's
                # premul-sum gave wrong bf16 results in torch 2.11 (GPU test, 2026-11-22): reduce a
                # (scaled) copy with SUM, then divide / copy back on the ranks that own the result
                return gloo_native(g)
            top = torch_op(op, name)
            if opname == "all_reduce":
                return dist.all_reduce(output, op=top, group=g, async_op=True)
            if opname == "reduce":
                return dist.reduce(output, dst=root, op=top, group=g, async_op=True)
            return dist.reduce_scatter_tensor(output, ib.view(output.dtype), op=top, group=g, async_op=True)

        def gloo_native(g):
            base = input.reshape(-1) if opname == "reduce_scatter" else output.reshape(-1)
            # a copy in the tensor's own dtype (x * 1.0 would make an integer tensor float32: int64
            # sums above 2**24 then lost their low bits)
            src = base * factor if name == "premul_sum" else base.clone()
            top = dist.ReduceOp.SUM if name in ("avg", "premul_sum") else torch_op(op, name)
            if opname == "all_reduce":
                work = dist.all_reduce(src, op=top, group=g, async_op=True)
            elif opname == "reduce":
                work = dist.reduce(src, dst=root, op=top, group=g, async_op=True)
            else:
                res = torch.empty_like(output.reshape(-1))
                work = dist.reduce_scatter_tensor(res, src, op=top, group=g, async_op=True)

            def after():
                out = res if opname == "reduce_scatter" else src
                if name == "avg":
                    divide(out, w)
                if opname != "reduce" or self.rank == root:
                    output.reshape(-1).copy_(out)
            return Handle(native=work, after=after)

        def multi(descs, shares, plan1, agreed):
            """Split call. On GPUs the copy engines' share of every chunk runs as one pipelined
            reduction (collectives/ce_reduce.py); the other lanes' share takes the staged path:
            reduce-scatter into slots on those lanes, reduce, gather the reduced chunks back."""
            me = self.rank
            cuda = dev.type == "cuda"
            shares_all = shares
            # all_reduce on GPUs: NCCL's share runs as NCCL's own all_reduce of a prefix of the
            # tensor, on a stream of its own beside the other lanes (its kernels and the copy
            # engines share NVLink; the host lane adds PCIe); the other lanes split the rest
            nat_f = shares.get("nccl", 0.0) if cuda and opname == "all_reduce" and name in NATIVE_SHARE_REDS else 0.0
            base = 0
            chunk_b = bounds
            if 0.0 < nat_f < 1.0:
                base = cut_points(numel * esz, [nat_f, 1.0 - nat_f], 4096)[1] // esz
                shares = {k: v / (1.0 - nat_f) for k, v in shares.items() if k != "nccl"}
                chunk_b = [base * esz + b for b in chunk_bounds(numel - base, w, esz)]
            elem = [(chunk_b[d] // esz, (chunk_b[d + 1] - chunk_b[d]) // esz) for d in range(w)]
            ce_f = shares.get("ce", 0.0) if cuda and opname != "reduce" and base < numel else 0.0
            rest = {k: v for k, v in shares.items() if not (k == "ce" and ce_f > 0)} if base < numel else {}
            if ce_f > 0 and rest:
                cut = [cut_points(n * esz, [ce_f, 1.0 - ce_f], 4096)[1] // esz for _, n in elem]
            else:
                cut = [n if ce_f > 0 else 0 for _, n in elem]
            ce_chunks = [(o, c) for (o, _), c in zip(elem, cut)]
            rest_chunks = [(o + c, n - c) for (o, n), c in zip(elem, cut)]
            # where rank d's reduced chunk goes in its own output: in place for all_reduce/reduce,
            # the start of the output for reduce_scatter
            out_at = [o for o, _ in elem] if opname != "reduce_scatter" else [0] * w
            def record(staged_plan):
                """The plan as it ran: the staged lanes' transfers, and the pulls of the copy
                engines' pipelined part (for Handle.shares and lane_bytes)."""
                if ce_f == 0 and base == 0:
                    return staged_plan
                lanes = dict(staged_plan.lanes) if staged_plan is not None else {}
                if ce_f > 0:
                    ce_bytes = [(o * esz, n * esz) for o, n in ce_chunks]
                    lanes["ce"] = reduce_scatter_chunks(w, ce_bytes).transfers
                if base:       # NCCL's own all_reduce of the prefix: no braid transfers to list
                    lanes["nccl"] = []
                return Plan(opname, w, size, dict(shares_all), lanes, [])

            caller = torch.cuda.current_stream(dev) if cuda else None
            start_event = None
            runs = []
            if cuda:
                if self._staged_end is not None and rest:
                    caller.wait_event(self._staged_end)   # the staged scratch is free again
                start_event = torch.cuda.Event()
                start_event.record(caller)
            if base:
                runs.append(self._native_share(output.reshape(-1)[:base], torch_op(op, name), start_event))
            if ce_f > 0:
                flat_in = ib.view(output.dtype)
                flat_out = output.reshape(-1)
                runs.append(self._ce_reduction().post(
                    start_event=start_event, inp=flat_in, out=flat_out, chunks=ce_chunks, out_offsets=out_at,
                    gather=opname == "all_reduce", descs=descs, name=name, factor=factor))
            if not rest or not any(n for _, n in rest_chunks):
                event = runs[0].end if cuda and runs else None
                if cuda and len(runs) > 1:         # join the lanes' ends on braid's op stream
                    join = self._op_stream()
                    for r in runs:
                        join.wait_event(r.end)
                    event = torch.cuda.Event()
                    event.record(join)
                return Handle(runs, plan=record(None if ce_f > 0 or base else plan1), event=event)
            stream = self._op_stream() if cuda else None
            ctx = torch.cuda.stream(stream) if cuda else contextlib.nullcontext()
            with ctx:
                if cuda:
                    stream.wait_event(start_event)
                    t_start = torch.cuda.Event(enable_timing=True)
                    t_start.record(stream)
                byte_chunks = tuple((o * esz, n * esz) for o, n in rest_chunks)
                p1 = self._plan(("rs", byte_chunks), lambda: reduce_scatter_chunks(w, list(byte_chunks)),
                                rest, size, dev)
                o_me, n_me = rest_chunks[me]
                slots = self._staged_scratch(w * n_me, output.dtype, dev)
                h1 = execute(self, p1, ib, [ob, flat_bytes(slots)], descs)
                h1.wait()
                if opname == "reduce_scatter":
                    c = cut[me]
                    reduce_slots(slots, w, name, output.reshape(-1)[c: c + n_me], factor)
                    staged = h1.runs
                else:
                    target = output if (opname == "all_reduce" or me == root) else torch.empty_like(output)
                    reduce_slots(slots, w, name, target.reshape(-1)[o_me: o_me + n_me], factor)
                    src = flat_bytes(target)
                    # only the staged lanes' descriptors (the copy engines' IPC handle of the
                    # output is wanted only when they are one of them: reduce)
                    d2 = self._exchange(dict(desc, op=f"{opname}/gather"), src, [k for k in agreed if k in rest])
                    mv = gather_chunks(w, list(byte_chunks), None if opname == "all_reduce" else root)
                    p2 = self._plan(("gather", byte_chunks, root), lambda: mv, rest, size, dev)
                    h2 = execute(self, p2, src, [ob], d2)
                    h2.wait()
                    staged = h1.runs + h2.runs
                event = None
                if cuda:
                    t_end = torch.cuda.Event(enable_timing=True)
                    t_end.record(stream)
                    if len(rest) == 1:     # one lane: its time is the whole staged path, reduction included
                        staged = [LaneRun(LaneKind(next(iter(rest))), start=t_start, end=t_end)]
                    for r in runs:
                        stream.wait_event(r.end)
                    event = torch.cuda.Event()
                    event.record(stream)
                    self._staged_end = event
                    for t in (output, input, slots):
                        if t.numel():
                            t.record_stream(stream)
            return Handle(runs + staged, plan=record(p1), event=event)

        def movement_of(descs):
            return size, ("rs", tuple(bounds)), lambda: reduce_scatter_movement(w, bounds)

        return self._run(opname, desc, size, ib, [ob], movement_of, native,
                         ("op", "dtype", "nbytes", "red", "factor", "root"), async_op, multi=multi)

    def _native_share(self, view: torch.Tensor, top, start_event) -> LaneRun:
        """NCCL's own all_reduce of `view` on braid's NCCL stream, after `start_event` (where the
        call was made on the caller's stream), timed for the balancer. torch runs a synchronous
        NCCL call on the current stream (2.11: no Work is returned); older versions run it on
        their own stream and make the current one wait: either way the end event follows it."""
        if self._nccl_stream is None:
            self._nccl_stream = torch.cuda.Stream(self.device)
        ns = self._nccl_stream
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(ns):
            ns.wait_event(start_event)
            t0.record(ns)
            dist.all_reduce(view, op=top, group=self.nccl_group)
            t1.record(ns)
        view.record_stream(ns)
        return LaneRun(LaneKind.NCCL, start=t0, end=t1)

    def _staged_scratch(self, n: int, dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
        """Slots of the staged reductions, kept from call to call on GPUs (a fresh allocation
        per call went to cudaMalloc: the previous call's block is still held by our streams).
        The next staged call starts after this one's end event (see multi())."""
        if dev.type != "cuda":
            return torch.empty(n, dtype=dtype, device=dev)
        need = n * torch.empty((), dtype=dtype).element_size()
        if self._staged_buf is None or self._staged_buf.numel() < need:
            self._staged_buf = None
            self._staged_buf = torch.empty(max(need, 1), dtype=torch.uint8, device=dev)
        return self._staged_buf[:need].view(dtype)

    def _ce_reduction(self):
        if self._ce_red is None:
            from .collectives.ce_reduce import CeReduction
            self._ce_red = CeReduction(self._lanes["ce"], self)
        return self._ce_red

    def _op_stream(self):
        if getattr(self, "_opstream", None) is None:
            self._opstream = torch.cuda.Stream(device=self.device)
        return self._opstream

    # helpers -----------------------------------------------------------------------------------------
    def _device_for(self, t) -> torch.device:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            if not self.cuda:
                raise MisuseError("CUDA tensor passed, but this communicator has no GPU lanes "
                                  "(initialise torch.distributed with the 'nccl' backend)")
            return self.device
        return torch.device("cpu")

    def _check_open(self) -> None:
        if self.closed:
            raise MisuseError("this braid communicator was closed")
        if self.aborted:
            raise LaneFailureError(f"this braid communicator was aborted ({self.aborted}); it cannot run "
                                   f"calls any more: create a new process group and communicator")
        if self.watchdog is not None and self.watchdog.failed:
            raise LaneFailureError(f"braid communicator is broken: {self.watchdog.failed}; "
                                   f"create a new process group and communicator")

    # faults: mismatches, timeouts and aborts that reach every rank -------------------------------
    def _enter(self, op: str, t: torch.Tensor, path: str) -> None:
        """Put a call in the ledger before it exchanges anything (then pass counted=True on)."""
        self.ncalls += 1
        self.last_call = (op, t.numel() * t.element_size(), t.dtype, path)
        if self.segment is not None:
            self._publish()

    def _status(self) -> tuple:
        """(calls, op, bytes, dtype, path) of the ledger, for the watchdog to publish."""
        op, nbytes, dtype, path = self.last_call
        return self.ncalls, op, nbytes, str(dtype).replace("torch.", ""), path

    def _publish(self) -> None:
        seg = self.segment
        if seg is not None and not seg.closed:
            calls, op, nbytes, dtype, path = self._status()
            seg.publish(calls, op, nbytes, dtype, path)

    def _describe(self, who: str, calls: int, op: str, nbytes: int, dtype: str, path: str) -> str:
        how = {"whole": f"taken whole by {'NCCL' if self.cuda else 'gloo'}",
               "split": "on braid's lanes (it starts by exchanging descriptors)"}.get(path, path)
        return f"{who} call #{calls} is {op} of {nbytes} bytes of {dtype}, {how}"

    def _peer_said(self, peer: int) -> str:
        st = self.segment.status(peer) if self.segment is not None else None
        if st is None:
            return f"rank {peer} has published no call yet"
        ago = max(time.time() - st["time"], 0.0)
        return (self._describe(f"rank {peer}'s latest", st["calls"], st["op"], st["nbytes"], st["dtype"],
                               st["path"]) + f" (reported {ago:.1f} s ago)")

    def _on_wait(self, peer: int, what: str, posted) -> None:
        """Called while this rank waits for `peer` in a collective exchange: raise
        PeerMismatchError, naming both calls, once the peer has shown that it made a different
        call at this point: it reported a later call, or this very call taken whole by the native
        library (which posts nothing here: the peer may then sit inside NCCL or gloo)."""
        if not what.startswith("collective #") or self.segment is None:
            return
        st = self.segment.status(peer)
        if st is None or not (st["calls"] > self.ncalls or (st["calls"] == self.ncalls and st["path"] == "whole")):
            return
        if posted():            # the peer posted after all (its report raced the post): no mismatch
            return
        msg = (f"ranks {self.rank} and {peer} made different calls: "
               f"{self._describe(f'rank {self.rank}', *self._status())}; {self._peer_said(peer)}. "
               f"Every rank must make the same collective calls in the same order with matching "
               f"sizes and dtypes.")
        exc = PeerMismatchError(msg)
        exc.peers_left_waiting = True       # see _give_up
        raise exc

    def _on_timeout(self, peer: int, what: str) -> None:
        raise BraidTimeoutError(
            f"rank {self.rank} waited {envs.get('BRAID_TIMEOUT_S'):.0f} s for rank {peer} ({what}): "
            f"{self._describe(f'rank {self.rank}', *self._status())}; {self._peer_said(peer)}. Check that "
            f"every rank makes the same calls in the same order (BRAID_TIMEOUT_S to change the limit).")

    def _give_up(self, exc: BaseException) -> None:
        """Mark this rank aborted in the node segment with `exc` as the cause (peers waiting on it
        raise at once; their watchdogs abort the NCCL communicators they could sit in), where a
        peer may be left waiting: a timeout, a lane failure, a mismatch seen in the call ledger.
        Not for a disagreement every rank found in the same exchange (each raised it and all
        stay in step: the communicator goes on working), nor for an error that repeats a peer's
        abort or this communicator's broken state."""
        seg = self.segment
        text = str(exc)
        if seg is None or seg.closed or " aborted: " in text or "communicator is broken" in text:
            return
        if isinstance(exc, PeerMismatchError) and not getattr(exc, "peers_left_waiting", False):
            return
        kind = 1 if isinstance(exc, PeerMismatchError) else 2 if isinstance(exc, BraidTimeoutError) else 3
        try:
            seg.mark_aborted(kind, f"{type(exc).__name__}: {text}")
        except Exception as err:       # noqa: BLE001  reporting must not hide the first error
            log.debug("braid: marking the abort failed: %s", err)

    def _native_groups(self) -> list:
        """The NCCL process groups a peer of this rank may be blocked in because of braid: braid's
        own, the fast path's (the default group when it is NCCL's), and under the braid backend
        its inner NCCL group."""
        groups = [g for g in (self.nccl_group, self.native_group) if g is not None]
        if getattr(self, "_braid_backend_owned", False):
            from .backend import world_group
            pg = world_group()
            if pg is not None and pg.nccl is not None:
                groups.append(pg.nccl)
        return list({id(g): g for g in groups}.values())

    def _abort_native(self, why: str) -> None:
        """Abort the NCCL communicators of _native_groups (a call blocked in one of them then
        fails instead of waiting forever). From the watchdog thread or abort()."""
        self.aborted = self.aborted or why
        self._fast_clear()  # the next call takes the full path, which refuses it
        if not self.cuda:
            return          # gloo has no abort that releases a blocked call; its timeout does
        for g in self._native_groups():
            try:
                be = g._get_backend(self.device) if hasattr(g, "_get_backend") else g
                fn = getattr(be, "abort", None) or getattr(be, "_abort", None)
                if fn is not None:
                    fn()
            except Exception as exc:     # noqa: BLE001  aborting is best effort, one group at a time
                log.debug("braid: aborting an NCCL group failed: %s", exc)

    def abort(self, reason: str = "abort() was called") -> None:
        """Give up on this communicator on this rank, and tell the peers: they raise at once
        where they wait for this rank (LaneFailureError "rank r aborted: ..."), and their
        watchdogs abort the NCCL communicators braid uses, so no rank stays blocked in NCCL. GPU
        stream waits on braid's counters are released. Afterwards every call raises: make a new
        process group and communicator (close() still releases memory). Not collective."""
        if self.closed or self.aborted:
            return
        seg = self.segment
        if seg is not None and not seg.closed:
            seg.mark_aborted(4, f"rank {self.rank}: {reason}")
            if self.cuda:
                seg.abort()
        self._abort_native(reason)

    # calibration -------------------------------------------------------------------------------------
    def calibration_key(self) -> dict:
        from .calibrate import machine_key
        return machine_key(self)

    def load_calibration(self) -> None:
        """Rank 0 reads the cached calibration (if any) and every rank takes the same copy."""
        from .calibrate import load
        box = [load(self) if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.gloo_group)
        self.set_calibration(box[0] or {})

    def set_calibration(self, table: dict) -> None:
        self.pays = {op[: -len("/pays")]: {int(b): v if isinstance(v, (str, dict)) else bool(v) for b, v in t.items()}
                     for op, t in table.items() if op.endswith("/pays")}
        self.calib = {op: {k: LaneCost(**v) if isinstance(v, dict) else v for k, v in lanes.items()}
                      for op, lanes in table.items() if not op.endswith(("/pays", "/timed"))}
        text = json.dumps({"costs": {op: {k: c.to_dict() for k, c in v.items()} for op, v in self.calib.items()},
                           "pays": self.pays}, sort_keys=True)
        self.calib_digest = hashlib.sha1(text.encode()).hexdigest()[:12] if self.calib else "default"
        self._native_cache.clear()
        if getattr(self, "_fast_ar", None) is not None:
            self._fast_clear()
        if getattr(self, "balancer", None) is not None:   # a new calibration restarts stage 2
            from .planner.balancer import OnlineBalancer
            self.balancer = OnlineBalancer()
            self._pending.clear()

    def close(self) -> None:
        """Release lanes, pinned memory and the shared segment. Idempotent; no collective calls."""
        if self.closed:
            return
        self.closed = True
        self._fast_clear()
        if self.cuda:
            torch.cuda.synchronize(self.device)
        for lane in self._lanes.values():
            lane.close()
        if self._ce_red is not None:
            self._ce_red.close()
        self._staged_buf = self._staged_end = self._ce_red = None
        self._closer()

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PendingP2P:
    """A send or recv whose descriptor is posted and whose lanes start once the peer's matching
    call (same direction, same position in that direction's order) is posted. Quacks like Handle."""

    def __init__(self, comm, token, desc, inp, outs, peer, n, src, dst, dev, start_event, native=None, lane=None):
        self.comm, self.token, self.desc = comm, token, desc
        self.inp, self.outs, self.peer, self.n = inp, outs, peer, n
        self.src, self.dst, self.dev, self.start_event = src, dst, dev, start_event
        self.inner: Handle | None = None
        self.error: BaseException | None = None
        # a call the native library takes whole, queued behind an earlier split call of its
        # direction: it posts no descriptor and starts once the calls before it have
        self._whole, self._lane = native, lane

    def try_complete(self) -> bool:
        if self.inner is not None:
            return True
        if self.error is not None:
            raise self.error
        for h in list(self.comm._p2p_pending):        # a direction's calls start in call order
            if h is self:
                break
            if (h.src, h.dst) == (self.src, self.dst) and not h.try_complete():
                return False
        if self._whole is not None:
            self._drop()
            self.inner = _as_handle(self._whole(), self._lane)
            return True
        theirs = self.comm.segment.poll_pair(self.token)
        if theirs is None:
            return False
        self._start(theirs)
        return True

    def complete(self) -> None:
        """Block until the peer's side is posted (other pending calls progress meanwhile)."""
        if self.try_complete():
            return
        seg = self.comm.segment
        deadline = time.monotonic() + envs.get("BRAID_TIMEOUT_S")
        spins = 0
        while not self.try_complete():
            self.comm._progress_p2p()
            spins += 1
            if spins > 200:
                time.sleep(0.0002)
                if spins % 2000 == 0:
                    seg.check_alive(self.peer)
                if time.monotonic() > deadline:
                    from .errors import BraidTimeoutError
                    what = "send to" if self.src == self.comm.rank else "recv from"
                    self.error = BraidTimeoutError(
                        f"rank {self.comm.rank}: {what} rank {self.peer} waited {envs.get('BRAID_TIMEOUT_S'):.0f} s "
                        f"for rank {self.peer}'s matching {'recv' if self.src == self.comm.rank else 'send'}")
                    self._drop()
                    raise self.error

    def _drop(self) -> None:
        if self in self.comm._p2p_pending:
            self.comm._p2p_pending.remove(self)

    def _start(self, theirs: dict) -> None:
        comm, me = self.comm, self.comm.rank
        self._drop()
        descs: list = [None] * comm.world_size
        descs[me], descs[self.peer] = self.desc, theirs
        try:
            comm._agree("send_recv", descs, ("op", "dtype", "nbytes", "src", "dst", "calib"))
        except PeerMismatchError as exc:
            self.error = exc
            raise
        shares = _pair_shares(descs[self.src], comm._agreed_lanes(descs))
        if comm._native_ok(shares):
            g = comm._native_group(shares)
            tb = self.inp if self.src == me else self.outs[0]
            work = dist.isend(tb, dst=self.peer, group=g) if self.src == me else dist.irecv(tb, src=self.peer, group=g)
            self.inner = _as_handle(work, next(iter(shares)))
            return
        src, dst, n = self.src, self.dst, self.n
        plan = comm._plan(("p2p", src, dst, n), lambda: p2p_movement(comm.world_size, src, dst, n), shares, n, self.dev)
        self.inner = execute(comm, plan, self.inp, self.outs, descs, self.peer, start_event=self.start_event)

    def wait(self, timeout=None) -> bool:
        self.complete()
        self.comm._progress_p2p()          # start whatever else is ready before blocking on lanes
        return self.inner.wait()

    def is_completed(self) -> bool:
        return self.try_complete() and self.inner.is_completed()

    def lane_times_us(self) -> dict[str, float]:
        self.complete()
        return self.inner.lane_times_us()

    @property
    def shares(self) -> dict[str, float]:
        self.complete()
        return self.inner.shares

    @property
    def plan(self):
        return self.inner.plan if self.inner is not None else None

    @property
    def native(self):
        return self.inner.native if self.inner is not None else None

    @property
    def runs(self):
        return self.inner.runs if self.inner is not None else []


def _pair_shares(sender: dict, agreed: list[str]) -> dict[str, float]:
    """A split send/recv's shares, the same on both ranks: the sender's, as it chose them when it
    posted the call, over the lanes both sides have (renormalised); with none of those left, the
    native library's lane alone where both have it, else the first lane both have."""
    proposed = {k: v for k, v in (sender.get("shares") or {}).items() if k in agreed and v > 0}
    total = sum(proposed.values())
    if total > 0:
        return {k: v / total for k, v in proposed.items()}
    if not agreed:
        raise LaneUnavailableError("send/recv: the pair has no lane in common")
    native = [k for k in ("nccl", "gloo") if k in agreed]
    return {(native or agreed)[0]: 1.0}


def _fit_shm(world_size: int, budget: int, chunk: int, relay: int = 0) -> tuple[int, int]:
    """Shrink the per-rank host buffer and relay staging so the node segment fits in /dev/shm (a
    container's default /dev/shm is 64 MiB; writing past it kills the process with SIGBUS instead
    of an error). Both are halved together; returns (host buffer bytes, relay staging bytes)."""
    try:
        st = os.statvfs("/dev/shm")
        free = st.f_bavail * st.f_frsize
    except OSError:
        return budget, relay
    need = Layout(world_size, budget, chunk, relay).total_bytes
    if need <= free * 0.9:
        return budget, relay
    fitted, fitted_relay = budget, relay
    while fitted > (64 << 10) and Layout(world_size, fitted, chunk, fitted_relay).total_bytes > free * 0.9:
        fitted //= 2
        fitted_relay = max(fitted_relay // 2, 64 << 10) if relay else 0
    log.warning("braid: /dev/shm has %d MiB free, too little for BRAID_HOST_BUFFER_MB=%d (and %d MiB of relay "
                "staging) on %d ranks; using %d KiB per rank and %d KiB of relay staging (host, shm and relay "
                "lanes get slower; enlarge /dev/shm to fix)",
                free >> 20, budget >> 20, relay >> 20, world_size, fitted >> 10, fitted_relay >> 10)
    return fitted, fitted_relay


def _check_plan_bounds(plan: Plan, descs: list) -> None:
    """Every byte range of the plan lies inside the tensors its ranks passed (every rank checks
    every rank from the exchanged sizes, so all raise alike)."""
    def outside(rank: int, buf: int | None, off: int, n: int) -> str | None:
        if not 0 <= rank < len(descs):
            return f"rank {rank} is not a rank of this world of {len(descs)}"
        d = descs[rank]
        if buf is None:
            size = d["in"]
            what = f"rank {rank}'s input ({size} bytes)"
        elif buf >= len(d["outs"]):
            return f"rank {rank} passed {len(d['outs'])} outputs, the plan writes output {buf}"
        else:
            size = d["outs"][buf]
            what = f"rank {rank}'s outputs[{buf}] ({size} bytes)"
        if off < 0 or off + n > size:
            return f"bytes [{off}, {off + n}) are outside {what}"
        return None

    problems = []
    for name, transfers in plan.lanes.items():
        for t in transfers:
            problems.append(outside(t.src, None, t.src_off, t.nbytes))
            problems += [outside(r, b, off, t.nbytes) for r, b, off in t.dsts]
    for c in plan.local:
        problems += [outside(c.rank, None, c.src_off, c.nbytes), outside(c.rank, c.buf, c.dst_off, c.nbytes)]
    bad = [p for p in problems if p]
    if bad:
        raise MisuseError(f"run_plan: the plan does not fit the tensors passed: {bad[0]}"
                          + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))


from torch._C import _distributed_c10d as _c10d   # noqa: E402  (the options classes, all of them)

_OPTS = {"allreduce": _c10d.AllreduceOptions, "reducescatter": _c10d.ReduceScatterOptions,
         "allgather": _c10d.AllgatherOptions, "alltoall": _c10d.AllToAllOptions,
         "broadcast": _c10d.BroadcastOptions, "reduce": _c10d.ReduceOptions}


def _backend_of(group, device: torch.device):
    """The backend object (ProcessGroupNCCL) behind `group` for `device`, when this torch exposes
    it and its methods; None otherwise (the fast path then calls torch.distributed)."""
    try:
        be = group._get_backend(device)
    except Exception:                                   # noqa: BLE001 (any torch without it)
        return None
    need = ("allreduce", "_reduce_scatter_base", "_allgather_base", "alltoall_base", "broadcast", "reduce",
            "send", "recv")
    return be if all(hasattr(be, m) for m in need) else None


class _Cycle:
    """The cycle of one skewed all_to_all call: from its start to the start of the next one, on
    the caller's stream (GPU: two timing events; CPU: the clock). In a loop this is what a call
    costs whatever bounds it (the GPU's lanes, the host's posting, waiting for the last peer),
    which neither a lane's own time nor the host time alone shows (4 x H200, 2026-11-22, h = 0.7
    at 256 MiB: lane times 2451 / 2176 us in calls that came every 1800 us; the first native call
    after a routed one read 1106 us from its own start to its end, NCCL's steady calls 398)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.end = None
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.start = time.perf_counter()

    def close(self, nxt: "_Cycle") -> None:
        self.end = nxt.start

    def done(self) -> bool:
        if self.end is None:
            return False
        return self.end.query() if self.cuda else True

    def elapsed_us(self) -> float:
        if self.cuda:
            return self.start.elapsed_time(self.end) * 1e3
        return (self.end - self.start) * 1e6


class _Works:
    """Several torch Works as one (a native batch_isend_irecv)."""

    def __init__(self, works):
        self.works = list(works or [])

    def wait(self, timeout=None) -> bool:
        for wk in self.works:
            wk.wait()
        return True

    def is_completed(self) -> bool:
        return all(wk.is_completed() for wk in self.works)


def _adjacent(views: list[torch.Tensor], dev: torch.device) -> torch.Tensor | None:
    """One flat uint8 tensor over `views` (flat uint8 views, in order) when they lie back to back
    in one allocation, else None. No views: an empty tensor."""
    parts = [v for v in views if v.numel()]
    if not parts:
        return torch.empty(0, dtype=torch.uint8, device=dev)
    storage = parts[0].untyped_storage()
    base = storage.data_ptr()
    at = parts[0].data_ptr()
    for v in parts:
        if v.untyped_storage().data_ptr() != base or v.data_ptr() != at:
            return None
        at += v.numel()
    total = at - parts[0].data_ptr()
    return torch.empty(0, dtype=torch.uint8, device=dev).set_(storage, parts[0].data_ptr() - base, (total,))


def _as_handle(work, lane: str) -> Handle:
    handle = work if isinstance(work, Handle) else Handle(native=work)
    handle.native_lane = lane
    return handle


class _Watchdog:
    """A thread per communicator with a node segment. A few times a second it publishes this
    rank's call ledger (peers read it to tell a mismatch from a slow rank, see Communicator._on_wait)
    and looks for peers that marked themselves aborted; once a second it checks that every peer's
    process is alive. A peer that exited or aborted marks this communicator broken (the next call
    raises), and on GPUs releases every stream wait on the node's counters and aborts the NCCL
    communicators a call of this rank could be blocked in (so no GPU stream, and no rank inside
    NCCL, waits forever for a dead or failed peer)."""

    PERIOD_S = 0.2

    def __init__(self, segment: NodeSegment, rank: int, world_size: int, cuda: bool, status, on_peer_abort):
        import threading
        self.failed = ""
        self._stop = threading.Event()
        self._segment, self._rank, self._world, self._cuda = segment, rank, world_size, cuda
        self._status, self._on_peer_abort = status, on_peer_abort
        self._thread = threading.Thread(target=self._run, name="braid-watchdog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        ticks = 0
        while not self._stop.wait(self.PERIOD_S):
            ticks += 1
            try:
                why = self._tick(ticks)
            except Exception:   # segment closed under us
                return
            if why:
                self.failed = why
                log.warning("braid: %s; releasing this rank's pending waits", why)
                if self._cuda:
                    self._segment.abort()
                self._on_peer_abort(why)
                return

    def _tick(self, ticks: int) -> str:
        """One look: publish the ledger; the cause when a peer aborted or died, else ""."""
        st = self._status()
        if st is None:          # the communicator is gone
            return ""
        self._segment.publish(*st)
        hit = self._segment.aborted()
        if hit is not None:
            return f"rank {hit[0]} aborted: {hit[2]}"
        if ticks % 5 == 0:
            for peer in range(self._world):
                if peer != self._rank:
                    try:
                        self._segment.check_alive(peer)
                    except LaneFailureError as exc:
                        return str(exc)
        return ""

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)


def _call(ref, name: str, *args):
    """`ref()`'s method `name`, or None once the communicator is gone (weak callbacks)."""
    obj = ref()
    return getattr(obj, name)(*args) if obj is not None else None


def _finalize(segment, seg_dev_ptr, watchdog=None) -> None:
    if watchdog is not None:
        watchdog.stop()
    if seg_dev_ptr is not None and segment is not None and not segment.closed:
        try:
            from .lanes import _cuda
            _cuda.host_unregister(segment.address)
        except Exception as exc:   # at interpreter exit the driver may be gone already
            log.debug("braid: unregister at close failed: %s", exc)
    if segment is not None:
        segment.close()


def _check_gpus_per_host(ids: list) -> None:
    """Every rank of a host on its own GPU. `ids`: (hostname, boot id, pid, GPU index) per rank.
    The same index on two hosts is normal (each rank on cuda:LOCAL_RANK)."""
    seen: dict[tuple, int] = {}
    for rank, (host, boot, _, dev) in enumerate(ids):
        other = seen.setdefault((host, boot, dev), rank)
        if other != rank:
            raise MisuseError(f"ranks {other} and {rank} both use GPU {dev} of host {host}; call "
                              f"torch.cuda.set_device(local_rank) before creating the communicator")


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""
