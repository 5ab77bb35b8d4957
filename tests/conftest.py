"""Shared helpers for braid's CPU tests.

`run_world(fn, world_size, ...)` starts `world_size` worker processes (see below), each with a gloo
process group on a free local port, runs `fn(rank, world_size, *args)` in every one and returns
their results (whatever `fn` returns, JSON-serialisable). A worker's exception comes back to the
parent as `WorkerError` carrying the worker's traceback. A world that has not finished within
`timeout` seconds is terminated and the test fails (no hung CI).

Workers start from a fork server that imported torch once (a fresh interpreter per worker cost
~2.5 s of CPU to import torch again, most of the tier's time on 2 cores); nothing of braid is
imported before a worker applies its test's settings. BRAID_TEST_SPAWN=1 spawns every worker
afresh instead.
"""
from __future__ import annotations

import datetime
import json
import os
import pathlib
import socket
import threading
import tempfile
import time
import traceback
from multiprocessing.connection import wait as mp_wait

import torch.multiprocessing as mp

# Settings every worker gets unless the test says otherwise: small rings so that every transfer
# of more than a few hundred KiB wraps around the ring many times, a bounded wait, no calibration
# from the user's cache.
DEFAULT_WORKER_ENV = {
    "BRAID_HOST_BUFFER_MB": "2",
    "BRAID_HOST_CHUNK_KB": "64",
    "BRAID_TIMEOUT_S": "30",
    "BRAID_CALIBRATE": "off",
    "OMP_NUM_THREADS": "1",
    # the CPU lanes are the tier's vehicle for braid's split machinery (planner, balancer, lanes,
    # agreement): whole calls through the segment are on only where a test asks for them
    "BRAID_CPU_SHM": "0",
}

WORLD_TIMEOUT_S = 120.0
_CONTEXT = None
_NATIVE_DIR = None


def _native_dir() -> str:
    """One folder for this pytest run's compiled native libraries (each world's cache folder links to
    it), removed when pytest's process ends."""
    global _NATIVE_DIR
    if _NATIVE_DIR is None:
        import atexit
        import shutil
        _NATIVE_DIR = tempfile.mkdtemp(prefix="braid-test-native-")
        atexit.register(shutil.rmtree, _NATIVE_DIR, True)
    return _NATIVE_DIR


def _context():
    """The start method of the workers: a fork server with torch imported (see the top)."""
    global _CONTEXT
    if _CONTEXT is None:
        if os.environ.get("BRAID_TEST_SPAWN") == "1" or "forkserver" not in mp.get_all_start_methods():
            _CONTEXT = mp.get_context("spawn")
        else:
            _CONTEXT = mp.get_context("forkserver")
            _CONTEXT.set_forkserver_preload(["torch", "torch.distributed"])
    return _CONTEXT


class WorkerError(AssertionError):
    """One or more workers of a world failed (the message holds their tracebacks)."""


def concurrently(jobs: dict) -> dict:
    """{key: fn} -> {key: fn()}, the functions run at once in threads (each waiting on worker
    processes of its own: their start-ups and waits overlap)."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max(len(jobs), 1)) as pool:
        futures = {k: pool.submit(fn) for k, fn in jobs.items()}
        return {k: f.result() for k, f in futures.items()}


_ISSUED: set[int] = set()
_ISSUED_LOCK = threading.Lock()


def free_port() -> int:
    """A free TCP port, never one this process handed out before (worlds started at once from
    threads must not meet on one port)."""
    with _ISSUED_LOCK:
        while True:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in _ISSUED:
                _ISSUED.add(port)
                return port


def stay_away(flag: str, limit: float) -> bool:
    """For a rank that must make no call while its peer waits for it to time out: sleep until the
    peer creates the file `flag` (it has its answer) or `limit` seconds have passed (the peer's
    wait outlived the limit: the peer then sees this rank go). True if the flag came."""
    deadline = time.monotonic() + limit
    while not os.path.exists(flag):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def braid_shm_entries() -> set[str]:
    """Names in /dev/shm that braid created (its segments are called braid-<pid>-<hex>)."""
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("braid-")}
    except FileNotFoundError:
        return set()


def _entry(rank: int, fn, world_size: int, port: int, args: tuple, env: dict, outdir: str,
           init_pg: bool) -> None:
    """Body of every worker process."""
    for key in [k for k in os.environ if k.startswith("BRAID_")]:
        del os.environ[key]             # only the settings the test names
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    out = pathlib.Path(outdir)
    try:
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        if init_pg:
            dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=60))
        result = fn(rank, world_size, *args)
        (out / f"result-{rank}.json").write_text(json.dumps(result))
    except BaseException:
        (out / f"error-{rank}.txt").write_text(traceback.format_exc())
        os._exit(1)
    try:
        import braid
        braid.close()
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:
        (out / f"error-{rank}.txt").write_text("at shutdown:\n" + traceback.format_exc())
        os._exit(1)


def run_world(fn, world_size: int, *args, env: dict | None = None, timeout: float = WORLD_TIMEOUT_S,
              allowed_exit: dict[int, int] | None = None, init_pg: bool = True, info: dict | None = None) -> list:
    """Run fn(rank, world_size, *args) in `world_size` worker processes; return their results.

    `allowed_exit` maps rank -> the exit code (or set of codes) that rank is expected to end with
    (a test that kills a worker on purpose); any other non-zero exit fails the test, terminates
    the rest of the world and raises WorkerError with every worker's traceback. After `timeout`
    seconds everything left is terminated and WorkerError says which ranks hung. `info`, if
    given, receives the workers' process ids under "pids" (rank order), and each rank's exit code
    and wall-clock time of exit under "exits" (rank -> (code, time.time())).
    """
    allowed_exit = dict(allowed_exit or {})
    ctx = _context()
    port = free_port()
    # the workers' calibration cache and their results live in folders removed afterwards
    with tempfile.TemporaryDirectory(prefix="braid-test-cache-", ignore_cleanup_errors=True) as cache_dir, \
            tempfile.TemporaryDirectory(prefix="braid-test-world-", ignore_cleanup_errors=True) as outdir:
        # braid's native libraries are compiled once per pytest run, not once per world
        os.symlink(_native_dir(), os.path.join(cache_dir, "native"))
        full_env = dict(DEFAULT_WORKER_ENV, BRAID_CACHE_DIR=cache_dir)
        full_env.update(env or {})
        procs = [ctx.Process(target=_entry, args=(r, fn, world_size, port, args, full_env, outdir, init_pg),
                             daemon=True, name=f"braid-test-rank{r}")
                 for r in range(world_size)]
        for p in procs:
            p.start()
        if info is not None:
            info["pids"] = [p.pid for p in procs]
        deadline = time.monotonic() + timeout
        live = {p.sentinel: r for r, p in enumerate(procs)}
        failed: list[int] = []
        hung = False
        while live:
            left = deadline - time.monotonic()
            if left <= 0:
                hung = True
                break
            for sentinel in mp_wait(list(live), timeout=min(left, 1.0)):
                r = live.pop(sentinel)
                procs[r].join()          # reap now: a dead peer must not linger as a zombie
                code = procs[r].exitcode
                if info is not None:
                    info.setdefault("exits", {})[r] = (code, time.time())
                ok = allowed_exit.get(r, 0)
                if code not in (ok if isinstance(ok, (set, frozenset)) else {ok}):
                    failed.append(r)
            if failed:
                break
        stragglers = [r for r in live.values()]
        for r in stragglers:
            procs[r].terminate()
        for r in stragglers:
            procs[r].join(5)
            if procs[r].is_alive():
                procs[r].kill()
                procs[r].join(5)
        if hung or failed:
            parts = []
            for r in range(world_size):
                f = pathlib.Path(outdir) / f"error-{r}.txt"
                status = ("hung (terminated)" if hung and r in stragglers else
                          "terminated after a peer failed" if r in stragglers else
                          f"exit code {procs[r].exitcode}")
                parts.append(f"--- rank {r}: {status}\n" + (f.read_text() if f.exists() else ""))
            what = f"world of {world_size} did not finish within {timeout:.0f} s" if hung else \
                f"ranks {failed} failed"
            raise WorkerError(f"{getattr(fn, '__name__', fn)}: {what}\n" + "\n".join(parts))
        results = []
        for r in range(world_size):
            f = pathlib.Path(outdir) / f"result-{r}.json"
            results.append(json.loads(f.read_text()) if f.exists() else None)
        return results
