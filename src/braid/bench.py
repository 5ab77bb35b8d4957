"""`braid bench`, `braid calibrate`, `braid topo`: run braid against its baseline across N ranks.

The launcher spawns one process per rank with torch.multiprocessing (start method spawn), or, under
torchrun (RANK/WORLD_SIZE set), joins the world it was started in. Every rank builds the same
workload (braid.workloads.make: braid's call and the baseline's on the same buffers), checks
braid's output against the baseline's, then times the two alternately (braid.calibrate.time_call:
the slowest rank's mean). Rank 0 prints an nccl-tests style table and writes the JSON and the plot.

GPU ranks use NCCL (baseline: NCCL alone); without GPUs the ranks use gloo and braid runs its CPU
lanes (shm, gloo) against gloo alone.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import inspect
import json
import logging
import math
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

OPS = ("all_gather", "broadcast", "send_recv", "all_to_all_single", "all_reduce", "reduce_scatter", "reduce")
EXTRA_OPS = ("moe",)      # not in `--op all`: one MoE layer (dispatch + combine), time per layer
# NVLink multicast (NVLS) off for NCCL, torch symmetric memory and NVSHMEM: set before any CUDA/NCCL init.
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
DTYPES = ("bfloat16", "float16", "float32", "float64", "int8", "uint8", "int32", "int64")
GPU_SIZES = (1 << 20, 1 << 30)
CPU_SIZES = (256 << 10, 16 << 20)   # with factor 4: a few minutes for every op on 2 cores
SMALL_ROUNDS = 10       # alternating windows per point for small (host-bound) calls
WRONG_EXIT = 3          # exit status when braid's output differs from the baseline's
NO_GPU_LINE = "no GPU: running braid's CPU lanes (gloo+shm) against gloo"
ONE_GPU_LINE = ("one GPU visible: braid's GPU lanes join two or more GPUs, so this runs on braid's CPU lanes "
                "(gloo+shm, 2 ranks); with 2+ GPUs braid runs against NCCL")
CPU_LINE = "--cpu: running braid's CPU lanes (gloo+shm) against gloo"


# ---------------------------------------------------------------------------------------------
# argument parsing
# ---------------------------------------------------------------------------------------------

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """'4096', '64K', '1M', '1.5G', '256KiB', '1MB' -> bytes (binary units, like nccl-tests)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 4096, 64K, 1M, 1G)")
    value = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return value


def parse_size_range(text: str) -> tuple[int, int]:
    """'1M:1G' -> (1 MiB, 1 GiB); a single size '4M' -> (4 MiB, 4 MiB)."""
    parts = text.split(":")
    if len(parts) == 1:
        n = parse_size(parts[0])
        return n, n
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"--sizes wants MIN:MAX (e.g. 1M:1G), got {text!r}")
    lo, hi = parse_size(parts[0]), parse_size(parts[1])
    if hi < lo:
        raise argparse.ArgumentTypeError(f"--sizes {text!r}: max is below min")
    return lo, hi


def parse_lanes(text: str) -> list[str]:
    from .planner.plan import LaneKind
    lanes = [x.strip().lower() for x in text.split(",") if x.strip()]
    known = [k.value for k in LaneKind]
    bad = [x for x in lanes if x not in known]
    if bad or not lanes:
        raise argparse.ArgumentTypeError(f"--lanes {text!r}: lanes are a comma list of {known}")
    return lanes


def _hot_fractions(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: fractions between 0 and 1, comma separated (e.g. 0.4,0.7,1)")
    if not values or any(not 0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: fractions between 0 and 1, comma separated (e.g. 0.4,0.7,1)")
    return values


def parse_shares(text: str) -> dict[str, float]:
    """'ce=0.9,host=0.1' -> {'ce': 0.9, 'host': 0.1}, normalised to sum to 1."""
    from .planner.plan import LaneKind
    known = [k.value for k in LaneKind]
    shares: dict[str, float] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        name, sep, value = part.partition("=")
        name = name.strip().lower()
        try:
            frac = float(value)
        except ValueError:
            frac = -1.0
        if not sep or name not in known or frac < 0:
            raise argparse.ArgumentTypeError(f"--shares {text!r}: want lane=fraction,... with lanes from {known}")
        shares[name] = frac
    total = sum(shares.values())
    if total <= 0:
        raise argparse.ArgumentTypeError(f"--shares {text!r}: at least one share must be positive")
    return {k: v / total for k, v in shares.items() if v > 0}


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _factor(text: str) -> float:
    value = float(text)
    if value <= 1:
        raise argparse.ArgumentTypeError(f"--factor must be > 1, got {text!r}")
    return value


def add_launch_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=_positive_int, default=None,
                   help="ranks to spawn (default: number of GPUs, or 2 on the CPU lanes with fewer than 2 GPUs or --cpu); "
                        "ignored under torchrun")
    p.add_argument("--lanes", type=parse_lanes, default=None,
                   help="restrict braid to these lanes, e.g. ce,host (sets BRAID_LANES in the workers)")
    p.add_argument("--cpu", action="store_true",
                   help="CPU tensors and CPU lanes (gloo ranks) even where GPUs are visible; the default on a "
                        "machine with one GPU, where braid has no GPU peer to join")


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--op", default=None, choices=OPS + EXTRA_OPS + ("all",),
                   help="op to run, or 'all' for each in turn (default: all_gather); moe = one MoE layer: "
                        "dispatch + combine with a Zipf-skewed expert load (time per layer)")
    p.add_argument("--workload", default=None, metavar="NAME[,NAME...]",
                   help="instead of an op sweep: time training steps under the braid backend against the same "
                        "steps on the baseline (and a floor without communication): ddp, fsdp, moe_layer, "
                        "a comma list, or 'all'")
    add_launch_arguments(p)
    p.add_argument("--sizes", type=parse_size_range, default=None, metavar="MIN:MAX",
                   help="size range, e.g. 1M:1G (default: 1M:1G on GPU, 256K:16M in x4 steps on CPU). The size is the "
                        "per-rank input of all_gather and all_to_all_single, the message of broadcast and send_recv")
    p.add_argument("--factor", type=_factor, default=2.0, help="size step factor (default 2)")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="element type (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--iters", type=_positive_int, default=None,
                   help="timed calls per measurement, at least (default: 20 GPU, 5 CPU; raised for small calls so "
                        "each measurement spans ~20 ms, unless --fixed-iters)")
    p.add_argument("--fixed-iters", action="store_true", help="time exactly --iters calls at every size")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls before each measurement (default: 5 GPU, 1 CPU)")
    p.add_argument("--repeat", type=_positive_int, default=None,
                   help="baseline/braid measurements alternate this many times; the min of each is kept (default 2; "
                        "with --workload: timed windows per side, the median is kept, default 5)")
    p.add_argument("--shares", type=parse_shares, default=None, metavar="LANE=FRAC,...",
                   help="fixed shares, e.g. ce=0.9,host=0.1: bypass the model (and the calibration)")
    p.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                   help="do not measure the lanes first: use the cached calibration, or the built-in model")
    p.add_argument("--hot-bytes", type=parse_size, default=None, metavar="SIZE",
                   help="all_to_all_single skew: rank0->rank1 carries SIZE, every other pair --cold-bytes "
                        "(one point instead of the --sizes sweep)")
    p.add_argument("--cold-bytes", type=parse_size, default=None, metavar="SIZE",
                   help="bytes of every other pair with --hot-bytes (default 0)")
    p.add_argument("--hot-fraction", type=_hot_fractions, default=None, metavar="H[,H...]",
                   help="all_to_all_single: every rank sends this fraction of its bytes to the last rank, "
                        "the rest evenly to the others (one hot destination); one sweep per value")
    p.add_argument("--width", "--hidden", dest="width", type=_positive_int, default=None,
                   help="--workload: layer width, the MoE layer's hidden size (default: 8192 GPU, 256 CPU)")
    p.add_argument("--depth", type=_positive_int, default=None,
                   help="--workload ddp/fsdp: Linear layers of the MLP (default: 8 GPU, 3 CPU)")
    p.add_argument("--batch", type=_positive_int, default=None,
                   help="--workload ddp/fsdp: input rows per rank and step (default: 16 GPU, 8 CPU)")
    p.add_argument("--bucket-mb", dest="bucket_mb", type=_positive_int, default=None,
                   help="--workload ddp: DDP's bucket_cap_mb (default 25)")
    p.add_argument("--tokens", type=_positive_int, default=None,
                   help="--workload moe_layer: tokens per rank (default: 8192 GPU, 64 CPU)")
    p.add_argument("--steps", type=_positive_int, default=None,
                   help="--workload: training steps per timed window (default: 20 GPU, 5 CPU; --warmup "
                        "untimed steps first, default 3 GPU, 1 CPU)")
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", dest="plot_path", default=None, metavar="PATH",
                   help="write a PNG of busbw vs size (needs matplotlib)")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="run baseline and braid once per size and count the bytes where they differ (default on)")
    p.add_argument("--plain", action="store_true", help="plain text output even when rich is installed")
    p.add_argument("--trace", type=_positive_int, default=None, metavar="CALLS",
                   help="instead of the sweep: run CALLS calls of --op at the smallest --sizes size and record "
                        "the shares and lane times of each (the online balancer at work); --json/--plot take it")
    p.add_argument("--slow", default=None, metavar="LANE=FACTOR@A:B",
                   help="with --trace, from call A to call B: on CPUs make the shm or gloo lane FACTOR times slower "
                        "(e.g. shm=4@10:30); on GPUs host=N runs N x 256 MiB of competing PCIe copies beside each call")


def add_calibrate_arguments(p: argparse.ArgumentParser) -> None:
    add_launch_arguments(p)
    p.add_argument("--ops", default=",".join(OPS),
                   help=f"comma list of ops to calibrate (default: {','.join(OPS)})")


# ---------------------------------------------------------------------------------------------
# configuration passed to every rank
# ---------------------------------------------------------------------------------------------

@dataclass
class Config:
    task: str                                   # bench | calibrate | topo
    ops: tuple[str, ...] = OPS
    sizes: tuple[int, int] | None = None
    factor: float = 2.0
    dtype: str | None = None
    iters: int | None = None
    auto_iters: bool = True
    trace: int | None = None
    slow: str | None = None
    warmup: int | None = None
    repeat: int = 2
    lanes: list[str] | None = None
    shares: dict[str, float] | None = None
    calibrate: bool = True
    hot_bytes: int | None = None
    cold_bytes: int | None = None
    hot_fraction: list[float] | None = None
    json_path: str | None = None
    plot_path: str | None = None
    check: bool = True
    plain: bool = False
    cpu: bool = False                           # gloo ranks and CPU tensors even where GPUs are visible
    notes: list[str] = field(default_factory=list)
    # training-step workloads (braid.jobs) instead of the op sweep; None: machine-kind defaults
    workloads: tuple[str, ...] = ()
    width: int | None = None
    depth: int | None = None
    batch: int | None = None
    bucket_mb: int | None = None
    tokens: int | None = None
    steps: int | None = None

    def resolved(self, cuda: bool) -> "Config":
        """Defaults that depend on GPU vs CPU."""
        c = Config(**self.__dict__)
        if self.sizes is None and not cuda and self.factor == 2.0:
            c.factor = 4.0                              # CPU default sweep: 256K, 1M, 4M, 16M
        c.sizes = self.sizes or (GPU_SIZES if cuda else CPU_SIZES)
        c.dtype = self.dtype or ("bfloat16" if cuda else "float32")
        c.iters = self.iters or (20 if cuda else 5)
        c.warmup = self.warmup if self.warmup is not None else (5 if cuda else 1)
        return c

    def size_list(self) -> list[int]:
        lo, hi = self.sizes
        out, n = [], float(lo)
        while n <= hi * (1 + 1e-9):
            size = int(round(n))
            if not out or size != out[-1]:
                out.append(size)
            n *= self.factor
        return out


def config_from_args(task: str, args: argparse.Namespace) -> Config:
    if task == "bench":
        if getattr(args, "workload", None) is not None:
            return _workload_config(args)
        ops = OPS if args.op == "all" else (args.op or "all_gather",)
        if args.cold_bytes is not None and args.hot_bytes is None:
            raise SystemExit("braid bench: --cold-bytes needs --hot-bytes")
        notes = []
        shape = [f for f in ("width", "depth", "batch", "bucket_mb", "tokens", "steps")
                 if getattr(args, f, None) is not None]
        if shape:
            notes.append(f"--{', --'.join(f.replace('_', '-') for f in shape)} only apply with --workload; ignored")
        if args.hot_bytes is not None and "all_to_all_single" not in ops:
            notes.append("--hot-bytes/--cold-bytes only apply to all_to_all_single; ignored")
        if args.hot_fraction is not None and args.hot_bytes is not None:
            raise SystemExit("braid bench: use --hot-fraction or --hot-bytes, not both")
        if args.hot_fraction is not None and "all_to_all_single" not in ops:
            notes.append("--hot-fraction only applies to all_to_all_single; ignored")
        return Config(task, ops=ops, sizes=args.sizes, factor=args.factor, dtype=args.dtype, iters=args.iters,
                      auto_iters=not args.fixed_iters, trace=args.trace, slow=args.slow, warmup=args.warmup,
                      repeat=args.repeat if args.repeat is not None else 2, lanes=args.lanes, shares=args.shares,
                      calibrate=args.calibrate, hot_bytes=args.hot_bytes,
                      cold_bytes=(args.cold_bytes or 0) if args.hot_bytes is not None else None,
                      hot_fraction=args.hot_fraction,
                      json_path=args.json_path, plot_path=args.plot_path, check=args.check, plain=args.plain,
                      cpu=args.cpu, notes=notes)
    if task == "calibrate":
        ops = tuple(x.strip() for x in args.ops.split(",") if x.strip())
        bad = [x for x in ops if x not in OPS]
        if bad or not ops:
            raise SystemExit(f"braid calibrate: --ops {args.ops!r}: ops are a comma list of {list(OPS)}")
        return Config(task, ops=ops, lanes=args.lanes, cpu=args.cpu)
    return Config(task, lanes=getattr(args, "lanes", None), cpu=getattr(args, "cpu", False))


def _workload_config(args: argparse.Namespace) -> Config:
    """`braid bench --workload ...`: training steps (braid.jobs) instead of the op sweep."""
    from .jobs import parse_workloads
    if args.op is not None:
        raise SystemExit(f"braid bench: --op {args.op} and --workload {args.workload} both choose what to run; "
                         f"give one of them")
    workloads = parse_workloads(args.workload)
    sweep = {"--sizes": args.sizes, "--iters": args.iters, "--hot-bytes": args.hot_bytes,
             "--cold-bytes": args.cold_bytes, "--hot-fraction": args.hot_fraction, "--trace": args.trace,
             "--slow": args.slow, "--plot": args.plot_path}
    ignored = [flag for flag, value in sweep.items() if value is not None]
    notes = [f"{', '.join(ignored)} only apply to the op sweep; ignored with --workload"] if ignored else []
    return Config("bench", ops=(), dtype=args.dtype, warmup=args.warmup,
                  repeat=args.repeat if args.repeat is not None else 5, lanes=args.lanes, shares=args.shares,
                  calibrate=args.calibrate, json_path=args.json_path, plain=args.plain, cpu=args.cpu, notes=notes,
                  workloads=workloads, width=args.width, depth=args.depth, batch=args.batch,
                  bucket_mb=args.bucket_mb, tokens=args.tokens, steps=args.steps)


# ---------------------------------------------------------------------------------------------
# launcher
# ---------------------------------------------------------------------------------------------

def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def set_gpu_env() -> None:
    os.environ.update(GPU_ENV)


def launch(cfg: Config, nproc: int | None) -> int:
    """Run `cfg.task` on every rank: join torchrun's world, or spawn the ranks here. Exit status."""
    set_gpu_env()   # before anything touches CUDA, here and (inherited) in the spawned ranks
    if under_torchrun():
        if nproc is not None and nproc != int(os.environ["WORLD_SIZE"]):
            print(f"braid {cfg.task}: under torchrun: --nproc {nproc} ignored, world size is "
                  f"{os.environ['WORLD_SIZE']}", file=sys.stderr)
        local = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
        _worker(local, cfg, None, None)
        return 0
    cuda = torch.cuda.is_available() and not cfg.cpu
    ngpu = torch.cuda.device_count() if cuda else 0
    one_gpu = cuda and ngpu == 1 and nproc is None and cfg.task in ("bench", "calibrate")
    if one_gpu:     # nothing for braid's GPU lanes to join; the CPU lanes still run for real
        cfg = dataclasses.replace(cfg, cpu=True)
        cuda, ngpu = False, 0
    world = nproc or (ngpu if cuda else 2)
    if cuda and world > ngpu:
        print(f"braid {cfg.task}: --nproc {world} but only {ngpu} GPU(s) are visible (one rank per GPU)", file=sys.stderr)
        return 2
    # training-step workloads also run on one rank (an explicit --nproc 1: the step code on one GPU)
    if cfg.task in ("bench", "calibrate") and world < 2 and not cfg.workloads:
        print(f"braid {cfg.task}: needs at least 2 ranks (got {world}); pass --nproc 2 or more", file=sys.stderr)
        return 2
    if one_gpu:
        print(ONE_GPU_LINE, flush=True)
    elif not cuda and cfg.task == "bench":
        print(CPU_LINE if torch.cuda.is_available() else NO_GPU_LINE, flush=True)
    port = _free_port()
    import torch.multiprocessing as mp
    try:
        mp.start_processes(_worker, args=(cfg, world, port), nprocs=world, join=True, start_method="spawn")
    except mp.ProcessRaisedException as exc:
        print(f"braid {cfg.task}: a rank failed:{exc}", file=sys.stderr)
        return 1
    except mp.ProcessExitedException as exc:
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
    return 0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_rank(local_rank: int, world: int | None, port: int | None, cpu: bool = False,
               braid_backend: bool = False) -> bool:
    """torch.distributed for this rank: NCCL on its GPU, or gloo without GPUs (or with `cpu`);
    with `braid_backend` the default group is braid's own backend instead. True on GPU."""
    set_gpu_env()
    if braid_backend:
        import braid  # noqa: F401  registers the "braid" backend
    cuda = torch.cuda.is_available() and not cpu
    kwargs = {}
    if world is not None:      # spawned here
        kwargs = dict(init_method=f"tcp://127.0.0.1:{port}", rank=local_rank, world_size=world)
    if cuda:
        torch.cuda.set_device(local_rank)
        if "device_id" in inspect.signature(dist.init_process_group).parameters:
            kwargs["device_id"] = torch.device("cuda", local_rank)   # eager NCCL init, bound to this GPU
        dist.init_process_group("braid" if braid_backend else "nccl", **kwargs)
    else:
        dist.init_process_group("braid" if braid_backend else "gloo", **kwargs)
        size = world or int(os.environ["WORLD_SIZE"])
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))   # ranks share the cores
    return cuda


def _setup_logging(rank: int) -> None:
    from . import envs
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
    the launcher or torchrun ends them); the process exit releases the memory."""
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
        import braid
        comm = braid.init()
        after = None
        if cfg.task == "bench" and cfg.workloads:
            from . import jobs
            after = jobs.run(comm, cfg, cuda)
        elif cfg.task == "bench":
            after = _bench(comm, cfg.resolved(cuda))
        elif cfg.task == "calibrate":
            _calibrate(comm, cfg)
        elif cfg.task == "topo":
            _topo(comm)
        else:
            raise ValueError(f"unknown task {cfg.task!r}")
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


# ---------------------------------------------------------------------------------------------
# machine description
# ---------------------------------------------------------------------------------------------

def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def nccl_version() -> str | None:
    try:
        if torch.cuda.is_available():
            return ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:   # CPU builds, or no libnccl
        pass
    return None


def machine_info(comm) -> dict:
    from . import __version__
    info = {"host": socket.gethostname(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "torch": torch.__version__, "nccl": nccl_version(), "braid_version": __version__,
            "world_size": comm.world_size}
    if comm.cuda:
        n = torch.cuda.device_count()
        name = torch.cuda.get_device_name(comm.device)
        info["machine"] = f"{comm.world_size}x {name}" + (f" (of {n})" if n > comm.world_size else "")
        info["gpu"], info["gpus"], info["cuda"] = name, n, torch.version.cuda
    else:
        info["machine"] = f"CPU {_cpu_name()} ({os.cpu_count()} cores)"
    return info


def header_line(tool: str, info: dict) -> str:
    return (f"braid {tool} {info['braid_version']} | {info['machine']} | {info['date'].replace('T', ' ')} | "
            f"torch {info['torch']} | NCCL {info['nccl'] or 'n/a'} | host {info['host']}")


def _human(n: float) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f}{unit}" if abs(v - round(v)) < 1e-9 else f"{v:.3g}{unit}"
    return f"{int(n)}"


def format_shares(shares: dict[str, float] | None) -> str:
    if not shares:
        return "-"
    return " ".join(f"{k}={v:.2f}" for k, v in shares.items())


# ---------------------------------------------------------------------------------------------
# output on rank 0: rich when importable, plain text otherwise
# ---------------------------------------------------------------------------------------------

COLUMNS = ("size", "count", "type", "time_us", "algbw", "busbw", "#wrong", "base_us", "base_busbw", "ratio",
           "host_us", "shares")


def _row_cells(p: dict) -> list[str]:
    wrong = "N/A" if p["wrong"] is None else str(p["wrong"])
    return [str(p["nbytes"]), str(p["count"]), p["dtype"], f"{p['time_us']:.1f}", f"{p['algbw_gbps']:.2f}",
            f"{p['busbw_gbps']:.2f}", wrong, f"{p['baseline']['time_us']:.1f}",
            f"{p['baseline']['busbw_gbps']:.2f}", f"{p['ratio']:.2f}", _host_cell(p), format_shares(p["shares"])]


def _host_cell(p: dict) -> str:
    """Host time per call, braid's / the baseline's (us)."""
    mine, base = p.get("host_us"), p["baseline"].get("host_us")
    return "-" if mine is None or base is None else f"{mine:.0f}/{base:.0f}"


class PlainUi:
    WIDTHS = (12, 11, 10, 11, 8, 8, 7, 12, 12, 7, 12)

    def __init__(self, total: int):
        self.total, self.done = total, 0
        self.tty = sys.stderr.isatty()

    def line(self, text: str = "") -> None:
        self._clear()
        print(text, flush=True)

    def start_op(self, op: str, title: str, baseline: str) -> None:
        self.line()
        self.line(f"# {title}")
        heads = list(COLUMNS)
        heads[7], heads[8] = f"{baseline}_us", f"{baseline}_busbw"
        self.line("# " + "".join(h.rjust(w) for h, w in zip(heads, self.WIDTHS))[2:] + "  shares")
        self.line("# " + "".join(u.rjust(w) for u, w in zip(
            ("(B)", "(elements)", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "", "(us)"), self.WIDTHS))[2:])

    def row(self, p: dict) -> None:
        cells = _row_cells(p)
        self.line("".join(c.rjust(w) for c, w in zip(cells, self.WIDTHS)) + "  " + cells[-1])

    def status(self, what: str) -> None:
        if self.tty:
            sys.stderr.write(f"\r[{self.done + 1}/{self.total}] {what} ...")
            sys.stderr.flush()

    def advance(self) -> None:
        self.done += 1

    def end_op(self) -> None:
        pass

    def close(self) -> None:
        self._clear()

    def _clear(self) -> None:
        if self.tty:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


class RichUi:
    def __init__(self, total: int):
        from rich.console import Console, Group
        from rich.live import Live
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        self.Group = Group
        self.console = Console()
        if not self.console.is_terminal:     # a log file or a pipe: no 80-column squeeze
            self.console = Console(width=200)
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=self.console)
        self.task = self.progress.add_task("sweep", total=total)
        self.table = None
        self.live = Live(self.progress, console=self.console, transient=True, refresh_per_second=4)
        self.live.start()

    def line(self, text: str = "") -> None:
        self.console.print(text, highlight=False, markup=False, soft_wrap=True)

    def start_op(self, op: str, title: str, baseline: str) -> None:
        from rich import box
        from rich.table import Table
        self.table = Table(title=title, title_justify="left", header_style="bold", box=box.SIMPLE_HEAD,
                           caption=f"size in bytes, time in us, bandwidth in GB/s; ratio = {baseline} time / braid time; "
                                   f"host_us = host time per call, braid/{baseline}",
                           caption_justify="left")
        heads = [("size", "right"), ("count", "right"), ("type", "left"), ("time_us", "right"),
                 ("algbw", "right"), ("busbw", "right"), ("#wrong", "right"),
                 (f"{baseline}_us", "right"), (f"{baseline}_busbw", "right"), ("ratio", "right"), ("host_us", "right"),
                 ("shares", "left")]
        for name, justify in heads:
            self.table.add_column(name, justify=justify, no_wrap=True)
        self.live.update(self.Group(self.table, self.progress))

    def row(self, p: dict) -> None:
        from rich.text import Text
        cells = [Text(c) for c in _row_cells(p)]
        if p["wrong"]:
            cells[6].stylize("bold red")
        r = p["ratio"]
        if r >= 1.05 or r < 0.95:
            cells[9].stylize("green" if r >= 1.05 else "red")
        self.table.add_row(*cells)

    def status(self, what: str) -> None:
        self.progress.update(self.task, description=what)

    def advance(self) -> None:
        self.progress.advance(self.task)

    def end_op(self) -> None:
        if self.table is not None:
            self.live.update(self.progress)
            self.console.print(self.table)
            self.table = None

    def close(self) -> None:
        self.end_op()
        self.live.stop()


def make_ui(total: int, plain: bool):
    if not plain:
        try:
            import rich  # noqa: F401
        except ImportError:
            return PlainUi(total)
        return RichUi(total)
    return PlainUi(total)


# ---------------------------------------------------------------------------------------------
# bench (every rank)
# ---------------------------------------------------------------------------------------------

def _sync(comm) -> None:
    if comm.cuda:
        torch.cuda.synchronize(comm.device)


def _sum_over_ranks(comm, value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, group=comm.gloo_group)
    return int(t.item())


def _calibrate_for_bench(comm, cfg: Config, say) -> str:
    """Calibrate the benched ops once (merged into the cache); returns a line for the header."""
    from . import calibrate as cal
    from . import envs
    if cfg.shares:
        return f"calibration: skipped, fixed shares {format_shares(cfg.shares)}"
    if not cfg.calibrate:
        return f"calibration: {'cached ' + comm.calib_digest if comm.calib else 'none cached: built-in lane model'} (--no-calibrate)"
    if envs.get("BRAID_CALIBRATE") == "off":
        return "calibration: BRAID_CALIBRATE=off: built-in lane model"
    if len(comm.lanes_for(comm.device)) < 2:
        return f"calibration: not needed, one lane ({', '.join(comm.lanes_for(comm.device))})"
    ops = tuple(dict.fromkeys("all_to_all_single" if op == "moe" else op for op in cfg.ops))  # moe runs all_to_all
    say(f"calibrating {', '.join(ops)} on lanes {', '.join(comm.lanes_for(comm.device))} ...")
    t0 = time.perf_counter()
    table = cal.calibrate(comm, ops=ops, save_to_disk=False)
    path = ""
    if comm.rank == 0:
        merged = dict(cal.load(comm) or {})     # keep the cached ops this run did not measure
        merged.update(table)
        path = cal.save(comm, merged)
    return f"calibration: measured in {time.perf_counter() - t0:.1f} s ({comm.calib_digest}), cached at {path}"


def _bench(comm, cfg: Config):
    """The sweep on every rank; rank 0 prints and returns what to do after the teardown (the plot)."""
    from . import calibrate as cal
    from .workloads import BUS_FACTOR, make
    r0 = comm.rank == 0
    world = comm.world_size
    dtype = getattr(torch, cfg.dtype)
    esz = torch.empty(0, dtype=dtype).element_size()
    baseline = "nccl" if comm.cuda else "gloo"
    info = machine_info(comm)

    if world < 2:
        from .errors import MisuseError
        raise MisuseError("braid bench needs at least 2 ranks")
    if cfg.trace:
        return _trace(comm, cfg, info)
    skewed = cfg.hot_bytes is not None
    plan = []      # (op, nbytes, hot fraction); nbytes None: the skewed all_to_all_single point
    for op in cfg.ops:
        if op == "all_to_all_single" and skewed:
            plan += [(op, None, None)]
        elif op == "all_to_all_single" and cfg.hot_fraction:
            plan += [(op, n, h) for h in cfg.hot_fraction for n in cfg.size_list()]
        else:
            plan += [(op, n, None) for n in cfg.size_list()]

    ui = make_ui(len(plan), cfg.plain) if r0 else None
    say = ui.line if r0 else (lambda text="": None)
    results: list[dict] = []
    bad = 0
    try:
        lanes = comm.lanes_for(comm.device)
        if cfg.shares and any(k not in lanes for k in cfg.shares):
            from .errors import MisuseError
            raise MisuseError(f"--shares {format_shares(cfg.shares)}: lanes "
                              f"{[k for k in cfg.shares if k not in lanes]} are not usable here "
                              f"(usable: {lanes}; unavailable: {comm.unavailable}); `braid topo` says why")
        say(header_line("bench", info))
        if not comm.cuda and os.environ.get("RANK") is not None:
            say(NO_GPU_LINE)
        for note in cfg.notes:
            say(f"note: {note}")
        unavailable = {k: v for k, v in comm.unavailable.items() if comm.wanted is None or k in comm.wanted}
        say(f"world {world} ranks | dtype {cfg.dtype} | iters {cfg.iters} warmup {cfg.warmup} repeat {cfg.repeat} | "
            f"braid lanes: {', '.join(lanes) or 'none'}"
            + (f" (unavailable: {'; '.join(f'{k}: {v}' for k, v in unavailable.items())})" if unavailable else "")
            + f" | baseline: {baseline}")
        say(_calibrate_for_bench(comm, cfg, say))

        common = {"world_size": world, "dtype": cfg.dtype, "lanes": lanes, "iters": cfg.iters, "warmup": cfg.warmup,
                  "repeat": cfg.repeat, "calibration": comm.calib_digest, "fixed_shares": cfg.shares, **info}
        if skewed:
            common.update(hot_nbytes=cfg.hot_bytes, cold_nbytes=cfg.cold_bytes)
        current = None
        with comm.fixed_shares(cfg.shares):
            for op, nbytes, hot in plan:
                if (op, hot) != current:
                    if r0:
                        ui.end_op()
                        title = f"{op}  world {world}  {info['machine']}"
                        if nbytes is None:
                            title += f"  hot 0->1 {_human(cfg.hot_bytes)}B, cold {_human(cfg.cold_bytes)}B"
                        if hot is not None:
                            title += f"  hot fraction {hot:g} to rank {world - 1}"
                        ui.start_op(op, title, baseline)
                    current = (op, hot)
                if r0:
                    ui.status(f"{op} {'skewed' if nbytes is None else _human(nbytes) + 'B'}")
                if nbytes is None:
                    load = make(comm, op, 0, dtype, hot_nbytes=cfg.hot_bytes, cold_nbytes=cfg.cold_bytes)
                else:
                    load = make(comm, op, nbytes, dtype, hot_fraction=hot)
                wrong = None
                if cfg.check:
                    load.baseline()
                    load.braid()
                    _sync(comm)
                    wrong = _sum_over_ranks(comm, load.wrong() if load.participates else 0)
                comm.last_handle = None
                t_base = t_braid = math.inf
                iters, rounds = cfg.iters, cfg.repeat
                if cfg.auto_iters:
                    # small calls: time enough of them that each measurement spans >= ~20 ms, in
                    # at least 6 shorter windows alternating baseline and braid (and which goes
                    # first): host-bound small calls drift with the machine's load, and many short
                    # alternating windows let both sides see the same quiet moments
                    probe = cal.time_call(comm, load.baseline, 3, cfg.warmup)
                    iters = max(cfg.iters, min(2000, int(20_000 / max(probe, 1.0))))
                    if iters > cfg.iters:
                        rounds = max(cfg.repeat, SMALL_ROUNDS)
                        iters = max(cfg.iters, iters * cfg.repeat // rounds)
                bases, braids, hosts = [], [], {"braid": [], "baseline": []}
                for k in range(rounds):
                    first_base = k % 2 == 0
                    for is_base in ((True, False) if first_base else (False, True)):
                        side = "baseline" if is_base else "braid"
                        t, host = cal.time_call_host(comm, load.baseline if is_base else load.braid,
                                                     iters, cfg.warmup)
                        (bases if is_base else braids).append(t)
                        hosts[side].append(host)
                # large calls: the best of the repeats; small ones (many alternating windows):
                # each side's median window, so one lucky quiet window does not decide the ratio
                pick = statistics.median if rounds >= SMALL_ROUNDS else min
                t_base, t_braid = pick(bases), pick(braids)
                common["host_us"] = {k: statistics.median(v) for k, v in hosts.items()}
                handle = comm.last_handle if load.participates else None
                mine = (handle.shares, handle.lane_times_us()) if handle is not None else None
                got = [None] * world
                dist.all_gather_object(got, mine, group=comm.gloo_group)
                if r0:
                    point = _point(op, load, esz, cfg.dtype, world, t_braid, t_base, wrong, got, baseline,
                                   BUS_FACTOR[op](world), common)
                    if hot is not None:
                        point["hot_fraction"] = hot
                    if op == "all_to_all_single" and comm.last_route is not None:
                        # the router's prediction for the last skewed call: routed vs NCCL's (us)
                        point["route_predicted_us"] = {"routed": comm.last_route[0], "native": comm.last_route[1],
                                                       "host": comm._routed.host_time_us()}
                    results.append(point)
                    ui.row(point)
                    ui.advance()
                    if cfg.json_path:
                        _write_json(cfg.json_path, results)
                bad += wrong or 0
                del load
        if r0:
            ui.end_op()
            if cfg.check:
                say(f"# {'all outputs match the baseline' if not bad else f'FAILED: {bad} wrong bytes in total'}")
            if cfg.json_path:
                say(f"# results written to {cfg.json_path}")
    finally:
        if r0:
            ui.close()

    def after() -> None:
        if r0 and cfg.plot_path:
            plot(results, cfg.plot_path, info)
        if bad:
            sys.exit(WRONG_EXIT)
    return after


def _parse_slow(text: str | None) -> tuple[str, float, int, int] | None:
    if not text:
        return None
    try:
        lane, rest = text.split("=")
        factor, span = rest.split("@")
        a, b = span.split(":")
        return lane.strip(), float(factor), int(a), int(b)
    except ValueError:
        raise SystemExit(f"braid bench: --slow {text!r}: expected LANE=FACTOR@A:B, e.g. shm=4@10:30") from None


def _trace(comm, cfg: Config, info: dict):
    """Shares and lane times call by call, at one size: stage 2 of the balancer, observed."""
    from .workloads import make
    op = cfg.ops[0]
    nbytes = cfg.sizes[0]
    slow = _parse_slow(cfg.slow)
    compete = None
    if slow and comm.cuda:
        if slow[0] != "host":
            raise SystemExit("braid bench: on GPUs --slow host=N@A:B runs N x 256 MiB of competing PCIe copies "
                             "(D2H + H2D) beside each call in A..B; other GPU lanes cannot be slowed yet")
        side = torch.cuda.Stream(device=comm.device)
        dev_buf = torch.empty(256 << 20, dtype=torch.uint8, device=comm.device)
        pin_a = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()
        pin_b = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()

        def _compete(copies: int) -> None:
            side.wait_stream(torch.cuda.current_stream(comm.device))
            with torch.cuda.stream(side):
                for _ in range(copies):
                    pin_a.copy_(dev_buf, non_blocking=True)
                    dev_buf.copy_(pin_b, non_blocking=True)
        compete = _compete
    elif slow and slow[0] not in ("shm", "gloo"):
        raise SystemExit("braid bench: on CPUs --slow slows the shm or gloo lane")
    load = make(comm, op, nbytes, getattr(torch, cfg.dtype))
    rows = []
    for call in range(cfg.trace):
        active = bool(slow and slow[2] <= call < slow[3])
        if compete is not None:
            comm.slowdown = {}
            if active:
                compete(max(1, int(slow[1])))
        else:
            comm.slowdown = {slow[0]: slow[1]} if active else {}
        t0 = time.perf_counter()
        load.braid()
        _sync(comm)
        wall_us = (time.perf_counter() - t0) * 1e6
        handle = comm.last_handle if load.participates else None
        mine = (handle.shares, handle.lane_times_us(), wall_us) if handle is not None else None
        got = [None] * comm.world_size
        dist.all_gather_object(got, mine, group=comm.gloo_group)
        views = [g for g in got if g is not None]
        lane_us: dict[str, float] = {}
        for _, times, _ in views:
            for k, v in times.items():
                lane_us[k] = max(lane_us.get(k, 0.0), v)
        rows.append({"call": call, "op": op, "nbytes": nbytes, "world_size": comm.world_size,
                     "shares": views[0][0] if views else {}, "lane_time_us": lane_us,
                     "time_us": max(v[2] for v in views) if views else 0.0,
                     "slowed": ({slow[0]: slow[1]} if active else {}), "machine": info.get("machine"),
                     "date": info.get("date")})
    comm.slowdown = {}
    if comm.rank == 0:
        print(f"# trace: {op} {_human(nbytes)}B x {cfg.trace} calls, {comm.world_size} ranks"
              + (f", {slow[0]} x{slow[1]:g} slower in calls {slow[2]}..{slow[3] - 1}" if slow else ""))
        print("#  call   time_us  shares                          lane_time_us")
        for r in rows:
            lt = " ".join(f"{k}={v:.0f}" for k, v in r["lane_time_us"].items())
            mark = " (slowed)" if r["slowed"] else ""
            print(f"  {r['call']:5d} {r['time_us']:9.0f}  {format_shares(r['shares']):30s}  {lt}{mark}")
        if cfg.json_path:
            _write_json(cfg.json_path, rows)

    def after() -> None:
        if comm.rank == 0 and cfg.plot_path:
            plot_trace(rows, cfg.plot_path, info)
    return after


def plot_trace(rows: list[dict], path: str, info: dict) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("braid bench: matplotlib is not installed; no trace plot written")
        return False
    lanes = sorted({k for r in rows for k in r["shares"]})
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    calls = [r["call"] for r in rows]
    for lane in lanes:
        ax1.plot(calls, [r["shares"].get(lane, 0.0) for r in rows], marker=".", label=lane)
        ax2.plot(calls, [r["lane_time_us"].get(lane, 0.0) / 1e3 for r in rows], marker=".", label=lane)
    slowed = [r["call"] for r in rows if r["slowed"]]
    for ax in (ax1, ax2):
        if slowed:
            ax.axvspan(min(slowed) - 0.5, max(slowed) + 0.5, color="orange", alpha=0.15, label="lane slowed")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right")
    ax1.set_ylabel("share")
    ax2.set_ylabel("lane time (ms)")
    ax2.set_xlabel("call")
    r0 = rows[0] if rows else {}
    fig.suptitle(f"braid online balancer: {r0.get('op')} {_human(r0.get('nbytes', 0))}B, "
                 f"{r0.get('world_size')} ranks, {info.get('machine', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _point(op, load, esz, dtype, world, t_braid, t_base, wrong, got, baseline, factor, common) -> dict:
    views = [g for g in got if g is not None]
    shares = views[0][0] if views else {}
    lane_us: dict[str, float] = {}
    for _, times in views:
        for k, v in times.items():
            lane_us[k] = max(lane_us.get(k, 0.0), v)
    algbw = load.algbytes / t_braid / 1e3
    base_alg = load.algbytes / t_base / 1e3
    point = {"op": op, "nbytes": load.nbytes, "count": load.nbytes // esz, "algbytes": load.algbytes,
             "world_size": world, "dtype": dtype, "time_us": t_braid, "algbw_gbps": algbw,
             "busbw_gbps": algbw * factor, "wrong": wrong, "shares": shares,
             "lane_time_us": lane_us,
             "baseline": {"name": baseline, "time_us": t_base, "algbw_gbps": base_alg, "busbw_gbps": base_alg * factor},
             "ratio": t_base / t_braid}
    host = common.get("host_us")
    if host:      # per call, the median window's, slowest rank: braid's and the baseline's own
        point["host_us"] = host["braid"]
        point["baseline"]["host_us"] = host["baseline"]
    if any(v[0] != shares for v in views):
        point["shares_by_rank"] = [g[0] if g is not None else None for g in got]
    point.update({k: v for k, v in common.items() if k not in point and k != "host_us"})
    return point


def _write_json(path: str, results: list[dict]) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# plot
# ---------------------------------------------------------------------------------------------

def plot(results: list[dict], path: str, info: dict) -> bool:
    """busbw vs size per op, braid against the baseline, as a PNG. False when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        print(f"--plot {path}: matplotlib is not installed (pip install matplotlib, or pip install "
              f"'braid[bench]'); no plot written", file=sys.stderr)
        return False
    if not results:
        print(f"--plot {path}: no results to plot", file=sys.stderr)
        return False
    ops = list(dict.fromkeys(p["op"] for p in results))
    cols = 1 if len(ops) == 1 else 2
    rows = math.ceil(len(ops) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7.5 * cols, 4.8 * rows), squeeze=False)
    world = results[0]["world_size"]
    base_name = results[0]["baseline"]["name"]
    for ax, op in zip(axes.flat, ops):
        pts = sorted((p for p in results if p["op"] == op), key=lambda p: p["nbytes"])
        xs = [p["nbytes"] for p in pts]
        ax.plot(xs, [p["busbw_gbps"] for p in pts], "o-", color="tab:blue", label="braid", linewidth=2)
        ax.plot(xs, [p["baseline"]["busbw_gbps"] for p in pts], "s--", color="tab:gray", label=base_name, linewidth=1.5)
        for p in pts:   # the split braid used, above each point
            ax.annotate(format_shares(p["shares"]).replace(" ", "\n"), (p["nbytes"], p["busbw_gbps"]),
                        textcoords="offset points", xytext=(0, 6), ha="center", fontsize=6, color="tab:blue")
        ax.set_xscale("log", base=2)
        if len(xs) == 1:   # one point (the skewed all_to_all): a tick at it, not at the powers of 2 around
            ax.set_xticks(xs)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _human(v)))
        ax.set_xlabel("size (bytes" + (", per rank)" if op in ("all_gather", "all_to_all_single") else ")"))
        ax.set_ylabel("busbw (GB/s)")
        ax.set_ylim(bottom=0, top=max(max(p["busbw_gbps"], p["baseline"]["busbw_gbps"]) for p in pts) * 1.25)
        title = f"{op}, {world} ranks, {info.get('machine', '')}"
        if pts[0].get("hot_nbytes") is not None and op == "all_to_all_single":
            title += f"\nhot 0->1 {_human(pts[0]['hot_nbytes'])}B, cold {_human(pts[0]['cold_nbytes'])}B"
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="upper left")
    for ax in list(axes.flat)[len(ops):]:
        ax.set_visible(False)
    fig.suptitle(f"braid vs {base_name}: {info.get('machine', '')}, torch {info.get('torch', '')}, "
                 f"NCCL {info.get('nccl') or 'n/a'}, {info.get('date', '').replace('T', ' ')}", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"# plot written to {path}", flush=True)
    return True


# ---------------------------------------------------------------------------------------------
# calibrate and topo (every rank; rank 0 prints)
# ---------------------------------------------------------------------------------------------

def _calibrate(comm, cfg: Config) -> None:
    from . import calibrate as cal
    r0 = comm.rank == 0
    lanes = comm.lanes_for(comm.device)
    if r0:
        print(header_line("calibrate", machine_info(comm)))
        print(f"world {comm.world_size} ranks ({'nccl' if comm.cuda else 'gloo'}) | lanes: {', '.join(lanes)} | "
              f"ops: {', '.join(cfg.ops)}", flush=True)
    t0 = time.perf_counter()
    table = cal.calibrate(comm, ops=cfg.ops, save_to_disk=False)
    seconds = time.perf_counter() - t0
    if not r0:
        return
    merged = dict(cal.load(comm) or {})
    merged.update(table)
    path = cal.save(comm, merged)
    print(f"measured in {seconds:.1f} s")
    print()
    print(f"{'op/world':<22}{'lane':<7}{'latency_us':>12}{'bw_GB/s':>10}{'floor_us':>10}")
    for key, costs in table.items():
        if key.endswith(("/pays", "/timed")):
            continue
        if not costs:
            print(f"{key:<22}{'-':<7}  (one lane: nothing to split)")
        for lane, c in costs.items():
            print(f"{key:<22}{lane:<7}{c['latency_us']:>12.1f}{c['bw_gbps']:>10.2f}{c.get('floor_us', 0.0):>10.1f}")
    measured = {k[: -len("/pays")]: v for k, v in table.items() if k.endswith("/pays") and v}
    if measured:
        print()
        print("split measured against the single lanes (size bucket: the split's balanced shares when it "
              "was faster, 'no' when NCCL alone was, or the lane alone that won):")

        def cell(ok) -> str:
            if isinstance(ok, dict):
                return "(" + format_shares(ok).replace(" ", ",") + ")"
            return ok if isinstance(ok, str) else "yes" if ok else "no"
        for key, verdicts in measured.items():
            cells = " ".join(f"{_human(1 << int(b))}B={cell(ok)}"
                             for b, ok in sorted(verdicts.items(), key=lambda kv: int(kv[0])))
            print(f"  {key:<22}{cells}")
    sizes = (1 << 20, 64 << 20, 1 << 30) if comm.cuda else (256 << 10, 8 << 20, 64 << 20)
    print()
    print("shares the ops start from:")
    print(f"{'op':<20}" + "".join(f"{_human(n) + 'B':>24}" for n in sizes))
    for op in cfg.ops:
        if f"{op}/{comm.world_size}" not in table:
            continue
        print(f"{op:<20}" + "".join(f"{format_shares(comm.shares_for(op, n, lanes)):>24}" for n in sizes))
    print()
    print(f"cached at {path}", flush=True)


def _topo(comm) -> None:
    from .planner.plan import CPU_LANES, GPU_LANES
    view = {"rank": comm.rank, "pid": os.getpid(), "device": str(comm.device), "unavailable": dict(comm.unavailable),
            "gpu_lanes": comm.lanes_for(torch.device("cuda")) if comm.cuda else [],
            "cpu_lanes": comm.lanes_for(torch.device("cpu"))}
    views = [None] * comm.world_size
    dist.all_gather_object(views, view, group=comm.gloo_group)
    if comm.rank != 0:
        return
    info = machine_info(comm)
    print(header_line("topo", info))
    print(f"CPU: {_cpu_name()}, {os.cpu_count()} cores")
    try:
        free = shutil.disk_usage("/dev/shm").free
        print(f"/dev/shm: {free / (1 << 30):.1f} GiB free (node segment of the host/shm lanes)")
    except OSError:
        print("/dev/shm: not available")
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        print(f"GPUs: {n} (CUDA {torch.version.cuda})")
        for i in range(n):
            p = torch.cuda.get_device_properties(i)
            print(f"  {i}  {p.name}  {p.total_memory / (1 << 30):.1f} GiB  sm_{p.major}{p.minor}")
        print("peer access (torch.cuda.can_device_access_peer, row -> column):")
        print("      " + "".join(f"{j:>4}" for j in range(n)))
        for i in range(n):
            print(f"  {i:>3} " + "".join(f"{'-' if i == j else ('Y' if torch.cuda.can_device_access_peer(i, j) else 'n'):>4}"
                                         for j in range(n)))
        if shutil.which("nvidia-smi"):
            try:
                out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20)
                if out.returncode == 0 and out.stdout.strip():
                    print("nvidia-smi topo -m:")
                    print("\n".join("  " + line for line in out.stdout.rstrip().splitlines()))
            except (OSError, subprocess.SubprocessError):
                pass
    else:
        print("GPUs: none (torch.cuda.is_available() is False): braid has its CPU lanes only")
    print(f"world: {comm.world_size} ranks, backend {dist.get_backend()}, single node: {comm.single_node}"
          + (f", node segment {comm.layout.total_bytes / (1 << 20):.0f} MiB" if comm.layout is not None else ""))
    wanted = os.environ.get("BRAID_LANES")
    print("lanes" + (f" (BRAID_LANES={wanted})" if wanted else "") + ":")
    usable_gpu, usable_cpu = set(views[0]["gpu_lanes"]), set(views[0]["cpu_lanes"])
    for kind in list(GPU_LANES) + list(CPU_LANES):
        name = kind.value
        tensors = "CUDA" if kind in GPU_LANES else "CPU"
        whys = {v["rank"]: v["unavailable"][name] for v in views if name in v["unavailable"]}
        if name in usable_gpu or name in usable_cpu:
            state = "available"
        elif whys:
            texts = set(whys.values())
            state = "not available: " + (next(iter(texts)) if len(texts) == 1 else
                                         "; ".join(f"rank {r}: {w}" for r, w in whys.items()))
        elif comm.wanted is not None and name not in comm.wanted:
            state = "off (not in BRAID_LANES)"
        elif kind in GPU_LANES and not comm.cuda:
            state = "not available: needs CUDA tensors and an NCCL backend"
        else:
            state = "not available"
        print(f"  {name:<5} {'(' + tensors + ' tensors)':<15} {state}")
    differ = [v for v in views if (v["gpu_lanes"], v["cpu_lanes"]) != (views[0]["gpu_lanes"], views[0]["cpu_lanes"])]
    for v in differ:
        print(f"  rank {v['rank']} differs: CUDA lanes {v['gpu_lanes']}, CPU lanes {v['cpu_lanes']}")
    sys.stdout.flush()


# ---------------------------------------------------------------------------------------------
# env (no ranks)
# ---------------------------------------------------------------------------------------------

def print_env() -> None:
    import textwrap
    from . import envs
    from .errors import MisuseError
    print("braid settings (environment variables; BRAID_* are read when used):")
    for name, default, doc in envs.describe():
        raw = os.environ.get(name)
        if raw is None:
            value = f"{default} (default)"
        else:
            try:
                value = f"{raw!r} -> {envs.get(name)!r}"
            except MisuseError:
                value = f"{raw!r} (INVALID)"
        print(f"\n{name} = {value}")
        print(textwrap.fill(doc, width=96, initial_indent="    ", subsequent_indent="    "))
    print("\nset by `braid bench/calibrate/topo` for GPU ranks (NVLink multicast off):")
    for k, v in GPU_ENV.items():
        now = os.environ.get(k)
        print(f"    {k}={v}" + (f"   (now in this shell: {now})" if now is not None else ""))
