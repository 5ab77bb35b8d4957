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
from ..node import COLL_MBOX_BYTES, COLL_SLOTS
from . import native_rounds
from .prepared import _DONE, _RAW, NO_OBS, Entry, graph_shares, not_capturable
from .rounds import DeferredHandle, Job

_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing
from .routing import _DECLINED

log = logging.getLogger("braid")


P2P_DESC_BYTES = 2048

DESC_MEMO = 16               # full descriptor exchanges remembered for repeated calls (_exchange_node)


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


class Exchange:
    """Part of braid.comm.Communicator (a mixin of the façade: the parts it composes own the state)."""

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
        desc = dict(desc, lanes=lanes, calib=self.policy.digest, rank=self.rank)
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
                    dist.send(mine, group_dst=peer, group=self.gloo_group)
                else:
                    dist.recv(theirs, group_src=peer, group=self.gloo_group)
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
             multi=None, route=None, counted: bool = False, emit=None, ticket=None) -> Handle | None:
        """The full path of every op (see _run_call); a fault it raises is also marked in the
        node segment, so peers waiting for this rank raise at once with its cause. `counted`:
        the call is in the ledger already (it agreed on something before coming here). Nothing
        here is recorded by autograd: a collective writes into its tensors as NCCL does, also
        into tensors that require grad (double backward through DDP reduces such gradients)."""
        try:
            return self._run_call(op, desc, size, inp, outs, movement_of, native, agree_keys, async_op,
                                  peer, always_exchange, multi, route, counted, emit, ticket)
        except (PeerMismatchError, BraidTimeoutError, LaneFailureError) as exc:
            self._give_up(exc)
            raise

    def _run_call(self, op: str, desc: dict, size: int, inp, outs, movement_of, native, agree_keys,
                  async_op: bool, peer: int | None, always_exchange: bool, multi, route,
                  counted: bool, emit=None, ticket=None) -> Handle | None:
        self._check_open()
        redo = self.shortcuts.rebuilding()
        rd = getattr(self, "_rounds", None)
        if rd is not None and not redo:
            rd.drain()
        if peer is None and self._p2p_pending:
            self._flush_p2p()
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
            handle = self._whole(native, shares)
        elif (peer is None and route is None and not always_exchange and self.segment is not None
              and self._prepared.enabled):
            handle, entry = self._run_prepared(op, desc, inp, outs, movement_of, native, agree_keys, lanes,
                                               shares, multi, emit, async_op, device, ticket)
            if entry is not None and not entry.native and handle.runs:
                self.policy.note_pending(op, entry.size, entry.agreed, entry.shares, handle)
        else:
            if self.cuda:
                self._prepared.dirty = True      # lanes post on their own streams
            if self.policy.adapt and peer is None:
                desc = dict(desc, obs=self.policy.observation(op), bal=self.policy.balancer.version)
            descs = self._exchange(desc, inp, lanes, peer)
            if self.policy.adapt and peer is None:
                self._agree(op, descs, ("bal",))
                self.policy.learn(descs)
            if peer is not None:
                self._check_direction(desc, descs[peer], peer)
            self._agree(op, descs, agree_keys + ("calib",))
            size, mkey, build = movement_of(descs)
            agreed = self._agreed_lanes(descs)
            # a routed call's host time: routing and posting. Not the exchange: waiting there for a
            # late peer (one that opened buffers, or allocated) read up to 237 ms on 4 x H200
            t_call = time.perf_counter()
            routed = route(descs, agreed) if route is not None else None
            samples = self.route_samples
            cycle = samples.start(device, route is not None and self._routed.wants_sample(len(samples.pending)))
            if routed is _DECLINED:        # routing measured against the native call and chose it
                routed, shares = None, {"nccl" if device.type == "cuda" else "gloo": 1.0}
            else:
                shares = self.policy.shares_for(op, size, agreed) if routed is None else routed.shares
            if routed is not None:
                opened = self._ipc_maps()
                handle = execute(self.lane_ctx, routed, inp, outs, descs, peer)
                self._routed.observe_host((time.perf_counter() - t_call) * 1e6,
                                          cold=self._routed.last_cold or self._ipc_maps() != opened,
                                          cls=self._routed.last_cls)
                self.route_samples.observe(handle, cycle)
            elif self.policy.native_ok(shares) and native is not None:
                handle = self._whole(native, shares)
                if cycle is not None:          # a skewed call that routing declined: timed too
                    self.route_samples.observe(None, cycle)
            else:
                if route is not None:          # a skewed call split by shares: neither side
                    self._routed.begin()
                if multi is not None:
                    handle = multi(descs, shares, self._plan(mkey, build, shares, size, device), agreed)
                else:
                    handle = execute(self.lane_ctx, self._plan(mkey, build, shares, size, device), inp, outs, descs, peer)
            if peer is None and routed is None:
                self.policy.note_pending(op, size, agreed, shares, handle)
        self.last_handle = handle
        if async_op:
            return handle
        handle.wait()
        return None

    def _whole(self, native, shares: dict[str, float]) -> Handle:
        """The native library's own call of the whole op (its group from `shares`); on CPU its
        wait goes in steps that see a peer's abort (_wait_gloo)."""
        handle = as_handle(native(self._native_group(shares)), next(iter(shares)))
        if not self.cuda:
            handle.waiter = self._wait_gloo
        return handle

    # prepared calls (comm/prepared.py) --------------------------------------------------------------
    def _fast_prepared(self, tkey, inp, outs: tuple, async_op: bool, redo=None):
        """A call whose shape last replayed a graph (a Ticket under the op's own arguments):
        the round of words and the launch, nothing else; with a rounds thread (comm/rounds.py)
        only the post of this rank's word, the rest on that thread. None: not this way (the
        caller takes the full path; after a round that missed, that path goes on from this
        round). `redo()`: the op's own call with the same arguments (the thread's full path)."""
        prep = self._prepared
        tk = prep.tickets.get(tkey)
        rd = getattr(self, "_rounds", None)
        if (tk is None or not prep.enabled or self.closed or self.aborted or tk.bal != self.policy.balancer.version
                or self._p2p_pending or (self.policy.pending and tk.op in self.policy.pending)
                or (self.watchdog is not None and self.watchdog.failed)
                or ((rd is not None or not prep.fast) and _capturing())):   # (else the native call checks)
            return None         # queued send/recv go first, a balancer report rides the full path
        if rd is not None and redo is not None and tk.entry.exec_ptr:
            if self.shortcuts.rebuilding():     # the rounds thread's own rebuild: the full path
                return None
            return self._deferred(rd, prep, tk, inp, outs, async_op, redo)
        seg = self.segment
        fast = prep.fast if prep.fast is not False else self._native_calls()
        # the round belongs to this call: counted while it waits, so that a peer still at the
        # previous call (taken whole) reads as late, not as a different call (CallLedger.check_peer)
        self.ledger.ncalls += 1
        if fast is not None and tk.entry.exec_ptr and prep.entries.get(tk.key) is tk.entry:
            done, posted = self._native_replay(fast, prep, seg, tk, inp, outs, async_op)
            if posted is None:
                return done         # a handle (launched), or None (nothing posted: the full path)
            word, token = posted    # posted, the round not settled: it goes on here
        elif fast is not None and _capturing():     # (the native call's own check did not run)
            self.ledger.ncalls -= 1
            return None
        else:
            word, token = prep.finish_word(tk.base, inp, tk.lanes), None
        t0 = time.perf_counter()
        try:
            got = seg.read_values(token if token is not None else seg.post_values([word, *NO_OBS]), tk.op)
        except (PeerMismatchError, BraidTimeoutError, LaneFailureError) as exc:
            self._give_up(exc)
            raise
        # the round's host time (this rank's post and read, and its wait for the last peer's word)
        prep.stats["round_us"] += (time.perf_counter() - t0) * 1e6
        # a hit only where the cache would hit (and with the same least-recently-used update), so
        # every rank's cache keeps the same keys whichever way its calls came in
        if (len(got) == len(tk.key) and all(g[0] == k for g, k in zip(got, tk.key))
                and prep.get(tk.key) is tk.entry):
            self.ledger.last_call = tk.ledger
            handle = prep.launch(tk.entry, self._lanes["ce"].stream, async_op, (inp, *outs))
            self.last_handle = handle
            return handle
        self.ledger.ncalls -= 1                 # a miss: the full path counts the call
        self._round = (word, got)        # and goes on from this round
        return None

    def _native_replay(self, fast, prep, seg, tk, inp, outs: tuple, async_op: bool):
        """The word, its post, the round and the launch of a Ticket's call in one native call
        (native_rounds.FastCalls). Returns (handle, None) where it launched, (None, None) where it
        posted nothing (a capture: the full path takes the call), else (None, (word, token)): the
        word is posted and the caller reads the round (a word that differs, a late peer)."""
        caller = _RAW(self.device.index)
        mode = 2 if async_op else 1 if prep.dirty else 0     # async; forked; on the caller's stream
        end = prep.end_event() if mode else 0
        t = tk.native
        if t is None:
            t = tk.native = fast.ticket(tk.base, tk.entry.exec_ptr, self._lanes["ce"].stream.cuda_stream,
                                        prep.fork_event(), tk.key)
        seq = seg.next_seq()
        code = fast.call(t, seq, inp.data_ptr() if inp is not None and inp.numel() and "ce" in tk.lanes else 0,
                         caller, end, mode)
        if code == native_rounds.HIT:
            prep.stats["round_us"] += fast.round_ns.value * 1e-3
            prep.get(tk.key)
            prep.stats["replays"] += 1
            prep.stats["native_calls"] += 1
            self.ledger.last_call = tk.ledger
            handle = prep.joined(mode == 2, end, self._lanes["ce"].stream, (inp, *outs), tk.entry.plan) \
                if mode else _DONE
            self.last_handle = handle
            return handle, None
        if code in (native_rounds.CAPTURING, native_rounds.ID_ERR):     # nothing posted: undone
            seg.coll_seq -= 1
            self.ledger.ncalls -= 1
            if code == native_rounds.ID_ERR:
                _cuda.check(fast.rc.value, "cuPointerGetAttribute(BUFFER_ID)")
            return None, None
        if code == native_rounds.LATE:      # a peer not there within the spin: Python waits
            prep.stats["native_late"] += 1
        elif code != native_rounds.DIFF:
            _cuda.check(fast.rc.value or -1, "the launch of a prepared call")
        return None, (fast.word.value, (seq, 1 + len(NO_OBS)))

    def _native_calls(self):
        """The communicator's native repeated calls (native_rounds.FastCalls), made at the first
        call that could take them; None where BRAID_NATIVE_CALL is 0 or they did not build."""
        prep = self._prepared
        prep.fast = None
        if not envs.get("BRAID_NATIVE_CALL"):
            return None
        lib = native_rounds.build()
        if lib is None:
            return None
        seg = self.segment
        try:
            prep.fast = native_rounds.FastCalls(
                lib, self.world_size, self.rank, COLL_SLOTS, 1 + len(NO_OBS), COLL_MBOX_BYTES,
                [seg.address + c for c in seg._coll_ctr], [seg.address + s[0] for s in seg._coll_slots],
                _cuda.native_fns(), seg.spin_s)
        except (OSError, LaneFailureError) as exc:
            log.info("braid: repeated calls stay in Python (%s)", exc)
        return prep.fast

    def _deferred(self, rd, prep, tk, inp, outs: tuple, async_op: bool, redo):
        """Post this rank's word and queue the rest of the call on the rounds thread
        (comm/rounds.py): the caller's stream (synchronous) or the handle's waiter (async) waits
        for the call's end counter. Counted in the ledger here, in call order."""
        rd.room()
        word = prep.finish_word(tk.base, inp, tk.lanes)
        self.ledger.count(tk.ledger)
        try:
            token = self.segment.post_values([word, *NO_OBS], hook=False)
        except (PeerMismatchError, BraidTimeoutError, LaneFailureError) as exc:
            self._give_up(exc)
            raise
        caller = _RAW(self.device.index)
        start = rd.start_event(caller)
        n = rd.next_number()
        tensors = (inp, *outs)
        # the words the program was built for, while the entry is the cache's (else the thread in
        # Python decides, as on a changed word)
        rd.push(Job(token, word, tk, start, n, tensors, redo, self.ledger.ncalls, tk.op),
                tk.key if prep.entries.get(tk.key) is tk.entry else None)
        # the program runs on the lane stream, which only the caller's stream waits for: a later
        # call on another stream of the caller's (FSDP2's gathers and reductions) must not start
        # its program beside it (two programs on the same flags)
        prep.dirty = True
        if async_op:
            stream = self._lanes["ce"].stream
            for t in tensors:       # the caller may free them before waiting: the allocator must know
                if t is not None and t.numel():
                    t.record_stream(stream)
            handle = DeferredHandle(rd, n, tensors, tk.entry.plan, self.device.index)
        else:
            rd.stream_wait(caller, n)
            handle = _DONE
        self.last_handle = handle
        return handle

    def _run_prepared(self, op: str, desc: dict, inp, outs, movement_of, native, agree_keys, lanes, shares,
                      multi, emit, async_op: bool, device, ticket=None):
        """A split collective through the prepared-call cache: one round of words, then the
        entry every rank keeps under the same key (built by the full exchange on a miss)."""
        prep, seg = self._prepared, self.segment
        capturing = self.cuda and _capturing()
        bal = self.policy.balancer.version
        base = prep.word_base(op, desc, inp, outs, lanes, shares, self.policy.digest, bal, capturing)
        posted, self._round = self._round, None
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
            entry = self._prepare(op, desc, inp, lanes, movement_of, native, agree_keys, device)
            prep.put(key, entry)
        if entry.native:
            if self.shortcuts.rebuilding():
                raise LaneFailureError(f"{op}: a deferred call of a shape prepared on the copy engines came out "
                                       f"whole when rebuilt; the ranks' lanes changed under it")
            return self._whole(native, entry.shares), entry
        if self.cuda and graph_shares(entry.shares) and (multi is None or emit is not None):
            if not entry.size:              # nothing to move (an empty graph cannot be launched)
                return _DONE, entry
            if capturing:           # a user's capture: the same program into the caller's stream
                _, sides = prep.streams()
                self._program(entry, inp, outs, emit)(torch.cuda.current_stream(self.device), sides, [])
                prep.stats["captured"] += 1
                return _DONE, entry
            if entry.graph is None:
                if self.shortcuts.rebuilding():
                    # the rounds thread rebuilds a deferred call (comm/rounds.py): no capture there
                    # (the caller's streams wait on this thread, and a capture stalled behind them:
                    # FSDP2 on 2 x H200), the program goes into its stream once; the shape's next
                    # call takes the caller's full path, which captures it
                    self._program(entry, inp, outs, emit)(torch.cuda.current_stream(self.device), prep.streams()[1], [])
                    if ticket is not None:
                        prep.tickets.pop(ticket, None)
                    return _DONE, entry
                prep.capture(entry, self._program(entry, inp, outs, emit))
            if ticket is not None and bal == self.policy.balancer.version:
                if posted is None or posted[0] == prep.finish_word(base, inp, lanes):
                    t = inp if inp is not None else outs[0]
                    prep.ticket(ticket, base, bal, key, entry, op,
                                (op, t.numel() * t.element_size(), desc.get("dtype"), "split"), lanes)
                else:                   # the ticket's facts went stale: the next call posts anew
                    prep.tickets.pop(ticket, None)
            return prep.launch(entry, self._lanes["ce"].stream, async_op, (inp, *outs)), entry
        if capturing:
            raise not_capturable(op, entry.shares)
        if self.cuda:
            prep.dirty = True
        if multi is not None:
            return multi(entry.descs, entry.shares, entry.plan, entry.agreed), entry
        return execute(self.lane_ctx, entry.plan, inp, outs, entry.descs), entry

    def _prepare(self, op: str, desc: dict, inp, lanes, movement_of, native, agree_keys, device) -> Entry:
        """The full agreement of a call not prepared yet: every rank's JSON descriptor, the
        checks that they match, the agreed lanes, the shares and the plan."""
        full = dict(desc, lanes=lanes, calib=self.policy.digest, rank=self.rank)
        if self.policy.adapt:
            full["bal"] = self.policy.balancer.version
        if "ce" in lanes:
            full.update(self._lanes["ce"].descriptor(inp))
        # the segment's second channel: a rank whose call was deferred (comm/rounds.py) makes this
        # exchange on its rounds thread, after its caller may have posted the words of later calls
        # on the first; every rank comes here for the same call, whichever thread runs it
        descs = self.segment.exchange_collective(full, list(range(self.world_size)), channel=1)
        if self.policy.adapt:
            self._agree(op, descs, ("bal",))
        self._agree(op, descs, agree_keys + ("calib",))
        size, mkey, build = movement_of(descs)
        agreed = self._agreed_lanes(descs)
        shares = self.policy.shares_for(op, size, agreed)
        if self.policy.native_ok(shares) and native is not None:
            return Entry(descs, None, shares, agreed, size, native=True)
        return Entry(descs, self._plan(mkey, build, shares, size, device), shares, agreed, size, native=False)

    def _program(self, entry: Entry, inp, outs, emit):
        """The GPU work of a call on the copy engines alone, with replay-safe flags, as a
        function of (stream, side streams, keep-alive list). Peers' buffers are mapped here,
        before any capture (opening an IPC handle is not a stream operation)."""
        sig = Flags(self.seg_dev_ptr, self.layout)
        me = self.rank
        if emit is not None:
            return emit(entry.descs, entry.shares, sig)
        ce = self._lanes["ce"]
        transfers = entry.plan.lanes.get("ce", [])
        peers = ce.peer_ptrs(transfers, me, entry.descs)
        out_ptrs = [o.data_ptr() for o in outs]
        in_ptr = inp.data_ptr() if inp is not None and inp.numel() else 0
        local = [(out_ptrs[c.buf] + c.dst_off, in_ptr + c.src_off, c.nbytes)
                 for c in entry.plan.local if c.rank == me and c.nbytes]

        def program(stream, sides, keep) -> None:
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

    def _check_direction(self, desc: dict, theirs: dict, peer: int) -> None:
        """A send must meet the peer's recv (and a recv its send) at the same place in call order."""
        if theirs.get("src") == desc.get("src"):
            return
        mine = "send" if desc["src"] == self.rank else "recv"
        their_call = "send" if theirs.get("src") == peer else "recv"
        raise PeerMismatchError(
            f"rank {self.rank} called {mine}() with rank {peer}, whose matching call was {their_call}(): "
            f"braid pairs the send/recv calls of two ranks in call order (per direction). Order them so "
            f"each send meets a recv, or use batch_isend_irecv.")

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
                    from ..planner.relay import check_transfer
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
        self.ledger.enter(op, ib, "split")
        try:
            descs = self._exchange(desc, ib, used)
            self._agree(op, descs, ("op", "plan", "dev") + (("relay_geom",) if "relay" in used else ()))
        except (PeerMismatchError, BraidTimeoutError, LaneFailureError) as exc:
            self._give_up(exc)
            raise
        _check_plan_bounds(plan, descs)
        handle = execute(self.lane_ctx, plan, ib, obs, descs)
        self.last_handle = handle
        if async_op:
            return handle
        handle.wait()
        return None
