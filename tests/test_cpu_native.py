"""The native all_reduce, reduce, reduce_scatter, all_to_all, all_gather and broadcast of CPU tensors (comm/_cpucoll.c
through comm/native_cpu.py): every dtype and reduction they take at 2, 3 and 4 ranks with several threads per rank and chunks small enough
that every slot is reused many times, against references built from every rank's inputs; the same
bits on every rank; calls interleaved with the other paths through the same areas; what it does
not take goes to the rounds in Python; a peer that dies, aborts or never comes inside the native
call, or leaves between replayed calls of every op, ends it on time with braid's error; its
threads end with the communicator."""
import os
import time
import zlib

import pytest
import torch

from conftest import run_world as _run_world
from test_cpu_shm import close, data, reference

# threads: 3 stripes a rank; chunks of 4 KiB: a 1 MiB call is dozens of chunks per stripe
ON = {"BRAID_CPU_SHM": "1", "BRAID_CPU_NATIVE": "1", "BRAID_CPU_THREADS": "3", "BRAID_CPU_CHUNK_KB": "4"}
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64]
OPS = ["sum", "avg", "min", "max", "product"]
# from the native path's least size (256 KiB of float32) up; none a multiple of the ranks or stripes
SIZES = [65_537, 1_000_003]


def run_world(fn, w, *args, env=None, **kw):
    return _run_world(fn, w, *args, env=dict(ON, **(env or {})), **kw)


def _digest(t):
    return zlib.crc32(t.contiguous().view(-1).view(torch.uint8).numpy())


def _every_worker(rank, w):
    import torch.distributed as dist
    import braid
    comm = braid.init()
    bad, digests = [], []
    native = lambda: comm._cpu.native_calls       # noqa: E731
    comm.all_reduce(torch.ones(1 << 17))            # the pool exists
    for n in SIZES:
        for dt in DTYPES if w < 8 else (torch.float32, torch.bfloat16, torch.int64):
            if dt.itemsize * n < 256 << 10 or not comm._cpu._native.takes(dt, "sum"):
                continue        # below the native path's size; float16 where the compiler has no _Float16
            for k, name in enumerate(OPS):
                xs = [data(r, n, dt, 31 * k + n % 97) for r in range(w)]
                t = xs[rank].clone()
                before = native()
                comm.all_reduce(t, op=name)
                if native() != before + 1:
                    bad.append(f"{name} {dt} n={n}: not the native path")
                if not close(t, reference(xs, name, 1.0), xs, name):
                    bad.append(f"{name} {dt} n={n}: wrong")
                digests.append((name, str(dt), n, _digest(t)))
                ar = t
                m = n // w
                before = native()
                out = torch.empty(m, dtype=dt)
                comm.reduce_scatter_tensor(out, xs[rank][: m * w].clone(), op=name)
                part = [x[rank * m:(rank + 1) * m] for x in xs]
                if native() != before + (m * w * dt.itemsize >= 256 << 10):
                    bad.append(f"reduce_scatter {name} {dt} n={n}: not the path its size takes")
                if not close(out, reference(part, name, 1.0), part, name):
                    bad.append(f"reduce_scatter {name} {dt} n={n}: wrong")
                root = (k + n) % w          # a reduce: the root alone gets the result
                t = xs[rank].clone()
                before = native()
                comm.reduce(t, dst=root, op=name)
                if native() != before + 1:
                    bad.append(f"reduce {name} {dt} n={n}: not the native path")
                if rank == root and not close(t, reference(xs, name, 1.0), xs, name):
                    bad.append(f"reduce {name} {dt} n={n} root {root}: wrong")
                if rank != root and not torch.equal(t.view(torch.uint8), xs[rank].view(torch.uint8)):
                    bad.append(f"reduce {name} {dt} n={n} root {root}: a non-root tensor changed")
                if rank == root and not torch.equal(t.view(torch.uint8), ar.view(torch.uint8)):
                    bad.append(f"reduce {name} {dt} n={n}: other bits than the all_reduce's")
            # all_to_all_single: blocks of m elements, bitwise (bytes move whatever the dtype)
            m = n // w
            inp = xs[rank][: m * w].clone()
            out = torch.full_like(inp, 7)
            before = native()
            comm.all_to_all_single(out, inp)
            if native() != before + (m * w * dt.itemsize >= 256 << 10):
                bad.append(f"all_to_all {dt} n={n}: not the path its size takes")
            want = torch.cat([x[rank * m:(rank + 1) * m] for x in xs])
            if not torch.equal(out.view(torch.uint8), want.view(torch.uint8)):
                bad.append(f"all_to_all {dt} n={n}: wrong")
            # all_gather_into_tensor of every rank's whole input, bitwise
            out = torch.full((w * n,), 7, dtype=dt)
            before = native()
            comm.all_gather_into_tensor(out, xs[rank])
            if native() != before + 1:
                bad.append(f"all_gather {dt} n={n}: not the native path")
            if not torch.equal(out.view(torch.uint8), torch.cat(xs).view(torch.uint8)):
                bad.append(f"all_gather {dt} n={n}: wrong")
            # broadcast from every root in turn, bitwise; the others' tensors start as garbage
            for root in range(w):
                t = xs[rank].clone() if rank == root else torch.full_like(xs[rank], 7)
                before = native()
                comm.broadcast(t, root)
                if native() != before + 1:
                    bad.append(f"broadcast {dt} n={n}: not the native path")
                if not torch.equal(t.view(torch.uint8), xs[root].view(torch.uint8)):
                    bad.append(f"broadcast {dt} n={n} root {root}: wrong")
    every = [None] * w
    dist.all_gather_object(every, digests, group=comm.gloo_group)
    for e in every:
        if e != digests:
            bad.append(f"ranks differ: {[a[:3] for a, b in zip(digests, e) if a != b][:3]}")
    braid.close()
    return bad


@pytest.mark.parametrize("w", [2, 3, 4, 8])
def test_every_dtype_and_reduction(w):
    # 8 ranks on a machine of few cores: one thread a rank (the others wait on cores, not data)
    env = {"BRAID_CPU_THREADS": "1"} if w == 8 else None
    for bad in run_world(_every_worker, w, timeout=300, env=env):
        assert bad == [], bad


def _lagged_worker(rank, w, lags, streams):
    """_every_worker with this rank's chunks a turn apart in every op or none (lags[rank]:
    BRAID_CPU_LAG) and its copies into its own tensors past the caches or not (streams[rank]:
    BRAID_CPU_STREAM)."""
    from braid.comm import native_cpu
    lib = native_cpu.build()
    every = native_cpu.kinds(native_cpu.envs.NATIVE_CPU_OPS)
    lib.cpucoll_set_lag(every if lags[rank] else 0)
    lib.cpucoll_set_stream(every if streams[rank] else 0)
    return _every_worker(rank, w)


# every rank a turn apart with streaming copies, and ranks that differ in both (each wait is for a
# turn a peer already ran; how a rank writes its own tensor is its own affair)
@pytest.mark.parametrize("lags, streams", [((1, 1, 1), (1, 1, 1)), ((1, 0, 0, 1), (0, 1, 0, 1))],
                         ids=["3-ranks-lag-1-streaming", "4-ranks-that-differ"])
def test_every_dtype_and_reduction_with_chunks_a_turn_apart(lags, streams):
    for bad in run_world(_lagged_worker, len(lags), lags, streams, timeout=300):
        assert bad == [], bad


def _mixed_worker(rank, w):
    """Native calls between the rounds in Python of every other op, which write the same areas."""
    import braid
    comm = braid.init()
    bad = []
    g = torch.Generator().manual_seed(5)
    for i in range(120):
        n = int(torch.randint(1, 400_000, (1,), generator=g))
        op = ["ar", "ar", "rs", "ag", "bc", "reduce"][i % 6]
        xs = [data(r, n * w, torch.float32, i) for r in range(w)]
        if op == "ar":
            t = xs[rank].clone()
            comm.all_reduce(t)
            ok = close(t, reference(xs, "sum", 1.0), xs, "sum")
        elif op == "rs":
            out = torch.empty(n)
            comm.reduce_scatter_tensor(out, xs[rank].clone())
            part = [x[rank * n:(rank + 1) * n] for x in xs]
            ok = close(out, reference(part, "sum", 1.0), part, "sum")
        elif op == "ag":
            out = torch.empty(n * w * w)
            comm.all_gather_into_tensor(out, xs[rank])
            ok = torch.equal(out, torch.cat(xs))
        elif op == "bc":
            t = xs[rank].clone()
            comm.broadcast(t, i % w)
            ok = torch.equal(t, xs[i % w])
        else:
            t = xs[rank].clone()
            comm.reduce(t, i % w)
            ok = close(t, reference(xs, "sum", 1.0), xs, "sum") if rank == i % w else torch.equal(t, xs[rank])
        if not ok:
            bad.append((i, op, n))
    calls = comm._cpu.native_calls
    braid.close()
    return bad, calls


def test_interleaved_with_the_other_paths():
    res = run_world(_mixed_worker, 3, timeout=300)
    for bad, calls in res:
        assert bad == []
        assert calls > 20           # about a third of the calls are native all_reduces


def _floor_worker(rank, w):
    """The bench's floor of the native all_reduce (every rank's copies and reductions, no wait):
    it runs on every rank at once, writes its scratch tensor, and leaves the native calls and
    their areas as they were: the calls around it stay right."""
    import torch.distributed as dist
    import braid
    comm = braid.init()
    out = []
    for k, dt in enumerate((torch.float32, torch.bfloat16)):
        xs = [data(r, 1_000_003, dt, 5 + k) for r in range(w)]
        t = xs[rank].clone()
        comm.all_reduce(t)
        right = [bool(close(t, reference(xs, "sum", 1.0), xs, "sum"))]
        calls = comm._cpu.native_calls
        ran, changed = [], []
        for _ in range(3):
            scratch = data(rank, 1_000_003, dt, 11)
            before = scratch.clone()
            dist.barrier(group=comm.gloo_group)
            ran.append(comm._cpu.all_reduce_floor(scratch))
            changed.append(not torch.equal(scratch.view(torch.uint8), before.view(torch.uint8)))
        xs = [data(r, 1_000_003, dt, 50 + k) for r in range(w)]
        t = xs[rank].clone()
        comm.all_reduce(t)
        right.append(bool(close(t, reference(xs, "sum", 1.0), xs, "sum")))
        out.append((ran, changed, right, comm._cpu.native_calls - calls))
    small = comm._cpu.all_reduce_floor(torch.ones(1000))      # below the native path: not taken
    braid.close()
    return out, small


@pytest.mark.parametrize("w", [2, 3])
def test_the_benchs_floor_runs_beside_the_calls_without_touching_them(w):
    for out, small in run_world(_floor_worker, w, timeout=240):
        assert small is False
        for ran, changed, right, calls in out:
            assert ran == [True] * 3 and all(changed) and right == [True, True] and calls == 1


def _autograd_worker(rank, w):
    """A tensor autograd saved, then reduced in place by the native path: backward says it was
    modified, as after torch's own in-place ops."""
    import braid
    comm = braid.init()
    w_ = torch.ones(300_001, requires_grad=True)
    x = torch.ones(300_001)
    y = (w_ * x).sum()           # saves x
    v = x._version
    comm.all_reduce(x)
    try:
        y.backward()
        raised = ""
    except RuntimeError as e:
        raised = str(e)
    return x._version > v, "modified by an inplace operation" in raised, comm._cpu.native_calls


def test_an_in_place_write_counts_for_autograd():
    for bumped, caught, calls in run_world(_autograd_worker, 2):
        assert calls == 1 and bumped and caught


def _fallback_worker(rank, w):
    import braid
    comm = braid.init()
    out = []
    for dt, name in ((torch.int8, "sum"), (torch.float32, "premul_sum"), (torch.float32, "sum")):
        xs = [data(r, 300_001, dt, 3) for r in range(w)]
        t = xs[rank].clone()
        before = comm._cpu.native_calls
        comm.all_reduce(t, op=braid.PremulSum(0.5) if name == "premul_sum" else name)
        want = reference(xs, name, 0.5)
        out.append((str(dt), name, comm._cpu.native_calls - before, bool(close(t, want, xs, name)),
                    comm.last_call[-1]))
    braid.close()
    return out


def test_what_it_does_not_take_runs_in_python():
    for rows in run_world(_fallback_worker, 2):
        assert [r[2] for r in rows] == [0, 0, 1]
        assert all(r[3] for r in rows) and all(r[4] == "shm" for r in rows)
    for rows in run_world(_fallback_worker, 2, env={"BRAID_CPU_NATIVE": "0"}):
        assert [r[2] for r in rows] == [0, 0, 0]
        assert all(r[3] for r in rows)


def _disagree_worker(rank, w, n):
    os.environ["BRAID_CPU_NATIVE"] = "1" if rank == 0 else "0"
    import braid
    from braid.errors import PeerMismatchError
    comm = braid.init()
    t = torch.ones(n)
    try:
        comm.all_reduce(t)
        return "no error"
    except PeerMismatchError as e:
        return str(e)


@pytest.mark.parametrize("w,n", [(2, 300_001), (3, 1_001)])
def test_ranks_that_disagree_on_the_native_path_raise(w, n):
    """BRAID_CPU_NATIVE set on one rank only: a mismatch on every rank, never a wait (a call of
    the pool's size, and a small one of three ranks, reduced on the caller's thread in C)."""
    res = run_world(_disagree_worker, w, n, timeout=60)
    for text in res:
        assert "different calls" in text and "in native code" in text, text


def _roots_worker(rank, w):
    import braid
    from braid.errors import PeerMismatchError
    comm = braid.init()
    t = torch.ones(300_001)
    try:
        comm.broadcast(t, rank)                     # every rank names itself the root
        return "no error"
    except PeerMismatchError as e:
        return str(e)


def test_a_native_broadcast_whose_ranks_name_other_roots_raises():
    for text in run_world(_roots_worker, 3, timeout=60):
        assert "different calls" in text, text
        for r in range(3):
            assert f"rank {r}: broadcast of {300_001 * 4} bytes (dtype code" in text and f"detail {r}, in native" in text, text


def _threads():
    return len(os.listdir("/proc/self/task"))


def _fault_worker(rank, w, how):
    """Rank 1 passes the call's header round, then dies, aborts or stays away: rank 0 is inside
    the native pool, waiting on rank 1's counters."""
    import braid
    from braid.comm import native_cpu
    comm = braid.init()
    t = torch.ones(300_001)
    comm.all_reduce(t)                  # the pool exists, the path works
    if rank == 1:
        cpu = comm._cpu
        from braid.comm.cpushm import NATIVE_BIT
        code = 1 | NATIVE_BIT       # the header's detail of a plain sum in native threads (cpushm._NAMES)
        cpu._round("all_reduce", t.numel() * 4, t.dtype, code, (cpu._native.threads, 4, 128))
        if how == "die":
            os._exit(3)
        if how == "abort":
            comm.segment.mark_aborted(4, "rank 1: given up for the test")
        time.sleep(8)
        return None
    t0 = time.monotonic()
    try:
        comm.all_reduce(t)
        return "no error", 0.0, ""
    except Exception as e:       # noqa: BLE001  the type, the text and the time are checked
        return type(e).__name__, time.monotonic() - t0, str(e)
    finally:
        assert native_cpu.OK == 0


@pytest.mark.parametrize("how,error", [("die", "LaneFailureError"), ("abort", "LaneFailureError"),
                                       ("away", "BraidTimeoutError")])
def test_a_peer_that_fails_inside_the_native_call(how, error):
    res = run_world(_fault_worker, 2, how, env={"BRAID_TIMEOUT_S": "3"}, allowed_exit={1: 3} if how == "die" else None,
                    timeout=60)
    name, took, text = res[0]
    assert name == error, (name, text)
    assert "rank 1" in text
    if how == "abort":
        assert "given up for the test" in text
    assert took < (5 if how != "away" else 6)


def _replayed_fault_worker(rank, w, op, how):
    """Every rank repeats one native call until it replays; then rank 1 dies or stays away, and
    rank 0's next replay (its header round in C, then the data's waits) must end with braid's
    error naming rank 1."""
    import braid
    comm = braid.init()
    n = 300_000
    def call():
        if op == "all_reduce":
            comm.all_reduce(torch.ones(n))
        elif op == "reduce_scatter":
            comm.reduce_scatter_tensor(torch.empty(n // w), torch.ones(n))
        elif op == "all_gather":
            comm.all_gather_into_tensor(torch.empty(n * w), torch.ones(n))
        elif op == "all_to_all_single":
            comm.all_to_all_single(torch.empty(n), torch.ones(n))
        else:
            comm.broadcast(torch.ones(n), 1)
    for _ in range(4):
        call()
    replays = comm._cpu_calls.replays
    if rank == 1:
        if how == "die":
            os._exit(3)
        time.sleep(8)
        return replays, None
    t0 = time.monotonic()
    try:
        call()
        return replays, ("no error", 0.0, "")
    except Exception as e:       # noqa: BLE001  the type, the text and the time are checked
        return replays, (type(e).__name__, time.monotonic() - t0, str(e))


@pytest.mark.parametrize("how,error", [("die", "LaneFailureError"), ("away", "BraidTimeoutError")])
@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter", "all_gather", "all_to_all_single", "broadcast"])
def test_a_peer_that_leaves_between_replayed_calls(op, how, error):
    res = run_world(_replayed_fault_worker, 2, op, how, env={"BRAID_TIMEOUT_S": "3"},
                    allowed_exit={1: 3} if how == "die" else None, timeout=60)
    replays, (name, took, text) = res[0]
    assert replays >= 2, replays            # the calls before were replays
    assert name == error, (name, text)
    assert "rank 1" in text
    assert took < (5 if how == "die" else 6)


def _big_a2a_worker(rank, w):
    """all_to_all_single below and above BRAID_CPU_A2A_BIG_MB (1 MiB here), odd block sizes:
    bitwise right, and how the native call ran (a turn apart with copies past the caches, or as
    BRAID_CPU_LAG / BRAID_CPU_STREAM say: neither here)."""
    import braid
    comm = braid.init()
    nat = comm._cpu._native_pool()
    got = []
    for m in (30_011, 100_003):             # int32 elements per block: 0.34-0.46 / 1.1-1.5 MiB a rank
        xs = [data(r, m * w, torch.int32, m) for r in range(w)]
        out = torch.full((m * w,), 7, dtype=torch.int32)
        for _ in range(2):                  # the full path, then the replay
            comm.all_to_all_single(out, xs[rank])
            want = torch.cat([x[rank * m:(rank + 1) * m] for x in xs])
            got.append((m, torch.equal(out, want), nat.lib.cpucoll_last_mode(nat._h)))
    braid.close()
    return got


@pytest.mark.parametrize("w,big,modes", [(4, "1", (0, 3)), (3, "1", (0, 0)), (4, "0", (0, 0))],
                         ids=["4-ranks", "3-ranks", "off"])
def test_a_big_all_to_all_runs_a_turn_apart_past_the_caches(w, big, modes):
    res = run_world(_big_a2a_worker, w, env={"BRAID_CPU_A2A_BIG_MB": big, "BRAID_CPU_LAG": "none",
                                             "BRAID_CPU_STREAM": "none"}, timeout=120)
    for rank, got in enumerate(res):
        assert [ok for _, ok, _ in got] == [True] * 4, (rank, got)
        assert [mode for _, _, mode in got] == [modes[0]] * 2 + [modes[1]] * 2, (rank, got)


def _close_worker(rank, w):
    import braid
    before = _threads()
    comm = braid.init()
    t = torch.ones(1_000_003)
    comm.all_reduce(t)
    during = _threads()
    braid.close()
    return before, during, _threads(), t[0].item()


def test_the_threads_end_with_the_communicator():
    for before, during, after, first in run_world(_close_worker, 2):
        assert first == 2.0
        assert during >= before + 2         # the pool's workers (3 threads a rank: 2 workers)
        assert after <= during - 2


def _warm_worker(rank, w):
    import braid
    comm = braid.init()
    made = comm._cpu._native is not None           # before any call
    threads = _threads()
    t = torch.full((1_000_003,), float(rank + 1))
    comm.all_reduce(t)
    return made, threads, comm._cpu._native is not None, t[0].item(), comm._cpu.native_calls


@pytest.mark.parametrize("warm", ["1", "0"])
def test_the_pool_starts_with_the_communicator_unless_warm_is_off(warm):
    """BRAID_WARM=1 (the default): the library is built and loaded and the pool's threads run
    when the communicator is made, so its first call does not compile C (1.3 s on 2 cores where
    nothing was built yet); 0: the first call that takes the native path makes them."""
    for made, threads, after, first, calls in run_world(_warm_worker, 2, env={"BRAID_WARM": warm}):
        assert made == (warm == "1")
        assert after and first == 3.0 and calls >= 1
        if warm == "1":
            assert threads >= 3                  # the main thread and the pool's 2 workers at least


def test_waits_that_find_their_core_wanted_switch_to_large_chunks_and_back():
    """NativePool.after_call: BUSY_YIELDS slow yields over two calls in a row switch this rank's
    offer to BUSY_CHUNK_KB chunks (its thread count stays) for BUSY_CALLS calls; one alone does
    not; quiet calls bring the usual offer back."""
    from braid.comm import native_cpu as N

    class Lib:
        busy = 0

        def cpucoll_busy(self, h):
            return self.busy

    pool = N.NativePool.__new__(N.NativePool)
    pool.lib, pool._h = Lib(), 1
    pool.idle_offer, pool.busy_offer = (3, 256, 1024), (3, max(256, N.BUSY_CHUNK_KB), 1024)
    pool.offer, pool._busy_calls, pool._last_busy = pool.idle_offer, 0, 0
    seen = []
    for busy in [1, 0, 0, 1, 1] + [0] * (N.BUSY_CALLS + 1):
        pool.lib.busy = busy
        pool.after_call()
        seen.append(pool.offer)
    assert seen[:4] == [pool.idle_offer] * 4                 # one slow yield in two calls: noise
    assert seen[4] == pool.busy_offer and pool.busy_offer[1] == N.BUSY_CHUNK_KB and pool.busy_offer[0] == 3
    busy_run = [o == pool.busy_offer for o in seen[4:]]
    assert busy_run == [True] * N.BUSY_CALLS + [False] * 2  # BUSY_CALLS calls from the second one, then back
    assert pool.offer == pool.idle_offer


def test_a_crowded_world_offers_large_chunks_but_for_broadcast():
    """NativePool.offer_for: with more ranks than cores every kind of call but broadcast (4)
    offers the busy offer's large chunks; otherwise, and for broadcast, the offer of the moment."""
    from braid.comm import native_cpu as N
    pool = N.NativePool.__new__(N.NativePool)
    pool.idle_offer, pool.busy_offer = (2, 256, 128), (2, N.BUSY_CHUNK_KB, 128)
    pool.offer, pool.crowded = pool.idle_offer, True
    assert [pool.offer_for(w) for w in range(5)] == [pool.busy_offer] * 4 + [pool.idle_offer]
    pool.crowded = False
    assert [pool.offer_for(w) for w in range(5)] == [pool.idle_offer] * 5
    pool.offer = pool.busy_offer                    # busy cores seen: every kind takes it
    assert [pool.offer_for(w) for w in range(5)] == [pool.busy_offer] * 5


def _crowded_worker(rank, w):
    """In a world of more ranks than cores every rank's pool knows it and offers the large
    chunks for the calls it runs, and every result is right."""
    import braid
    from braid.comm import cpushm
    comm = braid.init()
    nat = comm._cpu._native_pool()
    n = 600_011
    xs = [data(r, n, torch.float32, 5) for r in range(w)]
    t = xs[rank].clone()
    comm.all_reduce(t)
    ok = close(t, reference(xs, "sum", 1.0), xs, "sum")
    out = torch.empty(n - n % w)
    comm.all_to_all_single(out, xs[rank][: n - n % w].clone())
    m = n // w
    ok = ok and torch.equal(out, torch.cat([x[rank * m:(rank + 1) * m] for x in xs]))
    b = xs[rank].clone() if rank == 1 else torch.zeros(n)
    comm.broadcast(b, 1)
    ok = ok and torch.equal(b, xs[1])
    res = cpushm.crowded(w), nat.crowded, nat.offer_for(0), nat.busy_offer, ok
    braid.close()
    return res


def test_a_crowded_world_runs_its_calls_with_large_chunks():
    cores = len(os.sched_getaffinity(0))
    w = max(3, cores + 1) if cores < 8 else None
    if w is None:
        pytest.skip("more cores than the ranks a test world starts here")
    res = run_world(_crowded_worker, w, env={"BRAID_CPU_THREADS": "1"}, timeout=120)
    for rank, (crowded, pool_crowded, offer, busy, ok) in enumerate(res):
        assert ok, rank
        assert crowded and pool_crowded and offer == busy, (rank, offer, busy)


def _busy_cores_worker(rank, w):
    """Calls while other processes keep every core busy: every result right, the same bits on
    every rank (the native waits and the rounds' waits in Python may sleep on their counters,
    woken by the rank that raises them; the ranks may agree on larger chunks)."""
    import subprocess
    import sys

    import torch.distributed as dist
    import braid
    comm = braid.init()
    spinners = []
    if rank == 0:                                       # a busy loop per core, for the length of the calls
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                    for _ in range(len(os.sched_getaffinity(0)))]
    dist.barrier()
    bad, digests, busy = [], [], 0
    waits = 0                                           # the rounds' waits in sleeping mode, at most
    try:
        for i in range(24):
            n = (1 << 18) + 4099 * i                    # 1-1.4 MiB of float32, sizes changing
            xs = [data(r, n, torch.float32, i) for r in range(w)]
            t = xs[rank].clone()
            comm.all_reduce(t)
            if not close(t, reference(xs, "sum", 1.0), xs, "sum"):
                bad.append(f"all_reduce {i}: wrong")
            digests.append(_digest(t))
            busy = max(busy, comm._cpu._native._busy_calls)     # (on a 2-core container: 16, the busy offer)
            out = torch.empty(n * w)
            comm.all_gather_into_tensor(out, xs[rank])
            if not torch.equal(out, torch.cat(xs)):
                bad.append(f"all_gather {i}: wrong")
            m = 1000 + 37 * i                           # small calls: the rounds in Python, their waits
            ys = [data(r, m, torch.float32, 50 + i) for r in range(w)]
            u = ys[rank].clone()
            comm.all_reduce(u)
            if not close(u, reference(ys, "sum", 1.0), ys, "sum"):
                bad.append(f"small all_reduce {i}: wrong")
            digests.append(_digest(u))
            waits = max(waits, comm._cpu._busy_waits)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    comm.close()
    return bad, digests, (busy, waits)


@pytest.mark.parametrize("slow_yield_us", [None, "0"])
def test_calls_stay_right_while_other_processes_keep_the_cores_busy(slow_yield_us):
    """Also with the switch to sleeping waits off (BRAID_CPU_SLOW_YIELD_US=0): right, and no wait
    of either kind ever switched."""
    env = {"BRAID_CPU_THREADS": "1", "BRAID_CPU_CHUNK_KB": "64"}
    if slow_yield_us is not None:
        env["BRAID_CPU_SLOW_YIELD_US"] = slow_yield_us
    res = run_world(_busy_cores_worker, 2, timeout=240, env=env)
    for bad, _, _ in res:
        assert bad == []
    assert res[0][1] == res[1][1]                           # the same bits on both ranks
    if slow_yield_us == "0":
        assert [tuple(r[2]) for r in res] == [(0, 0), (0, 0)]


def _round_worker(rank, w, python_ranks, late_rank, in_c=None):
    """Every native op, their header rounds in C, except on `python_ranks` (BRAID_CPU_C_ROUND_RANKS=0:
    their rounds in Python, as a rank with sends/recvs pending runs them); `late_rank` comes to every other call
    some 30 ms late, so the others' rounds in C hand over to Python. Every result is checked
    against the reference and compared across ranks."""
    if rank in python_ranks:
        os.environ["BRAID_CPU_C_ROUND_RANKS"] = "0"
    import braid
    comm = braid.init()
    cpu = comm._cpu
    comm.all_reduce(torch.ones(1 << 17))            # the pool exists
    assert cpu._native.rounds is (rank not in python_ranks if in_c is None else in_c)
    bad, digests = [], []
    for i in range(24):
        n = 70_001 + 977 * i                        # float32: above the native path's least size
        xs = [data(r, n * w, torch.float32, 400 + i) for r in range(w)]
        if rank == late_rank and i % 2:
            time.sleep(0.03)
        op = ("all_reduce", "reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast")[i % 6]
        if op == "all_reduce":
            got = xs[rank].clone()
            comm.all_reduce(got)
            ok = close(got, reference(xs, "sum", 1.0), xs, "sum")
        elif op == "broadcast":
            got = xs[rank].clone() if rank == i % w else torch.empty_like(xs[rank])
            comm.broadcast(got, i % w)
            ok = torch.equal(got, xs[i % w])
        elif op == "reduce":
            got = xs[rank].clone()
            comm.reduce(got, i % w)
            ok = close(got, reference(xs, "sum", 1.0), xs, "sum") if rank == i % w else torch.equal(got, xs[rank])
        elif op == "reduce_scatter":
            got = torch.empty(n)
            comm.reduce_scatter_tensor(got, xs[rank].clone())
            part = [x[rank * n:(rank + 1) * n] for x in xs]
            ok = close(got, reference(part, "sum", 1.0), part, "sum")
        elif op == "all_gather":
            got = torch.empty(n * w * w)
            comm.all_gather_into_tensor(got, xs[rank])
            ok = torch.equal(got, torch.cat(xs))
        else:
            got = torch.empty(n * w)
            comm.all_to_all_single(got, xs[rank])
            ok = torch.equal(got, torch.cat([x[rank * n:(rank + 1) * n] for x in xs]))
        if not ok:
            bad.append((i, op))
        digests.append(_digest(got) if op not in ("reduce", "reduce_scatter", "all_to_all") else 0)
    counts = cpu.native_calls, cpu.late_rounds
    braid.close()
    return bad, digests, counts


@pytest.mark.parametrize("w,python_ranks,late_rank", [(2, (), None), (3, (1,), None), (3, (), 2), (4, (0, 3), 1)],
                         ids=["2-ranks-in-c", "3-ranks-one-in-python", "3-ranks-one-late", "4-ranks-mixed-and-late"])
def test_header_rounds_in_c_meet_rounds_in_python_and_late_peers(w, python_ranks, late_rank):
    res = run_world(_round_worker, w, python_ranks, late_rank, timeout=300)
    for rank, (bad, digests, (calls, late)) in enumerate(res):
        assert bad == [], (rank, bad)
        assert digests == res[0][1]             # the same bits on every rank
        assert calls >= 25                      # every call of the loop ran native (and the first)
        if late_rank is not None and rank != late_rank and rank not in python_ranks:
            assert late >= 1, (rank, late)      # some rounds began in C and ended in Python


def test_a_world_above_the_setting_runs_its_rounds_in_python():
    """BRAID_CPU_C_ROUND_RANKS=2 and 3 ranks: every round in Python, every result right."""
    res = run_world(_round_worker, 3, (), None, False, env={"BRAID_CPU_C_ROUND_RANKS": "2"}, timeout=300)
    for bad, digests, (calls, late) in res:
        assert bad == [] and digests == res[0][1] and calls >= 25 and late == 0


def _c_mismatch_worker(rank, w, late, replayed):
    import braid
    from braid.errors import PeerMismatchError
    comm = braid.init()
    comm.all_reduce(torch.ones(1 << 17))            # the pool exists
    if replayed:                                    # every rank's shape kept: their calls run again from it
        for r in range(w):
            comm.all_reduce(torch.ones(300_001 + 2 * r))
        replays = comm._cpu_calls.replays
    if late and rank == 1:
        time.sleep(0.05)
    t = torch.ones(300_001 + 2 * rank)              # every rank native, each its own size
    try:
        comm.all_reduce(t)
        return "no error"
    except PeerMismatchError as e:
        if replayed and comm._cpu_calls.replays != replays + 1:
            return "not replayed"
        return str(e)


@pytest.mark.parametrize("late,replayed", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["together", "one-late", "replayed", "replayed-one-late"])
def test_ranks_whose_native_calls_differ_raise_naming_every_call(late, replayed):
    """Header rounds in C that meet different headers: PeerMismatchError on every rank naming
    each rank's call (the round finished in C, or handed over to Python by a late peer; the
    calls run from what a first call of their shape kept, or not)."""
    for text in run_world(_c_mismatch_worker, 3, late, replayed, timeout=60):
        assert "different calls" in text, text
        for r in range(3):
            assert f"rank {r}: all_reduce of {(300_001 + 2 * r) * 4} bytes" in text, text


# shapes a repeated call comes back to (each above the native path's least size, none a multiple of
# the ranks): every op runs each of them again and again, from what its first call kept
REPEATED = [(70_001, torch.float32), (150_001, torch.bfloat16), (40_003, torch.float64), (90_007, torch.int64)]


def _replay_worker(rank, w, python_ranks, late_rank):
    """150 calls of the six native ops over a few shapes, fresh random data every call, the
    output a new tensor, a slice of a larger one (another address) or the same one, some calls
    async; among them calls the replay must leave to the full path (an output that requires
    grad, fixed shares, a recv pending) and calls of another op through the same areas. Every
    result against the reference, the same bits on every rank; `late_rank` sleeps before every
    fifth call (rounds kept in C hand over to Python), `python_ranks` run their rounds in Python."""
    import contextlib
    from torch.distributed import ReduceOp
    if rank in python_ranks:
        os.environ["BRAID_CPU_C_ROUND_RANKS"] = "0"
    import braid
    comm = braid.init()
    cpu, calls = comm._cpu, comm._cpu_calls
    bad, digests, kept = [], [], {}
    g = torch.Generator().manual_seed(11)
    spare = torch.empty(4 * 150_001 * w + 64, dtype=torch.float64)     # slices at other addresses
    full_path = 0
    for i in range(150):
        n, dt = REPEATED[int(torch.randint(len(REPEATED), (1,), generator=g))]
        op = ("all_reduce", "reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast")[
            int(torch.randint(6, (1,), generator=g))]
        how = int(torch.randint(8, (1,), generator=g))       # 0: a new tensor, 1: a slice, else the same
        special = i % 23 == 22                                # a call of a kept shape for the full path
        if special:
            op = ("all_reduce", "all_gather", "all_to_all")[i // 23 % 3]
            n, dt = REPEATED[0]
        name = "max" if dt is torch.int64 and i % 2 else "sum"
        red = getattr(ReduceOp, name.upper())
        xs = [data(r, n * w, dt, 700 + i) for r in range(w)]
        if rank == late_rank and i % 5 == 0:
            time.sleep(0.03)

        def buf(m, key):
            if how == 0:
                return torch.empty(m, dtype=dt)
            if how == 1:
                off = 8 * (1 + i % 5)
                return spare.view(torch.uint8)[off: off + m * dt.itemsize].view(dt)
            return kept.setdefault((key, m, dt), torch.empty(m, dtype=dt))
        full = False            # this call must take the full path
        ctx = contextlib.nullcontext()
        if special and op == "all_gather":
            full, ctx = True, comm.fixed_shares({"shm": 0.5, "gloo": 0.5})
        before = calls.replays
        if op in ("all_reduce", "reduce"):
            got = buf(n * w, "t")
            got.copy_(xs[rank])
            if special:
                full, got = True, got.clone().requires_grad_(True)
            version = got._version
            if op == "all_reduce":
                comm.all_reduce(got, op=red)
                ok = close(got.detach(), reference(xs, name, 1.0), xs, name)
            else:
                comm.reduce(got, i % w, op=red)
                ok = (close(got.detach(), reference(xs, name, 1.0), xs, name) if rank == i % w
                      else torch.equal(got.detach(), xs[rank]))
            if (op == "all_reduce" or rank == i % w) and got._version == version:
                bad.append((i, op, "the write did not count for autograd"))
        elif op == "reduce_scatter":
            got = buf(n, "rs")
            h = comm.reduce_scatter_tensor(got, xs[rank], op=red, async_op=i % 4 == 0)
            if h is not None:
                h.wait()
            part = [x[rank * n:(rank + 1) * n] for x in xs]
            ok = close(got, reference(part, name, 1.0), part, name)
        elif op == "broadcast":
            got = buf(n * w, "t")
            got.copy_(xs[rank] if rank == i % w else torch.zeros_like(xs[rank]))
            comm.broadcast(got, i % w)
            ok = torch.equal(got, xs[i % w])
        elif op == "all_gather":
            got = buf(n * w * w, "ag")
            with ctx:
                comm.all_gather_into_tensor(got, xs[rank])
            ok = torch.equal(got, torch.cat(xs))
        else:
            got = buf(n * w, "a2a")
            req = None
            if special and rank == 1:                         # a recv pending: the full path moves it
                req = comm.recv(sent := torch.empty(5), 0, async_op=True)
                full = bool(calls.p2p.pending)
            h = comm.all_to_all_single(got, xs[rank], async_op=i % 4 == 1)
            if h is not None:
                h.wait()
            if special and rank == 0:
                comm.send(torch.arange(5.0), 1)
            if req is not None:
                req.wait()
                if not torch.equal(sent, torch.arange(5.0)):
                    bad.append((i, "the send beside it"))
            ok = torch.equal(got, torch.cat([x[rank * n:(rank + 1) * n] for x in xs]))
        replayed = calls.replays - before
        full_path += full
        if full and replayed:
            bad.append((i, op, "replayed a call the full path must take"))
        if not ok:
            bad.append((i, op, n, str(dt), how, replayed))
        digests.append(_digest(got.detach()) if op in ("all_reduce", "all_gather", "broadcast") else 0)
        if i % 37 == 36:                                      # a call of the rounds in Python through the same areas
            t = data(rank, 1000, torch.float32, i)
            comm.broadcast(t, 0)
            if not torch.equal(t, data(0, 1000, torch.float32, i)):
                bad.append((i, "broadcast"))
    counts = calls.replays, cpu.native_calls, cpu.late_rounds, full_path
    braid.close()
    return bad, digests, counts


@pytest.mark.parametrize("w,python_ranks,late_rank,env", [
    (2, (), None, None), (3, (1,), 2, None), (3, (), None, {"BRAID_CPU_C_ROUND_RANKS": "2"})],
    ids=["2-ranks", "3-ranks-one-in-python-one-late", "3-ranks-rounds-in-python"])
def test_repeated_native_calls_run_again_from_what_they_kept(w, python_ranks, late_rank, env):
    res = run_world(_replay_worker, w, python_ranks, late_rank, env=env, timeout=300)
    for rank, (bad, digests, (replays, native, late, full)) in enumerate(res):
        assert bad == [], (rank, bad)
        assert digests == res[0][1]             # the same bits on every rank
        assert replays >= 100, (rank, replays)  # most calls came back to a kept shape
        assert native >= replays and full >= 4 + 2 * (rank == 1), (native, full)
        if late_rank is not None and rank != late_rank and rank not in python_ranks:
            assert late >= 1, (rank, late)      # replayed rounds handed over to Python
