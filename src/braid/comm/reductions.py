"""The reducing collectives: all_reduce, reduce_scatter, reduce. Whole calls go to the native
library; a split call reduce-scatters into per-rank slots on its lanes, reduces each chunk on the
device in rank order, and moves the reduced chunks on (on GPUs the copy engines' share runs as one
pipelined reduction, NCCL's share as its own all_reduce of a prefix).
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..collectives import flat_bytes, input_bytes, output_bytes, same_dtype
from ..errors import MisuseError
from ..collectives.ce_reduce import CeReduction, slot_rows
from ..executor import Handle, execute
from ..lanes import _cuda
from ..lanes.base import LaneRun, kept_buffer
from ..planner.plan import LaneKind, Plan

from ..collectives.reduce import check_reduce_dtype, divide, op_name, reduce_factor, reduce_slots, torch_op
from ..planner.plan import (ce_cut, chunk_bounds, cut_points, gather_chunks, reduce_scatter_chunks,
                            reduce_scatter_movement)
from .callpath import NATIVE_SHARE_REDS

log = logging.getLogger("braid")


@dataclass
class _ReduceCall:
    """The checked facts of one reducing call."""
    opname: str
    output: torch.Tensor
    input: torch.Tensor
    op: object
    root: int | None
    name: str               # the reduction braid runs (collectives/reduce.py)
    factor: float
    ib: torch.Tensor        # input as flat bytes
    ob: torch.Tensor        # output as flat bytes
    numel: int
    esz: int
    bounds: list[int]       # byte bounds of every rank's chunk
    dev: torch.device

    @property
    def size(self) -> int:
        return self.numel * self.esz

    @property
    def to_root(self) -> int | None:
        """The rank a reduce's copy-engine pipeline pushes to; None for the other ops."""
        return self.root if self.opname == "reduce" else None


@dataclass
class _Cuts:
    """How a split reduction's elements are divided between its parts (reduce_cuts)."""
    base: int                       # elements of NCCL's own all_reduce (a prefix)
    ce_f: float                     # the copy engines' fraction of every chunk
    rest: dict[str, float]          # the staged lanes' shares
    cut: list[int]                  # per rank: elements of its chunk the copy engines take
    ce_chunks: list[tuple[int, int]]
    rest_chunks: list[tuple[int, int]]
    out_at: list[int]


_NCCL_FLOAT8 = tuple(d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None))
                     if d is not None)


def _nccl_takes(t, op, opname: str) -> bool:
    """CUDA tensors braid's own reductions do not handle and NCCL does (checked on one H100 with
    torch 2.11, NCCL 2.28.9: scripts/probes/nccl_accepts.py): float8 with sum, product, min, max;
    complex with sum and avg in all_reduce and reduce. Such calls go to NCCL whole."""
    if not isinstance(t, torch.Tensor) or not t.is_cuda:
        return False
    if t.dtype in _NCCL_FLOAT8:                 # the op's name only for the dtypes it concerns
        return op_name(op) in ("sum", "product", "min", "max")
    return t.is_complex() and opname in ("all_reduce", "reduce") and op_name(op) in ("sum", "avg")


class GpuReductionParts:
    """What split reductions on GPUs keep from call to call, each made at first use: the copy
    engines' pipelined reduction, braid's op stream (the staged lanes' part and the join of the
    parts' ends), the stream of NCCL's share, and the staged lanes' slot scratch with the event
    after which it is free again. close() frees them."""

    def __init__(self, device: torch.device, ce_lane, lane_ctx):
        self.device, self._ce_lane, self._lane_ctx = device, ce_lane, lane_ctx
        self._ce = self._op = self._nccl = self._scratch = None
        self.staged_end = None          # the last staged reduction's end event

    def ce(self) -> CeReduction:
        if self._ce is None:
            self._ce = CeReduction(self._ce_lane, self._lane_ctx)
        return self._ce

    def op_stream(self):
        if self._op is None:
            self._op = torch.cuda.Stream(device=self.device)
        return self._op

    def nccl_stream(self):
        if self._nccl is None:
            self._nccl = torch.cuda.Stream(self.device)
        return self._nccl

    def scratch(self, n: int, dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
        """Slots of the staged reductions, kept from call to call on GPUs (a fresh allocation
        per call went to cudaMalloc: the previous call's block is still held by our streams).
        The next staged call starts after this one's end event (Reductions.reduce_split)."""
        if dev.type != "cuda":
            return torch.empty(n, dtype=dtype, device=dev)
        need = n * torch.empty((), dtype=dtype).element_size()
        if self._scratch is None or self._scratch.numel() < need:
            self._scratch = None
            self._scratch = kept_buffer(max(need, 1), dev)
        return self._scratch[:need].view(dtype)

    def close(self) -> None:
        if self._ce is not None:
            self._ce.close()
        self._ce = self._scratch = self.staged_end = None


class Reductions:
    """The reducing part of a communicator: every reducing op's full path (checked, then the
    native library whole or a split over the lanes) and the GPU pieces split reductions keep from
    call to call (`gpu`: GpuReductionParts, which it owns). The ops' fast paths are the
    communicator's own entries. Its collaborators: the call ledger, the native library's calls
    and groups, the lanes' context and the copy-engine lane, the full path's part (run, plan,
    exchange), the fast path's part (device check, whole calls' handles) and a multi-node world's
    steps (or None)."""

    def __init__(self, *, rank: int, world_size: int, cuda: bool, device: torch.device, ledger, library,
                 nccl_group, native_group, gloo_group, lane_ctx, ce_lane, exchange, calls, hier):
        self.rank, self.world_size, self.cuda = rank, world_size, cuda
        self.ledger, self.library = ledger, library
        self.nccl_group, self.native_group, self.gloo_group = nccl_group, native_group, gloo_group
        self.lane_ctx, self.exchange, self.calls, self.hier = lane_ctx, exchange, calls, hier
        # split reductions' GPU streams, scratch and the copy engines' reduction
        self.gpu = GpuReductionParts(device, ce_lane, lane_ctx)

    def close(self) -> None:
        self.gpu.close()

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
        if self.hier is not None and (h := self.hier.reduce_scatter_tensor(output, flat, op, async_op)) is not None:
            return h if async_op else None
        return self.reduction("reduce_scatter", output, flat, op, None, async_op)

    @torch.no_grad()
    def reduction(self, opname: str, output, input, op, root, async_op, tkey=None):
        """Every reducing op's full path: check the call, then the native library whole or a
        split (reduce_split)."""
        if self.cuda and _nccl_takes(output, op, opname):
            # NCCL reduces these and braid's own reductions do not: its call, whole (through
            # torch's front end, which turns complex tensors into float pairs where NCCL needs it)
            x = input if opname == "reduce_scatter" else output
            self.ledger.count((opname, x.numel() * x.element_size(), x.dtype, "whole"))
            g = self.native_group
            if opname == "all_reduce":
                work = dist.all_reduce(output, op=op, group=g, async_op=async_op)
            elif opname == "reduce":
                work = dist.reduce(output, group_dst=root, op=op, group=g, async_op=async_op)
            else:
                work = dist.reduce_scatter_tensor(output, input, op=op, group=g, async_op=async_op)
            if async_op:
                return self.calls.finish(work, True)
            self.ledger.last_handle = self.library.done
            return None
        rc = self.reduce_call(opname, output, input, op, root)
        desc = {"op": opname, "dtype": str(output.dtype), "nbytes": rc.size, "red": rc.name,
                "factor": rc.factor, "root": root}
        w, bounds = self.world_size, rc.bounds

        def movement_of(descs):
            return rc.size, ("rs", tuple(bounds)), lambda: reduce_scatter_movement(w, bounds)

        emit = None
        # a graph where the copy engines and the host lane take it (a reduce on the copy engines:
        # where every rank has a chunk to push to the root, as reduce_cuts has it; with fewer
        # elements than ranks it goes staged)
        if rc.dev.type == "cuda":
            emit = lambda descs, shares, sig: self.reduce_program(rc, descs, shares, sig)    # noqa: E731
            emit.ok = lambda shares: self.graphable(rc, shares)                              # noqa: E731
        return self.exchange.run(opname, desc, rc.size, rc.ib, [rc.ob], movement_of,
                                 lambda g: self.reduce_native(rc, g),
                                 ("op", "dtype", "nbytes", "red", "factor", "root"), async_op,
                                 multi=lambda descs, shares, plan1, agreed: self.reduce_split(rc, desc, descs, shares,
                                                                                             plan1, agreed),
                                 emit=emit, ticket=tkey)

    def reduce_call(self, opname: str, output, input, op, root) -> "_ReduceCall":
        """The checked facts of one reducing call (clear errors for what braid cannot reduce)."""
        name = op_name(op)
        dev = self.calls.device_for(input)
        if opname == "all_reduce" or opname == "reduce":
            ob = ib = output_bytes(output, "tensor", dev, opname)
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
        return _ReduceCall(opname, output, input, op, root, name, reduce_factor(op), ib, ob, numel, esz,
                           chunk_bounds(numel, self.world_size, esz), dev)

    def reduce_native(self, rc: "_ReduceCall", g):
        """The whole call on the native library's group `g`."""
        opname, output, name = rc.opname, rc.output, rc.name
        if name == "premul_sum" or (g is self.gloo_group and (name == "avg" or opname == "reduce")):
            # gloo has no avg/premul-sum and its reduce writes into non-root tensors; NCCL's
            # premul-sum gave wrong bf16 results in torch 2.11 (GPU test, 2026-11-22): reduce a
            # (scaled) copy with SUM, then divide / copy back on the ranks that own the result
            return self.reduce_copy(rc, g)
        top = torch_op(rc.op, name)
        if opname == "all_reduce":
            return dist.all_reduce(output, op=top, group=g, async_op=True)
        if opname == "reduce":
            return dist.reduce(output, group_dst=rc.root, op=top, group=g, async_op=True)
        return dist.reduce_scatter_tensor(output, rc.ib.view(output.dtype), op=top, group=g, async_op=True)

    def reduce_copy(self, rc: "_ReduceCall", g) -> Handle:
        """The native library reduces a copy (scaled for premul-sum) with SUM, or the op itself;
        the result is divided (avg) and copied back on the ranks that own it."""
        opname, output, name, root, w = rc.opname, rc.output, rc.name, rc.root, self.world_size
        base = rc.input.reshape(-1) if opname == "reduce_scatter" else output.reshape(-1)
        # a copy in the tensor's own dtype (x * 1.0 would make an integer tensor float32: int64
        # sums above 2**24 then lost their low bits)
        src = base * rc.factor if name == "premul_sum" else base.clone()
        top = dist.ReduceOp.SUM if name in ("avg", "premul_sum") else torch_op(rc.op, name)
        res = None
        if opname == "all_reduce":
            work = dist.all_reduce(src, op=top, group=g, async_op=True)
        elif opname == "reduce":
            work = dist.reduce(src, group_dst=root, op=top, group=g, async_op=True)
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

    def graphable(self, rc: "_ReduceCall", shares: dict[str, float]) -> bool:
        """A split reduction one program can hold: NCCL's own all_reduce of a prefix, the copy
        engines' pipelined share and the host lane's staged rest (no other staged lane)."""
        cuts = self.reduce_cuts(rc, shares)
        return (bool(cuts.base) or cuts.ce_f > 0 or bool(cuts.rest)) and set(cuts.rest) <= {"host"}

    def reduce_program(self, rc: "_ReduceCall", descs, shares: dict[str, float], sig):
        """A split reduction (graphable shares) as a program for a prepared call: f(stream,
        (reduce stream, gather stream), keep). The copy engines' pipelined share on `stream` and
        the side streams; the host lane's staged rest on braid's op stream beside it (its
        reduce-scatter into slots, this rank's reduction, its gather: reduce_staged's steps with
        the host lane's replay-safe programs). Slot rows and scratch are allocated in the
        program's own streams (inside a capture: from the graph's pool). NCCL's prefix, where
        the shares give it one, is its own all_reduce on braid's NCCL stream beside both (NCCL's
        calls can be captured; every rank's replays reach its communicator in the same order)."""
        cuts = self.reduce_cuts(rc, shares)
        assert set(cuts.rest) <= {"host"}, cuts
        w, me = self.world_size, self.rank
        inp, out = rc.ib.view(rc.output.dtype), rc.output.reshape(-1)
        staged = bool(cuts.rest) and any(n for _, n in cuts.rest_chunks)
        if cuts.ce_f > 0:
            red = self.gpu.ce()
            peers = red.peer_ptrs(descs)
            my_len = cuts.ce_chunks[me][1]
            rows = slot_rows(w, me, rc.to_root)
            npieces = red.num_pieces(cuts.ce_chunks, rc.esz)
        if staged:
            host = self.exchange.lanes["host"]
            esz = rc.esz
            byte_chunks = [(o * esz, n * esz) for o, n in cuts.rest_chunks]
            p1 = self.exchange.plan(("rs", tuple(byte_chunks)), lambda: reduce_scatter_chunks(w, byte_chunks),
                                    {"host": 1.0}, rc.size, rc.dev)
            p2 = None
            if rc.opname != "reduce_scatter":
                mv = gather_chunks(w, byte_chunks, None if rc.opname == "all_reduce" else rc.root)
                p2 = self.exchange.plan(("gather", tuple(byte_chunks), rc.root), lambda: mv, {"host": 1.0},
                                        rc.size, rc.dev)

        def hosted(seq, plan, src: int, outs: list[int], keep) -> None:
            """One staged phase on the host lane's streams, after `seq`'s work so far; `seq`
            then waits for it. Local copies of the phase on `seq`."""
            join = host.beside(seq, host.programs(me, plan.lanes.get("host", []), src, outs), keep)
            for c in plan.local:
                if c.rank == me and c.nbytes:
                    _cuda.memcpy_async(outs[c.buf] + c.dst_off, src + c.src_off, c.nbytes, seq.cuda_stream)
            join(seq)

        def program(stream, sides, keep) -> None:
            if cuts.base:
                ns = self.gpu.nccl_stream()
                nstart = torch.cuda.Event()
                nstart.record(stream)
                ns.wait_event(nstart)
                with torch.cuda.stream(ns):
                    dist.all_reduce(out[:cuts.base], op=torch_op(rc.op, rc.name), group=self.nccl_group)
                nend = torch.cuda.Event()
                nend.record(ns)
                keep += [nstart, nend]
            if staged:
                seq = self.gpu.op_stream()
                start = torch.cuda.Event()
                start.record(stream)
                seq.wait_event(start)
                keep.append(start)
                o_me, n_me = cuts.rest_chunks[me]
                with torch.cuda.stream(seq):
                    slots = torch.empty(w * n_me, dtype=rc.output.dtype, device=rc.dev)
                keep.append(slots)
                hosted(seq, p1, rc.ib.data_ptr(), [rc.ob.data_ptr(), slots.data_ptr()], keep)
                with torch.cuda.stream(seq):
                    if rc.opname == "reduce_scatter":
                        c = cuts.cut[me]
                        reduce_slots(slots, w, rc.name, out[c: c + n_me], rc.factor)
                    else:
                        target = out if (rc.opname == "all_reduce" or me == rc.root) else torch.empty_like(out)
                        keep.append(target)
                        reduce_slots(slots, w, rc.name, target[o_me: o_me + n_me], rc.factor)
                if p2 is not None:
                    hosted(seq, p2, target.data_ptr(), [rc.ob.data_ptr()], keep)
            if cuts.ce_f > 0:
                rs, gs = sides
                start = torch.cuda.Event()
                start.record(stream)
                rs.wait_event(start)
                gs.wait_event(start)
                slots_ce = torch.empty((rows, my_len), dtype=rc.output.dtype, device=rc.dev) if my_len else None
                events = [torch.cuda.Event() for _ in range(2 * npieces)]
                keep += [start, *events, slots_ce]
                red.emit(stream, rs, gs, inp=inp, out=out, chunks=cuts.ce_chunks, out_offsets=cuts.out_at,
                         gather=rc.opname == "all_reduce", peers=peers, name=rc.name, factor=rc.factor, sig=sig,
                         slots=slots_ce, events=events, root=rc.to_root)
            if staged:                  # joined after the copy engines' share, which ran beside it
                end = torch.cuda.Event()
                end.record(seq)
                stream.wait_event(end)
                keep.append(end)
            if cuts.base:
                stream.wait_event(nend)
        return program

    def reduce_cuts(self, rc: "_ReduceCall", shares: dict[str, float]) -> "_Cuts":
        """Which elements each part of a split reduction takes: NCCL's own all_reduce of a prefix
        (all_reduce on GPUs: its kernels run beside the copy engines, the host lane adds PCIe),
        the copy engines' pipelined share of every rank's chunk, and the staged lanes' rest."""
        w, esz, numel, opname = self.world_size, rc.esz, rc.numel, rc.opname
        cuda = rc.dev.type == "cuda"
        nat_f = shares.get("nccl", 0.0) if cuda and opname == "all_reduce" and rc.name in NATIVE_SHARE_REDS else 0.0
        base = 0
        chunk_b = rc.bounds
        if 0.0 < nat_f < 1.0:
            base = cut_points(numel * esz, [nat_f, 1.0 - nat_f], 4096)[1] // esz
            shares = {k: v / (1.0 - nat_f) for k, v in shares.items() if k != "nccl"}
            chunk_b = [base * esz + b for b in chunk_bounds(numel - base, w, esz)]
        elem = [(chunk_b[d] // esz, (chunk_b[d + 1] - chunk_b[d]) // esz) for d in range(w)]
        ce_f = shares.get("ce", 0.0) if cuda and base < numel else 0.0
        # a reduce's copy engines take every rank's chunk or none (fewer elements than ranks, or
        # a sliver share: staged)
        cut = ce_cut(elem, ce_f, any(k != "ce" for k in shares), esz, every=opname == "reduce")
        if opname == "reduce" and not any(cut):
            ce_f = 0.0
        rest = {k: v for k, v in shares.items() if not (k == "ce" and ce_f > 0)} if base < numel else {}
        # where rank d's reduced chunk goes in its own output: in place for all_reduce/reduce,
        # the start of the output for reduce_scatter
        out_at = [o for o, _ in elem] if opname != "reduce_scatter" else [0] * w
        return _Cuts(base, ce_f, rest, cut, [(o, c) for (o, _), c in zip(elem, cut)],
                     [(o + c, n - c) for (o, n), c in zip(elem, cut)], out_at)

    def reduce_record(self, rc: "_ReduceCall", cuts: "_Cuts", shares: dict[str, float], staged_plan):
        """The plan as it ran: the staged lanes' transfers, and the pulls of the copy engines'
        pipelined part (for Handle.shares and lane_bytes)."""
        if cuts.ce_f == 0 and cuts.base == 0:
            return staged_plan
        lanes = dict(staged_plan.lanes) if staged_plan is not None else {}
        if cuts.ce_f > 0:
            ce_bytes = [(o * rc.esz, n * rc.esz) for o, n in cuts.ce_chunks]
            lanes["ce"] = reduce_scatter_chunks(self.world_size, ce_bytes).transfers
        if cuts.base:       # NCCL's own all_reduce of the prefix: no braid transfers to list
            lanes["nccl"] = []
        return Plan(rc.opname, self.world_size, rc.size, dict(shares), lanes, [])

    def reduce_split(self, rc: "_ReduceCall", desc: dict, descs, shares, plan1, agreed) -> Handle:
        """Split call. On GPUs the copy engines' share of every chunk runs as one pipelined
        reduction (collectives/ce_reduce.py) and NCCL's share as its own all_reduce of a prefix;
        the other lanes' share takes the staged path (reduce_staged)."""
        cuda = rc.dev.type == "cuda"
        cuts = self.reduce_cuts(rc, shares)
        start_event = None
        runs = []
        if cuda:
            caller = torch.cuda.current_stream(rc.dev)
            if self.gpu.staged_end is not None and cuts.rest:
                caller.wait_event(self.gpu.staged_end)   # the staged scratch is free again
            start_event = torch.cuda.Event()
            start_event.record(caller)
        if cuts.base:
            runs.append(self.native_share(rc.output.reshape(-1)[:cuts.base], torch_op(rc.op, rc.name), start_event))
        if cuts.ce_f > 0:
            runs.append(self.gpu.ce().post(
                start_event=start_event, inp=rc.ib.view(rc.output.dtype), out=rc.output.reshape(-1),
                chunks=cuts.ce_chunks, out_offsets=cuts.out_at, gather=rc.opname == "all_reduce", descs=descs,
                name=rc.name, factor=rc.factor, root=rc.to_root))
        if not cuts.rest or not any(n for _, n in cuts.rest_chunks):
            event = runs[0].end if cuda and runs else None
            if cuda and len(runs) > 1:         # join the lanes' ends on braid's op stream
                join = self.gpu.op_stream()
                for r in runs:
                    join.wait_event(r.end)
                event = torch.cuda.Event()
                event.record(join)
            staged_plan = None if cuts.ce_f > 0 or cuts.base else plan1
            handle = Handle(runs, plan=self.reduce_record(rc, cuts, shares, staged_plan), event=event)
            if cuda:
                handle.keep = (rc.input, rc.output, rc.ib, rc.ob)
            return handle
        return self.reduce_staged(rc, desc, descs, shares, agreed, cuts, runs, start_event)

    def reduce_staged(self, rc: "_ReduceCall", desc: dict, descs, shares, agreed, cuts: "_Cuts", runs,
                       start_event) -> Handle:
        """The staged lanes' part: reduce-scatter into per-rank slots on those lanes, reduce this
        rank's slots in rank order, gather the reduced chunks back (all_reduce, reduce). On GPUs
        it runs on braid's op stream after `start_event`, and joins the other parts' ends."""
        me, w, esz, dev, opname = self.rank, self.world_size, rc.esz, rc.dev, rc.opname
        output, rest, rest_chunks = rc.output, cuts.rest, cuts.rest_chunks
        cuda = dev.type == "cuda"
        stream = self.gpu.op_stream() if cuda else None
        with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            if cuda:
                stream.wait_event(start_event)
                t_start = torch.cuda.Event(enable_timing=True)
                t_start.record(stream)
            byte_chunks = tuple((o * esz, n * esz) for o, n in rest_chunks)
            p1 = self.exchange.plan(("rs", byte_chunks), lambda: reduce_scatter_chunks(w, list(byte_chunks)),
                                    rest, rc.size, dev)
            o_me, n_me = rest_chunks[me]
            slots = self.gpu.scratch(w * n_me, output.dtype, dev)
            h1 = execute(self.lane_ctx, p1, rc.ib, [rc.ob, flat_bytes(slots)], descs)
            h1.wait()
            target = None
            if opname == "reduce_scatter":
                c = cuts.cut[me]
                reduce_slots(slots, w, rc.name, output.reshape(-1)[c: c + n_me], rc.factor)
                staged = h1.runs
            else:
                target = output if (opname == "all_reduce" or me == rc.root) else torch.empty_like(output)
                reduce_slots(slots, w, rc.name, target.reshape(-1)[o_me: o_me + n_me], rc.factor)
                src = flat_bytes(target)
                # only the staged lanes' descriptors (the copy engines' IPC handle of the
                # output is wanted only when they are one of them: reduce)
                d2 = self.exchange.exchange(dict(desc, op=f"{opname}/gather"), src, [k for k in agreed if k in rest])
                mv = gather_chunks(w, list(byte_chunks), None if opname == "all_reduce" else rc.root)
                p2 = self.exchange.plan(("gather", byte_chunks, rc.root), lambda: mv, rest, rc.size, dev)
                h2 = execute(self.lane_ctx, p2, src, [rc.ob], d2)
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
                self.gpu.staged_end = event
        handle = Handle(runs + staged, plan=self.reduce_record(rc, cuts, shares, p1), event=event)
        if cuda:        # (the slots are the communicator's own, kept from call to call)
            handle.keep = (rc.input, output, rc.ib, rc.ob, target)
        return handle

    def native_share(self, view: torch.Tensor, top, start_event) -> LaneRun:
        """NCCL's own all_reduce of `view` on braid's NCCL stream, after `start_event` (where the
        call was made on the caller's stream), timed for the balancer. torch runs a synchronous
        NCCL call on the current stream (2.11: no Work is returned); older versions run it on
        their own stream and make the current one wait: either way the end event follows it."""
        ns = self.gpu.nccl_stream()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(ns):
            ns.wait_event(start_event)
            t0.record(ns)
            dist.all_reduce(view, op=top, group=self.nccl_group)
            t1.record(ns)
        return LaneRun(LaneKind.NCCL, start=t0, end=t1)
