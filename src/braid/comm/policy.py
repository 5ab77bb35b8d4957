"""The split policy: which lanes take a call, and with what shares.

It owns what decides that: the calibration's lane costs and measured verdicts, shares fixed by a
test, the calibration or the bench, the online balancer (stage 2: shares moved toward equal finish
from the slowest rank's lane times) with the last split call of each op waiting to report, and the
per-shape caches of these answers. Every rank holds one and makes the same answers from the same
inputs (the same table, the same agreed observations), which the prepared calls and the fast path
rely on. The communicator asks it and never keeps copies of its state.

Rejected: this state as attributes of the communicator read by six mixins (a new calibration had
to clear caches in three files, and a fake communicator in a test had to know which attributes
each mixin read).
"""
from __future__ import annotations

import hashlib
import json
import math

from .. import envs
from ..errors import LaneUnavailableError
from ..planner.balancer import OnlineBalancer
from ..planner.model import LaneCost, choose_with_native

# Lane costs before any calibration (orders of magnitude from device probes on 4 x H200,
# 2026-11-22; CPU: a guess the calibration replaces). Bandwidth is the op's algorithm bandwidth on
# that lane alone.
DEFAULT_COSTS = {
    "ce": LaneCost(12.0, 360.0), "nccl": LaneCost(10.0, 320.0), "host": LaneCost(30.0, 30.0),
    "gloo": LaneCost(150.0, 1.0), "shm": LaneCost(60.0, 2.0),
}

CACHE_MAX = 4096         # answers kept per cache before it starts over
# With BRAID_NEAR_TRIAL set, the copy engines go on trial in the job where NCCL won alone by less
# than that factor (the calibration's times of both alone, per size bucket): in a training step
# NCCL's kernels share the SMs with the compute and the copy engines do not. The job's own trial
# (comm/arbiter.py) keeps them only where its steps go faster. Off by default: on 2 x H200
# (2026-11-27) DDP's and FSDP2's shapes were on trial from the calibration's own verdicts already
# and every trial sent them whole, though DDP with every bucket forced onto the copy engines ran
# 1.11-1.13x NCCL's steps (docs/design.md, "The trials' clock").
NEAR_OPS = ("all_reduce", "reduce_scatter", "all_gather")


class SplitPolicy:
    """Shares per call for one communicator.

    `lanes_here()`: the lanes usable for the communicator's own device; `unavailable` and `wanted`:
    the communicator's lanes that cannot run and the lanes asked for (None: all), for the errors;
    `hier`: the multi-node steps (None on one node), which take some calls from the native path.
    """

    def __init__(self, world_size: int, cuda: bool, check: bool, lanes_here, unavailable: dict[str, str],
                 wanted: set[str] | None, hier=None):
        self.world_size, self.cuda, self.check = world_size, cuda, check
        self.lanes_here, self._unavailable, self._wanted, self._hier = lanes_here, unavailable, wanted, hier
        self.fixed: dict[str, dict[str, float]] | None = None   # op (or "*") -> shares (fixed_shares)
        # fixed_shares(..., timed=True): every split call posts its lanes and times them (the
        # calibration's balancing reads their times), none replays a program
        self.lane_timing = False
        self.calib: dict[str, dict[str, LaneCost]] = {}         # "op/world" -> lane -> cost
        self.pays: dict[str, dict[int, bool | str | dict]] = {}  # "op/world" -> log2 bucket -> verdict
        self.timed: dict[str, dict[int, dict]] = {}             # "op/world" -> log2 bucket -> lane -> us
        # the job's trials are on (Communicator._learn_update): NCCL's near wins go to them
        self.near_trials = False
        self.near_factor = envs.get("BRAID_NEAR_TRIAL") if cuda else 0.0
        self.digest = "default"                                  # the table's identity (descriptors, words)
        self.balancer = OnlineBalancer()
        # what the calibration has not measured: the built-in model's split (CPU lanes, or on GPUs
        # with BRAID_SPLIT_UNMEASURED=1), else the native library whole
        self.model_unmeasured = not cuda or bool(envs.get("BRAID_SPLIT_UNMEASURED"))
        self.adapt = True                   # stage 2 on; False freezes the shares at the model's
        self.pending: dict[str, tuple] = {}  # op -> (bucket key, shares used, handle) of its last split call
        self._share_cache: dict = {}
        self._native_cache: dict = {}

    # the table and fixed shares -------------------------------------------------------------------
    def set_table(self, table: dict) -> None:
        """Take a calibration table (`calibrate.load`'s form); the answers start over and so does
        stage 2 (its shares moved from the old table's)."""
        self.pays = {op[: -len("/pays")]: {int(b): v if isinstance(v, (str, dict)) else bool(v) for b, v in t.items()}
                     for op, t in table.items() if op.endswith("/pays")}
        self.timed = {op[: -len("/timed")]: {int(b): dict(v) for b, v in t.items() if isinstance(v, dict)}
                      for op, t in table.items() if op.endswith("/timed")}
        self.calib = {op: {k: LaneCost(**v) if isinstance(v, dict) else v for k, v in lanes.items()}
                      for op, lanes in table.items() if not op.endswith(("/pays", "/timed"))}
        text = json.dumps({"costs": {op: {k: c.to_dict() for k, c in v.items()} for op, v in self.calib.items()},
                           "pays": self.pays}, sort_keys=True)
        self.digest = hashlib.sha1(text.encode()).hexdigest()[:12] if self.calib else "default"
        self._share_cache.clear()       # (keyed by the digest too, but what decides them may have
        self._native_cache.clear()      # changed with the same digest: model_unmeasured)
        self.balancer = OnlineBalancer()
        self.pending.clear()

    def set_fixed(self, fixed: dict[str, dict[str, float]] | None) -> None:
        self.fixed = fixed
        self._native_cache.clear()

    def fixed_for(self, op: str) -> dict[str, float] | None:
        """The shares fixed for `op` (or for every op), None where braid chooses."""
        if self.fixed is None:
            return None
        return self.fixed.get(op, self.fixed.get("*"))

    # shares ---------------------------------------------------------------------------------------
    def shares_for(self, op: str, nbytes: int, lanes: list[str]) -> dict[str, float]:
        if not lanes:
            raise LaneUnavailableError(f"{op}: no lane can move these tensors here "
                                       f"(unavailable: {self._unavailable}, BRAID_LANES={self._wanted})")
        fixed = self.fixed_for(op)
        if fixed is not None:
            missing = [k for k, v in fixed.items() if v > 0 and k not in lanes]
            if missing:
                raise LaneUnavailableError(f"{op}: lanes {missing} were asked for but are not available here: "
                                           f"{ {k: self._unavailable.get(k, 'not usable for this device') for k in missing} }")
            return {k: v for k, v in fixed.items() if v > 0}
        key = (op, nbytes, tuple(lanes), self.digest, self.near_trials)
        shares = self._share_cache.get(key)
        if shares is None:
            table = self.calib.get(f"{op}/{self.world_size}", {})
            costs = {k: table.get(k, DEFAULT_COSTS[k]) for k in lanes}
            shares = self.split_rule(op, costs, nbytes)
            if not self.model_unmeasured and not self.pays.get(f"{op}/{self.world_size}"):
                verdict = set(shares) <= {"nccl", "gloo"}     # nothing measured: the native library whole
            elif len(shares) > 1:
                verdict = self.split_verdict(op, nbytes)
            elif set(shares) <= {"nccl", "gloo"}:
                # the model keeps NCCL alone: a lane measured faster alone in this size bucket
                # (or in both buckets around it) replaces it; nothing else overrides the model
                verdict = self.split_verdict(op, nbytes, exact=True)
                verdict = verdict if isinstance(verdict, str) else True
            else:
                verdict = True
            if isinstance(verdict, dict):               # the split, balanced at calibration
                if len(shares) > 1 and set(verdict) <= set(lanes):
                    shares = dict(verdict)
            elif isinstance(verdict, str) and verdict in lanes:
                shares = {verdict: 1.0}                 # a lane alone measured fastest here
            elif verdict is not True and ("nccl" in lanes or "gloo" in lanes):
                shares = {next(k for k in ("nccl", "gloo") if k in lanes): 1.0}
            if set(shares) == {"nccl"} and "ce" in lanes and self.near(op, nbytes):
                shares = {"ce": 1.0}                    # on trial in the job (near)
            if len(self._share_cache) > CACHE_MAX:
                self._share_cache.clear()
            self._share_cache[key] = shares
        if len(shares) > 1 and self.adapt:
            bkey = self.bucket(op, nbytes, shares)
            self.balancer.start(bkey, shares)
            return self.balancer.shares(bkey)
        return shares

    def split_verdict(self, op: str, nbytes: int, exact: bool = False) -> bool | str | dict:
        """The calibration's verdict for the nearest measured size bucket (with `exact`, only this
        size's own bucket): True (nothing measured, or an old table's split), the split's shares as
        balanced there (a dict: the split measured fastest), False (the native lane alone), or the
        name of the lane that alone measured fastest (`calibrate.split_pays`; with `exact`, also
        a lane that measured fastest alone in both buckets around this one)."""
        pays = self.pays.get(f"{op}/{self.world_size}")
        if not pays:
            return True
        b = max(0, int(math.log2(max(nbytes, 1))))
        if exact:
            if b in pays:
                return pays[b]
            # between two measured buckets that named the same lane alone: that lane
            below, above = pays.get(b - 1), pays.get(b + 1)
            return below if isinstance(below, str) and below == above else True
        nearest = min(pays, key=lambda m: (abs(m - b), -m))
        return pays[nearest]

    def near(self, op: str, nbytes: int) -> bool:
        """Does the copy engines' call of `op` at this size go on trial in the job? Only while the
        job's trials are on, on GPUs, where the calibration timed NCCL and the copy engines alone
        in the nearest size bucket and NCCL won by less than BRAID_NEAR_TRIAL."""
        if not (self.near_trials and self.cuda and self.near_factor and op in NEAR_OPS):
            return False
        timed = self.timed.get(f"{op}/{self.world_size}")
        if not timed:
            return False
        b = max(0, int(math.log2(max(nbytes, 1))))
        t = timed[min(timed, key=lambda m: (abs(m - b), -m))]
        nccl, ce = t.get("nccl"), t.get("ce")
        return bool(nccl and ce and ce <= self.near_factor * nccl)

    def set_near_trials(self, on: bool) -> bool:
        """The job's trials on or off; True when that changed the answers (cached answers of
        other parts must go too)."""
        if on == self.near_trials:
            return False
        self.near_trials = on
        self._native_cache.clear()
        return True

    def split_rule(self, op: str, costs: dict[str, LaneCost], nbytes: int) -> dict[str, float]:
        """Shares from lane costs. braid's broadcast lanes are stars from the root (every peer
        reads the root), which only pays for 2 ranks; beyond that the copy engines sit out."""
        exclude = ("ce",) if op == "broadcast" and self.world_size > 2 else ()
        return choose_with_native(costs, nbytes, "nccl", exclude,
                                  single_ok=op in ("all_reduce", "reduce_scatter"),
                                  native_share=op == "all_reduce" and self.cuda)

    def native_ok(self, shares: dict[str, float]) -> bool:
        """One lane that is a library of its own (NCCL, gloo): call its collective directly."""
        return len(shares) == 1 and next(iter(shares)) in ("nccl", "gloo") and not self.check

    def native_for(self, op: str, nbytes: int) -> bool:
        """Cached: will this op at this size go to the native library's own call (NCCL on GPUs,
        gloo on CPU communicators)? (the small-message fast path)"""
        if self.check:
            return False
        if self._hier is not None and self._hier.wants(op, nbytes):
            return False              # node steps and rail steps (comm/hier.py)
        if self.fixed is not None:
            if not self.cuda:
                return False          # CPU: fixed shares drive the lanes themselves (the tests)
            # shares fixed to NCCL alone (the calibration timing it): NCCL's own call, as a
            # whole call takes it, so that NCCL is timed as users get it
            only = {k: v for k, v in (self.fixed_for(op) or {}).items() if v > 0}
            return self.native_ok(only) and next(iter(only)) in self.lanes_here()
        key = (op, nbytes, self.digest, self.near_trials)
        hit = self._native_cache.get(key)
        if hit is None:
            lanes = self.lanes_here()
            # a world of one rank has nothing to split: the native library's call is a local copy
            hit = bool(lanes) and (self.world_size == 1 or self.native_ok(self.shares_for(op, nbytes, lanes)))
            if len(self._native_cache) > CACHE_MAX:
                self._native_cache.clear()
            self._native_cache[key] = hit
        return hit

    # stage 2: the balancer's observations -------------------------------------------------------
    @staticmethod
    def bucket(op: str, nbytes: int, shares: dict[str, float]) -> tuple:
        return OnlineBalancer.bucket(op, nbytes) + (tuple(sorted(shares)),)

    def balancer_key(self, op: str, nbytes: int, lanes: list[str]):
        """The balancer bucket of this call: keyed by the model's split for it (the balancer may
        have parked a lane since, so the shares in use can name fewer lanes)."""
        model = self._share_cache.get((op, nbytes, tuple(lanes), self.digest, self.near_trials))
        return self.bucket(op, nbytes, model) if model and len(model) > 1 else None

    def note_pending(self, op: str, size: int, agreed: list[str], shares: dict[str, float], handle) -> None:
        """Keep a split call's handle: the next split call reports its lane times to the balancer."""
        if not self.adapt or self.fixed_for(op) is not None:
            return
        bkey = self.balancer_key(op, size, agreed)
        if bkey is not None and (len(shares) > 1 or self.balancer.parked(bkey)):
            self.pending[op] = (bkey, dict(shares), handle)

    def observation(self, op: str):
        """The last split call of this op, if it has finished here: (bucket, shares, lane times)."""
        pending = self.pending.pop(op, None)
        if pending is None:
            return None
        bkey, used, handle = pending
        if not handle.is_completed():
            return None
        return [list(bkey[:2]) + [list(bkey[2])], used, handle.lane_times_us()]

    def learn(self, descs: list) -> None:
        """Feed the balancer the slowest rank's lane times of the previous split call, when every
        rank reported it (so every rank makes the same move)."""
        obs = [d.get("obs") for d in descs if d is not None]
        if not obs or any(o is None for o in obs):
            return
        first = obs[0]
        if any(o[0] != first[0] or o[1] != first[1] for o in obs):
            return
        bkey = (obs[0][0][0], obs[0][0][1], tuple(obs[0][0][2]))
        times = {k: max(o[2].get(k, 0.0) for o in obs) for k in obs[0][1]}
        self.balancer.observe(bkey, obs[0][1], times)
