"""What braid's reductions accept and compute: every reducing collective x dtype x ReduceOp.

The table: all_reduce, reduce, reduce_scatter_tensor and reduce_scatter (list) x every dtype
braid reduces (REDUCE_DTYPES) and a few it need not (bool, int16, uint16, complex64) x SUM,
PRODUCT, MIN, MAX, AVG, PREMUL_SUM (`dist._make_nccl_premul_sum`; the direct API also takes
`braid.PremulSum`), BAND, BOR, BXOR. Each cell runs in worlds of 2 and 3 ranks, through
`dist.*` on backend "braid", through `dist.*` on a subgroup of backend "braid" (whose calls
braid's inner gloo group runs, with braid's semantics) and through braid's direct API
(`braid.all_reduce`... over a gloo default group), on fresh random data (a new seed each run unless BRAID_SEMANTICS_SEED is set;
a failure names it) at two odd sizes, on braid's three CPU paths: 7 elements per rank on its shm
lane, 65,537 split over its gloo and shm lanes, and 7 under a calibration that gives gloo's own
collective the call whole (each 7-element call is made twice: braid's backend hands a repeated
call shape straight to gloo); a subgroup's calls, 7 and 65,537 elements, all go to the inner group.

Every rank builds the other ranks' inputs that its result is reduced from (for reduce_scatter,
their chunk for it) from the seed, so the reference is computed locally from all ranks' inputs
with plain torch ops, not by a collective. The reference is NCCL's arithmetic:
- integer SUM and PRODUCT wrap around in the tensor's type; integer AVG is that wrapped sum
  divided with truncation toward zero (`torch.div(sum, n, rounding_mode="trunc")`), as NCCL
  computes it, and as frameworks that send int64 AVG to any backend not named "gloo" expect;
- bool SUM and MAX are a logical or, PRODUCT and MIN a logical and (torch's NCCL backend maps
  them so); bitwise ops (which NCCL lacks) are the bitwise reduction;
- float SUM, MIN, MAX and PRODUCT are compared bit for bit (the data are quarter steps, and
  +-{0.5, 1, 1.5, 2} for products, so every order of evaluation gives the same float); AVG and
  PREMUL_SUM within (world + 1) units of the dtype's epsilon at the data's scale, since NCCL
  scales before summing and braid divides after.
`reduce` is checked on the root only.

What must be accepted: what NCCL accepts and braid claims: SUM/PRODUCT/MIN/MAX/AVG on every
REDUCE_DTYPES dtype (integer AVG included) and PREMUL_SUM on its floating dtypes. Every other
cell may be accepted (then its values are checked like the rest) or refused. A refusal that
comes from braid (braid's code is on the traceback; refusals by torch's own front end, such as
PRODUCT of a complex tensor, are only recorded) must say which reduction op and dtype it
refuses and what to use instead, and must not name another backend (gloo, NCCL): a braid user
did not ask for those. Every rank must reach the same verdict on every call.

`python3 scripts/semantics_table.py` runs this module and writes docs/semantics.md from the
records (BRAID_SEMANTICS_JSON names the file the records are written to).

The second part checks that collectives never touch autograd: in-place results on leaves that
require grad, on non-leaves, on views of leaves taken under no_grad, on inference tensors;
create_graph=True backward through DDP on braid (compared with gloo); torch.func.grad while braid
is initialised.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import random
import re
import traceback

import pytest
import torch

from conftest import concurrently, free_port, run_world

ENV = {"BRAID_MIN_SPLIT_KB": "1", "CUDA_VISIBLE_DEVICES": ""}

COLLECTIVES = ("all_reduce", "reduce", "reduce_scatter_tensor", "reduce_scatter")
CLAIMED = ("float32", "float16", "bfloat16", "float64", "int8", "int32", "int64", "uint8")
EXTRA = ("bool", "int16", "uint16", "complex64")
DTYPES = CLAIMED + EXTRA
OPS = ("SUM", "PRODUCT", "MIN", "MAX", "AVG", "PREMUL_SUM", "BAND", "BOR", "BXOR")
DIRECT_ONLY_OPS = ("braid.PremulSum",)
# "backend": dist.* on the default group of backend braid; "subgroup": dist.* on a group of all
# ranks made by dist.new_group(backend="braid") (world of 2) or dist.new_group() (world of 3: the
# default backend), whose calls braid's inner gloo group runs; "direct": braid.* over gloo
APIS = ("backend", "subgroup", "direct")
WORLDS = (2, 3)
# (calibration, elements per rank (reduce_scatter: per output)) of each call of a cell. "model":
# braid's built-in lane model (7 elements on its shm lane, 65,537 split over gloo + shm); "whole":
# a calibration under which gloo's own collective takes small calls whole (braid's forwarding
# path). 7 elements come twice in each: the backend hands a repeated call shape straight to gloo.
CALLS = (("model", 7), ("model", 7), ("model", 65_537), ("whole", 7), ("whole", 7))
# a subgroup's calls all go to the inner group: no lanes, no calibration
SUBGROUP_CALLS = (("inner", 7), ("inner", 65_537))
# lane costs (calibration format) that give gloo's own collective every call below ~100 KB
WHOLE_LANES = {"gloo": {"latency_us": 10.0, "bw_gbps": 1.0, "floor_us": 10.0},
               "shm": {"latency_us": 100.0, "bw_gbps": 10.0, "floor_us": 100.0}}
CAL_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all_single", "reduce", "send_recv")
PREMUL_FACTOR = 1.25
SEED = int(os.environ.get("BRAID_SEMANTICS_SEED") or random.SystemRandom().randrange(1 << 31))

# words that name each reduction in a refusal message
OP_WORDS = {"SUM": ("sum",), "PRODUCT": ("product", "prod"), "MIN": ("min",), "MAX": ("max",),
            "AVG": ("avg", "average", "mean"), "PREMUL_SUM": ("premul",), "braid.PremulSum": ("premul",),
            "BAND": ("band", "bitwise and"), "BOR": ("bor", "bitwise or"), "BXOR": ("bxor", "bitwise xor")}
OTHER_BACKENDS = re.compile(r"gloo|nccl", re.IGNORECASE)
ADVICE = re.compile(r"\buse\b|instead|supported", re.IGNORECASE)


def ops_for(api: str) -> tuple:
    return OPS + (DIRECT_ONLY_OPS if api == "direct" else ())


def calls_for(api: str) -> tuple:
    return SUBGROUP_CALLS if api == "subgroup" else CALLS


def _modes(api: str) -> list:
    return list(dict.fromkeys(cal for cal, _ in calls_for(api)))


def must_accept(dtype: str, op: str) -> bool:
    """NCCL takes the cell and braid claims the dtype."""
    if dtype not in CLAIMED:
        return False
    if op in ("SUM", "PRODUCT", "MIN", "MAX", "AVG"):
        return True
    if op in ("PREMUL_SUM", "braid.PremulSum"):
        return getattr(torch, dtype).is_floating_point
    return False


# ---------------------------------------------------------------------------------------------
# data and references (pure functions of the seed: every rank computes every rank's data)
# ---------------------------------------------------------------------------------------------

def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:8], "little") >> 1)


def make_data(dtype: torch.dtype, op: str, n: int, g: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype.is_complex:
        re_, im = (torch.randint(-32, 32, (n,), generator=g).double() / 4 for _ in range(2))
        return torch.complex(re_, im).to(dtype)
    if dtype.is_floating_point:
        if op == "PRODUCT":
            mag = torch.tensor([0.5, 1.0, 1.5, 2.0], dtype=torch.float64)[torch.randint(0, 4, (n,), generator=g)]
            return (mag * (torch.randint(0, 2, (n,), generator=g) * 2 - 1)).to(dtype)
        return (torch.randint(-32, 32, (n,), generator=g).double() / 4).to(dtype)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -(1 << 62)), min(info.max, (1 << 62))
    if dtype == torch.int64:       # the whole range, so sums and products wrap around
        return torch.randint(-(1 << 63), (1 << 63) - 1, (n,), generator=g, dtype=torch.int64)
    return torch.randint(lo, hi + 1, (n,), generator=g, dtype=torch.int64).to(dtype)


def reference(parts: list[torch.Tensor], op: str, factor: float = PREMUL_FACTOR) -> torch.Tensor:
    """NCCL's result of reducing `parts` (one per rank) with `op`, in the parts' dtype."""
    dtype, n = parts[0].dtype, len(parts)
    if dtype == torch.bool:
        x = torch.stack(parts)
        if op in ("SUM", "MAX", "BOR"):
            return x.any(0)
        if op in ("PRODUCT", "MIN", "BAND"):
            return x.all(0)
        if op == "BXOR":
            return (x.sum(0) % 2).bool()
        raise ValueError(op)
    if dtype.is_floating_point or dtype.is_complex:
        x = torch.stack([p.to(torch.complex128 if dtype.is_complex else torch.float64) for p in parts])
        if op == "SUM":
            r = x.sum(0)
        elif op == "AVG":
            r = x.sum(0) / n
        elif op in ("PREMUL_SUM", "braid.PremulSum"):
            r = (x * factor).sum(0)
        elif op == "PRODUCT":
            r = x.prod(0)
        elif op == "MIN":
            r = x.amin(0)
        elif op == "MAX":
            r = x.amax(0)
        else:
            raise ValueError(op)
        return r.to(dtype)
    # integers: int64 arithmetic wraps modulo 2**64, and the cast back wraps modulo 2**bits
    x = torch.stack([p.to(torch.int64) for p in parts])
    if op == "SUM":
        return x.sum(0).to(dtype)
    if op == "AVG":
        return torch.div(x.sum(0).to(dtype), n, rounding_mode="trunc")
    if op == "PRODUCT":
        r = x[0].clone()
        for row in x[1:]:
            r = r * row
        return r.to(dtype)
    if op == "MIN":
        return x.amin(0).to(dtype)
    if op == "MAX":
        return x.amax(0).to(dtype)
    fn = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]
    r = x[0].clone()
    for row in x[1:]:
        r = fn(r, row)
    return r.to(dtype)


def tolerance(dtype: torch.dtype, op: str, w: int) -> float:
    """0 (bit for bit), or the absolute tolerance of AVG / PREMUL_SUM at the data's scale (8)."""
    if op not in ("AVG", "PREMUL_SUM", "braid.PremulSum") or not (dtype.is_floating_point or dtype.is_complex):
        return 0.0
    eps = torch.finfo(dtype if dtype.is_floating_point else torch.float32).eps
    return (w + 1) * eps * 8 * (PREMUL_FACTOR if "remul" in op.lower() else 1.0)


def compare(got: torch.Tensor, want: torch.Tensor, atol: float) -> str | None:
    """None when equal (bit for bit where atol is 0, NaN matching NaN), else what differs."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"got {got.dtype}{tuple(got.shape)}, want {want.dtype}{tuple(want.shape)}"
    wide = torch.complex128 if got.dtype.is_complex else \
        torch.float64 if got.dtype.is_floating_point else torch.int64
    a, b = got.to(wide), want.to(wide)
    if atol == 0.0:
        eq = a == b
        if wide != torch.int64:
            eq = eq | (a.isnan() & b.isnan())
    else:
        eq = (a - b).abs() <= atol
    if bool(eq.all()):
        return None
    bad = (~eq).nonzero().reshape(-1)
    i = int(bad[0])
    return (f"{bad.numel()} of {got.numel()} elements differ (tolerance {atol:.3g}); first at {i}: "
            f"got {got[i].item()}, want {want[i].item()}")


# ---------------------------------------------------------------------------------------------
# the worker: every cell, every size, on one world
# ---------------------------------------------------------------------------------------------

def _braid_dir() -> str:
    import braid
    return os.path.dirname(os.path.abspath(braid.__file__))


# how many calls reached braid's process group (backend and subgroup APIs): an exception raised
# inside the group loses its Python frames on the way back through torch's C++ dispatcher, so
# the traceback cannot tell a refusal by braid (or by the inner group braid gave the call to)
# from one by torch's front end
_ENTERED = [0]
_PG_METHODS = ("allreduce", "reduce", "reduce_scatter", "reduce_scatter_single", "_reduce_scatter_base")


def _count_group_calls() -> None:
    from braid.backend import BraidProcessGroup

    def counted(fn):
        def method(self, *args, **kwargs):
            _ENTERED[0] += 1
            return fn(self, *args, **kwargs)
        method.__name__ = fn.__name__
        return method

    for name in _PG_METHODS:
        fn = getattr(BraidProcessGroup, name, None)
        if fn is not None and not getattr(fn, "_counted", False):
            wrapped = counted(fn)
            wrapped._counted = True
            setattr(BraidProcessGroup, name, wrapped)


def _origin(exc: BaseException, entered: bool) -> str:
    """'braid' when the call reached braid (its process group was entered, or braid's code is on
    the traceback: braid refused, or the inner group it gave the call to did), else 'torch'
    (torch's front end refused before any backend)."""
    if entered:
        return "braid"
    root = _braid_dir()
    for frame in traceback.extract_tb(exc.__traceback__):
        if os.path.abspath(frame.filename).startswith(root + os.sep):
            return "braid"
    return "torch"


def _reduce_op(op: str):
    import torch.distributed as dist
    import braid
    if op == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(PREMUL_FACTOR)
    if op == "braid.PremulSum":
        return braid.PremulSum(PREMUL_FACTOR)
    return getattr(dist.ReduceOp, op)


def _call(api: str, coll: str, mine: torch.Tensor, op: str, root: int, w: int, group=None) -> torch.Tensor:
    """Run one collective on this rank's data; return this rank's result tensor. `group`: the
    subgroup (of all ranks: its ranks are the world's) for the "subgroup" API."""
    import torch.distributed as dist
    import braid
    rop = _reduce_op(op)
    if api == "direct":
        mod, kw = braid, {}
    else:
        mod, kw = dist, ({"group": group} if group is not None else {})
    if coll in ("all_reduce", "reduce"):
        t = mine.clone()
        if coll == "all_reduce":
            mod.all_reduce(t, op=rop, **kw)
        else:
            mod.reduce(t, dst=root, op=rop, **kw)
        return t
    out = torch.empty(mine.numel() // w, dtype=mine.dtype)
    if coll == "reduce_scatter_tensor":
        mod.reduce_scatter_tensor(out, mine, op=rop, **kw)
    else:
        mod.reduce_scatter(out, list(mine.chunk(w)), op=rop, **kw)
    return out


def set_calibration(comm, mode: str, w: int) -> None:
    """braid's built-in lane model ("model") or gloo whole for small calls ("whole"); every rank
    switches at the same point."""
    comm.set_calibration({f"{op}/{w}": dict(WHOLE_LANES) for op in CAL_OPS} if mode == "whole" else {})


def _inputs(seed: int, api: str, w: int, coll: str, dname: str, op: str, call: int, n: int, rank: int,
            root: int) -> tuple[torch.Tensor, list | None]:
    """(this rank's input to one call, the inputs its result is reduced from: one per rank, in
    rank order). For all_reduce and reduce those are every rank's whole input (None on a rank
    other than reduce's root, which has no result to check); for reduce_scatter, which gives this
    rank the reduction of chunk `rank` of every rank's input, each input is made of w chunks drawn
    on their own, so a rank draws its own input and chunk `rank` of the others' (2w - 1 chunks, not
    w * w)."""
    dtype = getattr(torch, dname)

    def draw(r, *chunk):
        return make_data(dtype, op, n, _gen(seed, api, w, coll, dname, op, call, r, *chunk))
    if coll.startswith("reduce_scatter"):
        mine = torch.cat([draw(rank, j) for j in range(w)])
        own = mine[rank * n:(rank + 1) * n].clone()
        return mine, [own if r == rank else draw(r, rank) for r in range(w)]
    mine = draw(rank)
    if coll == "reduce" and rank != root:
        return mine, None
    return mine, [mine if r == rank else draw(r) for r in range(w)]     # _call reduces a copy


def _cells_worker(rank: int, w: int, api: str, seed: int) -> list:
    import torch.distributed as dist
    import braid
    group = None
    if api in ("backend", "subgroup"):
        dist.init_process_group("braid", rank=rank, world_size=w, timeout=datetime.timedelta(seconds=60))
        verdicts = dist.new_group(backend="gloo")       # to compare verdicts, beside braid's calls
        _count_group_calls()
        if api == "subgroup":
            from braid.backend import BraidProcessGroup
            group = dist.new_group(backend="braid") if w == 2 else dist.new_group()
            assert isinstance(group, BraidProcessGroup) and not group._world, group
    else:
        braid.init()                                    # over the gloo default group
        verdicts = None
    comm = braid.init()            # the backend's own communicator under the braid backend
    records = []
    for mode in _modes(api):
        if mode != "inner":
            set_calibration(comm, mode, w)
        cell = 0
        for coll in COLLECTIVES:
            for dname in DTYPES:
                dtype = getattr(torch, dname)
                for op in ops_for(api):
                    cell += 1
                    root = cell % w
                    for call, (cal, n) in enumerate(calls_for(api)):
                        if cal != mode:
                            continue
                        mine, column = _inputs(seed, api, w, coll, dname, op, call, n, rank, root)
                        rec = {"api": api, "world": w, "coll": coll, "dtype": dname, "op": op, "n": n,
                               "call": call, "path": cal}
                        entered = _ENTERED[0]
                        try:
                            got = _call(api, coll, mine, op, root, w, group)
                        except Exception as exc:        # refused: record who refused and what it said
                            rec.update(status="refused", error=type(exc).__name__,
                                       origin=_origin(exc, _ENTERED[0] != entered), message=str(exc).strip()[:600])
                        else:
                            rec["status"] = "accepted"
                            if column is None:          # reduce, not the root: nothing to check
                                rec["check"] = None
                            else:
                                rec["check"] = compare(got, reference(column, op), tolerance(dtype, op, w)) or "ok"
                        records.append(rec)
    # every rank must reach the same verdict on every call: one exchange at the end (one per call
    # held the worlds in lockstep, most of the matrix's time with six worlds on two cores)
    every = [None] * w
    dist.all_gather_object(every, [1 if rec["status"] == "accepted" else 0 for rec in records], group=verdicts)
    for i, rec in enumerate(records):
        rec["verdicts"] = [e[i] if i < len(e) else None for e in every]
    if verdicts is not None:
        dist.destroy_process_group(verdicts)
    if group is not None:
        dist.destroy_process_group(group)
    return records


_CACHE: dict = {}


def _records(api: str) -> list:
    """All records of one API (worlds of 2 and 3 ranks), computed once per session: the first
    call runs every API's worlds at once (their processes overlap start-ups and waits)."""
    if api not in _CACHE:
        def world(a, w):
            return lambda: run_world(_cells_worker, w, a, SEED, init_pg=(a == "direct"), env=ENV, timeout=300)
        done = concurrently({(a, w): world(a, w) for a in APIS if a not in _CACHE for w in WORLDS})
        for (a, _), per_rank in done.items():
            recs = _CACHE.setdefault(a, [])
            for r, rows in enumerate(per_rank):
                for row in rows:
                    row["rank"] = r
                    recs.append(row)
        out = os.environ.get("BRAID_SEMANTICS_JSON")
        if out:
            _dump(out)
    return _CACHE[api]


def _dump(path: str) -> None:
    data = {"seed": SEED, "torch": torch.__version__, "collectives": COLLECTIVES, "dtypes": DTYPES,
            "claimed": CLAIMED, "ops": {api: ops_for(api) for api in APIS}, "worlds": WORLDS,
            "calls": {api: calls_for(api) for api in APIS},
            "premul_factor": PREMUL_FACTOR, "records": [r for api in APIS for r in _CACHE.get(api, [])]}
    with open(path, "w") as f:
        json.dump(data, f)


def message_problems(message: str, dtype: str, op: str) -> list[str]:
    """What a braid refusal message lacks (empty: it is fine)."""
    low = message.lower()
    problems = []
    if dtype not in low:
        problems.append(f"does not name the dtype {dtype}")
    if not any(word in low for word in OP_WORDS[op]):
        problems.append(f"does not name the op {op}")
    if not ADVICE.search(message):
        problems.append("does not say what to use instead")
    m = OTHER_BACKENDS.search(message)
    if m:
        problems.append(f"names another backend ({m.group(0)!r})")
    return problems


def cell_failures(records: list, dtype: str, op: str) -> list[str]:
    """Everything wrong with one (dtype, op) cell over its collectives, worlds, sizes and ranks."""
    bad = []
    for rec in records:
        where = (f"{rec['api']} {rec['coll']} world={rec['world']} n={rec['n']} path={rec['path']} "
                 f"call={rec['call']} rank={rec['rank']}")
        if len(set(rec["verdicts"])) != 1:
            bad.append(f"{where}: ranks disagree (accepted per rank: {rec['verdicts']})")
        if rec["status"] == "accepted":
            if rec["check"] not in (None, "ok"):
                bad.append(f"{where}: wrong result: {rec['check']}")
            continue
        if must_accept(dtype, op):
            bad.append(f"{where}: refused, but NCCL accepts it and braid claims {dtype}: "
                       f"{rec['error']}: {rec['message']}")
        elif rec["origin"] == "braid":
            problems = message_problems(rec["message"], dtype, op)
            if problems:
                bad.append(f"{where}: refusal message {'; '.join(problems)}: {rec['error']}: {rec['message']!r}")
    return bad


# Cells known to fail, each with its cause (strict xfail: a fix makes the test fail until its entry
# is removed). Empty: every cell passes.
KNOWN: dict[tuple[str, str, str], str] = {}


def _cells():
    for api in APIS:
        for dtype in DTYPES:
            for op in ops_for(api):
                marks = []
                reason = KNOWN.get((api, dtype, op))
                if reason:
                    marks.append(pytest.mark.xfail(strict=True, reason=reason))
                yield pytest.param(api, dtype, op, id=f"{api}-{dtype}-{op}", marks=marks)


@pytest.mark.parametrize("api,dtype,op", list(_cells()))
def test_cell(api, dtype, op):
    recs = [r for r in _records(api) if r["dtype"] == dtype and r["op"] == op]
    assert len(recs) == len(COLLECTIVES) * len(calls_for(api)) * sum(WORLDS), f"missing records for {api} {dtype} {op}"
    bad = cell_failures(recs, dtype, op)
    assert not bad, f"seed {SEED} (BRAID_SEMANTICS_SEED={SEED} repeats it):\n  " + "\n  ".join(bad[:12]) + \
        (f"\n  ... {len(bad) - 12} more" if len(bad) > 12 else "")


# ---- the pieces of the table, on their own (no world needed) --------------------------------

def test_reference_integer_avg_truncates_toward_zero():
    parts = [torch.tensor([-7, 7, -1, 100], dtype=torch.int32), torch.tensor([2, 2, 0, -1], dtype=torch.int32)]
    assert reference(parts, "AVG").tolist() == [-2, 4, 0, 49]          # -5/2 -> -2, 9/2 -> 4
    wrap = [torch.tensor([100], dtype=torch.int8), torch.tensor([100], dtype=torch.int8)]
    assert reference(wrap, "SUM").tolist() == [-56]                     # 200 wraps to -56
    assert reference(wrap, "AVG").tolist() == [-28]                     # NCCL: wrapped sum, then divide
    u = [torch.tensor([200], dtype=torch.uint8), torch.tensor([100], dtype=torch.uint8)]
    assert reference(u, "AVG").tolist() == [22]                         # (300 mod 256) // 2


def test_reference_bool_and_bitwise():
    a, b = torch.tensor([True, True, False, False]), torch.tensor([True, False, True, False])
    assert reference([a, b], "SUM").tolist() == [True, True, True, False]
    assert reference([a, b], "PRODUCT").tolist() == [True, False, False, False]
    assert reference([a, b], "BXOR").tolist() == [False, True, True, False]
    x, y = torch.tensor([0b1100], dtype=torch.uint8), torch.tensor([0b1010], dtype=torch.uint8)
    assert [reference([x, y], op).item() for op in ("BAND", "BOR", "BXOR")] == [0b1000, 0b1110, 0b0110]


def test_message_rules():
    assert message_problems("Cannot use ReduceOp.PREMUL_SUM with Gloo", "float32", "PREMUL_SUM")
    assert message_problems("Invalid scalar type", "int16", "SUM")
    good = ("all_reduce: dtype torch.int16 cannot be reduced with sum; use int32 or int64 instead")
    assert message_problems(good, "int16", "SUM") == []


# ---------------------------------------------------------------------------------------------
# collectives never touch autograd
# ---------------------------------------------------------------------------------------------

AUTOGRAD_SIZES = (7, 65_537)
KINDS = ("leaf", "nonleaf", "nograd_view_in_grad_mode", "view_under_no_grad")
AG_COLLECTIVES = ("all_reduce", "reduce", "broadcast", "reduce_scatter_tensor", "all_gather_into_tensor",
                  "all_to_all_single")


class _OnGroup:
    """torch.distributed's collectives with group= bound (the "subgroup" API)."""

    def __init__(self, group):
        self.group = group

    def __getattr__(self, name):
        import functools
        import torch.distributed as dist
        return functools.partial(getattr(dist, name), group=self.group)


def _open(api: str, rank: int, w: int):
    """The module whose collectives the autograd cases call: dist.* on backend braid ("backend"),
    dist.* on a subgroup of backend braid ("subgroup"), braid.* over a gloo default group
    ("direct"), or dist.* on gloo ("gloo", the control: the cases ask nothing that gloo does not
    do)."""
    import torch.distributed as dist
    import braid
    if api in ("backend", "subgroup"):
        dist.init_process_group("braid", rank=rank, world_size=w, timeout=datetime.timedelta(seconds=60))
        if api == "subgroup":
            return _OnGroup(dist.new_group(backend="braid"))
    elif api == "direct":
        braid.init()
    return braid if api == "direct" else dist


AG_REDUCING = ("all_reduce", "reduce", "reduce_scatter_tensor")
AG_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM")


def _ag_reference(parts: list, op: str) -> torch.Tensor:
    x = torch.stack(parts)
    return {"SUM": lambda: x.sum(0), "AVG": lambda: x.sum(0) / len(parts), "PRODUCT": lambda: x.prod(0),
            "MIN": lambda: x.amin(0), "MAX": lambda: x.amax(0),
            "PREMUL_SUM": lambda: (x * PREMUL_FACTOR).sum(0)}[op]()


def _autograd_worker(rank: int, w: int, api: str, colls: tuple, ops: tuple) -> dict:
    """Each collective (the reducing ones with every op in `ops`) on float32 tensors that take
    part in autograd; reports per case. In-place collectives (all_reduce, reduce, broadcast) write
    into such a tensor; the others read one and write a plain output. Data are small integers:
    every result is exact."""
    import torch.distributed as dist
    import braid
    mod = _open(api, rank, w)
    comm = braid.init() if api != "gloo" else None
    out = {}
    cases = [(mode, c, op) for mode in ("model", "whole") for c in colls for op in (ops if c in AG_REDUCING else ("-",))]
    current = None
    for mode, coll, op in cases:
        if (comm is None or api == "subgroup") and mode == "whole":
            continue                    # the calibration does not reach a subgroup's calls
        if comm is not None and mode != current:
            set_calibration(comm, mode, w)
            current = mode
        if op == "PREMUL_SUM":
            rop = braid.PremulSum(PREMUL_FACTOR) if api == "direct" else dist._make_nccl_premul_sum(PREMUL_FACTOR)
        elif op != "-":
            rop = getattr(dist.ReduceOp, op)
        if op != "-":
            # a reduction refused on plain tensors is the table's business, not this test's
            probe = torch.ones(8 * w)
            try:
                if coll == "reduce_scatter_tensor":
                    mod.reduce_scatter_tensor(torch.empty(8), probe, op=rop)
                elif coll == "reduce":
                    mod.reduce(probe, dst=0, op=rop)
                else:
                    mod.all_reduce(probe, op=rop)
            except Exception as exc:
                out[f"{mode}/{coll}/{op}"] = f"refused on plain tensors: {type(exc).__name__}: {exc}"
                continue
        for kind in KINDS:
            for n in AUTOGRAD_SIZES:
                name = f"{mode}/{coll}/{op}/{kind}/n={n}"
                total = n * w
                parts = [(torch.arange(total, dtype=torch.float32) * (r + 1) % 13) + 1 for r in range(w)]
                base = parts[rank].clone().requires_grad_(True)
                try:
                    if kind == "leaf":
                        t = base
                    elif kind == "nonleaf":
                        t = base * 1.0          # grad_fn MulBackward0
                    elif kind == "nograd_view_in_grad_mode":
                        with torch.no_grad():
                            t = base[:]
                    else:
                        t = None                # made below, under no_grad
                    fn_before = type(t.grad_fn).__name__ if t is not None and t.grad_fn is not None else None

                    def run(t):
                        if coll == "all_reduce":
                            mod.all_reduce(t, op=rop)
                            return t, _ag_reference(parts, op)
                        if coll == "reduce":
                            mod.reduce(t, dst=0, op=rop)
                            return (t, _ag_reference(parts, op)) if rank == 0 else (None, None)
                        if coll == "reduce_scatter_tensor":
                            o = torch.zeros(n)
                            mod.reduce_scatter_tensor(o, t, op=rop)
                            return o, _ag_reference(parts, op).chunk(w)[rank]
                        if coll == "broadcast":
                            mod.broadcast(t, src=0)
                            return t, parts[0]
                        if coll == "all_gather_into_tensor":
                            o = torch.zeros(total * w)
                            mod.all_gather_into_tensor(o, t)
                            return o, torch.cat(parts)
                        o = torch.zeros(total)
                        mod.all_to_all_single(o, t)
                        return o, torch.cat([p.chunk(w)[rank] for p in parts])

                    if kind == "view_under_no_grad":
                        with torch.no_grad():
                            t = base[:]
                            res, want = run(t)
                    else:
                        res, want = run(t)
                    # (a view made under no_grad whose base changed in place may not be asked
                    # for its grad_fn: torch raises; its base is checked below)
                    fn_after = fn_before if "view" in kind else \
                        type(t.grad_fn).__name__ if t.grad_fn is not None else None
                    problems = []
                    if res is not None and not torch.equal(res.detach(), want):
                        problems.append("wrong values")
                    if fn_after != fn_before:
                        problems.append(f"the tensor's grad_fn changed: {fn_before} -> {fn_after}")
                    if base.grad_fn is not None or not base.is_leaf or not base.requires_grad:
                        problems.append("the leaf stopped being a leaf that requires grad")
                    if res is not None and res is not t and (res.grad_fn is not None or not res.is_leaf):
                        problems.append(f"the output got a grad_fn {type(res.grad_fn).__name__}")
                    out[name] = "; ".join(problems) or "ok"
                except Exception as exc:
                    out[name] = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
    # torch.func.grad of a function with no collective, with braid's communicator running
    x = torch.linspace(-2, 2, 101, dtype=torch.float64)
    t = torch.ones(3)
    mod.all_reduce(t)                      # the communicator exists and has run a call
    g = torch.func.grad(lambda v: (v.sin() ** 2).sum())(x)
    out["torch.func.grad"] = "ok" if torch.allclose(g, 2 * x.sin() * x.cos()) and t.tolist() == [w] * 3 else \
        f"wrong: {g[:3].tolist()} / {t.tolist()}"
    hv = torch.func.jacrev(torch.func.grad(lambda v: (v ** 3).sum()))(x[:5])
    out["torch.func.jacrev(grad)"] = "ok" if torch.allclose(hv, torch.diag(6 * x[:5])) else "wrong"
    return out


def _inference_worker(rank: int, w: int, api: str) -> dict:
    """Collectives on tensors made under torch.inference_mode, called inside and outside it."""
    mod = _open(api, rank, w)
    out = {}
    for inside in (True, False):
        # outside inference mode, torch's own front end refuses to write all_gather_into_tensor's
        # and reduce_scatter_tensor's inference outputs (on gloo too): in-place results only there
        colls = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor") if inside else \
            ("all_reduce", "broadcast")
        for coll in colls:
            for n in AUTOGRAD_SIZES:
                name = f"{coll}/{'inside' if inside else 'outside'}/n={n}"
                parts = [torch.arange(n * w, dtype=torch.float32) * (r + 1) % 89 for r in range(w)]
                try:
                    with torch.inference_mode():
                        t = parts[rank].clone()
                        o_ag = torch.empty(n * w * w)
                        o_rs = torch.empty(n)
                    ctx = torch.inference_mode() if inside else torch.no_grad()
                    with ctx:
                        if coll == "all_reduce":
                            mod.all_reduce(t)
                            res, want = t, torch.stack(parts).sum(0)
                        elif coll == "broadcast":
                            mod.broadcast(t, src=0)
                            res, want = t, parts[0]
                        elif coll == "all_gather_into_tensor":
                            mod.all_gather_into_tensor(o_ag, t)
                            res, want = o_ag, torch.cat(parts)
                        else:
                            mod.reduce_scatter_tensor(o_rs, t)
                            res, want = o_rs, torch.stack(parts).sum(0).chunk(w)[rank]
                    out[name] = "ok" if torch.equal(res, want) else "wrong values"
                except Exception as exc:
                    out[name] = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
    return out


class _OneParam(torch.nn.Module):
    """One weight matrix: DDP with create_graph=True works for a model of one parameter (torch's
    own test_ddp_create_graph uses one scalar); with two or more, torch 2.13 refuses even on gloo
    ("a leaf Variable that requires grad is being used in an in-place operation")."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(-1, 1, 5 * 300).reshape(5, 300))

    def forward(self, x):
        return torch.tanh(x @ self.w).sum(-1)


def _ddp_create_graph_worker(rank: int, w: int, ports: list) -> dict:
    """DDP + loss.backward(create_graph=True) on gloo and on braid, as torch's test_ddp_create_graph
    (DDP warns that it does not reduce higher-order gradients, and asks only that the gradients
    still require grad): they do, and both backends give the same gradients and weights (the
    gradient has 1,500 floats: braid splits its all_reduce over its lanes)."""
    import torch.distributed as dist
    import braid  # noqa: F401
    out = {}
    for backend, port in zip(("gloo", "braid"), ports):
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group(backend, rank=rank, world_size=w, timeout=datetime.timedelta(seconds=60))
        model = _OneParam()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        g = torch.Generator().manual_seed(100 + rank)
        trace = []
        for _ in range(4):
            x = torch.randn(16, 5, generator=g)
            model.w.grad = None
            loss = ddp(x).pow(2).mean()
            loss.backward(create_graph=True)
            grad = model.w.grad
            trace.append({"requires_grad": bool(grad.requires_grad),
                          "grad": grad.detach().reshape(-1)[::7].tolist()})
            with torch.no_grad():
                model.w -= 0.01 * grad.detach()
        out[backend] = {"trace": trace, "backend": dist.get_backend(), "braid_calls": _braid_calls(),
                        "weights": model.w.detach().reshape(-1).tolist()}
        dist.destroy_process_group()
    return out


def _braid_calls() -> int:
    import torch.distributed as dist
    comm = getattr(dist.distributed_c10d._get_default_group(), "_comm", None)
    return int(getattr(comm, "ncalls", 0) or 0)


# gloo is the control of the cases (they ask nothing that torch refuses), on the collectives and
# ops where gloo itself stays out of autograd: torch 2.13's gloo records a CopyBackwards on
# reduce_scatter_tensor's output when the input requires grad, refuses all_gather_into_tensor from
# such an input (it copies through autograd-visible views), and divides AVG's result with an
# autograd-visible div_ (DivBackward1 on a non-leaf, an error on a leaf); NCCL does none of
# these, nor may braid.
GLOO_CLEAN = ("all_reduce", "reduce", "broadcast", "all_to_all_single")


@pytest.mark.parametrize("api", APIS + ("gloo",))
def test_collectives_leave_autograd_alone(api):
    colls = GLOO_CLEAN if api == "gloo" else AG_COLLECTIVES
    ops = ("SUM", "PRODUCT", "MIN", "MAX") if api == "gloo" else AG_OPS
    reps = run_world(_autograd_worker, 2, api, colls, ops, init_pg=(api not in ("backend", "subgroup")), env=ENV,
                     timeout=180)
    bad = {f"rank {r} {name}": v for r, rep in enumerate(reps) for name, v in rep.items()
           if v != "ok" and not v.startswith("refused on plain tensors")}
    assert not bad, "\n".join(f"{k}: {v}" for k, v in bad.items())
    assert sum(v == "ok" for v in reps[0].values()) >= len(colls) * len(KINDS) * len(AUTOGRAD_SIZES)


@pytest.mark.parametrize("api", APIS + ("gloo",))
def test_inference_tensors(api):
    """Tensors made under torch.inference_mode (Lightning's Trainer.validate reduces such tensors
    on every backend not named gloo), reduced inside inference mode and outside it."""
    reps = run_world(_inference_worker, 2, api, init_pg=(api not in ("backend", "subgroup")), env=ENV, timeout=180)
    bad = {f"rank {r} {name}": v for r, rep in enumerate(reps) for name, v in rep.items() if v != "ok"}
    assert not bad, "\n".join(f"{k}: {v}" for k, v in bad.items())


def test_ddp_create_graph_matches_gloo():
    ports = [free_port(), free_port()]
    while ports[1] == ports[0]:
        ports[1] = free_port()
    reps = run_world(_ddp_create_graph_worker, 2, ports, init_pg=False, env=ENV, timeout=180)
    for r, rep in enumerate(reps):
        assert rep["braid"]["backend"] == "braid" and rep["gloo"]["backend"] == "gloo"
        assert rep["braid"]["braid_calls"] > 0, "DDP's all_reduce did not reach braid's communicator"
        for step in rep["braid"]["trace"]:
            assert step["requires_grad"], f"rank {r}: a gradient lost requires_grad after DDP's reduction on braid"
        assert rep["braid"]["trace"] == rep["gloo"]["trace"], f"rank {r}: braid and gloo differ"
        assert rep["braid"]["weights"] == rep["gloo"]["weights"], f"rank {r}: final weights differ"
    assert reps[0]["braid"]["weights"] == reps[1]["braid"]["weights"], "ranks disagree on the weights"
