"""GPU tier: prepared calls (comm/prepared.py) and CUDA graphs.

- 1,000+ repeated and interleaved calls of every op the copy engines replay as a graph (reduce to
  the last rank and to rank 0 among them), several
  dtypes and odd sizes, with buffers kept, reallocated at other addresses and reallocated at the
  same address (a new allocation the peers must not read through an old mapping), against a
  reference every rank computes from seeds; the calls really replayed graphs (the cache's counts);
- the same through other lane sets, interleaved: data movement and reductions with the host lane
  (alone or with the copy engines) replay a graph, so does an all_reduce with NCCL's prefix; the
  other splits with NCCL are posted between;
- a user's torch.cuda.graph capture of every op, and of every moving and reducing op on
  ce + host, replayed with new data; a split that cannot be captured raises MisuseError at
  capture time, and the way it names (the call once on NCCL outside the capture,
  then captured on NCCL) gives right replays;
- async replays waited later;
- abort while a peer's replay waits: every rank ends within BRAID_TIMEOUT_S, the next call raises.
Runs with any GPU (ranks share it where there are fewer GPUs than ranks: gpu_world.py).
"""
from __future__ import annotations

import hashlib
import os
import time

import pytest
import torch
import torch.distributed as dist

from gpu_world import needs, run

ENV = {"BRAID_MIN_SPLIT_KB": "1"}
OPS = ("all_gather", "all_gather_list", "broadcast", "all_reduce", "all_reduce_max", "reduce_scatter", "all_to_all",
       "reduce", "reduce_max")
# and an all_to_all with equal split sizes given (its round carries the replay's words)
REPEATED = OPS + ("all_to_all_splits",)
REDUCING = ("all_reduce", "all_reduce_max", "reduce_scatter", "reduce", "reduce_max")
ROOT = {"reduce": -1, "reduce_max": 0}      # -1: the last rank
DTYPES = (torch.bfloat16, torch.float32, torch.float16, torch.int32, torch.uint8)
SIZES = (1, 4097, 65_539, 1_000_003)


def _data(key, n, dtype, dev):
    """The same tensor on every rank for the same key (a stable hash: Python's is per process)."""
    g = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:7], "little"))
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g) * 2).to(dtype).to(dev)
    return torch.randint(0, 7, (n,), generator=g).to(dtype).to(dev)


def _reduce(xs, how, dtype):
    """braid's reduction order: rank order, float32 accumulation for half types, rounded once."""
    if how == "max":
        out = xs[0]
        for x in xs[1:]:
            out = torch.maximum(out, x)
        return out
    acc = xs[0].float() if dtype.is_floating_point else xs[0].long()
    for x in xs[1:]:
        acc = acc + (x.float() if dtype.is_floating_point else x.long())
    return acc.to(dtype)


class _Case:
    """One op's buffers on this rank, refilled with fresh data per call."""

    def __init__(self, comm, op, n, dtype, rank, world, dev):
        self.comm, self.op, self.n, self.dtype, self.rank, self.world, self.dev = comm, op, n, dtype, rank, world, dev
        if op in ("reduce_scatter", "all_to_all", "all_to_all_splits"):
            self.n = n * world
        self.alloc()

    def alloc(self):
        n, w, dt, dev = self.n, self.world, self.dtype, self.dev
        self.x = torch.empty(n, dtype=dt, device=dev)
        if self.op == "all_gather":
            self.out = torch.empty(n * w, dtype=dt, device=dev)
        elif self.op == "all_gather_list":
            self.out = [torch.empty(n, dtype=dt, device=dev) for _ in range(w)]
        elif self.op == "reduce_scatter":
            self.out = torch.empty(n // w, dtype=dt, device=dev)
        elif self.op in ("all_to_all", "all_to_all_splits"):
            self.out = torch.empty(n, dtype=dt, device=dev)
        else:
            self.out = self.x

    def fill(self, key):
        self.xs = [_data((key, r), self.n, self.dtype, self.dev) for r in range(self.world)]
        self.x.copy_(self.xs[self.rank])

    def call(self, key, async_op=False):
        self.fill(key)
        return self.run(async_op)

    def run(self, async_op=False):
        c, op = self.comm, self.op
        if op == "all_gather":
            return c.all_gather_into_tensor(self.out, self.x, async_op=async_op)
        if op == "all_gather_list":
            return c.all_gather(self.out, self.x, async_op=async_op)
        if op == "broadcast":
            return c.broadcast(self.x, self.world - 1, async_op=async_op)
        if op == "reduce_scatter":
            return c.reduce_scatter_tensor(self.out, self.x, async_op=async_op)
        if op == "all_to_all":
            return c.all_to_all_single(self.out, self.x, async_op=async_op)
        if op == "all_to_all_splits":           # equal split sizes given, as torch's functional op does
            m = [self.n // self.world] * self.world
            return c.all_to_all_single(self.out, self.x, m, m, async_op=async_op)
        red = dist.ReduceOp.MAX if op.endswith("_max") else dist.ReduceOp.SUM
        if op in ROOT:
            return c.reduce(self.x, self.root, op=red, async_op=async_op)
        return c.all_reduce(self.x, op=red, async_op=async_op)

    @property
    def root(self) -> int:
        return ROOT[self.op] % self.world

    def right(self) -> bool:
        xs, op = self.xs, self.op
        if op == "all_gather":
            exp, got = torch.cat(xs), self.out
        elif op == "all_gather_list":
            exp, got = torch.cat(xs), torch.cat(self.out)
        elif op == "broadcast":
            exp, got = xs[-1], self.x
        elif op == "reduce_scatter":
            m = self.n // self.world
            exp, got = _reduce(xs, "sum", self.dtype)[self.rank * m:(self.rank + 1) * m], self.out
        elif op in ("all_to_all", "all_to_all_splits"):
            m, r = self.n // self.world, self.rank
            exp, got = torch.cat([x[r * m:(r + 1) * m] for x in xs]), self.out
        elif op in ROOT and self.rank != self.root:      # a reduce leaves the other ranks' tensors as they were
            exp, got = xs[self.rank], self.x
        else:
            exp, got = _reduce(xs, "max" if op.endswith("_max") else "sum", self.dtype), self.x
        if self.world > 2 and self.dtype.is_floating_point and op in ("all_reduce", "reduce_scatter", "reduce"):
            # more than two rows: torch.sum's own order within braid's rank-ordered reduction
            tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[self.dtype] * self.world
            return bool(((got.double() - exp.double()).abs() <= tol * (exp.double().abs() + 1)).all())
        return torch.equal(got.reshape(-1).view(torch.uint8), exp.reshape(-1).view(torch.uint8))


def _repeated(rank, world, comm, dev):
    prep = comm._prepared
    g = torch.Generator().manual_seed(5)                  # the same sequence on every rank
    cases = {}
    wrong, calls, staged = [], 0, 0
    with comm.fixed_shares({"ce": 1.0}):
        for i in range(1000):
            op = REPEATED[int(torch.randint(len(REPEATED), (1,), generator=g))]
            dt = DTYPES[int(torch.randint(len(DTYPES), (1,), generator=g))]
            n = SIZES[int(torch.randint(len(SIZES), (1,), generator=g))]
            if op in REDUCING:
                if dt == torch.uint8:
                    dt = torch.int32
            what = int(torch.randint(10, (1,), generator=g))
            key = (op, dt, n)
            c = cases.get(key)
            if c is None:
                c = cases[key] = _Case(comm, op, n, dt, rank, world, dev)
            elif what == 0:                                # new buffers (another address)
                c.alloc()
            elif what == 1:                                # a new allocation, the same address wanted
                c.x = c.out = None
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                c.alloc()
            if what == 2:                                  # async, waited after the check below
                h = c.call(("rep", i), async_op=True)
                h.wait()
            else:
                c.call(("rep", i))
            calls += 1
            # a reduce of fewer elements than ranks takes the staged path (some rank has nothing
            # to push to the root), not a graph
            staged += op in ROOT and c.n < world
            if not c.right():
                wrong.append((i, op, str(dt), n, what))
    assert not wrong, f"rank {rank}: {len(wrong)} of {calls} calls wrong, first {wrong[:5]}"
    st = prep.stats
    assert st["graphs"] > 0 and st["replays"] >= calls - staged - 50, (staged, st)    # tiny calls may go to NCCL whole
    if comm._rounds is None and prep.fast is not False:
        # the native call (BRAID_NATIVE_CALL, default on) took the repeats whose round matched:
        # launched them itself, or handed them to Python where a peer was not there within the
        # spin (ranks sharing a GPU and checking every call drift apart by milliseconds)
        assert prep.fast is not None and st["native_calls"] > 0, st
        assert st["native_calls"] + st["native_late"] > st["hits"] // 2, st
    if comm._rounds is not None:
        # BRAID_DEFER=1: most cache hits were deferred (about 360 of the 1,000 calls hit: the rest
        # are new shapes and reallocations), and most of those launched by the native launcher
        comm._rounds.drain()
        assert st["deferred"] > st["hits"] // 2, st
        if comm._rounds._native is not None:
            assert st.get("native", 0) > st["deferred"] // 2, st


@needs(2)
def test_thousand_repeated_calls_two_ranks(tmp_path):
    run(2, tmp_path, _repeated, ENV)


@needs(4)
def test_thousand_repeated_calls_four_ranks(tmp_path):
    run(4, tmp_path, _repeated, ENV)


# the same with the round and the launch on the communicator's rounds thread (comm/rounds.py):
# a new allocation at the same address is a changed word there, rebuilt on the thread
DEFER = {**ENV, "BRAID_DEFER": "1"}


@needs(2)
def test_thousand_repeated_calls_deferred_two_ranks(tmp_path):
    run(2, tmp_path, _repeated, DEFER)


@needs(4)
def test_thousand_repeated_calls_deferred_four_ranks(tmp_path):
    run(4, tmp_path, _repeated, DEFER)


@needs(2)
def test_thousand_repeated_calls_deferred_python_launcher(tmp_path):
    run(2, tmp_path, _repeated, {**DEFER, "BRAID_DEFER_NATIVE": "0"})


MOVING = ("all_gather", "all_gather_list", "broadcast")       # data movement through run_prepared


def _other_lanes(rank, world, comm, dev):
    """Other lane sets through the cache, every op's calls interleaved with the others' and with
    new buffers now and then: with the host lane (alone or beside the copy engines) a data
    movement or a reduction replays one graph (its host part staged through the graph rings with
    replay-safe flags); an all_reduce with NCCL's prefix replays one too (NCCL's call captured in
    it); the other splits with NCCL are posted eagerly between them."""
    prep = comm._prepared
    g = torch.Generator().manual_seed(11)
    for shares in ({"ce": 0.5, "host": 0.5}, {"nccl": 0.5, "ce": 0.5}, {"host": 1.0}, {"ce": 0.7, "host": 0.3},
                   {"nccl": 0.4, "ce": 0.3, "host": 0.3}):
        graphs, replays = prep.stats["graphs"], prep.stats["replays"]
        with comm.fixed_shares(shares):
            # (gpu_world's 512 KiB ring slots: the all_gather's host part goes round the graph ring)
            cases = {op: _Case(comm, op, 300_007 if op != "all_gather" else 2_500_001, torch.bfloat16,
                               rank, world, dev) for op in OPS}
            for i in range(8):
                order = torch.randperm(len(OPS), generator=g).tolist()
                for j in order:
                    op = OPS[j]
                    c = cases[op]
                    if i == 5:
                        c.alloc()                       # new buffers: a new word, a new program
                    if (i + j) % 4 == 0:                # async, waited after the next op's call
                        h = c.call(("other", str(shares), op, i), async_op=True)
                        h.wait()
                    else:
                        c.call(("other", str(shares), op, i))
                    assert c.right(), (shares, op, i)
        torch.cuda.synchronize()
        if "nccl" not in shares:
            # every moving and reducing op built a program (and again after its new buffers) and
            # replayed the rest
            n = len(MOVING) + len(REDUCING)
            assert prep.stats["graphs"] - graphs >= 2 * n, (shares, prep.stats)
            assert prep.stats["replays"] - replays >= 5 * n, (shares, prep.stats)
        else:
            # the all_reduces (sum and max) captured NCCL's prefix in their programs
            assert prep.stats["graphs"] - graphs >= 4 and prep.stats["replays"] - replays >= 10, (shares, prep.stats)
    assert comm._prepared.stats["hits"] > 0


@needs(2)
def test_other_lane_sets_through_the_cache(tmp_path):
    run(2, tmp_path, _other_lanes, ENV)


@needs(4)
def test_other_lane_sets_through_the_cache_four_ranks(tmp_path):
    run(4, tmp_path, _other_lanes, ENV)


def _captured(c, op, tag) -> None:
    """The call (made once before) captured in a user's graph, replayed five times with new data
    in the same buffers: every replay right."""
    c.call(("warm", tag, op))                           # prepared before the capture
    assert c.right()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        c.run()
    torch.cuda.synchronize()
    dist.barrier()
    for i in range(5):
        c.fill(("replay", tag, op, i))
        graph.replay()
        torch.cuda.synchronize()
        assert c.right(), (tag, op, i)
    del graph


def _uneven_case(rank, world, dev):
    m, k = 1 << 18, 4096
    mat = [[m + (k if (s, d) == (0, 1) else 0) for d in range(world)] for s in range(world)]
    ins, outs = mat[rank], [mat[s][rank] for s in range(world)]
    out = torch.empty(sum(outs), device=dev)
    x = torch.empty(sum(ins), device=dev)

    def fill(key):
        xs = [_data((key, s), sum(mat[s]), torch.float32, dev) for s in range(world)]
        x.copy_(xs[rank])
        return torch.cat([xs[s][sum(mat[s][:rank]): sum(mat[s][:rank + 1])] for s in range(world)])
    return x, out, ins, outs, fill


def _uneven_refused(comm, rank, world, dev):
    """An uneven all_to_all split over the copy engines and the host lane takes the full path, on
    the copy engines alone their uneven path; both post with counters that rise from call to
    call: right eagerly, and refused with a clear error inside a user's capture (captured, a
    compiled step's all_to_all was wrong on its second replay: it passed its waits before the
    peers were ready)."""
    from braid.errors import MisuseError
    x, out, ins, outs, fill = _uneven_case(rank, world, dev)
    want = fill(("uneven",))
    comm.all_to_all_single(out, x, outs, ins)
    assert torch.equal(out, want), "uneven all_to_all"
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(MisuseError, match="cannot be captured"):
        with torch.cuda.graph(graph):
            comm.all_to_all_single(out, x, outs, ins)
    torch.cuda.synchronize()
    dist.barrier()


def _user_graphs(rank, world, comm, dev):
    from braid.errors import MisuseError
    with comm.fixed_shares({"ce": 1.0}):
        for op in OPS:
            _captured(_Case(comm, op, 1_000_003, torch.float32, rank, world, dev), op, "ce")
        _captured(_Case(comm, "all_to_all_splits", 1_000_003, torch.float32, rank, world, dev),
                  "all_to_all_splits", "ce")
        _uneven_refused(comm, rank, world, dev)         # the copy engines' uneven path (comm/a2av.py)
    with comm.fixed_shares({"ce": 0.5, "host": 0.5}):
        # the copy engines and the host lane: captured; an all_to_all with equal split sizes (a
        # compiled step's) as the balanced call it is
        for op in MOVING + REDUCING + ("all_to_all", "all_to_all_splits"):
            _captured(_Case(comm, op, 1_000_003, torch.float32, rank, world, dev), op, "ce+host")
        _uneven_refused(comm, rank, world, dev)
    with comm.fixed_shares({"nccl": 0.5, "ce": 0.5}):
        # NCCL's prefix and the copy engines' share in one program
        _captured(_Case(comm, "all_reduce", 1_000_003, torch.float32, rank, world, dev), "all_reduce", "nccl+ce")
        c = _Case(comm, "all_gather", 1_000_003, torch.float32, rank, world, dev)
        c.call(("warm3",))
        c.fill(("nope",))
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(MisuseError, match="cannot be captured"):   # a split with NCCL
            with torch.cuda.graph(graph):
                c.run()
    torch.cuda.synchronize()
    dist.barrier()
    assert comm._prepared.stats["captured"] >= len(OPS) + len(MOVING) + len(REDUCING) + 4


@needs(2)
def test_user_cuda_graph_capture(tmp_path):
    run(2, tmp_path, _user_graphs, ENV)


def _captured_on_nccl(rank, world, comm, dev):
    """What the capture error advises for a call that cannot be captured: the same call once
    under comm.fixed_shares({'nccl': 1.0}) outside the capture, then captured under it. An
    uneven all_to_all (eagerly on the copy engines first, refused inside a capture there) and a
    reduce_scatter split with NCCL: five replays right with new data, the eager calls right after."""
    from braid.errors import MisuseError
    x, out, ins, outs, fill = _uneven_case(rank, world, dev)
    with comm.fixed_shares({"ce": 1.0}):
        want = fill(("ce",))
        comm.all_to_all_single(out, x, outs, ins)
        assert torch.equal(out, want), "uneven all_to_all on ce"
        with pytest.raises(MisuseError, match="once outside the captured region"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                comm.all_to_all_single(out, x, outs, ins)
    torch.cuda.synchronize()
    dist.barrier()
    c = _Case(comm, "reduce_scatter", 1_000_003, torch.float32, rank, world, dev)
    with comm.fixed_shares({"nccl": 0.5, "ce": 0.5}):
        c.call(("split",))
        assert c.right(), "reduce_scatter on nccl + ce"
    cases = (("uneven", lambda key: fill(key), lambda: comm.all_to_all_single(out, x, outs, ins),
              lambda want: torch.equal(out, want)),
             ("reduce_scatter", lambda key: c.fill(key), c.run, lambda want: c.right()))
    with comm.fixed_shares({"nccl": 1.0}):
        for tag, make, call, right in cases:
            want = make(("eager", tag))
            call()                                      # NCCL's first run of this call: outside
            torch.cuda.synchronize()
            assert right(want), ("eager", tag)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                call()
            torch.cuda.synchronize()
            dist.barrier()
            for i in range(5):
                want = make(("replay", tag, i))
                graph.replay()
                torch.cuda.synchronize()
                assert right(want), ("replay", tag, i)
            del graph
    for tag, make, call, right in cases:                # braid's own choice again, eagerly
        want = make(("after", tag))
        call()
        torch.cuda.synchronize()
        assert right(want), ("after", tag)
    dist.barrier()


@needs(2)
def test_a_capture_on_nccl_after_one_call_outside(tmp_path):
    run(2, tmp_path, _captured_on_nccl, {**ENV, "BRAID_A2AV_CE_MIN_MB": "1"})


def _abort_in_replay(rank, world, comm, dev):
    """Rank 1's GPU is held behind a long kernel while its replay is queued; then it aborts.
    Rank 0's replay waits for rank 1's flags on the GPU until the abort releases them."""
    import threading
    from braid.errors import LaneFailureError

    def deadline():                     # never hang the tier: fail this rank instead
        time.sleep(120)
        print(f"rank {rank}: abort test still running after 120 s", flush=True)
        os._exit(3)
    threading.Thread(target=deadline, daemon=True).start()
    with comm.fixed_shares({"ce": 1.0}):
        c = _Case(comm, "all_gather", 4 << 20, torch.float32, rank, world, dev)
        for i in range(3):
            c.call(("ab", i))
            assert c.right()
        c.fill(("ab", 9))
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.monotonic()
        if rank == 1:
            torch.cuda._sleep(int(5e9))                   # seconds of GPU time before its replay
        c.run()
        if rank == 1:
            comm.abort("test: abort during a replay")
        torch.cuda.synchronize()                          # rank 0: released by the abort
        took = time.monotonic() - t0
        assert took < 30, took
        if rank == 0:
            while not comm.watchdog.failed and time.monotonic() - t0 < 30:
                time.sleep(0.05)                          # the watchdog reads the abort mark
            with pytest.raises(LaneFailureError, match="aborted"):
                c.call(("after",))
    dist.barrier(group=comm.gloo_group)                   # nobody exits while a peer still maps its memory
    os._exit(0)            # NCCL's communicators were aborted: no orderly teardown to run


@needs(2)
def test_abort_during_a_replay_releases_every_rank(tmp_path):
    run(2, tmp_path, _abort_in_replay, ENV)


@needs(2)
def test_abort_during_a_deferred_replay_releases_every_rank(tmp_path):
    run(2, tmp_path, _abort_in_replay, DEFER)
