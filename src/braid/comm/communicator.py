"""The Communicator: braid's ops over a torch.distributed world, split across lanes.

Each op: check arguments locally -> decide the split (shares) -> either NCCL's own op when NCCL
alone is best (small messages), or: exchange call descriptors through the node segment (every
rank sees every rank's sizes, dtype, IPC handle), check that they agree, plan, and run the plan on
the lanes. Calls return at once; `async_op=False` makes the current stream wait (GPU) or blocks
until done (CPU), like torch.distributed.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import socket
import time
import weakref
from typing import Iterator

import torch
import torch.distributed as dist

from .. import envs
from ..collectives import check_rank, input_bytes, output_bytes, same_dtype
from ..errors import MisuseError
from ..executor import Handle
from ..lanes.base import LaneContext
from ..node import Layout, NodeSegment
from ..planner.model import LaneCost
from ..planner.plan import CPU_LANES, GPU_LANES, LaneKind, Plan, all_gather_movement, broadcast_movement
from ..planner.rings import COLL, PAIR, RingCursor, ring_id
from .callpath import _RED_T, CallPath, fast_reduce_ok
from .cpushm import NATIVE_MIN
from .exchange import Exchange
from .ledger import CallLedger, Faults, _Watchdog, _call
from .library import CpuCalls, LibraryCalls, backend_of
from .p2p import PointToPoint
from .pairs import P2PQueue
from .policy import SplitPolicy
from .reductions import Reductions
from .routing import RouteSamples, Routing, a2a_ticket
from .shortcuts import Shortcuts

log = logging.getLogger("braid")


# each rank's area for a GPU communicator's whole calls on CPU tensors (two halves of 1 MiB; a
# call of more goes in rounds of 1 MiB)
CPU_AREA = 2 << 20
OPS = ("send_recv", "broadcast", "all_gather", "all_to_all_single", "all_reduce", "reduce_scatter", "reduce")


class Communicator:
    """braid over the default torch.distributed group (one process per GPU, or CPU processes).

    Lanes: nccl, ce and host for CUDA tensors; gloo and shm for CPU tensors. `lanes` (or
    BRAID_LANES) restricts them; unavailable lanes are skipped with one log line.

    A façade: it sets up the node segment, the groups and the lanes, and composes parts that own
    their state (see docs/design.md, "One call"): the faults part (`_faults`: closed, aborted,
    broken, what a fault does to every rank), the fast path (`_calls`), the full path
    (`_exchange`), the all_to_all part (`_routing`), the reductions (`_reductions`) and the
    point-to-point part (`_p2p`). The ops' entries with their fast paths are its own methods; the
    rest of each op is one call into its part.
    """

    def __init__(self, group=None, lanes: list[str] | None = None, _node=None):
        if not dist.is_available() or not dist.is_initialized():
            raise MisuseError("braid.Communicator needs torch.distributed initialised first: "
                              "dist.init_process_group('nccl' or 'gloo') (torchrun sets the rendezvous)")
        if group is not None and group is not dist.group.WORLD and dist.get_world_size(group) != dist.get_world_size():
            raise MisuseError("braid supports the default (world) group in this version; pass group=None")
        # _node: braid's own communicator of one node of a multi-node world (comm/hier.py): the
        # groups of that node, made by every rank of the world; ranks are the node's own (0..G-1)
        self._node = _node
        level = str(envs.get("BRAID_LOG_LEVEL")).upper()
        log.setLevel(getattr(logging, level, logging.WARNING))
        if not log.handlers and not logging.getLogger().handlers:
            logging.basicConfig(format="%(name)s %(levelname)s: %(message)s")
        self.rank = dist.get_rank(_node["gloo"]) if _node else dist.get_rank()
        self.world_size = dist.get_world_size(_node["gloo"]) if _node else dist.get_world_size()
        self.hier = None       # the node and rail steps of a world of several nodes (comm/hier.py)
        self._init_state(lanes)
        self._init_groups()
        # the calls made so far, the last one and its handle, published to the node segment (comm/ledger.py)
        self.ledger = ledger = CallLedger(self.rank, self.cuda, self.segment)
        # whether calls may run (closed, aborted, broken) and what a fault does to every rank
        self._faults = faults = Faults(self.rank, self.cuda, self.device, self.segment, ledger,
                                       (self.nccl_group, self.native_group), self.hier)
        # whole calls to the native library (comm/library.py): NCCL's group on GPUs; on a CPU
        # communicator gloo's own (never the default group: under init_process_group("braid")
        # that is braid itself)
        self.library = LibraryCalls(self.cuda, self.native_group if self.cuda else self.gloo_group,
                                    backend_of(self.native_group, self.device) if self.cuda else None, ledger)
        # what the lanes get of this communicator (they never see the communicator itself)
        self.lane_ctx = LaneContext(self.rank, self.world_size, self.device, self.segment, self.layout,
                                    self.segment_tensor, self.seg_dev_ptr, self.ring_cursors)
        self._lanes = self.lane_ctx.lanes = self._make_lanes()
        # which lanes serve a device (the parts ask without holding the communicator)
        lanes_for = functools.partial(usable_lanes, self._lanes, self.unavailable, self.wanted)
        # which lanes take a call and with what shares: the calibration, fixed shares, the balancer
        self.policy = SplitPolicy(self.world_size, self.cuda, self.check, functools.partial(lanes_for, self.device),
                                  self.unavailable, self.wanted, self.hier)
        from .prepared import PreparedCalls
        self._prepared = PreparedCalls(self.rank, self.world_size, self.device, self.cuda)
        self._rounds = None         # deferred prepared calls and their thread (comm/rounds.py)
        if (self.cuda and self._prepared.enabled and self.segment is not None and "ce" in self._lanes
                and self.world_size > 1 and envs.get("BRAID_DEFER")):
            from .rounds import Rounds
            self._rounds = Rounds(self)
            rd = weakref.ref(self._rounds)
            self.segment.before_post = lambda: (r := rd()) is not None and r.queue and r.drain()
        elif self.cuda and self._prepared.enabled and self.segment is not None and envs.get("BRAID_NATIVE_CALL"):
            from . import native_rounds
            native_rounds.build()       # compiled (once per machine) and loaded now, not in a job's first replay
        faults.rounds = self._rounds
        from .arbiter import Arbiter, GpuPace, trial_log
        seg = self.segment
        # the trials of whole against split are agreed through the node segment: one node only
        learn = bool(envs.get("BRAID_LEARN_SPLIT")) and seg is not None and self.cuda and self.world_size > 1 \
            and self.single_node
        pace = envs.get("BRAID_TRIAL_PACE")
        self._pace = GpuPace(self.device.index, slower=pace == "max") if learn and pace != "host" else None
        self._arbiter = Arbiter(self._trial_exchange, enabled=learn, clock=self._pace or time.perf_counter,
                                block=envs.get("BRAID_TRIAL_BLOCK"), watch=envs.get("BRAID_TRIAL_WATCH"),
                                log=trial_log(envs.get("BRAID_TRIAL_LOG"), self.rank) if learn else None,
                                builds=lambda: self._prepared.stats["built"])
        # whole or split per call shape, the hot path's one decision (comm/shortcuts.py)
        self.shortcuts = faults.shortcuts = Shortcuts(self.policy.native_for, self._arbiter,
                                                      lambda: not faults.closed and not faults.aborted)
        self._learn_update()
        # whole CPU calls through the segment (comm/cpushm.py), and a CPU communicator's send/recv
        # through it (comm/cpup2p.py)
        cpu = p2p_shm = None
        if seg is not None and self.world_size > 1 and self.single_node and envs.get("BRAID_CPU_SHM"):
            from .cpushm import CpuShm
            # a GPU communicator's CPU tensors (object collectives, metrics) take an area of their own
            cpu = CpuShm(seg, self.layout, self.segment_tensor, self.rank, self.world_size,
                         self.layout.cpu_rings if self.cuda else None)
            cpu = cpu if cpu.ok and cpu.data >= 4096 else None
        if cpu is not None and not self.cuda and envs.get("BRAID_WARM"):
            cpu.warm()
        if cpu is not None and not self.cuda:
            from .cpup2p import CpuP2P
            p2p_shm = cpu.p2p = CpuP2P(seg, self.layout, self.segment_tensor, self.rank, self.world_size,
                                       give_up=faults.give_up)
        # sends/recvs posted, their peers' sides not read yet: the point-to-point part fills the
        # queue, the other parts start them before a collective
        pending = P2PQueue()
        self._cpu_calls = cpu_calls = CpuCalls(cpu, p2p_shm, self.policy, self.check, faults, pending,
                                               self._lanes.get("shm"), ledger)
        from ..collectives.routed import RoutedAllToAll
        self._routed = RoutedAllToAll(self.world_size)     # the router of skewed all_to_all calls
        self.route_samples = RouteSamples(self._routed)   # skewed calls timed for the router, until reported
        common = dict(rank=self.rank, world_size=self.world_size, cuda=self.cuda, device=self.device)
        ce = self._lanes.get("ce")
        self._calls = calls = CallPath(self.rank, self.world_size, self.cuda, self.device, seg, ledger,
                                       self.library, self.policy, self._prepared, self._rounds, self.shortcuts,
                                       faults, pending, ce, cpu_calls)
        self._exchange = exchange = Exchange(
            **common, segment=seg, layout=self.layout, seg_dev_ptr=self.seg_dev_ptr, lanes=self._lanes,
            lane_ctx=self.lane_ctx, lanes_for=lanes_for, unavailable=self.unavailable, wanted=self.wanted,
            policy=self.policy, prepared=self._prepared, rounds=self._rounds, shortcuts=self.shortcuts,
            ledger=ledger, faults=faults, calls=calls, pending=pending, routed=self._routed,
            samples=self.route_samples, native_group=self.native_group, gloo_group=self.gloo_group)
        self._routing = routing = Routing(
            **common, single_node=self.single_node, segment=seg, layout=self.layout, seg_dev_ptr=self.seg_dev_ptr,
            lanes=self._lanes, lanes_for=lanes_for, check=self.check, policy=self.policy, prepared=self._prepared,
            shortcuts=self.shortcuts, ledger=ledger, faults=faults, calls=calls, exchange=exchange, pending=pending,
            cpu=cpu_calls, hier=self.hier, routed=self._routed, samples=self.route_samples,
            native_group=self.native_group, mode=envs.get("BRAID_ROUTE"), ce_min=envs.get("BRAID_A2AV_CE_MIN_MB") << 20)
        self._reductions = Reductions(
            **common, ledger=ledger, library=self.library, nccl_group=self.nccl_group,
            native_group=self.native_group, gloo_group=self.gloo_group, lane_ctx=self.lane_ctx, ce_lane=ce,
            exchange=exchange, calls=calls, hier=self.hier)
        self._p2p = PointToPoint(
            **common, segment=seg, layout=self.layout, seg_dev_ptr=self.seg_dev_ptr, lanes=self._lanes,
            lane_ctx=self.lane_ctx, lanes_for=lanes_for, check=self.check, policy=self.policy,
            prepared=self._prepared, library=self.library, native_group=self.native_group, ledger=ledger,
            faults=faults, calls=calls, exchange=exchange, routing=routing, samples=self.route_samples,
            pending=pending, cpu=cpu_calls)
        faults.pairs = self._p2p.pairs
        # what the ops' own entries read on every call, bound here once: the fast path's two calls,
        # the CPU path's test and call, and the queue of pending sends/recvs (the backend reads it too)
        self._native_fast, self._fast_prepared = calls.native_fast, calls.fast_prepared
        self._cpu, self._cpu_ok, self._cpu_call, self._cpu_done = cpu, cpu_calls.ok, cpu_calls.call, cpu_calls.done
        self._cpu_replay = cpu_calls.replay
        self._p2p_pending = pending
        if self.segment is not None:
            fw = weakref.ref(faults)        # the segment and the watchdog must not keep the parts alive
            self.segment.on_wait = lambda *a: _call(fw, "on_wait", *a)
            self.segment.on_timeout = lambda *a: _call(fw, "on_timeout", *a)
            faults.watchdog = _Watchdog(self.segment, self.rank, self.world_size, self.cuda,
                                        status=ledger.status,
                                        on_peer_abort=lambda why: _call(fw, "abort_native", why, False),
                                        overdue=lambda: _call(fw, "p2p_overdue") or "")
        self._closer = weakref.finalize(self, _finalize, self.segment, self.seg_dev_ptr, faults.watchdog)
        _hook_exit()
        self.load_calibration()
        if _node is None:
            _LIVE.add(self)

    # set-up -----------------------------------------------------------------------------------
    def _init_state(self, lanes) -> None:
        """The settings read once, when the communicator is created, and the lanes asked for."""
        self.check = envs.get("BRAID_CHECK")   # read once, when the communicator is created
        wanted = lanes if lanes is not None else envs.get("BRAID_LANES")
        known = [k.value for k in LaneKind]
        unknown = [x for x in (wanted or ()) if str(x) not in known]
        if unknown:
            raise MisuseError(f"unknown lane(s) {unknown} (from {'lanes=' if lanes is not None else 'BRAID_LANES'}); "
                              f"valid lanes: {known}")
        self.wanted = None if wanted is None else {LaneKind(str(x)).value for x in wanted}

    def _init_groups(self) -> None:
        """braid's gloo group, the device, the node (a shared segment when every rank is on one
        host), braid's NCCL group and where whole calls go."""
        node = self._node
        self.gloo_group = node["gloo"] if node else dist.new_group(backend="gloo")
        # GPU lanes under an NCCL default group, or under braid's own backend (its default group
        # is braid's: whole calls then go to braid's NCCL group below, never to the default group)
        backend = str(dist.get_backend()).lower()
        self.cuda = torch.cuda.is_available() and dist.is_nccl_available() and ("nccl" in backend or backend == "braid")
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        ids = [None] * self.world_size
        dist.all_gather_object(ids, (socket.gethostname(), _boot_id(), os.getpid(),
                                     self.device.index if self.cuda else -1, _pretend_node()), group=self.gloo_group)
        hosts = [(h, b, fake) for h, b, _, _, fake in ids]     # a node: a host (or a pretend node of one)
        self.single_node = len(set(hosts)) == 1
        if self.cuda:
            _check_gpus_per_host([i[:4] for i in ids])

        self.layout = self.segment = self.segment_tensor = self.seg_dev_ptr = None
        self.ring_cursors: dict[tuple, RingCursor] = {}
        if self.single_node:
            self._open_segment()
        self.nccl_group = None
        if self.cuda:
            self.nccl_group = node["nccl"] if node else dist.new_group(backend="nccl")
            warm = torch.zeros(1, device=self.device)
            dist.all_reduce(warm, group=self.nccl_group)   # create the NCCL communicator now
        # where whole calls go to NCCL's own collective: the default group when it is NCCL (the
        # communicator the caller's own NCCL calls use: measured ~10 us per call faster at 1-4 MiB
        # than a second communicator from new_group on 2 and 4 x H200), else braid's group. The
        # nccl lane's share of split calls stays on braid's group, beside the other lanes.
        self.native_group = self.nccl_group
        if self.cuda and "nccl" in str(dist.get_backend()).lower() and not node:
            self.native_group = dist.group.WORLD
        self.num_nodes = len(set(hosts))
        if not self.single_node and not node and envs.get("BRAID_HIER"):
            from .hier import Hierarchy
            self.hier = Hierarchy.build(self, hosts, lambda lanes, groups: Communicator(lanes=lanes, _node=groups))

    def _open_segment(self) -> None:
        chunk = envs.get("BRAID_HOST_CHUNK_KB") << 10
        wanted_budget = envs.get("BRAID_HOST_BUFFER_MB") << 20   # every rank reads (and rejects) settings
        # CPU relays stage in the segment; GPU relays stage in device memory (a small area here
        # serves CPU tensors passed to a GPU communicator)
        wanted_relay = (1 << 20) if self.cuda else envs.get("BRAID_RELAY_BUFFER_MB") << 20
        cpu_area = CPU_AREA if self.cuda else 0     # a GPU communicator's whole CPU calls (comm/cpushm.py)
        box = [None]
        if self.rank == 0:     # decide the size, create the segment, then tell the others its name
            budget, relay = _fit_shm(self.world_size, wanted_budget, chunk, wanted_relay, cpu_area, self.cuda)
            self.layout = Layout(self.world_size, budget, chunk, relay, cpu_area, self.cuda)
            box = [(NodeSegment.new_name(), budget, relay)]
            self.segment = NodeSegment(box[0][0], self.layout, self.rank, create=True, spin_s=self._spin_s())
        dist.broadcast_object_list(box, group_src=0, group=self.gloo_group)
        name, budget, relay = box[0]
        self.layout = Layout(self.world_size, budget, chunk, relay, cpu_area, self.cuda)
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
                from ..lanes import _cuda
                self.seg_dev_ptr = _cuda.host_register(self.segment.address, self.layout.total_bytes)
            except (OSError, Exception) as exc:   # no driver symbol, registration refused
                log.warning("braid: cannot pin the node segment (%s); ce and host lanes are off", exc)
                self.seg_dev_ptr = None

    def _spin_s(self) -> float:
        return 0.002 if self.cuda else 0.00005

    def _make_lanes(self) -> dict[str, object]:
        from ..lanes.gloo import GlooLane
        from ..lanes.shm import ShmLane
        lanes: dict[str, object] = {"gloo": GlooLane(self.gloo_group), "shm": ShmLane(self.lane_ctx)}
        if self.cuda:
            from ..lanes.ce import CeLane
            from ..lanes.host import HostLane
            from ..lanes.nccl import NcclLane
            lanes["nccl"] = NcclLane(self.nccl_group, self.device)
            lanes["ce"] = CeLane(self.lane_ctx, self.device)
            lanes["host"] = HostLane(self.lane_ctx, self.device)
        from ..lanes.relay import RelayLane     # GPU or CPU engine, picked per call by the tensors
        lanes["relay"] = RelayLane(self.lane_ctx, lanes.get("ce"), self.device if self.cuda else None)
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
        return usable_lanes(self._lanes, self.unavailable, self.wanted, device)

    @property
    def slowdown(self) -> dict[str, float]:
        """Test/bench hook: CPU lane name -> time multiplier (the lanes read it per call)."""
        return self.lane_ctx.slowdown

    @slowdown.setter
    def slowdown(self, value: dict[str, float]) -> None:
        self.lane_ctx.slowdown = dict(value)

    # ops ----------------------------------------------------------------------------------------
    # Each op's entry: a whole call through the segment on CPU tensors, then the fast path (the
    # shortcuts' answer: the native library whole, or a prepared call replayed), then the rest of
    # the op (a multi-node world's steps, the full path) in its part.
    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, async_op: bool = False):
        """In place, like torch.distributed.all_reduce."""
        tkey = ckey = None
        if (self._cpu is not None and type(tensor) is torch.Tensor and not tensor.is_cuda and type(op) is _RED_T
                and tensor.numel() * tensor.element_size() >= NATIVE_MIN):
            ckey = ("ar", tensor.numel(), tensor.dtype, op)      # a repeated native call (CpuCalls.replay)
            if (h := self._cpu_replay(ckey, tensor, None)) is not None:
                return h if async_op else None
        if self._cpu is not None and self._cpu_ok(tensor) and (red := self._cpu_calls.reduction(op, tensor.dtype)):
            return self._cpu_call("all_reduce", tensor, lambda: self._cpu.all_reduce(tensor, *red), async_op, ckey)
        if type(op) is _RED_T and type(tensor) is torch.Tensor and tensor.is_cuda is self.cuda and tensor.is_contiguous():
            n = tensor.numel()
            if self.shortcuts.decide("ar", n, (tensor.dtype, op), self._rest_ar, tensor, op):
                return self._native_fast("allreduce", ([tensor],), "allreduce", async_op, op=op, fallback=lambda a:
                                         dist.all_reduce(tensor, op=op, group=self.library.group, async_op=a))
            if self.cuda:
                tkey = ("ar", tensor.data_ptr(), n, tensor.dtype, op)
                if (h := self._fast_prepared(tkey, tensor, (tensor,), async_op,
                                             lambda: self.all_reduce(tensor, op))) is not None:
                    return h if async_op else None
        if self.hier is not None and (h := self.hier.all_reduce(tensor, op, async_op)) is not None:
            return h if async_op else None
        return self._reductions.reduction("all_reduce", tensor, tensor, op, None, async_op, tkey)

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM,
                              async_op: bool = False):
        """output (numel m) = reduction over ranks of input[rank*m:(rank+1)*m]."""
        tkey = ckey = None
        if (self._cpu is not None and type(output) is torch.Tensor and not output.is_cuda and type(op) is _RED_T
                and type(input) is torch.Tensor and input.numel() * input.element_size() >= NATIVE_MIN):
            ckey = ("rs", output.numel(), input.numel(), output.dtype, input.dtype, op)
            if (h := self._cpu_replay(ckey, output, input)) is not None:
                return h if async_op else None
        if (self._cpu is not None and self._cpu_ok(output, input) and input.dtype is output.dtype
                and input.numel() == output.numel() * self.world_size
                and (red := self._cpu_calls.reduction(op, output.dtype))):
            src = input.detach() if input.requires_grad else input
            return self._cpu_call("reduce_scatter", input, lambda: self._cpu.reduce_scatter(output, src, *red), async_op,
                                  ckey)
        if getattr(input, "requires_grad", False):
            input = input.detach()     # read only: the native library's copies of it stay out of autograd
        if (type(op) is _RED_T and type(input) is torch.Tensor and type(output) is torch.Tensor and input.is_cuda is self.cuda
                and output.is_cuda is self.cuda and input.is_contiguous() and output.is_contiguous()):
            n = input.numel()
            if self.shortcuts.decide("rs", n, (input.dtype, op, output.numel()), self._rest_rs, output, input, op):
                return self._native_fast("_reduce_scatter_base", (output, input), "reducescatter", async_op, op=op,
                                         fallback=lambda a: dist.reduce_scatter_tensor(
                                             output, input, op=op, group=self.library.group, async_op=a))
            if self.cuda:
                tkey = ("rs", input.data_ptr(), output.data_ptr(), n, output.numel(), input.dtype, output.dtype, op)
                if (h := self._fast_prepared(tkey, input, (output,), async_op,
                                             lambda: self.reduce_scatter_tensor(output, input, op))) is not None:
                    return h if async_op else None
        if self.hier is not None and (h := self.hier.reduce_scatter_tensor(output, input, op, async_op)) is not None:
            return h if async_op else None
        return self._reductions.reduction("reduce_scatter", output, input, op, None, async_op, tkey)

    def reduce_scatter(self, output: torch.Tensor, input_list: list[torch.Tensor], op=dist.ReduceOp.SUM,
                       async_op: bool = False):
        """List form: input_list[d] is this rank's contribution to rank d (copied into one buffer)."""
        return self._reductions.reduce_scatter(output, input_list, op, async_op)

    def reduce(self, tensor: torch.Tensor, dst: int = 0, op=dist.ReduceOp.SUM, async_op: bool = False):
        """The reduction lands in `tensor` on rank dst; other ranks' tensors are left unchanged."""
        tkey = ckey = None
        if (self._cpu is not None and type(tensor) is torch.Tensor and not tensor.is_cuda and type(op) is _RED_T
                and type(dst) is int and tensor.numel() * tensor.element_size() >= NATIVE_MIN):
            ckey = ("rd", tensor.numel(), tensor.dtype, op, dst)
            if (h := self._cpu_replay(ckey, tensor, None)) is not None:
                return h if async_op else None
        if (self._cpu is not None and self._cpu_ok(tensor) and type(dst) is int and 0 <= dst < self.world_size
                and (red := self._cpu_calls.reduction(op, tensor.dtype))):
            return self._cpu_call("reduce", tensor, lambda: self._cpu.all_reduce(tensor, *red, root=dst), async_op, ckey)
        if (self._calls.fast_ok(tensor) and type(dst) is int and 0 <= dst < self.world_size
                and fast_reduce_ok(op, tensor.dtype, self.cuda)):
            if self.shortcuts.decide("rd", tensor.numel(), (tensor.dtype, op, dst), self._rest_rd, tensor):
                return self._native_fast("reduce", ([tensor],), "reduce", async_op, op=op, root=dst, fallback=lambda a:
                                         dist.reduce(tensor, group_dst=dst, op=op, group=self.native_group, async_op=a))
            tkey = ("rd", tensor.data_ptr(), tensor.numel(), tensor.dtype, op, dst)
            if (h := self._fast_prepared(tkey, tensor, (tensor,), async_op,
                                         lambda: self.reduce(tensor, dst, op))) is not None:
                return h if async_op else None
        check_rank(dst, self.world_size, "dst", "reduce")
        return self._reductions.reduction("reduce", tensor, tensor, op, dst, async_op, tkey)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes=None,
                          input_split_sizes=None, async_op: bool = False):
        op = "all_to_all_single"
        ckey = None
        if (self._cpu is not None and not input_split_sizes and not output_split_sizes and type(output) is torch.Tensor
                and not output.is_cuda and type(input) is torch.Tensor and input.dim() > 0
                and input.numel() * input.element_size() >= NATIVE_MIN):
            ckey = ("a2a", output.numel(), input.numel(), output.dtype, input.dtype, input.size(0))
            if (h := self._cpu_replay(ckey, output, input)) is not None:
                return h if async_op else None
        if getattr(input, "requires_grad", False):
            input = input.detach()     # read only: the native library's copies of it stay out of autograd
        if (self._cpu is not None and not input_split_sizes and not output_split_sizes and self._cpu_ok(output, input)
                and input.dtype is output.dtype and input.dim() > 0 and input.numel() == output.numel()
                and input.size(0) % self.world_size == 0):
            return self._cpu_call(op, input, lambda: self._cpu.all_to_all(output, input), async_op, ckey)
        if (not input_split_sizes and not output_split_sizes and type(input) is torch.Tensor
                and type(output) is torch.Tensor and input.is_cuda is self.cuda and output.is_cuda is self.cuda
                and input.dim() > 0 and input.is_contiguous() and output.is_contiguous()):
            n = input.numel()
            if self.shortcuts.decide("a2a", n, (input.dtype, input.size(0), output.numel()), self._rest_a2a,
                                     output, input):
                return self._native_fast("alltoall_base", (output, input, [], []), "alltoall", async_op, fallback=lambda a:
                                         dist.all_to_all_single(output, input, group=self.library.group, async_op=a))
            if self.cuda and self._routing.mode != "on":
                if (h := self._fast_prepared(a2a_ticket(input, output), input, (output,), async_op,
                                             lambda: self.all_to_all_single(output, input))) is not None:
                    return h if async_op else None
        return self._routing.all_to_all_single(output, input, output_split_sizes, input_split_sizes, async_op)

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        op = "all_gather"
        tkey = ckey = None
        if (self._cpu is not None and type(output) is torch.Tensor and not output.is_cuda
                and type(input) is torch.Tensor and input.numel() * input.element_size() >= NATIVE_MIN):
            ckey = ("ag", output.numel(), input.numel(), output.dtype, input.dtype)
            if (h := self._cpu_replay(ckey, output, input)) is not None:
                return h if async_op else None
        if (self._cpu is not None and self._cpu_ok(output, input) and input.dtype is output.dtype
                and output.numel() == input.numel() * self.world_size):
            src = input.detach() if input.requires_grad else input
            return self._cpu_call(op, input, lambda: self._cpu.all_gather(output, src), async_op, ckey)
        if getattr(input, "requires_grad", False):
            input = input.detach()     # read only: the native library's copies of it stay out of autograd
        if (type(input) is torch.Tensor and type(output) is torch.Tensor and input.is_cuda is self.cuda
                and output.is_cuda is self.cuda and input.is_contiguous() and output.is_contiguous()):
            n = input.numel()
            if self.shortcuts.decide("ag", n, (input.dtype, output.numel()), self._rest_ag, output, input):
                return self._native_fast("_allgather_base", (output, input), "allgather", async_op, fallback=lambda a:
                                         dist.all_gather_into_tensor(output, input, group=self.library.group, async_op=a))
            if self.cuda:
                tkey = ("ag", input.data_ptr(), output.data_ptr(), n, output.numel(), input.dtype, output.dtype)
                if (h := self._fast_prepared(tkey, input, (output,), async_op,
                                             lambda: self.all_gather_into_tensor(output, input))) is not None:
                    return h if async_op else None
        dev = self._calls.device_for(input)
        ib = input_bytes(input, "input", dev, op)
        ob = output_bytes(output, "output", dev, op)
        same_dtype(input, output, op)
        if ob.numel() != ib.numel() * self.world_size:
            raise MisuseError(f"{op}: output has {output.numel()} elements, need input.numel() * world_size = "
                              f"{input.numel()} * {self.world_size}")
        if self.hier is not None and (h := self.hier.all_gather_into_tensor(output, input, async_op)) is not None:
            return h if async_op else None
        n = ib.numel()
        desc = {"op": op, "dtype": str(input.dtype), "nbytes": n}
        return self._exchange.run(op, desc, n, ib, [ob],
                                  lambda d: (n, ("ag", n, False), lambda: all_gather_movement(self.world_size, n, False)),
                                  lambda g: dist.all_gather_into_tensor(ob, ib, group=g, async_op=True),
                                  ("op", "dtype", "nbytes"), async_op, ticket=tkey)

    def all_gather(self, output_list: list[torch.Tensor], input: torch.Tensor, async_op: bool = False):
        op = "all_gather"
        dev = self._calls.device_for(input)
        ib = input_bytes(input, "input", dev, op)
        if not isinstance(output_list, (list, tuple)) or len(output_list) != self.world_size:
            raise MisuseError(f"{op}: output_list must be a list of world_size={self.world_size} tensors")
        outs = []
        for i, o in enumerate(output_list):
            outs.append(output_bytes(o, f"output_list[{i}]", dev, op))
            same_dtype(input, o, op, ("input", f"output_list[{i}]"))
            if o.numel() != input.numel():
                raise MisuseError(f"{op}: output_list[{i}] has {o.numel()} elements, input has {input.numel()}")
        if self.hier is not None and type(input) is torch.Tensor and input.is_contiguous():
            whole = input.new_empty(input.numel() * self.world_size)
            if (h := self.hier.all_gather_into_tensor(whole, input, async_op)) is not None:
                with torch.no_grad():
                    for o, piece in zip(output_list, whole.view(self.world_size, -1)):
                        o.copy_(piece.view_as(o))
                return h if async_op else None
        n = ib.numel()
        desc = {"op": op, "dtype": str(input.dtype), "nbytes": n}
        return self._exchange.run(op, desc, n, ib, outs,
                                  lambda d: (n, ("ag", n, True), lambda: all_gather_movement(self.world_size, n, True)),
                                  lambda g: dist.all_gather(list(outs), ib, group=g, async_op=True),
                                  ("op", "dtype", "nbytes"), async_op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False):
        op = "broadcast"
        tkey = ckey = None
        if (self._cpu is not None and type(tensor) is torch.Tensor and not tensor.is_cuda and type(src) is int
                and tensor.numel() * tensor.element_size() >= NATIVE_MIN):
            ckey = ("bc", tensor.numel(), tensor.dtype, src)
            if (h := self._cpu_replay(ckey, tensor, None)) is not None:
                return h if async_op else None
        if self._cpu is not None and self._cpu_ok(tensor) and type(src) is int and 0 <= src < self.world_size:
            return self._cpu_call(op, tensor, lambda: self._cpu.broadcast(tensor, src), async_op, ckey)
        if type(tensor) is torch.Tensor and type(src) is int and tensor.is_cuda is self.cuda and tensor.is_contiguous():
            n = tensor.numel()
            if self.shortcuts.decide("bc", n, (tensor.dtype, src), self._rest_bc, tensor, src):
                return self._native_fast("broadcast", ([tensor],), "broadcast", async_op, root=src, fallback=lambda a:
                                         dist.broadcast(tensor, group_src=src, group=self.library.group, async_op=a))
            if self.cuda:
                tkey = ("bc", tensor.data_ptr(), n, tensor.dtype, src)
                if (h := self._fast_prepared(tkey, tensor if self.rank == src else None, (tensor,), async_op,
                                             lambda: self.broadcast(tensor, src))) is not None:
                    return h if async_op else None
        dev = self._calls.device_for(tensor)
        check_rank(src, self.world_size, "src", op)
        if self.hier is not None and (h := self.hier.broadcast(tensor, src, async_op)) is not None:
            return h if async_op else None
        tb = output_bytes(tensor, "tensor", dev, op)
        n = tb.numel()
        desc = {"op": op, "dtype": str(tensor.dtype), "nbytes": n, "root": src}
        inp = tb if self.rank == src else None
        return self._exchange.run(op, desc, n, inp, [tb],
                                  lambda d: (n, ("bc", n, src), lambda: broadcast_movement(self.world_size, n, src)),
                                  lambda g: dist.broadcast(tb, group_src=src, group=g, async_op=True),
                                  ("op", "dtype", "nbytes", "root"), async_op, ticket=tkey)

    def send(self, tensor: torch.Tensor, dst: int, async_op: bool = False):
        return self._p2p.call(tensor, dst, True, async_op)

    def recv(self, tensor: torch.Tensor, src: int, async_op: bool = False):
        return self._p2p.call(tensor, src, False, async_op)

    def batch_isend_irecv(self, p2p_op_list, device: torch.device | None = None) -> list:
        return self._p2p.batch_isend_irecv(p2p_op_list, device)

    batch_isend_irecv.__doc__ = PointToPoint.batch_isend_irecv.__doc__

    def run_plan(self, plan: Plan, input: torch.Tensor | None, outputs: list[torch.Tensor],
                 async_op: bool = False) -> Handle | None:
        return self._exchange.run_plan(plan, input, outputs, async_op)

    run_plan.__doc__ = Exchange.run_plan.__doc__

    def abort(self, reason: str = "abort() was called", wait: bool = True) -> None:
        """Give up on this communicator on this rank, and tell the peers: they raise at once
        where they wait for this rank (LaneFailureError "rank r aborted: ..."), and their
        watchdogs abort the NCCL communicators braid uses, so no rank stays blocked in NCCL. GPU
        stream waits on braid's counters are released. Afterwards every call raises: make a new
        process group and communicator (close() still releases memory). Not collective.
        wait=False: NCCL's aborts run on a thread of their own (Faults.abort_native)."""
        self._faults.abort(reason, wait)

    # shares -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def fixed_shares(self, shares: dict[str, float] | None, op: str = "*", timed: bool = False) -> Iterator[None]:
        """Use these shares for every op (or one op) inside the block (tests, calibration, bench).
        timed=True: every split call inside posts its lanes and times each (the handle's
        lane_times_us), where a repeat would otherwise replay a program that times nothing; every
        rank must pass the same."""
        self._drain()
        policy = self.policy
        old, old_timing = policy.fixed, policy.lane_timing
        policy.set_fixed(None if shares is None else {**(old or {}), op: dict(shares)})
        policy.lane_timing = timed
        self.shortcuts.clear()
        self._prepared.clear()
        self._learn_update()
        try:
            yield
        finally:
            self._drain(raising=False)
            policy.set_fixed(old)
            policy.lane_timing = old_timing
            self.shortcuts.clear()
            self._prepared.clear()
            self._learn_update()

    def _drain(self, raising: bool = True) -> None:
        """Let the deferred calls queued so far run (comm/rounds.py) before what they were
        prepared under changes (shares, calibration); raises the error one of them met."""
        rd = getattr(self, "_rounds", None)
        if rd is not None:
            rd.drain(raising)

    def _trial_exchange(self, values: list[int]) -> list[list[int]]:
        """The whole-or-split trials' agreement (comm/arbiter.py). A call asks the arbiter before
        the ledger counts it; while this exchange waits the call is counted, so that a peer still
        at the previous call, taken whole, reads as late, not as a different call (Faults.on_wait)."""
        self.ledger.ncalls += 1
        try:
            return self.segment.exchange_values(values, "whole-or-split trial")
        finally:
            self.ledger.ncalls -= 1

    def _learn_update(self) -> None:
        """Whole or split learned in the job (comm/arbiter.py) only where braid chooses the shares:
        not under fixed shares (tests, the calibration, `--shares`) nor in check mode."""
        self.shortcuts.learn = self._arbiter.enabled and self.policy.fixed is None and not self.check
        if self.policy.set_near_trials(self.shortcuts.learn):
            self.shortcuts.clear()          # the kept answers of shapes NCCL won by little

    @contextlib.contextmanager
    def calibrated_verdict(self) -> Iterator[None]:
        """Inside the block every call of a shape the calibration splits is split, as the calibration
        chose, without trials against the whole call (the op sweep of `braid bench`: its alternating
        windows would fall inside a trial's intervals)."""
        was = self._arbiter.enabled
        self._arbiter.enabled = False
        self._learn_update()
        try:
            yield
        finally:
            self._arbiter.enabled = was
            self._learn_update()

    def shares_for(self, op: str, nbytes: int, lanes: list[str]) -> dict[str, float]:
        """This call's shares over `lanes` (comm/policy.py)."""
        return self.policy.shares_for(op, nbytes, lanes)

    def split_rule(self, op: str, costs: dict[str, LaneCost], nbytes: int) -> dict[str, float]:
        """Shares from lane costs alone (comm/policy.py; the calibration asks it)."""
        return self.policy.split_rule(op, costs, nbytes)

    # the braid backend's forwarding ------------------------------------------------------------
    # Under init_process_group("braid"), a call that the native library takes whole goes from the
    # backend straight to its inner NCCL (gloo) group, with torch's own options object, and the
    # caller gets that library's Work: its future, its stream semantics, no braid object per call.
    # These read the fast path's answer for the call shape; a shape not seen yet answers False, so
    # its first call takes the full path, which fills the answer in (the same facts on every rank).
    def _takes(self, t) -> bool:
        """A tensor the fast path's answers apply to (all_reduce's test is written out in the
        backend: the same as whole_reduce_scatter's, for one tensor)."""
        return (type(t) is torch.Tensor and t.is_cuda is self.cuda and t.is_contiguous()
                and not (f := self._faults).closed and not f.aborted)

    #
    # A shape the calibration splits is still NCCL's whole while the job's trial says so
    # (comm/arbiter.py): these ask the arbiter too, so such a call is forwarded as well (through
    # braid's own op and Work it cost ~20-100 us more host time a call: 2 x H200, FSDP2). The
    # decision and the hand-off of the arbiter's answer to the op's own path: comm/shortcuts.py.
    def whole_reduce_scatter(self, out, inp, op) -> bool:
        if not (self._takes(inp) and self._takes(out)) or out.dtype is not inp.dtype:
            return False
        return self.shortcuts.answer("rs", inp.numel(), (inp.dtype, op, out.numel()), self._rest_rs, out, inp, op)

    def whole_all_gather(self, out, inp) -> bool:
        if not (self._takes(inp) and self._takes(out)) or out.dtype is not inp.dtype:
            return False
        return self.shortcuts.answer("ag", inp.numel(), (inp.dtype, out.numel()), self._rest_ag, out, inp)

    def whole_broadcast(self, t, root: int) -> bool:
        if not self._takes(t):
            return False
        return self.shortcuts.answer("bc", t.numel(), (t.dtype, root), self._rest_bc, t, root)

    def whole_all_reduce(self, t, op) -> bool:
        if not self._takes(t):
            return False
        return self.shortcuts.answer("ar", t.numel(), (t.dtype, op), self._rest_ar, t, op)

    def whole_all_to_all(self, out, inp) -> bool:
        """Balanced all_to_all_single (no split sizes) only: uneven calls agree per call."""
        if not (self._takes(inp) and self._takes(out)) or inp.dim() == 0 or out.dtype is not inp.dtype:
            return False
        return self.shortcuts.answer("a2a", inp.numel(), (inp.dtype, inp.size(0), out.numel()), self._rest_a2a,
                                     out, inp)

    # Each op's shape for both questions (the op's own and the backend's, comm/shortcuts.py): the
    # entry's key and facts are written at the two call sites, (element count, (dtype, the op's
    # other facts)); what only a call the entry does not settle needs is here: whether the native
    # call can take the shape at all, the op's name and bytes for the calibration, the arbiter's
    # key. Tensors are contiguous, on this communicator's kind of device.
    def _rest_ar(self, t, op) -> tuple:
        n, dt = t.numel(), t.dtype
        return fast_reduce_ok(op, dt, self.cuda), "all_reduce", n * t.element_size(), ("ar", n, dt, op)

    def _rest_rs(self, out, inp, op) -> tuple:
        n, dt = inp.numel(), inp.dtype
        return (dt is out.dtype and n == out.numel() * self.world_size and fast_reduce_ok(op, dt, self.cuda),
                "reduce_scatter", n * inp.element_size(), ("rs", n, dt, op))

    def _rest_ag(self, out, inp) -> tuple:
        n, dt = inp.numel(), inp.dtype
        return (dt is out.dtype and out.numel() == n * self.world_size, "all_gather", n * inp.element_size(),
                ("ag", n, dt))

    def _rest_bc(self, t, root) -> tuple:
        n, dt = t.numel(), t.dtype
        return 0 <= root < self.world_size, "broadcast", n * t.element_size(), ("bc", n, dt, root)

    def _rest_rd(self, t) -> tuple:
        # reduce: its checks ran at the call site (fast_reduce_ok, dst); no in-job trial (key None)
        return True, "reduce", t.numel() * t.element_size(), None

    def _rest_a2a(self, out, inp) -> tuple:
        n, dt = inp.numel(), inp.dtype
        return (dt is out.dtype and n == out.numel() and inp.size(0) % self.world_size == 0, "all_to_all_single",
                n * inp.element_size(), ("a2a", n, dt))

    # calibration -------------------------------------------------------------------------------------
    def calibration_key(self) -> dict:
        from ..calibrate import machine_key
        return machine_key(self)

    def load_calibration(self) -> None:
        """Rank 0 reads the cached calibration (if any) and every rank takes the same copy, and
        rank 0's BRAID_SPLIT_UNMEASURED and BRAID_NEAR_TRIAL with it (ranks that decide calls
        differently would wait for each other in different libraries)."""
        from ..calibrate import load
        pol = self.policy
        box = [(load(self), pol.model_unmeasured, pol.near_factor) if self.rank == 0 else None]
        dist.broadcast_object_list(box, group_src=0, group=self.gloo_group)
        table, model, near = box[0]
        for name, attr, value in (("BRAID_SPLIT_UNMEASURED", "model_unmeasured", model),
                                  ("BRAID_NEAR_TRIAL", "near_factor", near)):
            if value != getattr(pol, attr):
                log.warning("braid: %s differs from rank 0's on rank %d; rank 0's applies", name, self.rank)
                setattr(pol, attr, value)
        self.set_calibration(table or {})
        if not table and self.cuda and self.rank == 0 and self.world_size > 1 and not self.policy.model_unmeasured:
            log.info("braid: no calibration cached for this machine: GPU calls go to NCCL whole until "
                     "`braid calibrate` (or `braid bench`) measures where splitting them pays")

    def set_calibration(self, table: dict) -> None:
        """Take a calibration table: the shares start over from it (comm/policy.py), and the
        answers and prepared calls made under the old one go."""
        self._drain()
        self.policy.set_table(table)
        if getattr(self, "shortcuts", None) is not None:
            self.shortcuts.clear()
        if getattr(self, "_prepared", None) is not None:
            self._prepared.clear()

    # the ledger's count and last call, read through the communicator (comm/ledger.py owns them)
    @property
    def ncalls(self) -> int:
        return self.ledger.ncalls

    @property
    def last_call(self) -> tuple:
        return self.ledger.last_call

    @property
    def last_route(self) -> tuple[float, float] | None:
        """The router's last prediction for a skewed all_to_all: (routed us, native us)."""
        return self.route_samples.last

    # the split policy's state, read through the communicator (comm/policy.py owns it)
    @property
    def calib(self) -> dict:
        return self.policy.calib

    @property
    def pays(self) -> dict:
        return self.policy.pays

    @property
    def calib_digest(self) -> str:
        return self.policy.digest

    @property
    def balancer(self):
        return self.policy.balancer

    @property
    def adapt(self) -> bool:
        """Stage 2 on (the default); `comm.adapt = False` freezes the shares at the model's."""
        return self.policy.adapt

    @adapt.setter
    def adapt(self, value: bool) -> None:
        self.policy.adapt = bool(value)

    # the state of the parts, read through the communicator --------------------------------------
    @property
    def closed(self) -> bool:
        return self._faults.closed

    @property
    def aborted(self) -> str:
        """Why abort() was called, or "" (comm/ledger.py's Faults owns it)."""
        return self._faults.aborted

    @property
    def watchdog(self):
        return self._faults.watchdog

    @property
    def backend_groups(self) -> list:
        """The braid backend's inner NCCL group(s), aborted with braid's own (backend.py sets them)."""
        return self._faults.backend_groups

    @backend_groups.setter
    def backend_groups(self, groups: list) -> None:
        self._faults.backend_groups = list(groups)

    @property
    def last_handle(self) -> Handle | None:
        """The handle of this rank's last call (the call ledger keeps it)."""
        return self.ledger.last_handle

    @last_handle.setter
    def last_handle(self, handle) -> None:
        self.ledger.last_handle = handle

    @property
    def routing(self) -> str:
        """Skewed all_to_all through the router: "auto", "on" or "off" (BRAID_ROUTE at creation)."""
        return self._routing.mode

    @routing.setter
    def routing(self, mode: str) -> None:
        self._routing.mode = mode

    @property
    def uneven(self):
        """The uneven all_to_all's agreement and its counters (comm/uneven.py)."""
        return self._routing.uneven

    def close(self) -> None:
        """Release lanes, pinned memory and the shared segment. Idempotent; no collective calls."""
        if self.closed:
            return
        if self._rounds is not None:        # queued calls run (or fail) before anything is freed
            self._rounds.close()
        self._faults.closed = True
        self.shortcuts.clear()
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self._prepared.close()
        if self._pace is not None:
            self._arbiter.close()       # its marks' events go back to the clock, which frees them all
            self._pace.close()
        self._routing.close()
        self._p2p.close()
        self._cpu_calls.close()     # its views of the segment go before the segment does
        self._cpu = None
        for lane in self._lanes.values():
            lane.close()
        self._reductions.close()
        if self.hier is not None:
            self.hier.close()
        self._closer()

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# the communicators made over a torch.distributed world (not a node's sub-communicators, which
# their parent closes), for close_before_destroy
_LIVE: "weakref.WeakSet[Communicator]" = weakref.WeakSet()


def close_before_destroy(group=None) -> None:
    """Close every open communicator that destroying `group` (None or WORLD: every group) takes
    groups from, before torch shuts a group down (torch's destroy_process_group, wrapped by
    braid's backend module). Why: a prepared all_reduce with NCCL's share keeps a CUDA graph that
    holds an NCCL call of the communicator's NCCL group, NCCL's destroy of that group waits until
    the graph is freed, and torch shuts the groups a communicator made down before the default
    group, whose shutdown (under the braid backend) would have closed it: the destroy never
    returned. Closing frees the graphs first; a failed close is reported, the destroy goes on."""
    world = group is None or group is dist.group.WORLD
    for comm in list(_LIVE):
        if comm.closed:
            continue
        if world or any(g is group for g in (comm.gloo_group, comm.nccl_group, comm.native_group)):
            try:
                comm.close()
            except Exception as exc:     # noqa: BLE001  shutting down: report, go on
                log.warning("braid: closing a communicator before destroy_process_group failed: %s", exc)


_GPU_NAMES = tuple(k.value for k in GPU_LANES)     # (an enum member's .value costs ~0.5 us a read)
_CPU_NAMES = tuple(k.value for k in CPU_LANES)


def usable_lanes(lanes: dict, unavailable: dict[str, str], wanted: set | None, device: torch.device) -> list[str]:
    """Lane names usable for tensors on `device`, in plan order: made here, available, asked for."""
    names = _GPU_NAMES if device.type == "cuda" else _CPU_NAMES
    return [k for k in names if k in lanes and k not in unavailable and (wanted is None or k in wanted)]


def _fit_shm(world_size: int, budget: int, chunk: int, relay: int = 0, cpu_area: int = 0,
             graph: bool = False) -> tuple[int, int]:
    """Shrink the per-rank host buffer and relay staging so the node segment fits in /dev/shm (a
    container's default /dev/shm is 64 MiB; writing past it kills the process with SIGBUS instead
    of an error). Both are halved together; returns (host buffer bytes, relay staging bytes)."""
    try:
        st = os.statvfs("/dev/shm")
        free = st.f_bavail * st.f_frsize
    except OSError:
        return budget, relay
    need = Layout(world_size, budget, chunk, relay, cpu_area, graph).total_bytes
    if need <= free * 0.9:
        return budget, relay
    fitted, fitted_relay = budget, relay
    while fitted > (64 << 10) and Layout(world_size, fitted, chunk, fitted_relay, cpu_area, graph).total_bytes > free * 0.9:
        fitted //= 2
        fitted_relay = max(fitted_relay // 2, 64 << 10) if relay else 0
    log.warning("braid: /dev/shm has %d MiB free, too little for BRAID_HOST_BUFFER_MB=%d (and %d MiB of relay "
                "staging) on %d ranks; using %d KiB per rank and %d KiB of relay staging (host, shm and relay "
                "lanes get slower; enlarge /dev/shm to fix)",
                free >> 20, budget >> 20, relay >> 20, world_size, fitted >> 10, fitted_relay >> 10)
    return fitted, fitted_relay


# set by an exit hook that runs before weakref's finalizers do at interpreter exit: a process
# that ends without destroy_process_group (or close) still holds its views of the segment then,
# which only the exit itself releases; that is no leak, so it is not warned about
_EXIT = {"hooked": False, "exiting": False}


def _hook_exit() -> None:
    """Register the exit mark once, after this process's first weakref.finalize (made just
    before): exit hooks run last-registered first, so the mark is set before the finalizers run."""
    if not _EXIT["hooked"]:
        _EXIT["hooked"] = True
        atexit.register(_EXIT.__setitem__, "exiting", True)


def _finalize(segment, seg_dev_ptr, watchdog=None) -> None:
    if watchdog is not None:
        watchdog.stop()
    if seg_dev_ptr is not None and segment is not None and not segment.closed:
        try:
            from ..lanes import _cuda
            _cuda.host_unregister(segment.address)
        except Exception as exc:   # at interpreter exit the driver may be gone already
            log.debug("braid: unregister at close failed: %s", exc)
    if segment is not None:
        segment.close(quiet=_EXIT["exiting"])


def _check_gpus_per_host(ids: list) -> None:
    """Every rank of a host on its own GPU, unless BRAID_SHARED_GPU lets ranks share one (a
    development mode). `ids`: (hostname, boot id, pid, GPU index) per rank. The same index on two
    hosts is normal (each rank on cuda:LOCAL_RANK)."""
    if envs.get("BRAID_SHARED_GPU"):
        return
    seen: dict[tuple, int] = {}
    for rank, (host, boot, _, dev) in enumerate(ids):
        other = seen.setdefault((host, boot, dev), rank)
        if other != rank:
            raise MisuseError(f"ranks {other} and {rank} both use GPU {dev} of host {host}; call "
                              f"torch.cuda.set_device(local_rank) before creating the communicator (for "
                              f"development, BRAID_SHARED_GPU=1 lets ranks share a GPU: correct results "
                              f"and host times, not link speeds)")


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _pretend_node() -> int:
    """This rank's pretend node under BRAID_FAKE_NODES (0 when unset): the world's ranks cut in
    order into that many nodes of equal size."""
    n = envs.get("BRAID_FAKE_NODES")
    if n <= 1:
        return 0
    world = dist.get_world_size()
    if world % n:
        raise MisuseError(f"BRAID_FAKE_NODES={n} does not divide the world of {world} ranks; set it to "
                          f"a divisor of {world} (pretend nodes have equal sizes)")
    return dist.get_rank() // (world // n)
