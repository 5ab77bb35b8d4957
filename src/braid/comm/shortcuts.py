"""Whole or split, per call shape: the one place the hot path decides it.

Most calls of a job go to the native library whole (NCCL on GPUs, gloo on a CPU communicator):
every small message, every size the calibration leaves to it, and each shape the job's own trial
sent back (comm/arbiter.py). Such a call must cost a few Python steps besides that library's own
call, so the answer is worked out once per call shape with the full checks and kept:

    table[op][element count] = (the shape's other facts..., whole?)

until it may change: fixed shares, a new calibration, close, an abort (clear()).

Two callers ask about the same call. Under init_process_group("braid") the backend asks first
(answer): "whole" forwards torch's call to the inner NCCL group with torch's own options and Work.
Otherwise the op itself asks (decide), and fills the table for a shape not seen yet. A shape the
calibration splits is on trial: the arbiter counts every call of it once, so a "split" the backend
was told is handed to the op's own question (`said`) instead of being asked again.

Each op gives, at its two call sites (its own path and the backend's CallPath.whole_*), the key
into its table and the facts the entry must match (every call), and in Communicator._rest_* what only
a call the entry does not settle needs: whether the native call can take the shape at all
(`valid`), the op's name and bytes for the calibration, and the arbiter's key (None: the op has
no in-job trial, as reduce). A shape the entry says is whole costs one lookup.
"""
from __future__ import annotations

from threading import get_ident

MAX_SHAPES = 1024       # entries per op before its table starts over
# how many of an entry's leading facts the arbiter's key of the shape holds after (op, elements):
# all_reduce and reduce-scatter (dtype, op), all-gather (dtype) (the communicator's _rest_* keys)
_KEY_FACTS = {"ar": 2, "rs": 2, "ag": 1}


class Shortcuts:
    """The kept whole-or-split answers of a communicator, and the arbiter's hand-off."""

    OPS = ("ar", "rs", "ag", "bc", "rd", "a2a", "a2av")

    def __init__(self, native_for, arbiter, usable):
        # native_for(op name, bytes): the calibration's answer (NCCL/gloo whole?);
        # usable(): the communicator is neither closed nor aborted
        self.native_for, self.arbiter, self.usable = native_for, arbiter, usable
        self.ar: dict = {}
        self.rs: dict = {}
        self.ag: dict = {}
        self.bc: dict = {}
        self.rd: dict = {}       # reduce: no in-job trial (its rest's key is None)
        self.a2a: dict = {}
        self.a2av: dict = {}     # uneven all_to_all: (in, out elements) -> shape facts (comm/routing.py)
        self.learn = False       # shapes the calibration splits go on trial (Communicator._learn_update)
        self.said = None         # the arbiter's key of a "split" the backend was told for this call
        self.redo_thread = 0     # the rounds thread while it rebuilds a deferred call (comm/rounds.py)
        self.on_clear = None     # called when the answers are cleared (the backend's hand-off: backend.py)

    def rebuilding(self) -> bool:
        """Is the calling thread the rounds thread rebuilding a deferred call?"""
        return bool(self.redo_thread) and self.redo_thread == get_ident()

    def table(self, op: str) -> dict:
        return getattr(self, op)

    def put(self, op: str, n, facts: tuple, whole: bool) -> tuple:
        """Keep the answer for a shape: `facts` then whole (never once closed or aborted)."""
        table = getattr(self, op)
        if len(table) >= MAX_SHAPES:
            table.clear()
        ent = table[n] = facts + (bool(whole) and self.usable(),)
        return ent

    def clear(self) -> None:
        for op in self.OPS:
            getattr(self, op).clear()
        if self.on_clear is not None:
            self.on_clear()

    def settled(self, op: str) -> dict:
        """The shapes of `op` (ar, rs, ag) whose calls go whole now without a trial under way:
        element count -> the entry's facts; kept whole, or split by the calibration and sent back
        whole by the arbiter's last verdict."""
        in_key = _KEY_FACTS[op]
        out = {}
        for n, ent in list(getattr(self, op).items()):
            facts = ent[:-1]
            if ent[-1] or (self.learn and self.arbiter.settled_whole((op, n) + facts[:in_key])):
                out[n] = facts
        return out

    def decide(self, op: str, n: int, facts: tuple, rest, *args) -> bool:
        """The op's own question: True when this call goes to the native library whole. A shape
        whose entry says whole costs one lookup, as does one it says split while no trial runs;
        otherwise `rest(*args)` gives (valid, the op's name, its bytes, the arbiter's key), and a
        shape not seen yet is worked out from them (valid and the calibration's answer). The
        rounds thread rebuilding a deferred call (its trial step was counted when the call was
        made) is told split."""
        if self.redo_thread and self.rebuilding():
            return False
        ent = getattr(self, op).get(n)
        if ent is not None and ent[:-1] == facts:
            if ent[-1]:
                return True
            if not self.learn:
                return False        # split, and no trial to count: nothing more to ask
        valid, name, nbytes, key = rest(*args)
        if ent is None or ent[:-1] != facts:
            ent = self.put(op, n, facts, valid and self.native_for(name, nbytes))
            if ent[-1]:
                return True
        if not (self.learn and valid) or key is None:
            return False
        said, self.said = self.said, None
        if said is not None and said == key:
            return False            # the backend asked for this call already: split
        return self.arbiter.whole(key)

    def answer(self, op: str, n: int, facts: tuple, rest, *args) -> bool:
        """The backend's question, before the op's: True forwards the call whole. A shape not
        seen yet answers False (the op's own path fills its entry in, the same on every rank)."""
        ent = getattr(self, op).get(n)
        if ent is None or ent[:-1] != facts:
            return False
        if ent[-1]:
            return True
        if not self.learn:
            return False
        valid, _, _, key = rest(*args)
        if not valid:
            return False
        if self.arbiter.whole(key):
            return True
        self.said = key
        return False
