"""The full path of every op: agree on the call across ranks (descriptors through the node segment,
digests for repeated calls), plan the movement with the agreed shares, and post it on the lanes.
`run_plan` runs a plan given by the caller (routed plans, tests).
"""
from __future__ import annotations

import hashlib
import json
import logging
import time

import torch
import torch.distributed as dist

from .. import envs
from ..collectives import input_bytes, output_bytes
from ..errors import BraidTimeoutError, LaneFailureError, LaneUnavailableError, MisuseError, PeerMismatchError
from ..executor import Handle, as_handle, execute
from ..planner.plan import Plan, split

from ..lanes import _cuda
from ..lanes.signals import Flags
from .prepared import (SAMPLE_EVERY, SAMPLE_FIRST, Entry, _capturing, graph_shares, not_capturable,
                       posted_not_capturable)


# a skewed call's routing decision: the native collective, not a share split (comm/routing.py)
DECLINED = object()

log = logging.getLogger("braid")


P2P_DESC_BYTES = 2048

DESC_MEMO = 16               # full descriptor exchanges remembered for repeated calls (exchange_node)


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


def agree(op: str, descs: list, keys: tuple[str, ...]) -> None:
    """Every rank that posted a descriptor passed the same value under each of `keys`."""
    present = [(r, d) for r, d in enumerate(descs) if d is not None]
    for key in keys:
        values = {r: d.get(key) for r, d in present}
        vals = list(values.values())
        if all(v == vals[0] for v in vals):
            continue               # equal as objects (the common case: no serialising)
        if len(set(map(json.dumps, vals))) > 1:       # a tuple and a list may still be equal
            raise PeerMismatchError(f"{op}: ranks disagree on {key}: {values}. Every rank must pass "
                                    f"matching arguments to the same call.")

def agreed_lanes(descs: list) -> list[str]:
    """The lanes every rank offered, in the first rank's order."""
    sets = [set(d["lanes"]) for d in descs if d is not None]
    first = next(d["lanes"] for d in descs if d is not None)
    return [k for k in first if all(k in s for s in sets)]


def _ipc_maps(lanes: dict) -> int:
    """Peer buffers the copy-engine lane has opened so far (a routed call that opened one paid
    for it: its host time is not the steady cost)."""
    return len(getattr(lanes.get("ce"), "maps", ()))


class Exchange:
    """The full path's part of a communicator. It owns what the full path keeps between calls:
    the recent full descriptor exchanges under their digests (`memo`) and the plans under their
    movement and shares (`plans`). Its collaborators: the node segment and its layout, the lanes
    and their context, which lanes serve a device (`lanes_for`, `unavailable`, `wanted`), the
    split policy, the prepared calls and their deferred rounds, the shortcuts, the call ledger,
    the faults part, the fast path's part (the round it hands over, the device check, gloo's
    wait), the queue of pending sends/recvs, the router and its samples (routed all_to_all), and
    the native library's groups (NCCL's and braid's gloo group)."""

    def __init__(self, *, rank: int, world_size: int, cuda: bool, device: torch.device, segment, layout,
                 seg_dev_ptr, lanes: dict, lane_ctx, lanes_for, unavailable: dict, wanted, policy, prepared, rounds,
                 shortcuts, ledger, faults, calls, pending, routed, samples, native_group, gloo_group):
        self.rank, self.world_size, self.cuda, self.device = rank, world_size, cuda, device
        self.segment, self.layout, self.seg_dev_ptr = segment, layout, seg_dev_ptr
        self.lanes, self.lane_ctx, self.lanes_for = lanes, lane_ctx, lanes_for
        self.unavailable, self.wanted = unavailable, wanted
        self.policy, self.prepared, self.rounds, self.shortcuts = policy, prepared, rounds, shortcuts
        self.ledger, self.faults, self.calls, self.pending = ledger, faults, calls, pending
        self.sample_counts: dict[tuple, int] = {}      # balanced splits' calls per shape (sampled)
        self.routed, self.samples = routed, samples
        self.native_group, self.gloo_group = native_group, gloo_group
        self.memo: dict = {}    # every rank's descriptor digest -> those descriptors (recent full exchanges)
        self.plans: dict = {}   # (movement, shares, alignment, smallest piece) -> plan

    def group_for(self, shares: dict[str, float]):
        """The native library's group for a call whose shares are one library's whole."""
        return self.native_group if "nccl" in shares else self.gloo_group

    # descriptor exchange --------------------------------------------------------------------------
    def exchange_node(self, desc: dict) -> list:
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
        memo = self.memo
        hit = memo.get(key)
        if hit is not None:
            return list(hit)
        descs = seg.exchange_collective(desc, list(range(self.world_size)))
        if len(memo) >= DESC_MEMO:
            memo.pop(next(iter(memo)))
        memo[key] = descs
        return descs

    def exchange(self, desc: dict, inp: torch.Tensor | None, lanes: list[str], peer: int | None = None) -> list:
        desc = dict(desc, lanes=lanes, calib=self.policy.digest, rank=self.rank)
        if "ce" in lanes:
            desc.update(self.lanes["ce"].descriptor(inp))
        if self.segment is not None:
            if peer is None:
                return self.exchange_node(desc)
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
                    dist.send(mine, group_dst=peer, group=self.gloo_group)
                else:
                    dist.recv(theirs, group_src=peer, group=self.gloo_group)
            raw = bytes(theirs.tolist())
            got[peer] = json.loads(raw[4:4 + int.from_bytes(raw[:4], "little")])
            return got
        got = [None] * self.world_size
        dist.all_gather_object(got, desc, group=self.gloo_group)
        return got

    # the common path of every op ---------------------------------------------------------------------
    @torch.no_grad()
    def run(self, op: str, desc: dict, size: int, inp, outs, movement_of, native, agree_keys,
             async_op: bool, peer: int | None = None, always_exchange: bool = False,
             multi=None, route=None, counted: bool = False, emit=None, ticket=None) -> Handle | None:
        """The full path of every op (see run_call); a fault it raises is also marked in the
        node segment, so peers waiting for this rank raise at once with its cause. `counted`:
        the call is in the ledger already (it agreed on something before coming here). Nothing
        here is recorded by autograd: a collective writes into its tensors as NCCL does, also
        into tensors that require grad (double backward through DDP reduces such gradients)."""
        try:
            return self.run_call(op, desc, size, inp, outs, movement_of, native, agree_keys, async_op,
                                 peer, always_exchange, multi, route, counted, emit, ticket)
        except (PeerMismatchError, BraidTimeoutError, LaneFailureError) as exc:
            self.faults.give_up(exc)
            raise

    def run_call(self, op: str, desc: dict, size: int, inp, outs, movement_of, native, agree_keys,
                 async_op: bool, peer: int | None, always_exchange: bool, multi, route,
                 counted: bool, emit=None, ticket=None) -> Handle | None:
        self.faults.check_open()
        redo = self.shortcuts.rebuilding()
        rd = self.rounds
        if rd is not None and not redo:
            rd.drain()
        if peer is None and self.pending:
            self.pending.flush()
        device = (inp if inp is not None else outs[0]).device
        lanes = self.lanes_for(device)
        shares = self.policy.shares_for(op, size, lanes) if not always_exchange else None
        whole = shares is not None and self.policy.native_ok(shares) and native is not None
        if peer is None and not redo:       # the rounds thread's rebuild: counted by its caller
            t = inp if inp is not None else outs[0]
            if not counted:
                self.ledger.ncalls += 1
            self.ledger.last_call = (op, t.numel() * t.element_size(), desc.get("dtype"), "whole" if whole else "split")
            if not whole and self.segment is not None:
                self.ledger.publish()             # peers that wait in the exchange below can read it
        if whole and redo:
            raise LaneFailureError(f"{op}: a deferred call of a shape prepared on the copy engines came out "
                                   f"whole when rebuilt; its lanes or shares changed under it")
        if whole:
            handle = self.whole(native, shares)
        elif (peer is None and route is None and not always_exchange and self.segment is not None
              and self.prepared.enabled):
            handle, entry = self.run_prepared(op, desc, inp, outs, movement_of, native, agree_keys, lanes,
                                              shares, multi, emit, async_op, device, ticket)
            if entry is not None and not entry.native and handle.runs:
                self.policy.note_pending(op, entry.size, entry.agreed, entry.shares, handle)
        else:
            if self.cuda:
                self.prepared.dirty = True      # lanes post on their own streams
            if self.policy.adapt and peer is None:
                desc = dict(desc, obs=self.policy.observation(op), bal=self.policy.balancer.version)
            descs = self.exchange(desc, inp, lanes, peer)
            if self.policy.adapt and peer is None:
                agree(op, descs, ("bal",))
                self.policy.learn(descs)
            if peer is not None:
                self.check_direction(desc, descs[peer], peer)
            agree(op, descs, agree_keys + ("calib",))
            size, mkey, build = movement_of(descs)
            agreed = agreed_lanes(descs)
            # a routed call's host time: routing and posting. Not the exchange: waiting there for a
            # late peer (one that opened buffers, or allocated) read up to 237 ms on 4 x H200
            t_call = time.perf_counter()
            routed = route(descs, agreed) if route is not None else None
            if routed is DECLINED:        # routing measured against the native call and chose it
                routed, shares = None, {"nccl" if device.type == "cuda" else "gloo": 1.0}
            else:
                shares = self.policy.shares_for(op, size, agreed) if routed is None else routed.shares
            capturing = device.type == "cuda" and _capturing()
            if capturing and (routed is not None or not (self.policy.native_ok(shares) and native is not None)):
                raise posted_not_capturable(op, shares, "routed" if routed is not None else "full")
            samples = self.samples
            # the routing's timing events stay out of a capture (a captured call is timed by no one)
            cycle = None if capturing else samples.start(
                device, route is not None and self.routed.wants_sample(len(samples.pending)))
            if routed is not None:
                opened = _ipc_maps(self.lanes)
                handle = execute(self.lane_ctx, routed, inp, outs, descs, peer)
                self.routed.observe_host((time.perf_counter() - t_call) * 1e6,
                                         cold=self.routed.last_cold or _ipc_maps(self.lanes) != opened,
                                         cls=self.routed.last_cls)
                self.samples.observe(handle, cycle)
            elif self.policy.native_ok(shares) and native is not None:
                handle = self.whole(native, shares)
                if cycle is not None:          # a skewed call that routing declined: timed too
                    self.samples.observe(None, cycle)
            else:
                if route is not None:          # a skewed call split by shares: neither side
                    self.routed.begin()
                if multi is not None:
                    handle = multi(descs, shares, self.plan(mkey, build, shares, size, device), agreed)
                else:
                    handle = execute(self.lane_ctx, self.plan(mkey, build, shares, size, device), inp, outs, descs, peer)
            if peer is None and routed is None:
                self.policy.note_pending(op, size, agreed, shares, handle)
        self.ledger.last_handle = handle
        if async_op:
            return handle
        handle.wait()
        return None

    def whole(self, native, shares: dict[str, float]) -> Handle:
        """The native library's own call of the whole op (its group from `shares`); on CPU its
        wait goes in steps that see a peer's abort (CallPath.wait_gloo)."""
        handle = as_handle(native(self.group_for(shares)), next(iter(shares)))
        if not self.cuda:
            handle.waiter = self.calls.wait_gloo
        return handle

    # prepared calls (comm/prepared.py) --------------------------------------------------------------
    def run_prepared(self, op: str, desc: dict, inp, outs, movement_of, native, agree_keys, lanes, shares,
                     multi, emit, async_op: bool, device, ticket=None):
        """A split collective through the prepared-call cache: one round of words, then the
        entry every rank keeps under the same key (built by the full exchange on a miss)."""
        prep, seg = self.prepared, self.segment
        capturing = self.cuda and _capturing()
        bal = self.policy.balancer.version
        base = prep.word_base(op, desc, inp, outs, lanes, shares, self.policy.digest, capturing)
        posted, self.calls.round = self.calls.round, None
        obs = None
        if posted is not None:           # the fast path posted this call's word and read the round
            got = posted[1]
        else:
            word = prep.finish_word(base, inp, lanes)
            obs = self.policy.observation(op) if self.policy.adapt and not capturing else None
            got = seg.read_values(seg.post_values([word] + prep.obs_values(obs)), op)
        learned = prep.agreed_obs(obs, got)
        if learned is not None:
            self.policy.balancer.observe(*learned)
        key = tuple(g[0] for g in got)
        entry = prep.get(key)
        if entry is None:
            entry = self.prepare(op, desc, inp, lanes, movement_of, native, agree_keys, device)
            prep.put(key, entry)
        if entry.native:
            if self.shortcuts.rebuilding():
                raise LaneFailureError(f"{op}: a deferred call of a shape prepared on the copy engines came out "
                                       f"whole when rebuilt; the ranks' lanes changed under it")
            return self.whole(native, entry.shares), entry
        ok = entry.graph_ok          # one program can hold the call (decided once per entry: its key holds the op)
        if ok is None:
            ok = entry.graph_ok = bool(self.cuda and "ce" in self.lanes and (
                graph_shares(entry.shares) if multi is None else emit is not None and emit.ok(entry.shares)))
        if ok and not self.sampled(op, entry, capturing):
            if not entry.size:              # nothing to move (an empty graph cannot be launched)
                return entry.done, entry
            if capturing:           # a user's capture: the same program into the caller's stream
                _, sides = prep.streams()
                self.program(entry, inp, outs, emit)(torch.cuda.current_stream(self.device), sides, [])
                prep.stats["captured"] += 1
                return entry.done, entry
            if entry.graph is None:
                if self.shortcuts.rebuilding():
                    # the rounds thread rebuilds a deferred call (comm/rounds.py): no capture there
                    # (the caller's streams wait on this thread, and a capture stalled behind them:
                    # FSDP2 on 2 x H200), the program goes into its stream once; the shape's next
                    # call takes the caller's full path, which captures it
                    self.program(entry, inp, outs, emit)(torch.cuda.current_stream(self.device), prep.streams()[1], [])
                    if ticket is not None:
                        prep.tickets.pop(ticket, None)
                    return entry.done, entry
                prep.capture(entry, self.program(entry, inp, outs, emit))
            if ticket is not None and bal == self.policy.balancer.version and not self.balanced(op, entry):
                if posted is None or posted[0] == prep.finish_word(base, inp, lanes):
                    t = inp if inp is not None else outs[0]
                    prep.ticket(ticket, base, bal, key, entry, op,
                                (op, t.numel() * t.element_size(), desc.get("dtype"), "split"), lanes)
                else:                   # the ticket's facts went stale: the next call posts anew
                    prep.tickets.pop(ticket, None)
            return prep.launch(entry, self.lanes["ce"].stream, async_op, (inp, *outs)), entry
        if capturing:
            raise not_capturable(op, entry.shares)
        if self.cuda:
            prep.dirty = True
        if multi is not None:
            return multi(entry.descs, entry.shares, entry.plan, entry.agreed), entry
        return execute(self.lane_ctx, entry.plan, inp, outs, entry.descs), entry

    def balanced(self, op: str, entry: Entry) -> bool:
        """A split over several lanes whose shares the balancer still moves (it needs their times)."""
        return len(entry.shares) > 1 and self.policy.adapt and self.policy.fixed_for(op) is None

    def sampled(self, op: str, entry: Entry, capturing: bool) -> bool:
        """Post this call of a balanced split (its lanes timed for the balancer) instead of
        replaying it: its first SAMPLE_FIRST calls and every SAMPLE_EVERY-th after. Every rank
        counts the same calls of the same shape, so every rank takes the same way."""
        if capturing:
            return False
        if self.policy.lane_timing:         # fixed_shares(..., timed=True): every split call
            return len(entry.shares) > 1
        if not self.balanced(op, entry):
            return False
        # counted per shape and lane set, not per entry: each balancer move builds the shape's
        # entry anew, and a count that restarted with it posted every call while the balancer
        # kept moving (a DDP job's buckets: 117 entries built in 165 calls, 2 x H200)
        key = entry.sample_key
        if key is None:                         # once per entry
            key = entry.sample_key = (op, entry.size, tuple(sorted(entry.shares)))
        if key not in self.sample_counts and len(self.sample_counts) >= 4096:
            self.sample_counts.clear()          # at the same call on every rank (the same counts)
        n = self.sample_counts[key] = self.sample_counts.get(key, 0) + 1
        return n <= SAMPLE_FIRST or n % SAMPLE_EVERY == 0

    def prepare(self, op: str, desc: dict, inp, lanes, movement_of, native, agree_keys, device) -> Entry:
        """The full agreement of a call not prepared yet: every rank's JSON descriptor, the
        checks that they match, the agreed lanes, the shares and the plan."""
        full = dict(desc, lanes=lanes, calib=self.policy.digest, rank=self.rank)
        if self.policy.adapt:
            full["bal"] = self.policy.balancer.version
        if "ce" in lanes:
            full.update(self.lanes["ce"].descriptor(inp))
        # the segment's second channel: a rank whose call was deferred (comm/rounds.py) makes this
        # exchange on its rounds thread, after its caller may have posted the words of later calls
        # on the first; every rank comes here for the same call, whichever thread runs it
        descs = self.segment.exchange_collective(full, list(range(self.world_size)), channel=1)
        if self.policy.adapt:
            agree(op, descs, ("bal",))
        agree(op, descs, agree_keys + ("calib",))
        size, mkey, build = movement_of(descs)
        agreed = agreed_lanes(descs)
        shares = self.policy.shares_for(op, size, agreed)
        if self.policy.native_ok(shares) and native is not None:
            return Entry(descs, None, shares, agreed, size, native=True)
        return Entry(descs, self.plan(mkey, build, shares, size, device), shares, agreed, size, native=False)

    def program(self, entry: Entry, inp, outs, emit):
        """The GPU work of a call on the copy engines and the host lane, with replay-safe flags,
        as a function of (stream, side streams, keep-alive list). Peers' buffers are mapped here,
        before any capture (opening an IPC handle is not a stream operation)."""
        sig = Flags(self.seg_dev_ptr, self.layout)
        me = self.rank
        if emit is not None:
            return emit(entry.descs, entry.shares, sig)
        ce = self.lanes["ce"]
        transfers = entry.plan.lanes.get("ce", [])
        peers = ce.peer_ptrs(transfers, me, entry.descs)
        out_ptrs = [o.data_ptr() for o in outs]
        in_ptr = inp.data_ptr() if inp is not None and inp.numel() else 0
        local = [(out_ptrs[c.buf] + c.dst_off, in_ptr + c.src_off, c.nbytes)
                 for c in entry.plan.local if c.rank == me and c.nbytes]
        staged = entry.plan.lanes.get("host", [])
        if staged:          # the host lane's share: its producer and consumer on its two streams
            host = self.lanes["host"]
            progs = host.programs(me, staged, in_ptr, out_ptrs)

        def program(stream, sides, keep) -> None:
            join = host.beside(stream, progs, keep) if staged else None
            ce_program(stream, sides, keep)
            if join is not None:        # joined after the copy engines' part, which runs beside it
                join(stream)

        def ce_program(stream, sides, keep) -> None:
            # the rank's own part (input to output, device-local) on a side stream, beside the
            # pulls: in line before them it held up this rank's `ready` and the peers' pulls
            # by its whole time (~50 us of a 250 us all_gather of 64 MiB on 2 x H200)
            sh = stream.cuda_stream
            side = sides[1]
            if local:
                fork = torch.cuda.Event()
                fork.record(stream)
                side.wait_event(fork)
                for dst, src, n in local:
                    _cuda.memcpy_async(dst, src, n, side.cuda_stream)
            ce.emit(sh, me, transfers, peers, out_ptrs, sig)
            if local:
                join = torch.cuda.Event()
                join.record(side)
                stream.wait_event(join)
                keep += [fork, join]
        return program

    def check_direction(self, desc: dict, theirs: dict, peer: int) -> None:
        """A send must meet the peer's recv (and a recv its send) at the same place in call order."""
        if theirs.get("src") == desc.get("src"):
            return
        mine = "send" if desc["src"] == self.rank else "recv"
        their_call = "send" if theirs.get("src") == peer else "recv"
        raise PeerMismatchError(
            f"rank {self.rank} called {mine}() with rank {peer}, whose matching call was {their_call}(): "
            f"braid pairs the send/recv calls of two ranks in call order (per direction). Order them so "
            f"each send meets a recv, or use batch_isend_irecv.")

    def plan(self, mkey, build, shares: dict[str, float], size: int, device: torch.device):
        """Plans are pure functions of the movement and the shares: cache them (splitting a
        large all_gather costs tens of microseconds of Python)."""
        min_split = envs.get("BRAID_MIN_SPLIT_KB") << 10
        align = 4096 if device.type == "cuda" else 64
        key = (mkey, tuple(shares.items()), align, min_split)
        plan = self.plans.get(key)
        if plan is None:
            plan = split(build(), shares, size, align=align, min_split=min_split)
            if len(self.plans) > 256:
                self.plans.clear()
            self.plans[key] = plan
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
        self.faults.check_open()
        if not isinstance(plan, Plan):
            raise MisuseError(f"{op}: plan must be a braid Plan, got {type(plan).__name__}")
        if plan.world_size != self.world_size or plan.p2p:
            raise MisuseError(f"{op}: the plan is for {'send/recv' if plan.p2p else f'a world of {plan.world_size}'}; "
                              f"run_plan runs collective plans over all {self.world_size} ranks")
        outputs = list(outputs or [])
        first = input if input is not None else (outputs[0] if outputs else None)
        dev = self.calls.device_for(first) if first is not None else self.device
        ib = input_bytes(input, "input", dev, op) if input is not None else torch.empty(0, dtype=torch.uint8, device=dev)
        obs = [output_bytes(o, f"outputs[{i}]", dev, op) for i, o in enumerate(outputs)]
        used = [name for name, ts in plan.lanes.items() if ts]
        for name in used:
            if name == "relay":
                ok, why = self.lanes["relay"].available_for(dev.type)
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
                    from ..planner.relay import check_transfer
                    try:
                        check_transfer(t, self.world_size)
                    except ValueError as exc:
                        raise MisuseError(f"{op}: {exc}") from None
        if dev.type == "cuda" and _capturing() and any(name != "nccl" for name in used):
            raise posted_not_capturable(op, {name: 1.0 for name in used}, "plan")
        if self.pending:
            self.pending.flush()
        digest = hashlib.sha1(plan.to_json().encode()).hexdigest()[:16]
        desc = {"op": op, "plan": digest, "dev": dev.type, "in": ib.numel(), "outs": [o.numel() for o in obs]}
        if "relay" in used:
            desc.update(self.lanes["relay"].descriptor(ib, dev.type))
        self.ledger.enter(op, ib, "split")
        try:
            descs = self.exchange(desc, ib, used)
            agree(op, descs, ("op", "plan", "dev") + (("relay_geom",) if "relay" in used else ()))
        except (PeerMismatchError, BraidTimeoutError, LaneFailureError) as exc:
            self.faults.give_up(exc)
            raise
        _check_plan_bounds(plan, descs)
        handle = execute(self.lane_ctx, plan, ib, obs, descs)
        self.ledger.last_handle = handle
        if async_op:
            return handle
        handle.wait()
        return None
