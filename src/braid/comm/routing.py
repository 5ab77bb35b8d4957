"""all_to_all(v): the balanced call, the uneven call's cheap agreement (is any demand large enough
to route?), and the skewed call's routing decision: the router's plan over direct, relay and
multi-rail paths, timed against the native call and learned per traffic class.
"""
from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from ..collectives import input_bytes, output_bytes, same_dtype, split_bytes
from ..errors import BraidTimeoutError, LaneFailureError, PeerMismatchError
from ..planner.plan import all_to_all_movement

from .a2av import UnevenCe, word_of
from .exchange import DECLINED
from .policy import DEFAULT_COSTS
from .uneven import SMALL_RUN, Even, UnevenAgreement, skewed

log = logging.getLogger("braid")


def a2a_ticket(input: torch.Tensor, output: torch.Tensor) -> tuple:
    """A balanced all_to_all's prepared-call ticket: the op's own arguments."""
    return ("a2a", input.data_ptr(), output.data_ptr(), input.numel(), output.numel(), input.dtype, output.dtype)


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


class RouteSamples:
    """The skewed all_to_all calls timed as samples of the routing decision (comm/routing.py's
    router, `router`), from their start until every rank has reported their times in the same
    call: their count (the same on every rank), each one's handle, cycle and lane times, and the
    cycle still open (the last sample's, ended by the next skewed call's start)."""

    def __init__(self, router):
        self.router = router
        self.seq = 0                 # skewed calls observed so far (same on every rank)
        self.pending: list = []      # [seq, handle, cycle, times] of each observed call
        self.open: _Cycle | None = None
        self.last: tuple[float, float] | None = None   # the router's last prediction: (routed us, native us)

    def report(self) -> dict:
        """What a descriptor carries of the samples (the router's form)."""
        return self.router.report(self.observation())

    def observation(self) -> list:
        """[seq, lane times] of each observed skewed call that has finished here, oldest first
        (reported in descriptors until every rank has reported it in the same call)."""
        out = []
        for p in self.pending:
            seq, handle, cycle, times = p
            if times is None:
                if not cycle.done() or (handle is not None and not all(r.done() for r in handle.runs)):
                    break
                times = {k: round(v, 1) for k, v in handle.lane_times_us().items()} if handle is not None else {}
                times["cycle"] = round(cycle.elapsed_us(), 1)
                p[1:] = [None, None, times]          # drop the handle and events, keep the numbers
            out.append([seq, times])
        return out

    def forget(self, learned) -> None:
        """Every rank reported these samples: the router has them."""
        gone = set(learned)
        self.pending = [p for p in self.pending if p[0] not in gone]

    def start(self, device: torch.device, sample: bool) -> _Cycle | None:
        """A skewed call that is a sample of its decision (or the call after one): its start on the
        stream (nothing of it is enqueued yet) ends the last sample's cycle; its own cycle when it
        is a sample."""
        if not sample and self.open is None:
            return None
        cycle = _Cycle(device)
        if self.open is not None:
            self.open.close(cycle)
            self.open = None
        return cycle if sample else None

    def observe(self, handle, cycle) -> None:
        """Time this skewed call (routed: `handle`'s lanes too) when the routing decision wants it
        as a sample (`cycle` was made for it); its cycle ends at the next skewed call's start."""
        self.open = cycle
        if cycle is None:
            return
        self.seq += 1
        self.pending.append([self.seq, handle, cycle, None])
        self.router.expect(self.seq)


class Routing:
    """The all_to_all part of a communicator: the uneven call's agreement (`uneven`, comm/uneven.py)
    and its path on the copy engines alone (`a2av_ce`, comm/a2av.py, made at first use), the
    routing mode (`mode`: BRAID_ROUTE's auto, on or off) and the routing decision of a skewed
    call over the router's paths. Its collaborators: the node segment and the lanes, the split
    policy, the prepared calls, the shortcuts (the uneven call's kept shape facts), the call
    ledger, the faults part, the fast path's part, the full path's part, the queue of pending
    sends/recvs, the whole CPU calls, a multi-node world's steps (or None), the router and its
    samples, and the native library's group."""

    def __init__(self, *, rank: int, world_size: int, cuda: bool, device: torch.device, single_node: bool,
                 segment, layout, seg_dev_ptr, lanes: dict, lanes_for, check: bool, policy, prepared, shortcuts,
                 ledger, faults, calls, exchange, pending, cpu, hier, routed, samples, native_group, mode: str,
                 ce_min: int):
        self.rank, self.world_size, self.cuda, self.device = rank, world_size, cuda, device
        self.single_node, self.segment, self.layout, self.seg_dev_ptr = single_node, segment, layout, seg_dev_ptr
        self.lanes, self.lanes_for, self.check = lanes, lanes_for, check
        self.policy, self.prepared, self.shortcuts, self.ledger = policy, prepared, shortcuts, ledger
        self.faults, self.calls, self.exchange, self.pending, self.cpu = faults, calls, exchange, pending, cpu
        self.hier, self.routed, self.samples, self.native_group = hier, routed, samples, native_group
        self.mode = mode                # skewed all_to_all through the router: auto/on/off
        self.a2av_ce = None             # uneven all_to_all on the copy engines alone, made at first use
        # the uneven all_to_all's agreement and its counters (comm/uneven.py)
        self.uneven = UnevenAgreement(
            rank, world_size, segment, policy, ledger, policy.lanes_here, lambda: self.mode,
            faults.check_open, faults.give_up, faults.abort_native, ce_min)

    def close(self) -> None:
        if self.a2av_ce is not None:
            self.a2av_ce.close()

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes=None,
                          input_split_sizes=None, async_op: bool = False):
        """Communicator.all_to_all_single past its fast path (the communicator's own entry): the
        uneven call's agreement, a multi-node world's steps, the full path with routing."""
        op = "all_to_all_single"
        agreed = counted = False           # counted: in the ledger already
        if input_split_sizes and output_split_sizes and type(input) is torch.Tensor \
                and type(output) is torch.Tensor and input.is_cuda and output.is_cuda and input.dim() > 0 \
                and output.dim() > 0 and input.is_contiguous() and output.is_contiguous():
            # equal lists here may be the balanced call's (where every rank's are): the round
            # carries this rank's word for that call's program, and is its replay's round too
            tk, tkey, got = None, None, None
            if input_split_sizes[0] == output_split_sizes[0] and len(set(input_split_sizes)) == 1 \
                    and len(set(output_split_sizes)) == 1:
                tkey = a2a_ticket(input, output)
                got = self.a2a_even(tkey, output, input, input_split_sizes, output_split_sizes, async_op)
                if got is not None and got[0] is not None:
                    return got[0] if async_op else None
            if got is not None:            # the native call's round, read in Python
                tk = self.calls._ticket(tkey)
                agreed, small, lean = got[1]
            else:
                pword = 0
                if tkey is not None:
                    tk, pword = self.calls.ticket_word(tkey, input)
                agreed, small, lean = self.a2av_agree(output, input, output_split_sizes, input_split_sizes, pword)
            counted = agreed
            if isinstance(lean, Even):      # every rank's split sizes equal (the round showed each the matrix)
                if tk is not None and (h := self.calls.replay_agreed(tk, lean.words, input, (output,),
                                                                     async_op)) is not None:
                    return h if async_op else None
                # else the balanced call's own round and replay (the round above counted the
                # call: the prepared call counts it again, or the full path below does)
                output_split_sizes = input_split_sizes = None
                self.ledger.ncalls -= 1
                agreed = counted = False
                h = self.calls.fast_prepared(tkey or a2a_ticket(input, output), input, (output,), async_op,
                                             lambda: self.all_to_all_single(output, input))
                if h is not None:
                    return h if async_op else None
            elif lean is not None:
                h = self.a2av_lean(output, input, *lean, async_op)
                return h if async_op else None
            if small:
                args = (output, input, list(output_split_sizes), list(input_split_sizes))
                return self.calls.native_fast("alltoall_base", args, "alltoall", async_op, counted=True,
                                              fallback=lambda x: dist.all_to_all_single(
                                                  output, input, args[2], args[3], group=self.native_group,
                                                  async_op=x))
        dev = self.calls.device_for(input)
        ib = input_bytes(input, "input", dev, op)
        ob = output_bytes(output, "output", dev, op)
        same_dtype(input, output, op)
        ins = split_bytes(input_split_sizes, input, self.world_size, "input", op)
        outs = split_bytes(output_split_sizes, output, self.world_size, "output", op)
        balanced = not input_split_sizes and not output_split_sizes
        if (self.cpu.shm is not None and not balanced and not counted and self.cpu.ok(output, input)
                and dev.type == "cpu" and self.mode != "on"):      # BRAID_ROUTE=on: the router, as asked
            self.cpu.enter(op, input)
            counted = True                 # in the ledger: the lanes' path below goes on from there
            if self.cpu.shm.all_to_all_v(ob, ib, ins, outs, input.dtype):
                self.ledger.last_handle = self.cpu.done
                return self.cpu.done if async_op else None
        if self.hier is not None:
            h = (self.hier.all_to_all_single(output, input, async_op) if balanced else
                 self.hier.all_to_all_v(output, input, output_split_sizes, input_split_sizes, async_op))
            if h is not None:
                return h if async_op else None
        if not agreed and not balanced and self.segment is not None and dev.type == "cuda" and not self.check \
                and self.policy.fixed is None and self.mode != "on" and len(self.lanes_for(dev)) > 1:
            # the same agreement for the uneven calls the block above leaves (one split list given)
            me = self.rank
            big = max([v for d, v in enumerate(ins) if d != me] + [v for s, v in enumerate(outs) if s != me] + [0])
            if "nccl" in self.lanes_for(dev):
                self.faults.check_open()
                self.ledger.enter(op, ib, "agreeing")
                counted = True
                if self.uneven.small(big, op):
                    return self.calls.native_fast("alltoall_base", (ob, ib, list(outs), list(ins)), "alltoall",
                                                  async_op, counted=True, fallback=lambda a: dist.all_to_all_single(
                                                      ob, ib, list(outs), list(ins), group=self.native_group,
                                                      async_op=a))
        # A balanced call on GPUs is never routed (the router declines a balanced matrix unless
        # BRAID_ROUTE=on): it takes the prepared path, one round of words and a graph replay per
        # repeat (it posted every lane each call: 178-270 us of host time on 2 x H200). Its
        # descriptor leaves the routed observations out (they would change its word at every
        # call); the next skewed call carries them.
        prepared = balanced and dev.type == "cuda" and self.mode != "on"
        desc = {"op": op, "dtype": str(input.dtype), "in": tuple(ins) if prepared else ins,
                "out": tuple(outs) if prepared else outs}
        if not prepared:
            desc.update(self.samples.report())
        tkey = a2a_ticket(input, output) if prepared and input.is_contiguous() and output.is_contiguous() else None

        def native(g):
            return dist.all_to_all_single(ob, ib, list(outs), list(ins), group=g, async_op=True)

        movement_of, route = self.a2a_rules(op, dev)

        # Without split sizes the traffic is balanced by contract (as for NCCL), so every rank
        # knows the whole matrix and can pick the path alone; uneven splits must be exchanged first.
        return self.exchange.run(op, desc, sum(ins), ib, [ob], movement_of, native, ("op", "dtype"), async_op,
                                 always_exchange=not balanced and (len(self.lanes_for(dev)) > 1 or self.check),
                                 route=None if prepared else route, counted=counted, ticket=tkey)

    def a2av_agree(self, output, input, output_split_sizes, input_split_sizes,
                   pword: int = 0) -> tuple[bool, bool, tuple | None]:
        """An uneven all_to_all of CUDA tensors with both split lists: (agreed, small, lean).
        `pword`: this rank's prepared word for the call as a balanced one (0: none), which the
        copy engines' round carries (comm/uneven.py, Even).
        agreed: the ranks took part in the cheap agreement (the call is in the ledger); small:
        the call is NCCL's own, whole (no rank has a demand over the routing threshold, or the
        shares for its size are NCCL's); lean: (matrix, words) when the copy engines take it
        alone (comm/a2av.py). Neither: the full path (routing, or a split over several lanes)."""
        op = "all_to_all_single"
        ent = self.a2av_entry(input, output)
        # uneven splits: each rank knows only its row and column of the matrix. The ranks agree
        # on one number first, the largest demand: when none exceeds the routing threshold
        # (NIMBLE: multipath off at or below 1 MB), the call is NCCL's own, whole, with no
        # descriptor exchange (4 x H200, 1 MiB hot: ~400 us per call with one, NCCL ~45). A
        # rank with a larger demand of its own knows the answer: it posts and does not wait.
        # The shape facts, and whether this communicator agrees this way at all, are kept per
        # call shape, so a call costs a few Python steps besides NCCL's own.
        w = self.world_size
        if ent[-1] and len(input_split_sizes) == w and len(output_split_sizes) == w \
                and sum(input_split_sizes) == ent[1] and sum(output_split_sizes) == ent[2] \
                and min(input_split_sizes) >= 0 and min(output_split_sizes) >= 0:
            me = self.rank
            if w == 2 and ent[5] and self.uneven.pair_whole(input_split_sizes[1 - me] * ent[3],
                                                            output_split_sizes[1 - me] * ent[4]):
                return True, True, None
            a, b = list(input_split_sizes), list(output_split_sizes)
            a[me] = b[me] = 0
            big = max(max(a) * ent[3], max(b) * ent[4])
            self.faults.check_open()
            self.ledger.enter(op, input, "agreeing")
            if not ent[5]:
                return True, self.uneven.small(big, op), None
            recv = [x * ent[4] for x in output_split_sizes]
            row = [x * ent[3] for x in input_split_sizes]
            fast = self.native_posting()
            if fast is not None and input.numel():
                got = self.uneven.round_native(fast, op, big, [self.uneven.agreement(), *row, pword], recv,
                                               input.data_ptr())
                if got is not None:
                    return got
            return self.uneven.round(op, big, [word_of(input), self.uneven.agreement(), *row, pword], recv)
        return False, False, None

    def native_posting(self):
        """The native calls (native_rounds.FastCalls) where they post an uneven call on the copy
        engines and make its round (`_rounds.c` uneven_post, uneven_round), else None."""
        prep = self.prepared
        fast = prep.fast if prep.fast is not False else self.calls.native_calls()
        return fast if fast is not None and fast.posts else None

    def a2av_entry(self, input, output) -> tuple:
        """The uneven call's kept facts for this shape: (dtype, rows in, rows out, bytes per
        input row, bytes per output row, lean, ok). lean: the copy engines alone may take it
        (decided per call from the matrix: every rank posts its row in the round, the same width
        everywhere); ok: the ranks agree this way at all (a2av_agree)."""
        key = (input.numel(), output.numel())
        ent = self.shortcuts.a2av.get(key)
        dt, rin, rout = input.dtype, input.size(0), output.size(0)
        if ent is None or ent[0] is not dt or ent[1] != rin or ent[2] != rout:
            idx = self.device.index if self.cuda else None
            lanes = self.lanes_for(self.device)
            base = (dt is output.dtype and self.segment is not None and not self.check
                    and self.mode != "on" and input.get_device() == idx and output.get_device() == idx)
            lean = (base and self.cuda and self.single_node and "ce" in lanes and self.prepared.enabled
                    and self.world_size > 1)
            ok = lean or (base and self.policy.fixed is None and len(lanes) > 1 and "nccl" in lanes)
            esz = input.element_size()     # bytes per row; an empty side's splits are all 0
            ent = self.shortcuts.put("a2av", key, (dt, rin, rout, key[0] // max(rin, 1) * esz,
                                                   key[1] // max(rout, 1) * esz, lean), ok)
        return ent

    def a2a_even(self, tkey, output, input, input_split_sizes, output_split_sizes, async_op):
        """An all_to_all whose split sizes are all equal on this rank, in one native call
        (CallPath.native_replay with the round's values): the copy engines' uneven round as
        a2av_agree posts it, and the balanced call's launch where every rank posted this rank's
        values (the same row, agreement and pair hash: an even matrix, whose verdict is Even)
        and its word for that call's program. Returns None: not this way (no prepared ticket or
        native calls, a rounds thread, a round to be read one call late, a call two ranks decide
        alone, a shape the round does not take): a2av_agree's path, as if this were not tried;
        (handle, None): launched; (None, (agreed, small, lean)): the round posted and read in
        Python (a peer late, or its values differ), as a2av_agree returns it.

        An equal-split call whose matrix is even cost 93-117 us of host time in Python (one H200
        that 2 ranks share, 1-64 MiB, 2026-12-03): the round's post and read, its verdict and the
        launch, each a few Python steps over values known from the call's shape; 51-67 us at 4 MiB
        this way."""
        calls, prep, uneven = self.calls, self.prepared, self.uneven
        tk = calls._ticket(tkey)
        if tk is None or calls.rounds is not None or not tk.entry.exec_ptr or "ce" not in tk.lanes \
                or prep.entries.get(tk.key) is not tk.entry:
            return None
        fast = prep.fast if prep.fast is not False else calls.native_calls()
        if fast is None:
            return None
        ent = self.a2av_entry(input, output)
        w, m = self.world_size, input_split_sizes[0]
        if not (ent[-1] and ent[5] and len(input_split_sizes) == w and len(output_split_sizes) == w
                and m * w == ent[1] and output_split_sizes[0] * w == ent[2]):
            return None
        agree = uneven.agreement()
        memo = tk.even
        if memo is None or memo[0] != agree or memo[1] is not ent or memo[2] != self.mode:
            vals = None
            sent, got_b = m * ent[3], output_split_sizes[0] * ent[4]
            # two ranks decide a small call alone (UnevenAgreement.pair_whole): never here
            if sent == got_b and m > 0 and (w > 2 or self.policy.fixed is not None or 2 * sent >= uneven.ce_min):
                vals = uneven.even_values(sent, [sent] * w, tk.key)
            memo = tk.even = (agree, ent, self.mode,
                              None if vals is None else fast.values(vals), [got_b] * w)
        vals = memo[3]
        if vals is None:
            return None
        op = "all_to_all_single"
        self.faults.check_open()
        uneven.settle(op)
        if uneven.small_run >= SMALL_RUN:    # the round is read one call late: a2av_agree's
            return None
        vals[-2] = uneven.pair_hash
        ledger = self.ledger
        # counted while its round waits (CallPath.fast_prepared); native_replay undoes it where
        # it posts nothing
        ledger.ncalls += 1
        done, posted = calls.native_replay(fast, prep, self.segment, tk, input, (output,), async_op, vals, 3 + w)
        if posted is None:
            if done is None:                 # nothing posted (a capture)
                return None
            uneven.pair_hash = 0
            uneven.small_run = 0
            return done, None
        uneven.pair_hash = 0
        ledger.last_call = (op, input.numel() * input.element_size(), input.dtype, "agreeing")
        ledger.publish()
        return None, uneven.read(posted[1], memo[4], op)

    def a2av_lean(self, output, input, matrix, words, token, async_op):
        """The uneven call on the copy engines alone (comm/a2av.py), after its round (`token`)."""
        if self.a2av_ce is None:
            self.a2av_ce = UnevenCe(self.rank, self.world_size, self.segment, self.seg_dev_ptr, self.layout,
                                    self.lanes["ce"], self.prepared)
        if self.pending:
            self.pending.flush()
        try:
            handle = self.a2av_ce.run(output, input, matrix, words, async_op, self.native_posting(), token)
        except (PeerMismatchError, BraidTimeoutError, LaneFailureError) as exc:
            self.faults.give_up(exc)
            raise
        self.ledger.last_handle = handle
        return handle

    def a2a_rules(self, op: str, dev: torch.device):
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
            from ..collectives.routed import PATH_LANE
            kind = dev.type
            names = PATH_LANE[kind]
            learned = self.routed.agree(descs, names)   # every rank reported these observations
            if learned:
                self.samples.forget(learned)
            self.routed.begin()
            mode = self.mode
            if mode == "off" or (mode == "auto" and self.policy.fixed is not None):
                return None
            if not all(n in agreed for n in names.values()):
                return None
            if not all(d.get("zc", True) for d in descs if d is not None):
                return None      # a rank's bytes are not one buffer (batch_isend_irecv)
            matrix = [list(descs[s]["in"]) for s in range(w)]
            if mode == "auto" and not skewed(matrix):
                return None      # small or balanced: the share-based split (or NCCL) handles it
            table = self.policy.calib.get(f"{op}/{w}", {})
            costs = {k: table.get(k, DEFAULT_COSTS[k]) for k in names.values()}
            native_name = "nccl" if kind == "cuda" else "gloo"
            native_cost = table.get(native_name, DEFAULT_COSTS[native_name]) if native_name in agreed else None
            plan, routed_us, native_us = self.routed.plan(matrix, kind, costs, native_cost, force=mode == "on")
            self.samples.last = (routed_us, native_us)
            if log.isEnabledFor(logging.DEBUG):
                rt = self.routed
                st = rt._classes.get(rt.last_cls, {})
                log.debug("route rank %d class %s: routed %.0f us, native %.0f us, host %.0f us, fix %s, "
                          "trial %s, steady %s, in flight %d -> %s",
                          self.rank, rt.last_cls, routed_us, native_us, rt.host_time_us(),
                          rt.fix(rt.last_cls) if rt.last_cls else {}, st.get("trial"), rt.steady,
                          len(rt.in_flight), "routed" if plan is not None else "native")
            if plan is None and self.routed.last_pred is not None and not self.check:
                return DECLINED           # the side compared with routing: the native call itself
            return plan

        return movement_of, route
