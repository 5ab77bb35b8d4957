"""braid as a torch.distributed backend: `import braid; dist.init_process_group("braid")`.

Plain torch.distributed calls (dist.all_reduce, all_gather_into_tensor, broadcast, send/recv,
DDP...) then run on braid's lanes. The process group the factory builds is a Python
`dist.ProcessGroup` that holds two raw inner groups, made from the rendezvous store at once:
gloo always, NCCL where CUDA and NCCL are there. The braid `Communicator` cannot exist yet at
that point (it makes its own groups with dist.new_group, which needs the default group), so it
is made on the first collective braid takes: every rank calls that collective, so every rank
makes it at the same point. Until then send/recv go to the inner groups; so do the ops braid
does not have (gather, scatter, list all_to_all, coalesced ops, uneven all_gather lists, several
tensors per call, dtypes braid does not reduce) and every op of a subgroup (new_group without a
backend builds another of these groups, inner groups only). Reductions the inner gloo group runs
keep braid's semantics (_inner_reduction): AVG (integers: a wrapping sum divided truncating toward
zero, as NCCL), premul-sum, and braid's refusals. Collectives stay out of autograd: tensors that
require grad reach the inner groups detached.
Under torch's profiler every call leaves one "braid:<op>" event (all_reduce, all_gather, send,
recv...: gloo's and NCCL's names), asynchronous, with the call's input tensors as its inputs (see
_recorded); the calls braid hands to an inner group whole leave the inner group's own event too.
The inner groups are also registered as the group's cpu/cuda backends, so torch code that asks
the group for its backend (group names, eager NCCL connect with device_id) finds them.
"""
from __future__ import annotations

import datetime
import functools
import logging

import torch
import torch.distributed as dist

from . import envs
from .backend_work import (_OP_OF, BraidWork, _AnySourceWork, _coalescing, _detached, _done, _finished,  # noqa: F401
                           _make_nccl, _method, _QueuedWork, _record_begin, _record_end, _tensors_in, _together,
                           profiler_on)
from .collectives.reduce import REDUCE_DTYPES, PremulSum, check_reduce_dtype, divide, op_name, reduce_factor
from .comm.ledger import TeardownWatch

NAME = "braid"
log = logging.getLogger("braid")
_P2P_NAMES = frozenset(("send", "recv", "recv_anysource"))
_EMPTY = torch.empty(0, dtype=torch.uint8)      # the ledger's tensor of a barrier


_PLAIN_TYPES = frozenset(getattr(dist.ReduceOp, n) for n in ("SUM", "AVG", "PRODUCT", "MIN", "MAX"))


# not exported by torch.distributed (torch 2.11-2.13): from the binding itself
_AllgatherOptions = getattr(dist, "AllgatherOptions", None) or torch._C._distributed_c10d.AllgatherOptions


def _options(cls, timeout=None, **fields):
    """torch's options object `cls` with these fields set (None: left at torch's default)."""
    o = cls()
    for k, v in fields.items():
        if v is not None:
            setattr(o, k, v)
    if timeout is not None:
        o.timeout = timeout
    return o


def _reduce_op(op):
    """A ReduceOp for an options object from what torch's binding accepts (ReduceOp or its type)."""
    return None if op is None else op if isinstance(op, dist.ReduceOp) else dist.ReduceOp(op)


def _plain_op(op):
    """The op braid's Communicator reduces with: the ReduceOp (SUM/AVG/PRODUCT/MIN/MAX), braid's
    PremulSum for torch's premul-sum (its factor read from the op object), or None: bitwise ops
    (the inner group runs them, braid's checks first: _inner_reduction) and unknown ops."""
    try:                        # torch's ReduceOp object of a plain op: its type names it
        if op.op in _PLAIN_TYPES:
            return op.op
    except (AttributeError, TypeError):
        pass
    try:
        name = op_name(op)
    except Exception:
        return None
    if name == "premul_sum":
        return PremulSum(reduce_factor(op))
    if name in ("band", "bor", "bxor"):
        return None
    return getattr(dist.ReduceOp, "PRODUCT" if name == "product" else name.upper())


class BraidProcessGroup(dist.ProcessGroup):
    """The process group `init_process_group("braid")` makes (see the module text)."""

    _recording = False      # a call's profiler record is open (its nested calls leave none)

    def __init__(self, store, rank: int, size: int, timeout, world: bool):
        super().__init__(rank, size)
        self._braid_rank, self._braid_size = rank, size
        self._timeout = timeout if timeout is not None else datetime.timedelta(minutes=30)
        self._world = world           # the default group: braid's Communicator runs on it
        self._comm = None
        self._closed = False
        self.gloo = dist.ProcessGroupGloo(dist.PrefixStore("braid/gloo/", store), rank, size, self._timeout)
        self.nccl = _make_nccl(dist.PrefixStore("braid/nccl/", store), rank, size, self._timeout)
        self._gpu = self.nccl is not None
        self._p2p_queue: list[tuple] = []    # GPU send/recv not yet posted (see _p2p)
        self._inner_calls: dict = {}         # torch's method name -> the inner group's (_whole_now)
        # the hand-off (_look): whole calls so far (the forwarders' apart), and at the last look
        # those and braid's count of calls
        self._wholes, self._forwarded, self._look_at, self._looked = 0, 0, 0, (0, 0)
        self._handoff_every = 0               # calls between looks (BRAID_HANDOFF; 0: never), read with the communicator
        self._handed: list[str] = []          # torch's method names bound to forwarders now
        self.handed_at = 0                    # braid's count of calls at the last hand-off
        # every rank knows the inner NCCL group's communicator of all ranks exists (see flush_p2p)
        self._p2p_world = False
        try:
            self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self.gloo)
            if self.nccl is not None:
                self._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, self.nccl)
        except Exception as exc:   # only torch's own lookups of the group's backends need them
            log.debug("braid backend: inner groups not registered as backends: %s", exc)

    # identity ---------------------------------------------------------------------------------
    def getBackendName(self) -> str:
        return NAME

    def __repr__(self) -> str:
        return f"BraidProcessGroup(rank={self._braid_rank}, size={self._braid_size}, world={self._world})"

    def ensure_communicator(self, lanes: list[str] | None = None):
        """braid's Communicator of this (default) group, made now if no collective made it yet
        (collective: every rank calls this at the same point; `lanes` applies only then)."""
        from .errors import MisuseError
        if not self._world:
            raise MisuseError("this braid process group is a subgroup: braid's Communicator runs on the "
                              "default (world) group only; subgroups use plain gloo/NCCL")
        if self._closed:
            raise MisuseError("the braid process group was destroyed")
        if self._comm is None:
            from .comm import Communicator
            # made on a first call that may run in inference mode (Lightning's validation): its
            # buffers must be plain tensors, or no later call outside that mode could write them
            with torch.inference_mode(False):
                comm = Communicator(lanes=lanes)
            comm._braid_backend_owned = True
            comm.backend_groups = [self.nccl] if self.nccl is not None else []   # aborted with braid's own
            if comm.cuda and self.nccl is not None:
                self._connect_world(comm.device)
            # the inner group's all_reduce, bound once (the forwarding path's hottest call)
            self._inner_allreduce = (self.nccl if comm.cuda else self.gloo).allreduce
            self._handoff_every = envs.get("BRAID_HANDOFF")
            self._look_at = self._handoff_every
            self._comm = comm
        return self._comm

    # routing ----------------------------------------------------------------------------------
    def _braid_for(self, tensors):
        """braid's Communicator when it takes a call on these tensors (made on first use), else
        None (the call goes to an inner group). Decided from facts every rank shares."""
        if not self._world or self._closed or not tensors:
            return None
        kind = None
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                return None
            if t.layout != torch.strided or t.is_quantized:
                return None
            if kind is None:
                kind = t.device.type
            elif t.device.type != kind:
                return None
        if kind == "cuda" and not self._gpu:
            return None
        if kind not in ("cpu", "cuda"):
            return None
        return self._comm if self._comm is not None else self.ensure_communicator()

    def _inner(self, tensors):
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.is_cuda and self.nccl is not None:
                return self.nccl
        return self.gloo

    def _forward(self, name: str, *args, **kwargs):
        self.flush_p2p()
        tensors = list(_tensors_in((args, list(kwargs.values()))))
        inner = self._inner(tensors)
        if any(t.requires_grad for t in tensors):
            args, kwargs = _detached(args), {k: _detached(v) for k, v in kwargs.items()}
        work = _method(inner, name)(*args, **kwargs)
        if inner is self.nccl and name not in _P2P_NAMES:
            self._p2p_world = True            # a collective: every rank made the communicator of all
        # a synchronous NCCL call may return no Work (it ran on the current stream)
        return work if work is not None else _done()

    def _whole(self, name: str, args: tuple, opts, comm):
        """The inner group's own call (`name`, torch's options), returning its own Work: the
        forwarding path for calls braid's Communicator gives the native library whole."""
        if self._p2p_queue:
            self.flush_p2p()
        if comm._p2p_pending and not comm.cuda:
            comm._p2p_pending.flush()
        ledger = comm.ledger
        ledger.last_handle = comm.library.done
        t = args[1] if len(args) > 1 else args[0][0]      # the input (list forms: the tensor)
        ledger.count((_OP_OF.get(name, name), t.numel() * t.element_size(), t.dtype, "whole"))
        inner = self.nccl if comm.cuda else self.gloo
        if t.requires_grad:
            args = _detached(args)                  # as in _forward
        work = _method(inner, name)(*args, opts)
        self._wholes += 1
        if self._wholes == self._look_at:
            self._look(comm)
        return work if work is not None else _finished()

    def _whole_now(self, name: str, op: str, output, input, opts, comm):
        """_whole for a single-tensor call whose shape the kept answer sends whole (the caller
        checked it): the inner group's own call, counted, its method found once per name."""
        if self._p2p_queue or comm._p2p_pending:
            return self._whole(name, (output, input), opts, comm)
        ledger = comm.ledger
        ledger.last_handle = comm.library.done
        ledger.count((op, input.numel() * input.element_size(), input.dtype, "whole"))
        fn = self._inner_calls.get(name)
        if fn is None:
            fn = self._inner_calls[name] = _method(self.nccl if comm.cuda else self.gloo, name)
        work = fn(output, input, opts)
        self._wholes += 1
        if self._wholes == self._look_at:
            self._look(comm)
        return work if work is not None else _finished()

    # the hand-off -----------------------------------------------------------------------------
    # A job whose calls all go whole (FSDP2's, on 2 x H200) pays braid's Python on each: the
    # checks above, ~10-30 us a call over the inner group's own (the probe's `--handoff`). Every
    # BRAID_HANDOFF whole calls the backend looks: when every call of the communicator since the
    # last look went whole, no in-job trial runs and no shares are fixed, torch's single-tensor
    # all_reduce, all-gather and reduce-scatter methods of this group are bound to forwarders
    # (instance attributes over the class's methods) that give each call of a shape that goes
    # whole now straight to the inner NCCL group (gloo's on a CPU communicator), counted as braid
    # counts a whole call. Any other call (a shape not seen, other dtypes or ops, tensors on the
    # other kind of device or that require grad, a profiler on, sends or receives not yet
    # matched) takes the class's method as before. The looks come at the same call on every rank
    # (every rank makes the same calls and braid decides them alike), so every rank hands off at
    # the same call. Given back (the class's methods again) when the communicator's kept answers
    # are cleared: fixed shares, a new calibration, close, abort. The price: the shapes handed off
    # are not tried again (comm/arbiter.py's reprobes) until then.
    def _look(self, comm) -> None:
        whole = self._all_whole(comm)
        self._looked = (comm.ledger.ncalls, self._wholes + self._forwarded)
        self._look_at = self._wholes + self._handoff_every
        if whole and not comm._arbiter.trying():
            self._hand_off(comm)          # (again after a look that found more shapes)

    def _all_whole(self, comm) -> bool:
        """Every call since the last look went whole, and nothing stops a hand-off (fixed
        shares, check mode)."""
        calls, wholes = comm.ledger.ncalls, self._wholes + self._forwarded
        was_calls, was_wholes = self._looked
        return calls - was_calls == wholes - was_wholes and comm.policy.fixed is None and not comm.check

    def _hand_off(self, comm) -> None:
        sc = comm.shortcuts
        bound = []
        for name, op in _HANDED.items():
            if not hasattr(type(self), name):
                continue                      # torch's names differ between versions
            fn = getattr(self.nccl if comm.cuda else self.gloo, name, None)
            if fn is None:
                continue
            keep = sc.settled(op)
            if not keep:
                continue
            make = _forward_all_reduce if op == "ar" else _forward_single
            setattr(self, name, make(self, getattr(type(self), name).__get__(self), fn, keep, comm,
                                     _OP_OF.get(name, name)))
            bound.append(name)
        if bound:
            if bound != self._handed:
                log.info("braid backend: every call went whole for %d calls; %s of the shapes seen go "
                         "straight to the inner group now", self._handoff_every, ", ".join(bound))
            self._handed = bound
            self.handed_at = comm.ledger.ncalls
            sc.on_clear = self._take_back

    def handing_off(self) -> bool:
        """A hand-off is on its way: none is in place, hand-offs are on, and every call since
        the last look went whole with nothing that stops one (the next look hands off, if the
        calls stay so). `braid bench --workload` warms a job up until this and the trials end."""
        comm = self._comm
        if comm is None or self._handed or not self._handoff_every:
            return False
        return comm.ledger.ncalls > self._looked[0] and self._all_whole(comm)

    def _take_back(self) -> None:
        """The class's own methods again (the communicator's kept answers were cleared)."""
        for name in self._handed:
            self.__dict__.pop(name, None)
        self._handed = []
        comm = self._comm
        if comm is not None and comm.shortcuts.on_clear == self._take_back:
            comm.shortcuts.on_clear = None
        self._look_at = self._wholes + self._handoff_every if self._handoff_every else 0

    def _run(self, call, opts, result):
        """Run a braid call; synchronous calls (opts.asyncOp False) keep braid's own synchronous
        path (on GPUs: NCCL's call on the current stream for small messages)."""
        self.flush_p2p()
        if not getattr(opts, "asyncOp", True):
            call(False)
            return _done(result)
        return BraidWork(call(True), result)

    @staticmethod
    def _reducible(t, op) -> bool:
        # bool on CPU tensors (sum = or, product = and); on GPUs NCCL's own call maps them so
        return op is not None and (t.dtype in REDUCE_DTYPES or (t.dtype is torch.bool and not t.is_cuda))

    def _inner_reduction(self, method: str, args: tuple, opts, outs: list, ins: list, root=None):
        """A reducing call the inner group runs (every call of a subgroup; calls braid's
        Communicator does not take), with braid's semantics where the inner group's differ: braid's
        refusals (they name the op, the dtype and the fix), AVG as a SUM then a division (integers
        truncated toward zero, as NCCL), premul-sum as a SUM of scaled copies. outs: the tensors
        that receive the result; ins: the tensors the call reads; root: reduce's destination."""
        cuda = any(t.is_cuda for t in outs + ins)
        try:
            name = op_name(opts.reduceOp)
        except Exception:
            name = None
        if name is None or not outs or any(t.layout != torch.strided or t.is_quantized for t in outs + ins):
            return self._forward(method, *args, opts)      # not braid's to judge: the inner group's errors
        if cuda and self.nccl is not None and name != "premul_sum":
            return self._forward(method, *args, opts)      # NCCL's own ops (integer AVG as braid's)
        # premul-sum on NCCL too, as on braid's default group: NCCL's own gave wrong bfloat16 results
        opname = {"allreduce": "all_reduce", "reduce": "reduce"}.get(method, "reduce_scatter")
        for t in outs + ins:
            check_reduce_dtype(t.dtype, name, opname, cuda)
        if name not in ("avg", "premul_sum"):
            return self._forward(method, *args, opts)
        factor = reduce_factor(opts.reduceOp)
        writing = torch.inference_mode() if any(t.is_inference() for t in outs) else torch.no_grad()
        with writing:               # an inference tensor is written only in inference mode
            if name == "premul_sum" or method == "reduce":
                # reduce: a copy, so that non-root tensors stay as they were; premul-sum: scaled copies
                src = [t * factor if name == "premul_sum" else t.clone() for t in ins]
                work_outs = src if method in ("allreduce", "reduce") else outs
                if method in ("allreduce", "reduce"):
                    args = (src,)
                elif method == "reduce_scatter":
                    it = iter(src)
                    args = (args[0], [[next(it) for _ in ts] for ts in args[1]])
                else:
                    args = (args[0], src[0])
            else:
                work_outs = outs
            asked = opts.reduceOp
            opts.reduceOp = dist.ReduceOp.SUM
            try:
                self._forward(method, *args, opts).wait()
            finally:
                opts.reduceOp = asked               # the caller's options object, as it came
            if method == "reduce" and self._braid_rank != root:
                return _done(outs)
            for dst, res in zip(outs, work_outs):
                if name == "avg":
                    divide(res, self._braid_size)
                if res is not dst:
                    dst.copy_(res)
        return _done(outs)

    # profiler -------------------------------------------------------------------------------
    # Each method that torch calls starts with `if profiler_on() and not self._recording:` (off:
    # one C call, nothing made) and then runs again inside _recorded.
    def _recorded(self, op: str, inputs, method, *args, **kwargs):
        """Run `method(*args, **kwargs)` (a method of this group) inside the profiler record "braid:<op>",
        the tensors `inputs` as its inputs. The record ends when the call is done: at once for a
        synchronous call or a Work that is finished, else when its Work is waited on, found
        completed or asked for its future; for a Work of the inner group, once the inner group
        has the call (its own event covers the rest)."""
        rec = _record_begin("braid:" + op, inputs)
        self._recording = True
        try:
            work = method(*args, **kwargs)
        except BaseException:
            _record_end(rec)
            raise
        finally:
            self._recording = False
        if isinstance(work, BraidWork) and not work._waited:
            work._record = rec
        else:
            _record_end(rec)
        return work

    # collectives ------------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None, op=None, timeout=None):
        """torch's forms: (tensors, opts), (tensors, op, timeout), (tensor, op, timeout)."""
        if (type(tensors) is not list or (opts is not None and type(opts) is not dist.AllreduceOptions)
                or op is not None or timeout is not None):
            if isinstance(tensors, torch.Tensor):
                tensors = [tensors]
            if not isinstance(opts, dist.AllreduceOptions):
                opts = _options(dist.AllreduceOptions, timeout, reduceOp=_reduce_op(opts if opts is not None else op))
            tensors = list(tensors)
        if profiler_on() and not self._recording:
            return self._recorded("all_reduce", tensors, self.allreduce, tensors, opts)
        opts = opts if opts is not None else dist.AllreduceOptions()
        comm = self._comm
        if comm is not None and len(tensors) == 1:
            # DDP's hot call, its test written out here (a call less: ~0.5-1 us of host time)
            t = tensors[0]
            ent = comm.shortcuts.ar.get(t.numel())
            if (ent is not None and ent[2] and ent[0] is t.dtype and ent[1] == opts.reduceOp.op
                    and comm._takes(t)):
                if self._p2p_queue or comm._p2p_pending:
                    return self._whole("allreduce", (tensors,), opts, comm)
                ledger = comm.ledger
                ledger.last_handle = comm.library.done
                ledger.count(("all_reduce", t.numel() * t.element_size(), t.dtype, "whole"))
                work = self._inner_allreduce(tensors, opts)
                self._wholes += 1
                if self._wholes == self._look_at:
                    self._look(comm)
                return work if work is not None else _finished()
            if ent is not None and comm.whole_all_reduce(t, opts.reduceOp.op):   # a split shape's trial said whole
                return self._whole("allreduce", (tensors,), opts, comm)
        op = _plain_op(opts.reduceOp)
        if len(tensors) == 1 and self._reducible(tensors[0], op):
            comm = self._braid_for(tensors)
            if comm is not None:
                t = tensors[0]
                return self._run(lambda a: comm.all_reduce(t, op, async_op=a), opts, [t])
        return self._inner_reduction("allreduce", (tensors,), opts, list(tensors), list(tensors))

    def broadcast(self, tensors, opts=None, timeout=None, root=None):
        """torch's forms: (tensors, opts), (tensor, root, timeout)."""
        if isinstance(tensors, torch.Tensor):
            root = opts if root is None else root
            tensors, opts = [tensors], _options(dist.BroadcastOptions, timeout, rootRank=int(root or 0), rootTensor=0)
        if profiler_on() and not self._recording:
            return self._recorded("broadcast", tensors, self.broadcast, tensors, opts)
        opts = opts if opts is not None else dist.BroadcastOptions()
        comm = self._comm
        if (comm is not None and len(tensors) == 1 and opts.rootTensor == 0
                and comm.whole_broadcast(tensors[0], opts.rootRank)):
            return self._whole("broadcast", (tensors,), opts, comm)
        if len(tensors) == 1 and opts.rootTensor == 0:
            comm = self._braid_for(tensors)
            if comm is not None:
                t, root = tensors[0], opts.rootRank
                return self._run(lambda a: comm.broadcast(t, root, async_op=a), opts, [t])
        return self._forward("broadcast", tensors, opts)

    def reduce(self, tensors, opts=None, op=None, timeout=None, root=None):
        """torch's forms: (tensors, opts), (tensor, root, op, timeout)."""
        if isinstance(tensors, torch.Tensor):
            root = opts if root is None else root
            tensors, opts = [tensors], _options(dist.ReduceOptions, timeout, rootRank=int(root or 0), rootTensor=0,
                                                reduceOp=_reduce_op(op))
        if profiler_on() and not self._recording:
            return self._recorded("reduce", tensors, self.reduce, tensors, opts)
        opts = opts if opts is not None else dist.ReduceOptions()
        op = _plain_op(opts.reduceOp)
        if len(tensors) == 1 and opts.rootTensor == 0 and self._reducible(tensors[0], op):
            comm = self._braid_for(tensors)
            if comm is not None:
                t, root = tensors[0], opts.rootRank
                return self._run(lambda a: comm.reduce(t, root, op, async_op=a), opts, [t])
        return self._inner_reduction("reduce", (tensors,), opts, list(tensors), list(tensors), opts.rootRank)

    def allgather(self, output_tensors, input_tensors, opts=None, timeout=None):
        """torch's forms: (output lists, inputs, opts), (outputs, input, timeout)."""
        if isinstance(input_tensors, torch.Tensor):
            output_tensors, input_tensors = [list(output_tensors)], [input_tensors]
            opts = _options(_AllgatherOptions, opts if timeout is None else timeout)
        if profiler_on() and not self._recording:
            return self._recorded("all_gather", input_tensors, self.allgather, output_tensors, input_tensors, opts)
        opts = opts if opts is not None else _AllgatherOptions()
        if len(input_tensors) == 1 and len(output_tensors) == 1:
            inp, outs = input_tensors[0], list(output_tensors[0])
            even = len(outs) == self._braid_size and all(
                isinstance(o, torch.Tensor) and o.numel() == inp.numel() and o.dtype == inp.dtype for o in outs)
            comm = self._braid_for([inp] + outs) if even else None
            if comm is not None:
                return self._run(lambda a: comm.all_gather(outs, inp, async_op=a), opts, outs)
        return self._forward("allgather", output_tensors, input_tensors, opts)

    def _all_gather_single(self, name, output, input, opts):
        if profiler_on() and not self._recording:
            return self._recorded("all_gather_into_tensor", [input], self._all_gather_single, name, output, input, opts)
        opts = opts if opts is not None else _AllgatherOptions()
        if input.requires_grad:
            input = input.detach()      # read only; the output is not autograd's (see _detached)
        comm = self._comm
        if comm is not None:
            # FSDP2's hot calls: a shape braid's Communicator sends whole goes to the inner group
            # with its test written out (the kept answer, comm/shortcuts.py, and CallPath._takes
            # for both tensors; a closed or aborted communicator keeps no answers)
            ent = comm.shortcuts.ag.get(input.numel())
            if ent is not None and ent[2] and ent[0] is input.dtype and ent[1] == output.numel():
                if (type(input) is torch.Tensor and type(output) is torch.Tensor and input.is_cuda is comm.cuda
                        and output.is_cuda is comm.cuda and input.is_contiguous() and output.is_contiguous()):
                    return self._whole_now(name, "all_gather", output, input, opts, comm)
            elif ent is not None and comm.whole_all_gather(output, input):   # a split shape's trial said whole
                return self._whole(name, (output, input), opts, comm)
        comm = self._braid_for([output, input])
        if comm is not None:
            return self._run(lambda a: comm.all_gather_into_tensor(output, input, async_op=a), opts, [output])
        return self._forward(name, output, input, opts)

    def _allgather_base(self, output, input, opts=None):           # torch <= 2.12
        return self._all_gather_single("_allgather_base", output, input, opts)

    def all_gather_single(self, output, input, opts=None):         # torch >= 2.13
        return self._all_gather_single("all_gather_single", output, input, opts)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None, timeout=None, op=None):
        """torch's forms: (outputs, input lists, opts), (output, inputs, op, timeout)."""
        if isinstance(output_tensors, torch.Tensor):
            output_tensors, input_tensors = [output_tensors], [list(input_tensors)]
            opts = _options(dist.ReduceScatterOptions, timeout, reduceOp=_reduce_op(opts if op is None else op))
        if profiler_on() and not self._recording:
            return self._recorded("reduce_scatter", list(_tensors_in(input_tensors)), self.reduce_scatter,
                                  output_tensors, input_tensors, opts)
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        op = _plain_op(opts.reduceOp)
        if len(output_tensors) == 1 and len(input_tensors) == 1 and self._reducible(output_tensors[0], op):
            out, ins = output_tensors[0], list(input_tensors[0])
            even = len(ins) == self._braid_size and all(
                isinstance(i, torch.Tensor) and i.numel() == out.numel() and i.dtype == out.dtype for i in ins)
            comm = self._braid_for([out] + ins) if even else None
            if comm is not None:
                return self._run(lambda a: comm.reduce_scatter(out, ins, op, async_op=a), opts, [out])
        return self._inner_reduction("reduce_scatter", (output_tensors, input_tensors), opts, list(output_tensors),
                                     [t for ts in input_tensors for t in ts])

    def _reduce_scatter_single(self, name, output, input, opts):
        if profiler_on() and not self._recording:
            return self._recorded("reduce_scatter_tensor", [input], self._reduce_scatter_single, name, output, input,
                                  opts)
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        if input.requires_grad:
            input = input.detach()      # as in _all_gather_single
        comm = self._comm
        if comm is not None:
            # as in _all_gather_single (the kept answer's facts: dtype, op, output elements)
            ent = comm.shortcuts.rs.get(input.numel())
            if (ent is not None and ent[3] and ent[0] is input.dtype and ent[1] == opts.reduceOp.op
                    and ent[2] == output.numel()):
                if (type(input) is torch.Tensor and type(output) is torch.Tensor and input.is_cuda is comm.cuda
                        and output.is_cuda is comm.cuda and input.is_contiguous() and output.is_contiguous()):
                    return self._whole_now(name, "reduce_scatter", output, input, opts, comm)
            elif ent is not None and comm.whole_reduce_scatter(output, input, opts.reduceOp.op):
                return self._whole(name, (output, input), opts, comm)
        op = _plain_op(opts.reduceOp)
        comm = self._braid_for([output, input]) if self._reducible(output, op) else None
        if comm is not None:
            return self._run(lambda a: comm.reduce_scatter_tensor(output, input, op, async_op=a), opts, [output])
        return self._inner_reduction(name, (output, input), opts, [output], [input])

    def _reduce_scatter_base(self, output, input, opts=None):       # torch <= 2.12
        return self._reduce_scatter_single("_reduce_scatter_base", output, input, opts)

    def reduce_scatter_single(self, output, input, opts=None):      # torch >= 2.13
        return self._reduce_scatter_single("reduce_scatter_single", output, input, opts)

    # torch's coalesced forms: the functional collectives (DTensor's redistribution, the whole
    # state dict of an FSDP2 model, tensor parallelism, compiled collectives) call these with one
    # pair or several; gloo's and NCCL's backend objects do not offer them to a Python group, so
    # each pair goes through the single call, and one Work waits for all of them
    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        return _together([self._all_gather_single("_allgather_base", o, i, opts) for o, i in zip(outputs, inputs)],
                         outputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced       # torch >= 2.13's name

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        return _together([self._reduce_scatter_single("_reduce_scatter_base", o, i, opts)
                          for o, i in zip(outputs, inputs)], outputs)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced   # torch >= 2.13's name

    def _all_to_all_single(self, name, output, input, output_split_sizes, input_split_sizes, opts):
        if profiler_on() and not self._recording:
            return self._recorded("all_to_all", [input], self._all_to_all_single, name, output, input,
                                  output_split_sizes, input_split_sizes, opts)
        if not isinstance(opts, dist.AllToAllOptions):     # None, or torch's form with a timeout
            opts = _options(dist.AllToAllOptions, opts)
        if input.requires_grad:
            input = input.detach()      # as in _all_gather_single
        comm = self._comm
        if (comm is not None and not output_split_sizes and not input_split_sizes
                and comm.whole_all_to_all(output, input)):
            return self._whole(name, (output, input, output_split_sizes, input_split_sizes), opts, comm)
        comm = self._braid_for([output, input])
        if comm is not None:
            osz = list(output_split_sizes) or None
            isz = list(input_split_sizes) or None
            return self._run(lambda a: comm.all_to_all_single(output, input, osz, isz, async_op=a), opts, [output])
        return self._forward(name, output, input, output_split_sizes, input_split_sizes, opts)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):   # torch <= 2.12
        return self._all_to_all_single("alltoall_base", output, input, output_split_sizes, input_split_sizes, opts)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):  # >= 2.13
        return self._all_to_all_single("all_to_all_single", output, input, output_split_sizes,
                                       input_split_sizes, opts)

    # point to point ---------------------------------------------------------------------------
    # torch's batch_isend_irecv coalesces only for its own ProcessGroup type: for this group it
    # issues the ops one by one, and two ranks that each isend and then irecv to the other hung in
    # NCCL (2 x H200, torch 2.11). So a GPU send/recv that goes to NCCL is queued, and the queue is
    # posted as one NCCL group when any of its Works is waited on or asked about, or before any
    # other call on this group: the ops of one batch_isend_irecv always go together. Large
    # messages that braid splits keep braid's own send/recv (its lanes start once both sides are
    # posted, in any order).
    def _p2p(self, sending: bool, tensors, peer: int, tag: int):
        # before the first collective made the Communicator, or with a tag: the inner group
        comm = self._comm if (self._comm is not None and tag == 0 and len(tensors) == 1) else None
        if comm is not None and self._braid_for(tensors) is not None:
            t = tensors[0]
            if not (t.is_cuda and comm.policy.native_for("send_recv", t.numel() * t.element_size())):
                self.flush_p2p()
                handle = comm.send(t, peer, async_op=True) if sending else comm.recv(t, peer, async_op=True)
                return BraidWork(handle, [t])
        if self.nccl is not None and any(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors):
            work = _QueuedWork(self, list(tensors))
            self._p2p_queue.append((sending, list(tensors), peer, tag, work))
            return work
        self.flush_p2p()
        return self._forward("send" if sending else "recv", tensors, peer, tag)

    def flush_p2p(self) -> None:
        """Post the queued GPU send/recv as one NCCL group (nothing to do when none is queued).

        NCCL matches a send to a recv on one communicator, and torch's NCCL group picks it by
        how the op was posted: inside a group, the communicator of all ranks; alone, one of the
        pair's own (unless the group was connected eagerly). What this queue holds when it is
        posted differs from rank to rank (a rank's earlier isend rides with its next send; its
        peer's recv may go alone), so a message could leave on one communicator and be awaited
        on the other, and both ranks hung (4 ranks, NCCL 2.28). Once every rank knows the
        communicator of all ranks exists (_connect_world, or a collective forwarded to NCCL),
        every post is a group, even of one op: each message travels on that communicator."""
        if not self._p2p_queue:
            return
        queue, self._p2p_queue = self._p2p_queue, []
        queue = self._copy_to_self(queue)
        if not queue:
            return
        dev = next(t.device for _, ts, _, _, _ in queue for t in ts if t.is_cuda)
        inner = self.nccl
        if len(queue) == 1 and not self._p2p_world:
            sending, ts, peer, tag, w = queue[0]
            w._posted(getattr(inner, "send" if sending else "recv")(ts, peer, tag))
            return
        self._p2p_world = True       # a group needs the communicator of all ranks: it exists now
        _coalescing(inner._start_coalescing, dev)
        try:
            for sending, ts, peer, tag, _ in queue:
                getattr(inner, "send" if sending else "recv")(ts, peer, tag)
        finally:
            group_work = _coalescing(inner._end_coalescing, dev)
        for *_, w in queue:
            w._posted(group_work)

    def _copy_to_self(self, queue: list) -> list:
        """A rank's sends to itself and its receives from itself in one queue, matched in order,
        as copies on the current stream: what NCCL does for them, without its communicator of all
        ranks (a batch of sends/recvs goes to that communicator, and making it needs every rank:
        one rank's batch to itself, torch's test_batch_isend_irecv_self_nccl, waited for a peer
        that never came). Returns the rest of the queue, in its order."""
        me = self._braid_rank
        sends = [q for q in queue if q[0] and q[2] == me]
        if not sends:
            return queue
        served = []
        for q in queue:
            if q[0] or q[2] != me or not sends:
                continue
            src, dst = sends[0][1], q[1]
            if len(src) != len(dst) or any(a.numel() != b.numel() or a.dtype != b.dtype for a, b in zip(src, dst)):
                break               # NCCL's own call says what is wrong with the pair
            with torch.no_grad():
                for d, a in zip(dst, src):
                    d.copy_(a.reshape(d.shape))
            served += [sends.pop(0), q]
        for q in served:
            q[4]._posted(_finished())
        return [q for q in queue if not any(q is s for s in served)]

    def _connect_world(self, device) -> None:
        """Make the inner NCCL group's communicator of all ranks now, on `device` (every rank
        calls this at the same call: braid's Communicator is made at the first collective), so
        that every later queued send/recv can travel on it (flush_p2p). Where torch connected
        it already (init_process_group's device_id), or a group of sends/recvs or a forwarded
        collective made it, nothing to do."""
        if self._p2p_world or getattr(self, "bound_device_id", None) is not None:
            self._p2p_world = True
            return
        connect = getattr(self.nccl, "eager_connect_single_device", None)
        try:
            if connect is not None:
                connect(device)
            else:                       # an older torch: a one-element all_reduce makes it
                t = torch.zeros(1, device=device)
                work = self.nccl.allreduce([t], dist.AllreduceOptions())
                if work is not None:
                    work.wait()
        except Exception as exc:    # NCCL's own error surfaces at the next call that needs it
            log.warning("braid backend: connecting the inner NCCL group failed (%s); its sends and "
                        "receives keep torch's choice of communicator", exc)
            return
        self._p2p_world = True

    def send(self, tensors, dstRank, tag=0):
        if profiler_on() and not self._recording:
            return self._recorded("send", tensors, self._p2p, True, tensors, dstRank, tag)
        return self._p2p(True, tensors, dstRank, tag)

    def recv(self, tensors, srcRank, tag=0):
        if profiler_on() and not self._recording:
            return self._recorded("recv", tensors, self._p2p, False, tensors, srcRank, tag)
        return self._p2p(False, tensors, srcRank, tag)

    def recv_anysource(self, tensors, tag=0):
        """recv from any source (dist.recv without src). Once braid's communicator exists, a
        peer's untagged send of a CPU tensor goes over braid's lanes, which match a receive to one
        named source: gloo's any-source receive would never see it. In a world of two ranks the
        source can only be the other rank, so braid receives from it; in a larger world braid
        cannot tell which peer will send and says so rather than wait forever."""
        if profiler_on() and not self._recording:
            return self._recorded("recvAnySource", tensors, self.recv_anysource, tensors, tag)
        comm = self._comm if (tag == 0 and len(tensors) == 1) else None
        if comm is not None and self._braid_for(tensors) is not None and not tensors[0].is_cuda:
            if self._braid_size != 2:
                from .errors import MisuseError
                raise MisuseError(
                    "recv from any source (no src) after braid's first collective works in a world of "
                    "2 ranks only: braid's send/recv match one named peer; pass src=, or a tag (tagged "
                    "send/recv go to gloo's own)")
            self.flush_p2p()
            peer = 1 - self._braid_rank
            return _AnySourceWork(comm.recv(tensors[0], peer, async_op=True), [tensors[0]], peer)
        return self._forward("recv_anysource", tensors, tag)

    def barrier(self, opts=None, timeout=None):
        """One round through the node segment on CPU ranks of one host, else on the inner gloo group. With braid's GPU lanes the current stream is drained
        first, so work queued before the barrier has finished, as after NCCL's barrier."""
        if profiler_on() and not self._recording:
            return self._recorded("barrier", (), self.barrier, opts)
        self.flush_p2p()
        comm = self._comm
        if comm is not None and getattr(comm, "cuda", False) and not comm.closed:
            torch.cuda.current_stream().synchronize()
        if comm is not None and not comm.closed and getattr(comm, "_cpu", None) is not None:
            # CPU ranks of one host: one round of stamps through the node segment
            comm._cpu_call("barrier", _EMPTY, comm._cpu.barrier, False)
            return _finished()
        bo = dist.BarrierOptions()
        if timeout is None:     # torch's forms: (opts), (timeout)
            timeout = opts if isinstance(opts, datetime.timedelta) else getattr(opts, "timeout", None)
        if timeout is not None:
            try:
                bo.timeout = timeout
            except (TypeError, AttributeError):
                pass
        return self.gloo.barrier(bo)

    # life cycle -------------------------------------------------------------------------------
    def _release(self, how: str) -> None:
        if self._closed:
            return
        self._closed = True
        self._take_back()
        self._handoff_every = 0
        self._p2p_queue = []                 # never posted: nothing of theirs is in flight
        comm, self._comm = self._comm, None
        if comm is not None and how == "abort":
            comm.abort("its process group was aborted")     # the peers learn it, waits are released
        if comm is not None:
            try:
                comm.close()
            except Exception as exc:     # shutting down: report, go on releasing
                log.warning("braid backend: closing the communicator failed: %s", exc)
        for inner in (self.nccl, self.gloo):
            fn = getattr(inner, how, None) if inner is not None else None
            if fn is not None:
                try:
                    fn()
                except Exception as exc:
                    log.debug("braid backend: inner %s failed: %s", how, exc)

    def shutdown(self) -> None:
        self._release("shutdown")

    def abort(self) -> None:
        self._release("abort")


# the hand-off's methods (torch's names in 2.11-2.13) -> the communicator's table of kept answers
_HANDED = {"allreduce": "ar", "_allgather_base": "ag", "all_gather_single": "ag",
           "_reduce_scatter_base": "rs", "reduce_scatter_single": "rs"}


def _forward_single(pg, slow, fn, keep: dict, comm, op: str):
    """The hand-off's all-gather or reduce-scatter (torch's (output, input, opts) form): a call of
    a shape in `keep` (input elements -> its facts as comm/shortcuts.py keeps them) goes to `fn`,
    the inner NCCL group's own method; anything else to `slow`, the class's method."""
    ledger, cuda, pending = comm.ledger, comm.cuda, comm._p2p_pending      # (the list itself: kept)
    reduce = op == "reduce_scatter"

    def forward(output, input, opts=None):
        f = keep.get(input.numel()) if type(input) is torch.Tensor else None
        if (f is not None and opts is not None and f[0] is input.dtype and f[-1] == output.numel()
                and (not reduce or f[1] == opts.reduceOp.op) and input.is_cuda is cuda and type(output) is torch.Tensor
                and output.is_cuda is cuda and not input.requires_grad and not pg._p2p_queue and not pending
                and not profiler_on() and input.is_contiguous() and output.is_contiguous()):
            ledger.last_handle = comm.library.done
            ledger.count((op, input.numel() * input.element_size(), input.dtype, "whole"))
            pg._forwarded += 1
            work = fn(output, input, opts)
            return work if work is not None else _finished()
        return slow(output, input, opts)
    return forward


def _forward_all_reduce(pg, slow, fn, keep: dict, comm, op: str):
    """The hand-off's all_reduce: torch's (tensors, opts) form with one tensor, as _forward_single."""
    ledger, cuda, pending = comm.ledger, comm.cuda, comm._p2p_pending      # (the list itself: kept)

    def forward(tensors, opts=None, op=None, timeout=None):
        if type(tensors) is list and len(tensors) == 1 and type(opts) is dist.AllreduceOptions and op is None \
                and timeout is None:
            t = tensors[0]
            f = keep.get(t.numel()) if type(t) is torch.Tensor else None
            if (f is not None and f[0] is t.dtype and f[1] == opts.reduceOp.op and t.is_cuda is cuda
                    and not t.requires_grad and not pg._p2p_queue and not pending and not profiler_on()
                    and t.is_contiguous()):
                ledger.last_handle = comm.library.done
                ledger.count(("all_reduce", t.numel() * t.element_size(), t.dtype, "whole"))
                pg._forwarded += 1
                work = fn(tensors, opts)
                return work if work is not None else _finished()
        return slow(tensors, opts, op, timeout)
    return forward


# the ops braid forwards whole: torch's method -> the name of its profiler record, and which
# positional argument holds its inputs (None: no tensors)
_FORWARDED = {"gather": ("gather", 1), "scatter": ("scatter", 1), "alltoall": ("all_to_all", 1),
              "allreduce_coalesced": ("all_reduce_coalesced", 0),
              "allgather_coalesced": ("all_gather_coalesced", 1),
              "monitored_barrier": ("monitored_barrier", None)}


def _forwarding(name: str):
    op, at = _FORWARDED[name]

    def method(self, *args, **kwargs):
        if profiler_on() and not self._recording:
            inputs = list(_tensors_in(args[at])) if at is not None and len(args) > at else []
            return self._recorded(op, inputs, self._forward, name, *args, **kwargs)
        return self._forward(name, *args, **kwargs)
    method.__name__ = name
    method.__doc__ = f"torch's {name}: braid has no version of its own; the inner gloo/NCCL group runs it."
    return method


for _name in _FORWARDED:
    setattr(BraidProcessGroup, _name, _forwarding(_name))


def _create(store, rank, world_size, timeout):
    """torch's factory hook. The default group is made before dist.is_initialized() turns True;
    later groups with this backend (new_group without a backend) are subgroups."""
    return BraidProcessGroup(store, rank, world_size, timeout, world=not dist.is_initialized())


def world_group() -> BraidProcessGroup | None:
    """The default process group when it is braid's, else None."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    pg = dist.distributed_c10d._get_default_group()
    return pg if isinstance(pg, BraidProcessGroup) else None


def register() -> None:
    """Register the "braid" backend with torch.distributed, and have torch's destroy_process_group
    close braid's communicators before it shuts their groups down (idempotent)."""
    if not dist.is_available():
        return
    _wrap_destroy()
    if NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(NAME, _create, devices=["cpu", "cuda"])


def _wrap_destroy() -> None:
    """torch.distributed.destroy_process_group (and distributed_c10d's, the same function) closes
    the braid communicators that use the groups it destroys first (comm/communicator.py
    close_before_destroy says why), then runs torch's own; on a machine with GPUs a watch says
    why where it has not returned in 10 s (comm/ledger.py TeardownWatch). Code that bound
    torch's function before braid was imported calls torch's alone."""
    c10d = dist.distributed_c10d
    if getattr(c10d.destroy_process_group, "_braid_wraps", None) is not None:
        return
    torch_destroy = c10d.destroy_process_group

    @functools.wraps(torch_destroy)
    def destroy_process_group(*args, **kwargs):
        from .comm.communicator import close_before_destroy
        if torch.cuda.is_available():
            TeardownWatch.start()       # a group's shutdown may wait for CUDA graphs (its doc says why)
        close_before_destroy(args[0] if args else kwargs.get("group"))
        return torch_destroy(*args, **kwargs)
    destroy_process_group._braid_wraps = torch_destroy
    c10d.destroy_process_group = destroy_process_group
    if getattr(dist, "destroy_process_group", None) is torch_destroy:
        dist.destroy_process_group = destroy_process_group


register()
