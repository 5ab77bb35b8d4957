"""Which NIC a GPU's next inter-node operation takes (FuseLink's policy). Pure; no torch.

    if the GPU's own NIC is idle for its owner:          send direct
    elif another GPU's NIC is idle and may be borrowed:  relay over NVLink to that GPU, send there
    else:                                                queue on the own NIC

"Idle" is FuseLink's test: a NIC is busy while its owner GPU has its own operations in flight (the
owner's completions seen since the last look). Borrowing a NIC is allowed only while
- its owner has no operation of its own on it (the owner's traffic takes priority: borrowed
  operations never count against the owner, and the owner's never wait for them),
- fewer than `max_borrowed_inflight` borrowed operations are in flight on it, and
- the relay GPU's buffer has room: borrowed bytes on it stay under `relay_mem_bytes`.
Among the NICs that may be borrowed the least loaded wins (fewest operations in flight, then
fewest borrowed bytes, then the lowest index), so choices are deterministic.

A GPU without a NIC of its own (4 NICs for 8 GPUs) has a home NIC, the one on its PCIe switch;
it is "own" for this policy but its owner is another GPU, whose traffic still comes first.

Rejected: choosing by measured NIC throughput (needs timing on the send path; FuseLink's
completion-count test is cheap and good enough when operations are of similar size).
"""
from __future__ import annotations

from dataclasses import dataclass

from . import checks
from .checks import MisuseError


@dataclass(frozen=True)
class NicState:
    nic: int
    owner: int                    # the GPU on whose PCIe switch the NIC sits
    owner_inflight: int = 0       # the owner's own operations in flight on it
    borrowed_inflight: int = 0    # other GPUs' operations in flight on it
    relay_bytes: int = 0          # bytes of borrowed operations buffered on the owner GPU now


@dataclass(frozen=True)
class NicPolicy:
    max_borrowed_inflight: int = 1
    relay_mem_bytes: int = 64 << 20
    direct_depth: int = 2         # the own NIC counts as idle below this many own operations in flight
    borrow: bool = True           # False: always the home NIC (one-path libraries)


@dataclass(frozen=True)
class NicChoice:
    nic: int
    relay: int | None             # the GPU whose buffer the bytes pass through, None when direct
    reason: str                   # "direct", "borrowed", "queued", "no-borrow"


def home_nic(gpu: int, nics: list[NicState]) -> NicState:
    """The GPU's own NIC, or the first NIC on its switch when it owns none."""
    own = [n for n in nics if n.owner == gpu]
    if own:
        return own[0]
    if not nics:
        raise MisuseError("choose_nic needs at least one NIC; pass one NicState per NIC of the node")
    below = [n for n in nics if n.owner <= gpu]
    return max(below, key=lambda n: n.owner) if below else min(nics, key=lambda n: n.owner)


def can_borrow(gpu: int, state: NicState, nbytes: int, policy: NicPolicy) -> bool:
    return (state.owner != gpu and state.owner_inflight == 0
            and state.borrowed_inflight < policy.max_borrowed_inflight
            and state.relay_bytes + nbytes <= policy.relay_mem_bytes)


def served_gpus(nics: list[NicState]) -> int | None:
    """How many GPUs (0..N-1) a NIC list serves, read from its owners: NICs spread evenly over the
    GPUs (NIC k on GPU k * gpus // nics), so the last owner serves up to the owners' spacing past
    itself. None for a single owner, whose spacing the list does not tell."""
    owners = sorted({n.owner for n in nics})
    if len(owners) < 2:
        return None
    return owners[-1] + min(b - a for a, b in zip(owners, owners[1:]))


def _check(gpu, nbytes, nics, num_gpus) -> None:
    if not isinstance(nics, (list, tuple)) or not nics:
        raise MisuseError(f"choose_nic: nics = {nics!r:.60} must be a non-empty list of NicState, one per NIC "
                          f"of the node")
    for i, n in enumerate(nics):
        if not isinstance(n, NicState):
            raise MisuseError(f"choose_nic: nics[{i}] = {n!r:.60} is not a NicState")
    checks.whole(gpu, "choose_nic: gpu", 0, "a GPU index of the node")
    top = served_gpus(nics) if num_gpus is None else checks.whole(num_gpus, "choose_nic: num_gpus", 1)
    if top is not None and gpu >= top:
        owners = sorted({n.owner for n in nics})
        raise MisuseError(f"choose_nic: gpu = {gpu}, but these NICs (on GPUs {owners}) serve GPUs 0..{top - 1}; "
                          f"pass a GPU of the node" + ("" if num_gpus is not None else
                                                       ", or num_gpus= if the node has more GPUs"))
    checks.real(nbytes, "choose_nic: nbytes", strict=False, hint="the operation's size in bytes")


def choose_nic(gpu: int, nbytes: int, nics: list[NicState], policy: NicPolicy = NicPolicy(),
               num_gpus: int | None = None) -> NicChoice:
    """The NIC for `gpu`'s next operation of `nbytes` (see the module docstring). gpu must be one
    of the GPUs the NICs serve: 0..num_gpus-1, or without num_gpus as far as the owners tell
    (`served_gpus`); nbytes >= 0; at least one NIC. Bad input raises MisuseError."""
    _check(gpu, nbytes, nics, num_gpus)
    home = home_nic(gpu, nics)
    relay_home = None if home.owner == gpu else home.owner
    mine = home.owner_inflight if home.owner == gpu else home.borrowed_inflight
    if mine < policy.direct_depth:
        return NicChoice(home.nic, relay_home, "direct")
    if not policy.borrow:
        return NicChoice(home.nic, relay_home, "no-borrow")
    free = [n for n in nics if n.nic != home.nic and can_borrow(gpu, n, nbytes, policy)]
    if free:
        best = min(free, key=lambda n: (n.borrowed_inflight, n.relay_bytes, n.nic))
        return NicChoice(best.nic, best.owner, "borrowed")
    return NicChoice(home.nic, relay_home, "queued")
