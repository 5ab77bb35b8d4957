"""Starting the ranks of `braid bench`, `braid calibrate` and `braid topo`.

The launcher spawns one process per rank with torch.multiprocessing (start method spawn: a forked
CUDA context is unusable), or, under torchrun (RANK/WORLD_SIZE set), runs the one rank it was
started as. GPU ranks join with NCCL, one GPU each; more ranks than GPUs (--nproc) share them in
braid's shared-GPU mode (`config.placement`: exact results, host-cost times). With no GPU, one GPU
and no --nproc (nothing for braid's GPU lanes to join) or --cpu, two gloo ranks run braid's CPU
lanes. Each rank then runs its task
(`sweep.run`, `braid.jobs.run`, `commands.calibrate` or `commands.topo`).

A rank that fails re-raises without tearing anything down: its peers may sit in a collective that
will never complete, and the launcher (or torchrun) ends them. A rank whose stdout was closed by its
reader (`braid topo | head -1`) exits with PIPE_EXIT instead, without a traceback; the launcher then
ends the other ranks quietly and exits with the same status, as a shell does for a writer killed by
SIGPIPE.
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
import multiprocessing.connection
import os
import select
import signal
import socket
import sys
import warnings

import torch
import torch.distributed as dist

import braid   # also registers the "braid" backend (_init_rank with braid_backend)

from .. import envs
from . import config
from .config import CPU_LINE, NO_GPU_LINE, ONE_GPU_LINE, PIPE_EXIT, WRONG_EXIT, Config, usable_cores


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _set_gpu_env() -> None:
    # looked up on the config module at call time, so a test that replaces
    # braid.bench.config.set_gpu_env (to keep these variables out of its own process) is obeyed
    config.set_gpu_env()


def launch(cfg: Config, nproc: int | None) -> int:
    """Run `cfg.task` on every rank: join torchrun's world, or spawn the ranks here. Exit status."""
    _set_gpu_env()   # before anything touches CUDA, here and (inherited) in the spawned ranks
    if under_torchrun():
        if nproc is not None and nproc != int(os.environ["WORLD_SIZE"]):
            print(f"braid {cfg.task}: under torchrun: --nproc {nproc} ignored, world size is "
                  f"{os.environ['WORLD_SIZE']}", file=sys.stderr)
        local = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
        _worker(local, cfg, None, None)
        return 0
    cuda = torch.cuda.is_available() and not cfg.cpu
    ngpu = torch.cuda.device_count() if cuda else 0
    shared = cuda and envs.get("BRAID_SHARED_GPU")     # asked for: 2 ranks on one GPU by default
    one_gpu = cuda and ngpu == 1 and nproc is None and not shared and cfg.task in ("bench", "calibrate")
    if one_gpu:     # nothing for braid's GPU lanes to join; the CPU lanes still run for real
        cfg = dataclasses.replace(cfg, cpu=True)
        cuda, ngpu = False, 0
    # more ranks than GPUs: the ranks share them (config.placement, in each rank)
    world = nproc or (max(ngpu, 2) if shared else ngpu if cuda else 2)
    # training-step workloads also run on one rank (an explicit --nproc 1: the step code on one GPU)
    if cfg.task in ("bench", "calibrate") and world < 2 and not cfg.workloads:
        print(f"braid {cfg.task}: needs at least 2 ranks (got {world}); pass --nproc 2 or more", file=sys.stderr)
        return 2
    if one_gpu:
        print(ONE_GPU_LINE, flush=True)
    elif not cuda and cfg.task == "bench":
        print(CPU_LINE if torch.cuda.is_available() else NO_GPU_LINE, flush=True)
    return _spawn(cfg, world)


def _spawn(cfg: Config, world: int) -> int:
    """`world` ranks of `cfg.task` on this machine; the exit status says how they ended."""
    port = _free_port()
    import torch.multiprocessing as mp
    ctx = None
    try:
        ctx = mp.start_processes(_worker, args=(cfg, world, port), nprocs=world, join=False, start_method="spawn")
        while True:        # ctx.join, but a rank that lost its stdout ends the run quietly
            if _pipe_closed(ctx):
                return PIPE_EXIT
            if ctx.join(timeout=0):
                break
            live = [p.sentinel for p in ctx.processes if p.exitcode is None]
            ready = multiprocessing.connection.wait(live) if live else []
            for p in ctx.processes:
                if p.sentinel in ready:
                    p.join()       # its exit status (the sentinel fires a moment before it is set)
    except mp.ProcessRaisedException as exc:
        print(f"braid {cfg.task}: a rank failed:{exc}", file=sys.stderr)
        return 1
    except mp.ProcessExitedException as exc:
        if exc.exit_code == PIPE_EXIT:
            _silence_stdout()
            return PIPE_EXIT
        if exc.exit_code == WRONG_EXIT:
            what = "losses" if cfg.workloads else "output"
            where = "the losses column" if cfg.workloads else "#wrong"
            print(f"braid {cfg.task}: braid's {what} differed from the baseline's ({where} above)", file=sys.stderr)
            return WRONG_EXIT
        print(f"braid {cfg.task}: a rank died: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"braid {cfg.task}: interrupted", file=sys.stderr)
        return 130
    finally:
        if ctx is not None:
            for path in ctx.error_files:   # torch leaves a rank's traceback file in /tmp
                try:
                    os.unlink(path)
                except (OSError, TypeError):
                    pass
    return 0


def _pipe_closed(ctx) -> bool:
    """Whether a rank exited because stdout's reader went away; if so, end the others quietly
    (they may wait in a collective for it) and point this process's stdout at /dev/null."""
    if not any(p.exitcode == PIPE_EXIT for p in ctx.processes):
        return False
    for p in ctx.processes:
        if p.exitcode is None:
            p.terminate()
    for p in ctx.processes:
        p.join(10)
        if p.exitcode is None:
            p.kill()
            p.join()
    _silence_stdout()
    return True


def _stdout_closed() -> bool:
    """True when stdout is a pipe or socket whose reader has gone (poll reports an error on it)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):
        return False


def _silence_stdout() -> None:
    """stdout to /dev/null, so nothing later (the interpreter's final flush) writes to the closed pipe."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (AttributeError, OSError, ValueError):
        pass


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_rank(local_rank: int, world: int | None, port: int | None, cpu: bool = False,
               braid_backend: bool = False) -> bool:
    """torch.distributed for this rank: NCCL on its GPU, or gloo without GPUs (or with `cpu`);
    with `braid_backend` the default group is braid's own backend instead. True on GPU."""
    _set_gpu_env()
    cuda = torch.cuda.is_available() and not cpu
    kwargs = {}
    if world is not None:      # spawned here
        kwargs = dict(init_method=f"tcp://127.0.0.1:{port}", rank=local_rank, world_size=world)
    if cuda:
        shared = envs.get("BRAID_SHARED_GPU")
        if world is not None:  # this rank's GPU; shared-GPU mode when the ranks outnumber the GPUs
            gpu, env = config.placement(local_rank, world, torch.cuda.device_count(), shared)
            os.environ.update(env)         # before NCCL starts
        else:                  # torchrun: `import braid` gave this rank its NCCL_HOSTID (BRAID_SHARED_GPU=1)
            gpu = local_rank % torch.cuda.device_count() if shared else local_rank
        torch.cuda.set_device(gpu)
        if "device_id" in inspect.signature(dist.init_process_group).parameters:
            kwargs["device_id"] = torch.device("cuda", gpu)   # eager NCCL init, bound to this GPU
        dist.init_process_group("braid" if braid_backend else "nccl", **kwargs)
    else:
        dist.init_process_group("braid" if braid_backend else "gloo", **kwargs)
        size = world or int(os.environ["WORLD_SIZE"])
        # ranks share the cores this process may run on (taskset, cgroups: not os.cpu_count()):
        # more intra-op threads than that, spinning after each parallel kernel, stalled 8 and 16
        # ranks on 16 of 32 cores for 10-20 ms a call, gloo's calls too
        torch.set_num_threads(max(1, usable_cores() // size))
    return cuda


def _setup_logging(rank: int) -> None:
    from .. import envs
    logger = logging.getLogger("braid")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"[rank {rank}] %(name)s %(levelname)s: %(message)s"))
        logger.addHandler(handler)
    try:
        logger.setLevel(str(envs.get("BRAID_LOG_LEVEL")).upper())
    except (ValueError, TypeError):
        logger.setLevel(logging.WARNING)


def _worker(local_rank: int, cfg: Config, world: int | None, port: int | None) -> None:
    """One rank. On an exception it re-raises without tearing down (peers may sit in a collective;
    the launcher or torchrun ends them); the process exit releases the memory. A rank whose
    stdout's reader went away (`braid topo | head -1`) exits with PIPE_EXIT at once, without a
    traceback."""
    try:
        _rank(local_rank, cfg, world, port)
        sys.stdout.flush()        # here, not at the interpreter's exit, so a closed pipe is seen below
    except BrokenPipeError:
        if not _stdout_closed():
            raise
        # the reader has what it wanted; peers that wait for this rank are ended by the launcher
        # (under torchrun, by its agent). Ended here, without the interpreter's exit: that
        # destroyed gloo's groups under their running threads now and then (SIGABRT, "terminate
        # called without an active exception": once in a CPU test run of `braid topo | head -1`),
        # and nothing is left to release (the node segment was unlinked once every rank mapped it)
        _silence_stdout()
        sys.stderr.flush()
        os._exit(PIPE_EXIT)


def _rank(local_rank: int, cfg: Config, world: int | None, port: int | None) -> None:
    if cfg.lanes:
        os.environ["BRAID_LANES"] = ",".join(cfg.lanes)
    if cfg.workloads and cfg.cpu:
        # the braid backend takes CUDA whenever torch sees a GPU; CPU-lane ranks (--cpu, or one
        # GPU for two ranks) must not: hide the GPUs before anything in this process asks
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        cuda = _init_rank(local_rank, world, port, cfg.cpu, braid_backend=bool(cfg.workloads))
        _setup_logging(dist.get_rank())
        # torch >= 2.13 flags dist.all_gather_into_tensor (the baseline's call) as deprecated on every call
        warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
        comm = braid.init()
        after = _run_task(comm, cfg, cuda)
    except BaseException:
        # No teardown: peers may sit in a collective that will never complete. The traceback goes to
        # the launcher (mp.spawn) or torchrun, which end the other ranks. Should the exit itself hang
        # (an NCCL communicator torn down mid-call), SIGALRM's default action ends this process.
        if hasattr(signal, "alarm"):
            signal.alarm(30)
        raise
    braid.close()
    dist.destroy_process_group()
    if after is not None:
        after()


def _run_task(comm, cfg: Config, cuda: bool):
    """This rank's part of the task; returns what to run after the teardown (a plot, an exit), or None."""
    if cfg.task == "bench" and cfg.workloads:
        from .. import jobs
        return jobs.run(comm, cfg, cuda)
    if cfg.task == "bench":
        from . import sweep
        return sweep.run(comm, cfg.resolved(cuda))
    from . import commands
    if cfg.task == "calibrate":
        commands.calibrate(comm, cfg)
    elif cfg.task == "topo":
        commands.topo(comm)
    else:
        raise ValueError(f"unknown task {cfg.task!r}")
    return None
