"""Whole calls to the native library (braid.comm.library) on their own, with a fake backend."""
from __future__ import annotations


def test_whole_calls_count_in_the_ledger_and_reuse_their_options():
    """A whole call counts itself once (not when its agreement counted it),
    names itself in braid's op names, and goes to the backend object's own method with an options
    object built once per shape; without a backend object, torch.distributed's function."""
    import torch
    import torch.distributed as dist

    from braid.comm.ledger import CallLedger
    from braid.comm.library import LibraryCalls

    seen = []

    class Backend:
        def allreduce(self, tensors, opts):
            seen.append(("allreduce", tensors, opts))
            return "work"

        def send(self, tensors, peer, tag):
            seen.append(("send", peer, tag))
            return "sent"

    ledger = CallLedger(0, True, None)
    lib = LibraryCalls(True, "group", Backend(), ledger)
    t = torch.ones(6, dtype=torch.bfloat16)
    assert lib.start("allreduce", ([t],), "allreduce", False, op=dist.ReduceOp.SUM) == "work"
    assert ledger.ncalls == 1 and ledger.last_call == ("all_reduce", 12, torch.bfloat16, "whole")
    lib.start("allreduce", ([t],), "allreduce", False, op=dist.ReduceOp.SUM, counted=True)
    assert ledger.ncalls == 1                                 # counted by its agreement already
    assert seen[0][2] is seen[1][2] and seen[0][2].reduceOp == dist.ReduceOp.SUM
    assert lib.point(t, 1, True, "group") == "sent" and seen[-1] == ("send", 1, 0)
    assert lib.done.shares == {"nccl": 1.0} and lib.done.is_completed()
    cpu = LibraryCalls(False, "gloo group", None, ledger)
    got = []
    assert cpu.start("allreduce", ([t],), "allreduce", False, fallback=lambda a: got.append(a) or "w") == "w"
    assert got == [True] and ledger.ncalls == 2               # gloo's call: always async, waited in steps
    assert cpu.done.shares == {"gloo": 1.0}
