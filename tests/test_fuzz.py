"""Fuzz tier: seeded random sequences of collectives, checked against local references.

Every rank draws the same call sequence from `random.Random(seed)` (op, dtype, size, reduce op,
root, split sizes, async or not); each rank's data for call k is seeded by (seed, k, rank), so
every rank builds the reference of every call locally from every rank's data (no collective
builds a reference). Worlds of 2 and 3 ranks, through braid's direct API (`braid.init()` over a
gloo default group) and through `dist.*` on the braid backend.

Sizes run from zero elements to 3 MiB per rank (odd counts, biased small). Settings: the test
defaults plus BRAID_MIN_SPLIT_KB=1, so that mid and large calls really split over gloo + shm.
Calls alternate, in blocks of BLOCK calls (the same on every rank), between braid's built-in CPU
lane model (shm alone below ~180 KB, gloo + shm split above) and a set calibration
(FAST_CALIB: gloo's own collective whole below ~100 KB, shm alone up to ~1 MB, split above), so
the sequence crosses braid's three CPU paths and its calibration changes.

Checks: data movement bit for bit (random bytes, NaN patterns included); integer reductions and
float sum/min/max exactly (float data are small integers for sums, so every order of summation
is exact); float avg and product within one unit of the dtype's epsilon, relative (avg divides
once, and may round through float32; products of values in +-{0.5, 1, 1.5, 2} are exact, the
tolerance is only a margin). `reduce` leaves non-root tensors unchanged (braid's docstring).
About 15% of calls are async_op=True and are waited and checked after one or two later calls.

BRAID_FUZZ_OPS (default 2,000) is the total over the four worlds; e.g. BRAID_FUZZ_OPS=10000 for
the larger run. BRAID_FUZZ_SEED changes the base seed (default 20261126). A failure names the
world, seed and call index: the sequence is a pure function of (seed, world size, API).
BRAID_FUZZ_TRACE=<folder> makes every rank write each call it posted (and, if the world hangs,
every thread's stack) there: a world that gloo aborts leaves no Python traceback.

Bugs the fuzz found are reproduced small at the end of this file, each with a test that failed
before its fix: `reduce` of int32/int64 taken whole by gloo was computed in float32; a 0- or
1-element input with a stride other than 1 raised; the two ranks of a split send/recv could cut
it into different shares (each side asked its own balancer); a send/recv that the native library
takes whole could overtake an earlier split one of the same direction still waiting for its peer.
"""
from __future__ import annotations

import datetime
import hashlib
import os
import random
import time
import traceback

import pytest
import torch

from conftest import braid_shm_entries, run_world

ENV = {"BRAID_MIN_SPLIT_KB": "1", "CUDA_VISIBLE_DEVICES": "",
       "BRAID_FUZZ_TRACE": os.environ.get("BRAID_FUZZ_TRACE")}
TOTAL_OPS = int(os.environ.get("BRAID_FUZZ_OPS", "2000"))
BASE_SEED = int(os.environ.get("BRAID_FUZZ_SEED", "20261126"))
WORLDS = [("direct", 2), ("direct", 3), ("backend", 2), ("backend", 3)]
BLOCK = 100                     # calls per calibration block
P2P_OPS = ("send_recv", "ring")     # ring: dist.batch_isend_irecv (isend/irecv one by one) on the backend
MAX_BYTES = 3 << 20             # the largest per-rank piece
# lane costs (calibration format) that give gloo's own collective every call below ~100 KB, shm
# alone up to ~1 MB and a gloo + shm split above (gloo 10 us + 1 GB/s, shm 100 us + 10 GB/s)
FAST_LANES = {"gloo": {"latency_us": 10.0, "bw_gbps": 1.0, "floor_us": 10.0},
              "shm": {"latency_us": 100.0, "bw_gbps": 10.0, "floor_us": 100.0}}
CAL_OPS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all_single", "reduce", "send_recv"]

DTYPES = ["float32", "bfloat16", "float16", "float64", "int32", "int64", "uint8", "int8"]
OPS = [  # (name, weight)
    ("all_reduce", 16), ("reduce_scatter_tensor", 8), ("reduce_scatter", 5), ("reduce", 7),
    ("all_gather_into_tensor", 12), ("all_gather", 7), ("broadcast", 10), ("a2a_even", 8),
    ("a2a_uneven", 10), ("send_recv", 9), ("ring", 8),
]


# ---------------------------------------------------------------------------------------------
# seeded data and references (inside the workers)
# ---------------------------------------------------------------------------------------------

def _gen(*key) -> torch.Generator:
    seed = int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:8], "little") >> 1
    return torch.Generator().manual_seed(seed)


def _bytes_data(key, n: int, dtype: torch.dtype) -> torch.Tensor:
    """n elements of `dtype` made of random bytes (any bit pattern: data movement only)."""
    esz = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * esz,), generator=_gen(*key), dtype=torch.uint8)
    return raw.view(dtype)


_PROD_FLOAT = torch.tensor([-2.0, -1.5, -1.0, -0.5, 0.5, 1.0, 1.5, 2.0], dtype=torch.float64)
_PROD_INT = torch.tensor([-3, -2, -1, 1, 2, 3], dtype=torch.int64)


def _red_data(key, n: int, dtype: torch.dtype, red: str) -> torch.Tensor:
    """Values for a reduction whose reference is exact (see the module text)."""
    g = _gen(*key)
    fl = dtype.is_floating_point
    if red in ("sum", "avg"):
        if fl:
            return torch.randint(-8, 9, (n,), generator=g).to(dtype)
        lo, hi = {torch.int8: (-40, 41), torch.uint8: (0, 81), torch.int32: (-(1 << 24), 1 << 24),
                  torch.int64: (-(1 << 40), 1 << 40)}[dtype]
        return torch.randint(lo, hi, (n,), generator=g, dtype=torch.int64).to(dtype)
    if red == "product":
        if fl:
            return _PROD_FLOAT[torch.randint(0, len(_PROD_FLOAT), (n,), generator=g)].to(dtype)
        if dtype is torch.uint8:
            return torch.randint(1, 4, (n,), generator=g, dtype=torch.int64).to(dtype)
        return _PROD_INT[torch.randint(0, len(_PROD_INT), (n,), generator=g)].to(dtype)
    # max / min: anything (a selection is exact); floats with few ties
    if fl:
        return (torch.randn(n, generator=g, dtype=torch.float64) * 100).to(dtype)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -(1 << 62)), min(info.max, 1 << 62)
    return torch.randint(lo, hi, (n,), generator=g, dtype=torch.int64).to(dtype)


def _reduce_ref(parts: list[torch.Tensor], red: str) -> torch.Tensor:
    dtype = parts[0].dtype
    if red in ("max", "min"):
        x = torch.stack(parts)
        return x.amax(0) if red == "max" else x.amin(0)
    wide = torch.float64 if dtype.is_floating_point else torch.int64
    x = torch.stack([p.to(wide) for p in parts])
    if red == "sum":
        out = x.sum(0)
    elif red == "avg":
        out = x.sum(0) / len(parts)
    elif red == "product":
        out = x.prod(0)
    else:
        raise ValueError(red)
    return out.to(dtype)


def _diff(got: torch.Tensor, want: torch.Tensor, exact: bool = True) -> str | None:
    """None when equal (bit for bit, or within the dtype's epsilon, relative); else what differs."""
    if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
        return f"got {got.dtype}{tuple(got.shape)}, want {want.dtype}{tuple(want.shape)}"
    if got.numel() == 0:
        return None
    if exact:
        a, b = got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)
        if torch.equal(a, b):
            return None
        esz = got.element_size()
        bad = (a != b).nonzero().reshape(-1) // esz
        i = int(bad[0])
        return (f"{bad.unique().numel()} of {got.numel()} elements differ, first at {i}: "
                f"got {got.reshape(-1)[i].item()!r}, want {want.reshape(-1)[i].item()!r}")
    eps = torch.finfo(got.dtype).eps
    g, w = got.double().reshape(-1), want.double().reshape(-1)
    err = (g - w).abs() - eps * w.abs()
    if bool((err <= 0).all()):
        return None
    i = int(err.argmax())
    return f"beyond {eps:g} relative at {i}: got {g[i].item()!r}, want {w[i].item()!r}"


# ---------------------------------------------------------------------------------------------
# the two ways in: braid's direct API and dist.* on the braid backend
# ---------------------------------------------------------------------------------------------

class _Direct:
    name = "direct"

    def __init__(self):
        import braid
        self.comm = braid.init()
        self.c = self.comm

    def comm_now(self):
        return self.comm

    def all_reduce(self, t, op, a):
        return self.c.all_reduce(t, op, async_op=a)

    def reduce_scatter_tensor(self, out, inp, op, a):
        return self.c.reduce_scatter_tensor(out, inp, op, async_op=a)

    def reduce_scatter(self, out, ins, op, a):
        return self.c.reduce_scatter(out, ins, op, async_op=a)

    def reduce(self, t, dst, op, a):
        return self.c.reduce(t, dst, op, async_op=a)

    def all_gather_into_tensor(self, out, x, a):
        return self.c.all_gather_into_tensor(out, x, async_op=a)

    def all_gather(self, outs, x, a):
        return self.c.all_gather(outs, x, async_op=a)

    def broadcast(self, t, src, a):
        return self.c.broadcast(t, src, async_op=a)

    def all_to_all_single(self, out, inp, osz, isz, a):
        return self.c.all_to_all_single(out, inp, osz, isz, async_op=a)

    def send(self, t, dst, a):
        return self.c.send(t, dst, async_op=a)

    def recv(self, t, src, a):
        return self.c.recv(t, src, async_op=a)

    def ring(self, ops):
        """braid's batch_isend_irecv is collective: every rank calls it."""
        return self.c.batch_isend_irecv(ops)


class _Backend:
    name = "backend"

    def __init__(self, rank, w):
        import torch.distributed as dist
        import braid  # noqa: F401  registers the backend
        dist.init_process_group("braid", rank=rank, world_size=w, timeout=datetime.timedelta(seconds=60))
        self.d = dist
        self.pg = dist.distributed_c10d._get_default_group()

    def comm_now(self):
        return self.pg._comm

    def all_reduce(self, t, op, a):
        return self.d.all_reduce(t, op=op, async_op=a)

    def reduce_scatter_tensor(self, out, inp, op, a):
        return self.d.reduce_scatter_tensor(out, inp, op=op, async_op=a)

    def reduce_scatter(self, out, ins, op, a):
        return self.d.reduce_scatter(out, ins, op=op, async_op=a)

    def reduce(self, t, dst, op, a):
        return self.d.reduce(t, dst, op=op, async_op=a)

    def all_gather_into_tensor(self, out, x, a):
        return self.d.all_gather_into_tensor(out, x, async_op=a)

    def all_gather(self, outs, x, a):
        return self.d.all_gather(outs, x, async_op=a)

    def broadcast(self, t, src, a):
        return self.d.broadcast(t, src, async_op=a)

    def all_to_all_single(self, out, inp, osz, isz, a):
        return self.d.all_to_all_single(out, inp, osz, isz, async_op=a)

    def send(self, t, dst, a):
        return self.d.isend(t, dst) if a else self.d.send(t, dst)

    def recv(self, t, src, a):
        if a:
            return self.d.irecv(t, src)
        self.d.recv(t, src)             # returns the sender's rank, not a Work
        return None

    def ring(self, ops):
        return self.d.batch_isend_irecv(ops)


# ---------------------------------------------------------------------------------------------
# one call
# ---------------------------------------------------------------------------------------------

def _count(rng: random.Random, esz: int) -> int:
    """Elements per rank: bytes drawn from buckets biased small, odd counts mostly."""
    u = rng.random()
    if u < 0.06:
        return 0
    if u < 0.48:
        nbytes = rng.randint(1, 1 << 10)
    elif u < 0.76:
        nbytes = rng.randint(1 << 10, 64 << 10)
    elif u < 0.93:
        nbytes = rng.randint(64 << 10, 512 << 10)
    else:
        nbytes = rng.randint(512 << 10, MAX_BYTES)
    n = max(1, nbytes // esz)
    if rng.random() < 0.7:
        n |= 1
    return n


class _Call:
    """One drawn call: its description, a Work/handle list to wait on, and a check."""

    def __init__(self, what: str, works, check):
        self.what, self.works, self.check = what, [w for w in works if w is not None], check


def _draw_red(rng, dtype) -> str:
    reds = ["sum", "sum", "max", "min", "product"] + (["avg"] if dtype.is_floating_point else [])
    return rng.choice(reds)


def _draw_op(rng: random.Random) -> str:
    return rng.choices([o for o, _ in OPS], weights=[wt for _, wt in OPS])[0]


def _post(api, rank: int, w: int, seed: int, k: int, rng: random.Random, async_op: bool, op: str,
          dev=None) -> _Call:
    """Post one drawn call; its tensors live on `dev` (None: CPU), its references on the CPU."""
    import torch.distributed as dist
    R = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
         "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}
    dtype = getattr(torch, rng.choice(DTYPES))
    on = (lambda t: t) if dev is None else (lambda t: t.to(dev))      # noqa: E731
    dev_kw = {} if dev is None else {"device": dev}
    esz = torch.empty((), dtype=dtype).element_size()
    n = _count(rng, esz)
    head = f"call {k} {op} {str(dtype)[6:]} n={n}" + (" async" if async_op else "")

    if op in ("all_reduce", "reduce"):
        red = _draw_red(rng, dtype)
        root = rng.randrange(w)
        parts = [_red_data((seed, k, r), n, dtype, red) for r in range(w)]
        t = on(parts[rank].clone())
        if op == "all_reduce":
            work = api.all_reduce(t, R[red], async_op)
        else:
            work = api.reduce(t, root, R[red], async_op)
        what = f"{head} {red}" + (f" root={root}" if op == "reduce" else "")
        exact = not (dtype.is_floating_point and red in ("avg", "product"))

        def check():
            if op == "reduce" and rank != root:
                d = _diff(t.cpu(), parts[rank])
                return None if d is None else f"non-root tensor changed: {d}"
            return _diff(t.cpu(), _reduce_ref(parts, red), exact)
        return _Call(what, [work], check)

    if op in ("reduce_scatter_tensor", "reduce_scatter"):
        red = _draw_red(rng, dtype)
        parts = [_red_data((seed, k, r), n * w, dtype, red) for r in range(w)]
        out = torch.full((n,), 7, dtype=dtype, **dev_kw)
        if op == "reduce_scatter_tensor":
            work = api.reduce_scatter_tensor(out, on(parts[rank].clone()), R[red], async_op)
        else:
            work = api.reduce_scatter(out, list(on(parts[rank].clone()).chunk(w)) if n else
                                      [torch.empty(0, dtype=dtype, **dev_kw) for _ in range(w)], R[red], async_op)
        exact = not (dtype.is_floating_point and red in ("avg", "product"))
        return _Call(f"{head} {red}", [work],
                     lambda: _diff(out.cpu(), _reduce_ref([p[rank * n:(rank + 1) * n] for p in parts], red), exact))

    if op in ("all_gather_into_tensor", "all_gather"):
        parts = [_bytes_data((seed, k, r), n, dtype) for r in range(w)]
        strided = api.name == "direct" and op == "all_gather_into_tensor" and rng.random() < 0.1
        x = on(parts[rank])
        if strided:                   # a non-contiguous input (braid copies it first)
            x = torch.stack([x, torch.zeros_like(x)], 1)[:, 0]
        if op == "all_gather_into_tensor":
            out = torch.empty(n * w, dtype=dtype, **dev_kw)
            work = api.all_gather_into_tensor(out, x, async_op)
            return _Call(head + (" strided" if strided else ""), [work], lambda: _diff(out.cpu(), torch.cat(parts)))
        outs = [torch.empty(n, dtype=dtype, **dev_kw) for _ in range(w)]
        work = api.all_gather(outs, x, async_op)

        def check():
            for r in range(w):
                d = _diff(outs[r].cpu(), parts[r])
                if d is not None:
                    return f"output_list[{r}]: {d}"
            return None
        return _Call(head, [work], check)

    if op == "broadcast":
        root = rng.randrange(w)
        want = _bytes_data((seed, k, root), n, dtype)
        t = on(want.clone()) if rank == root else torch.zeros(n, dtype=dtype, **dev_kw)
        work = api.broadcast(t, root, async_op)
        return _Call(f"{head} root={root}", [work], lambda: _diff(t.cpu(), want))

    if op in ("a2a_even", "a2a_uneven"):
        cols = rng.choice([1, 1, 3])
        if op == "a2a_even":
            m = max(n // (w * cols), 0)
            rows = [[m] * w for _ in range(w)]
        else:
            cap = max(1, n // (w * cols))
            rows = [[0 if rng.random() < 0.25 else rng.randint(1, cap) for _ in range(w)] for _ in range(w)]
            u = rng.random()
            if u < 0.2:                               # a rank that sends nothing at all
                rows[rng.randrange(w)] = [0] * w
            elif u < 0.3:                             # a rank that receives nothing at all
                d = rng.randrange(w)
                for s in range(w):
                    rows[s][d] = 0
        ins = [_bytes_data((seed, k, s), sum(rows[s]) * cols, dtype).view(-1, cols) for s in range(w)]
        out = torch.full((sum(rows[s][rank] for s in range(w)), cols), 7, dtype=dtype, **dev_kw)
        if op == "a2a_even":
            work = api.all_to_all_single(out, on(ins[rank]), None, None, async_op)
        else:
            work = api.all_to_all_single(out, on(ins[rank]), [rows[s][rank] for s in range(w)], rows[rank], async_op)
        want = torch.cat([ins[s].split(rows[s])[rank] for s in range(w)])
        return _Call(f"{head} cols={cols} rows={rows}", [work], lambda: _diff(out.cpu(), want))

    if op == "send_recv":
        a, b = rng.sample(range(w), 2)
        both = rng.random() < 0.4              # an exchange: a and b each send to the other
        strided = api.name == "direct" and rng.random() < 0.1 and n >= 2      # n: see all_gather
        mk = {s: _bytes_data((seed, k, s), n, dtype) for s in (a, b)}
        works, got = [], None
        what = f"{head} {a}->{b}" + (f" and {b}->{a}" if both else "") + (" strided" if strided else "")
        if rank in (a, b):
            peer = b if rank == a else a
            x = on(mk[rank])
            if strided:
                x = torch.stack([x, torch.zeros_like(x)], 1)[:, 0]
            got = torch.full((n,), 7, dtype=dtype, **dev_kw)
            if both:              # both directions at once: must not block on each other
                works = [api.send(x, peer, True), api.recv(got, peer, True)] if rank == a else \
                        [api.recv(got, peer, True), api.send(x, peer, True)]
            elif rank == a:
                works = [api.send(x, b, async_op)]
            else:
                works = [api.recv(got, a, async_op)]

        def check():
            if rank == b or (both and rank == a):
                return _diff(got.cpu(), mk[b if rank == a else a])
            return None
        return _Call(what, works, check)

    if op == "ring":
        shift = rng.randint(1, w - 1)
        nxt, prv = (rank + shift) % w, (rank - shift) % w
        x = on(_bytes_data((seed, k, rank), n, dtype))
        got = torch.full((n,), 7, dtype=dtype, **dev_kw)
        ops = [dist.P2POp(dist.isend, x, nxt), dist.P2POp(dist.irecv, got, prv)]
        if rng.random() < 0.5:
            ops.reverse()
        works = api.ring(ops)
        return _Call(f"{head} shift={shift}", list(works),
                     lambda: _diff(got.cpu(), _bytes_data((seed, k, prv), n, dtype)))
    raise ValueError(op)


def _lanes_of(comm) -> str:
    h = getattr(comm, "last_handle", None) if comm is not None else None
    if type(h).__name__ == "PendingP2P" and getattr(h, "inner", None) is None:
        return "deferred"             # asking its shares would start it (a blocking wait)
    try:
        shares = h.shares if h is not None else {}
    except Exception:                 # a pending send/recv may not know its lanes yet
        shares = {}
    if type(h).__name__ == "HierHandle":
        return "steps"                # a multi-node call in node and rail steps
    if len(shares) > 1:
        return "split"
    return next(iter(shares), "none")


def _fuzz_worker(rank: int, w: int, mode: str, seed: int, n_ops: int, dev=None, lanes=None) -> dict:
    """One rank's fuzz sequence; `dev`: where the tensors live (None: CPU), `lanes`: the lane
    costs of the calibrated blocks (default FAST_LANES, the CPU lanes')."""
    api = _Direct() if mode == "direct" else _Backend(rank, w)
    lanes = lanes or FAST_LANES
    rng = random.Random(seed)
    pending: list[tuple[int, _Call]] = []      # (calls left before its wait, call)
    wrong: list[str] = []
    paths: dict[str, int] = {}
    ops_run = 0
    t0 = time.monotonic()

    def settle(call: _Call) -> None:
        for wk in call.works:
            wk.wait()
        d = call.check()
        if d is not None:
            wrong.append(f"{call.what}: {d}")

    # BRAID_FUZZ_TRACE=folder: each rank writes every call it posted to folder/rank<r>.txt
    # (a world that dies inside gloo's C++ leaves no Python traceback)
    folder = os.environ.get("BRAID_FUZZ_TRACE")
    trace = open(os.path.join(folder, f"{mode}-w{w}-rank{rank}.txt"), "w") if folder else None
    if folder:                         # and every thread's stack if the world hangs
        import faulthandler
        stacks = open(os.path.join(folder, f"{mode}-w{w}-rank{rank}-stacks.txt"), "w")
        faulthandler.dump_traceback_later(_world_timeout(n_ops) - 10, file=stacks)
    k = -1
    try:
        for k in range(n_ops):
            if k % BLOCK == 0:
                # calls in flight (async, a send/recv whose peer has not posted yet) keep what
                # they were posted with across the calibration switch
                calibrated = (k // BLOCK) % 2 == 1
                # under the backend the communicator is made at the first calibration switch
                # (every rank calls this at the same call), so block 0 runs the lazy path
                comm = api.comm_now() if not calibrated and k == 0 else \
                    (api.comm if mode == "direct" else api.pg.ensure_communicator())
                if comm is not None:
                    comm.set_calibration({f"{op}/{w}": dict(lanes) for op in CAL_OPS} if calibrated else {})
            async_op = rng.random() < 0.15
            op = _draw_op(rng)
            call = _post(api, rank, w, seed, k, rng, async_op, op, dev)
            if trace is not None:
                trace.write(f"{call.what}\n")
                trace.flush()
            ops_run += 1
            lane = _lanes_of(api.comm_now())
            paths[lane] = paths.get(lane, 0) + 1
            if async_op:
                pending.append((rng.randint(1, 2), call))
            else:
                settle(call)
            due = [c for left, c in pending if left <= 0]
            pending = [(left - 1, c) for left, c in pending if left > 0]
            for c in due:
                settle(c)
        for _, c in pending:
            settle(c)
        error = None
    except Exception:
        error = f"at call {k}: " + traceback.format_exc()[-4000:]
    seconds = time.monotonic() - t0
    if mode == "backend":
        import torch.distributed as dist
        if error is None:
            dist.barrier()
        dist.destroy_process_group()
    return {"ops": ops_run, "wrong": wrong[:20], "n_wrong": len(wrong), "error": error,
            "seconds": round(seconds, 2), "paths": paths}


# ---------------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------------

_TOTAL = {"worlds": 0, "ops": 0, "wrong": 0, "seconds": 0.0}


def _world_timeout(n_ops: int) -> float:
    return 60 + 0.12 * n_ops


def _ops_per_world() -> int:
    return max(1, TOTAL_OPS // len(WORLDS))


@pytest.mark.parametrize("mode,w", WORLDS, ids=[f"{m}-w{w}" for m, w in WORLDS])
def test_fuzz(mode, w, capsys):
    n_ops = _ops_per_world()
    seed = BASE_SEED + 1000 * w + (0 if mode == "direct" else 1)
    info: dict = {}
    t0 = time.monotonic()
    reports = run_world(_fuzz_worker, w, mode, seed, n_ops, init_pg=mode == "direct", env=ENV, info=info,
                        timeout=_world_timeout(n_ops))
    wall = time.monotonic() - t0
    errors = {r: rep["error"] for r, rep in enumerate(reports) if rep["error"]}
    assert not errors, f"{mode} w={w} seed={seed}:\n" + "\n".join(f"rank {r}: {e}" for r, e in errors.items())
    ops = reports[0]["ops"]
    wrong = sum(rep["n_wrong"] for rep in reports)
    paths = reports[0]["paths"]
    _TOTAL["worlds"] += 1
    _TOTAL["ops"] += ops
    _TOTAL["wrong"] += wrong
    _TOTAL["seconds"] += wall
    with capsys.disabled():
        print(f"\nfuzz {mode} w={w} seed={seed}: ops={ops} wrong={wrong} seconds={wall:.1f} "
              f"(calls {max(rep['seconds'] for rep in reports):.1f} s) paths={paths}")
        if _TOTAL["worlds"] == len(WORLDS):
            print(f"fuzz total: ops={_TOTAL['ops']} wrong={_TOTAL['wrong']} seconds={_TOTAL['seconds']:.1f} "
                  f"({len(WORLDS)} worlds, BRAID_FUZZ_OPS={TOTAL_OPS}, BRAID_FUZZ_SEED={BASE_SEED})")
    assert all(rep["ops"] == n_ops for rep in reports), [rep["ops"] for rep in reports]
    bad = {r: rep["wrong"] for r, rep in enumerate(reports) if rep["wrong"]}
    assert wrong == 0, f"{mode} w={w} seed={seed}: {wrong} wrong results\n" + \
        "\n".join(f"rank {r}: " + "\n  ".join(v) for r, v in bad.items())
    if n_ops >= 400:
        # the sequence really crossed braid's CPU paths (gloo's own call, shm alone, a split)
        assert paths.get("split", 0) > 0 and paths.get("gloo", 0) > 0 and paths.get("shm", 0) > 0, paths
    left = {e for e in braid_shm_entries() if any(e.startswith(f"braid-{p}-") for p in info["pids"])}
    assert not left, left


@pytest.mark.parametrize("mode,route", [("direct", "auto"), ("backend", "auto"), ("direct", "on")])
def test_fuzz_on_pretend_nodes(mode, route, capsys):
    """The same random sequence on 4 ranks cut into 2 pretend nodes, calls from 64 KiB in node and
    rail steps (BRAID_HIER=1), smaller ones whole; with BRAID_ROUTE=on every uneven all_to_all also
    crosses on the rails the router plans: every result checked, no call in the wrong order."""
    n_ops = max(1, TOTAL_OPS // 8)
    seed = BASE_SEED + 4000 + (0 if mode == "direct" else 1) + (2 if route == "on" else 0)
    env = dict(ENV, BRAID_FAKE_NODES="2", BRAID_HIER="1", BRAID_HIER_MIN_BYTES=str(64 << 10), BRAID_ROUTE=route)
    t0 = time.monotonic()
    reports = run_world(_fuzz_worker, 4, mode, seed, n_ops, init_pg=mode == "direct", env=env,
                        timeout=_world_timeout(n_ops) * 2)
    errors = {r: rep["error"] for r, rep in enumerate(reports) if rep["error"]}
    assert not errors, f"{mode} pretend nodes seed={seed}:\n" + "\n".join(f"rank {r}: {e}" for r, e in errors.items())
    wrong = sum(rep["n_wrong"] for rep in reports)
    paths = reports[0]["paths"]
    with capsys.disabled():
        print(f"\nfuzz {mode} 2 x 2 pretend nodes route={route} seed={seed}: ops={reports[0]['ops']} wrong={wrong} "
              f"seconds={time.monotonic() - t0:.1f} paths={paths}")
    bad = {r: rep["wrong"] for r, rep in enumerate(reports) if rep["wrong"]}
    assert wrong == 0, f"{mode} pretend nodes seed={seed}: {wrong} wrong\n" + \
        "\n".join(f"rank {r}: " + "\n  ".join(v) for r, v in bad.items())
    if n_ops >= 200:
        assert paths.get("steps", 0) > 0 and paths.get("gloo", 0) > 0, paths


# ---------------------------------------------------------------------------------------------
# bugs the fuzz found, reproduced small
# ---------------------------------------------------------------------------------------------

def _bugs_worker(rank: int, w: int) -> dict:
    import braid
    comm = braid.init()
    out: dict = {}
    # 1. reduce of integers, whole on gloo
    comm.set_calibration({f"reduce/{w}": dict(FAST_LANES)})
    t = torch.tensor([(1 << 40) + 1 + rank], dtype=torch.int64)
    comm.reduce(t, 0)
    out["reduce_int64_sum"] = [t.item(), comm.last_handle.shares]
    t = torch.tensor([(1 << 24) + 1], dtype=torch.int32)
    comm.reduce(t, 0, "max")
    out["reduce_int32_max"] = [t.item(), comm.last_handle.shares]
    comm.set_calibration({})
    # 2. a tensor of 0 or 1 elements whose stride is not 1 (torch calls it contiguous)
    for name, x, n in (("one", torch.tensor([10 + rank, -1], dtype=torch.int64)[::2], 1),
                       ("zero", torch.empty(0, 2, dtype=torch.int64)[:, 0], 0)):
        assert x.is_contiguous() and x.numel() == n and (n == 0 or x.stride() == (2,))
        got = torch.full((n * w,), -7, dtype=torch.int64)
        try:
            comm.all_gather_into_tensor(got, x)
            out[f"strided_{name}"] = got.tolist()
        except Exception as exc:          # noqa: BLE001  reported to the test
            out[f"strided_{name}"] = f"{type(exc).__name__}: {exc}"
    return out


@pytest.fixture(scope="module")
def bugs():
    return run_world(_bugs_worker, 2, env=ENV, timeout=60)


def test_reduce_of_integers_whole_on_gloo_is_exact(bugs):
    r0 = bugs[0]
    assert r0["reduce_int64_sum"][1] == {"gloo": 1.0}, r0      # the path the bug is on
    assert r0["reduce_int64_sum"][0] == 2 * (1 << 40) + 3, r0
    assert r0["reduce_int32_max"][0] == (1 << 24) + 1, r0


def test_strided_tensor_of_0_or_1_elements_is_accepted(bugs):
    for rep in bugs:
        assert rep["strided_one"] == [10, 11], rep
        assert rep["strided_zero"] == [], rep


def _p2p_histories_worker(rank: int, w: int) -> dict:
    """Rank 2 sends 622,894 bytes to rank 1, then rank 0 sends 920,644 bytes to rank 2: both in
    the same log2 size bucket, both split over gloo + shm."""
    import braid
    comm = braid.init()
    a, b = 622_894, 920_644
    if rank == 2:
        comm.send(torch.ones(a, dtype=torch.uint8), 1)
    if rank == 1:
        comm.recv(torch.empty(a, dtype=torch.uint8), 2)
    if rank == 0:
        comm.send(torch.full((b,), 5, dtype=torch.uint8), 2)
    if rank == 2:
        t = torch.empty(b, dtype=torch.uint8)
        comm.recv(t, 0)
        return {"ok": bool((t == 5).all())}
    return {"ok": True}


def _p2p_calibration_worker(rank: int, w: int) -> dict:
    """A deferred send (rank 0) and a recv that starts at once (rank 1, its peer had posted); then
    both ranks change the calibration at the same point, then wait."""
    import braid
    comm = braid.init()
    x = torch.full((100,), 3, dtype=torch.uint8)
    got = torch.zeros(100, dtype=torch.uint8)
    if rank == 1:
        time.sleep(1.0)
        h = comm.recv(got, 0, async_op=True)
    else:
        h = comm.send(x, 1, async_op=True)
        time.sleep(2.0)
    comm.set_calibration({f"send_recv/{w}": dict(FAST_LANES)})
    h.wait()
    return {"ok": rank == 0 or bool((got == 3).all())}


@pytest.mark.parametrize("case", ["histories", "calibration"])
def test_split_send_recv_shares_agree_across_pairs(case):
    if case == "histories":
        res = run_world(_p2p_histories_worker, 3, env=dict(ENV, BRAID_TIMEOUT_S="5"), timeout=40)
    else:
        res = run_world(_p2p_calibration_worker, 2, env=dict(ENV, BRAID_TIMEOUT_S="3"), timeout=40)
    assert all(r["ok"] for r in res), res


def _p2p_order_worker(rank: int, w: int) -> dict:
    """Rank 0 posts a split send (2,000,000 B, deferred: rank 1 has not posted yet), then a small
    send that gloo's own call takes whole; rank 1 posts the matching recvs in the same order."""
    import braid
    comm = braid.init()
    comm.set_calibration({f"send_recv/{w}": dict(FAST_LANES)})
    big, small = 2_000_000, 280
    if rank == 0:
        h1 = comm.send(torch.full((big,), 1, dtype=torch.uint8), 1, async_op=True)
        h2 = comm.send(torch.full((small,), 2, dtype=torch.uint8), 1, async_op=True)
        h1.wait()
        h2.wait()
        return {"ok": True}
    time.sleep(1.0)
    a, b = torch.zeros(big, dtype=torch.uint8), torch.zeros(small, dtype=torch.uint8)
    r1 = comm.recv(a, 0, async_op=True)
    r2 = comm.recv(b, 0, async_op=True)
    r1.wait()
    r2.wait()
    return {"ok": bool((a == 1).all()) and bool((b == 2).all())}


def test_send_recv_keeps_order_between_split_and_whole():
    res = run_world(_p2p_order_worker, 2, env=dict(ENV, BRAID_TIMEOUT_S="5"), timeout=40)
    assert all(r["ok"] for r in res), res
