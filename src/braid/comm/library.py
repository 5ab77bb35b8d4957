"""The native library's own calls, taken whole: NCCL's on GPUs, gloo's on a CPU communicator.

A call the fast path gives the library whole goes to the backend object's own method (the
ProcessGroupNCCL behind the group) with an options object built once per kind, root, reduction
and async flag, as torch.distributed's wrapper would make the call but without the wrapper's
per-call checks (the fast path made them once per call shape). Where this torch exposes no
backend object, the caller's `fallback` (torch.distributed's own function) makes the call.

Rejected: the wrapper on every call (its argument checks and group lookups cost several
microseconds per call of the 26-50 us NCCL's own call takes on the host).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d   # the options classes

from ..errors import MisuseError
from ..executor import Handle

# the fast path's kinds as braid's op names (the call ledger speaks braid's names)
OP_OF = {"allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter",
         "alltoall": "all_to_all_single", "broadcast": "broadcast", "reduce": "reduce"}

_OPTS = {"allreduce": _c10d.AllreduceOptions, "reducescatter": _c10d.ReduceScatterOptions,
         "allgather": _c10d.AllgatherOptions, "alltoall": _c10d.AllToAllOptions,
         "broadcast": _c10d.BroadcastOptions, "reduce": _c10d.ReduceOptions}

OPTS_MAX = 256           # options objects kept before the cache starts over


class NativeDone(Handle):
    """last_handle after a synchronous whole call: the native library (or braid's shared-memory
    path on CPU tensors) took it, already waited."""

    def __init__(self, lane: str):
        super().__init__(native=None)
        self.native_lane = lane
        self._waited = True

    @property
    def shares(self) -> dict[str, float]:
        return {self.native_lane: 1.0}


def backend_of(group, device):
    """The backend object (ProcessGroupNCCL) behind `group` for `device`, when this torch exposes
    it and its methods; None otherwise (the calls then go through torch.distributed)."""
    try:
        be = group._get_backend(device)
    except Exception:                                   # noqa: BLE001 (any torch without it)
        return None
    need = ("allreduce", "_reduce_scatter_base", "_allgather_base", "alltoall_base", "broadcast", "reduce",
            "send", "recv")
    return be if all(hasattr(be, m) for m in need) else None


class LibraryCalls:
    """One communicator's whole calls to its native library.

    `group`: the process group they go to (on GPUs the default group when it is NCCL's: measured
    ~10 us per call faster at 1-4 MiB than a second communicator; else braid's own); `backend`:
    its backend object, or None; `ledger`: the call ledger, which counts each call.
    """

    def __init__(self, cuda: bool, group, backend, ledger):
        self.cuda, self.group, self.backend, self.ledger = cuda, group, backend, ledger
        self.lane = "nccl" if cuda else "gloo"
        self.done = NativeDone(self.lane)
        self._opts: dict = {}

    def opts(self, kind: str, async_op: bool, op=None, root: int = 0):
        """torch's options object for a call, built once per (kind, op, root, async)."""
        key = (kind, op, root, async_op)
        o = self._opts.get(key)
        if o is None:
            o = _OPTS[kind]()
            if op is not None:
                o.reduceOp = op
            if kind in ("broadcast", "reduce"):
                o.rootRank, o.rootTensor = root, 0
            if hasattr(o, "asyncOp"):
                o.asyncOp = async_op     # synchronous: NCCL runs on the caller's stream (torch >= 2.8)
            if len(self._opts) > OPTS_MAX:
                self._opts.clear()
            self._opts[key] = o
        return o

    def start(self, method: str, args: tuple, kind: str, async_op: bool, op=None, root: int = 0,
              fallback=None, counted: bool = False):
        """Count the call (unless `counted`: the caller's agreement did) and start it: the
        backend's `method` with cached options, or `fallback(async)` without a backend object
        (a CPU communicator's gloo call is always asynchronous there: it is waited in steps).
        Returns the library's Work (None for a synchronous NCCL call)."""
        x = args[1] if len(args) > 1 else (args[0][0] if type(args[0]) is list else args[0])
        if not counted:
            self.ledger.ncalls += 1
        self.ledger.last_call = (OP_OF[kind], x.numel() * x.element_size(), x.dtype, "whole")
        be = self.backend
        if be is None:
            return fallback(async_op or not self.cuda)
        return getattr(be, method)(*args, self.opts(kind, async_op, op, root))

    def point(self, tensor, peer: int, sending: bool, fallback_group):
        """A whole send or recv: the backend's own (tag 0, as torch's isend/irecv), else
        torch.distributed's on `fallback_group`."""
        be = self.backend
        if be is not None:
            return be.send([tensor], peer, 0) if sending else be.recv([tensor], peer, 0)
        g = fallback_group
        return dist.isend(tensor, group_dst=peer, group=g) if sending else dist.irecv(tensor, group_src=peer, group=g)


class CpuCalls:
    """Whole calls on CPU tensors through the node segment: `shm` (comm/cpushm.py's CpuShm: a CPU
    communicator's collectives, and a GPU communicator's CPU tensors in an area of their own) and
    a CPU communicator's send/recv (`p2p`, comm/cpup2p.py); either is None where the
    communicator has no such path. Such a call is the communicator's like any other: it checks
    that the communicator is open, starts the pending sends/recvs first (`pending`) and counts
    itself in the ledger. close() lets both go, before the segment does.

    A call the native pool took (CpuShm.native_run) is kept under its entry's key (the op, the
    tensors' sizes and dtypes, the reduction, the root): the next call of that key whose tensors
    are plain (contiguous dense CPU tensors, an output outside autograd) runs it again from what
    was kept (`replay`), past the entry's checks, the reduction's lookups and the layers between
    the entry and the native call: after the native call has left the caches to the data they
    cost 5-35 us of a 256 KiB-4 MiB call (2 ranks on 2 cores, 2026-12-07: the Python around a
    1-4 MiB call 32-71 us, replayed 18-41)."""

    KEPT_MAX = 256          # native calls kept before the cache starts over

    def __init__(self, shm, p2p, policy, check: bool, faults, pending, shm_lane, ledger):
        self.shm, self.p2p = shm, p2p
        self.policy, self.check, self.faults, self.pending = policy, check, faults, pending
        self.shm_lane, self.ledger = shm_lane, ledger
        self.done = NativeDone("shm")       # last_handle after a call here
        self._kept: dict = {}               # an entry's key -> (its NativeCall, its ledger record)
        self.replays = 0                    # calls run again from what was kept
        if shm is not None:
            shm.publish = ledger.publish    # before a late peer's round waits in Python (see replay)

    def ok(self, *tensors) -> bool:
        """This call may run whole through the segment: a communicator with that path, no
        explicit shares, plain contiguous CPU tensors."""
        if self.shm is None or self.policy.fixed is not None or self.check:
            return False
        for t in tensors:
            if type(t) is not torch.Tensor or t.is_cuda or not t.is_contiguous() or t.layout is not torch.strided:
                return False
        return True

    def enter(self, op: str, x: torch.Tensor) -> None:
        """Open, pending sends/recvs and the shm lane's earlier async calls first (they share
        the segment), then the call in the ledger."""
        self.faults.check_open()
        if self.pending:
            self.pending.flush()
        self._lane_done()
        self.ledger.enter(op, x, "shm")

    def _lane_done(self) -> None:
        """The shm lane's earlier async calls finished (they share the segment)."""
        last = getattr(self.shm_lane, "_last", None)
        if last:
            for lane_run in list(last.values()):
                if lane_run.thread is not None:
                    lane_run.thread.join()

    def call(self, op: str, x: torch.Tensor, run, async_op: bool, key=None):
        """Run `run()` (a CpuShm op) as the communicator's call (see enter). With `key` (the
        entry's, see replay), a native call it makes is kept for the next call of that key."""
        self.enter(op, x)
        if key is None:
            run()
        else:
            shm = self.shm
            shm.recording, shm.recorded = True, None
            try:
                run()
            finally:
                shm.recording = False
            if shm.recorded:
                if len(self._kept) >= self.KEPT_MAX:
                    self._kept.clear()
                self._kept[key] = (shm.recorded, self.ledger.last_call)
        self.ledger.last_handle = self.done
        return self.done if async_op else None

    def replay(self, key, out: torch.Tensor, inp: torch.Tensor | None):
        """The call of `key` run again as the native call kept for it, with this call's tensors
        (`inp` None: an all_reduce or reduce of `out` in place); its handle, or None where none
        is kept or this call needs the full path: a tensor that is not a contiguous dense CPU
        tensor, an output that requires grad or is an inference tensor (the full path writes it
        in the mode those need), shares fixed since, or sends/recvs pending (the full path moves
        them first). The key holds what decided the path (op, sizes, dtypes, reduction, root),
        so the checks the entry made for the kept call hold for this one."""
        kept = self._kept.get(key)
        if kept is None:
            return None
        if (out.requires_grad or out.is_inference() or not out.is_contiguous() or out.layout is not torch.strided
                or (inp is not None and (type(inp) is not torch.Tensor or inp.is_cuda or not inp.is_contiguous()
                                         or inp.layout is not torch.strided))
                or self.policy.fixed is not None or self.pending or (self.p2p is not None and self.p2p.pending)):
            return None
        self.faults.check_open()
        self._lane_done()
        c, record = kept
        # counted, not published: the watchdog publishes the count a few times a second, and a
        # round the C code hands to Python (a late peer) publishes before it waits (CpuShm.publish);
        # a peer reads a count that lags, never one ahead (2 ranks on 2 cores, 2026-12-07: the
        # publish cost 4-18 us of a 256 KiB-16 MiB call, the native call having left the caches cold)
        self.ledger.count(record)
        self.replays += 1
        self.shm.native_run(c, out, inp)
        self.ledger.last_handle = self.done
        return self.done

    def reduction(self, op, dtype) -> tuple[str, float] | None:
        """(name, factor) where the segment's whole call reduces this op and dtype; None: the
        full path (which also explains what braid cannot reduce)."""
        red = self.shm.reduction(op)
        if red is None:
            return None
        try:
            self.shm.checked(dtype, red[0], "all_reduce")     # kept once accepted
        except MisuseError:
            return None
        return red

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()        # its views of the segment go before the segment does
            self.shm = None
        if self.p2p is not None:
            self.p2p.close()
            self.p2p = None
