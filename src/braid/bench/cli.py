"""The command line of `braid bench`, `braid calibrate` and `braid topo`: argument types, the
options with their help texts, and the `Config` built from them.

Sizes are binary (64K = 64 KiB), like nccl-tests. Mistakes the parser can see (an unknown lane, a
fraction outside 0..1, --cold-bytes without --hot-bytes) stop here with a message naming the fix;
flags that do not apply to what runs are kept as notes that the bench prints before its table.
"""
from __future__ import annotations

import argparse
import re

from .config import DTYPES, EXTRA_OPS, OPS, Config

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


# ---------------------------------------------------------------------------------------------
# argument types
# ---------------------------------------------------------------------------------------------

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
    from ..planner.plan import LaneKind
    lanes = [x.strip().lower() for x in text.split(",") if x.strip()]
    known = [k.value for k in LaneKind]
    bad = [x for x in lanes if x not in known]
    if bad or not lanes:
        raise argparse.ArgumentTypeError(f"--lanes {text!r}: lanes are a comma list of {known}")
    return lanes


def parse_ops(text: str) -> tuple[str, ...]:
    """--op: 'all_gather,all_reduce' -> ('all_gather', 'all_reduce'); 'all' -> every op but moe
    (which 'all,moe' adds). Repeats are dropped, the order kept."""
    names = [x.strip().lower() for x in text.split(",") if x.strip()]
    known = OPS + EXTRA_OPS
    bad = [x for x in names if x not in known and x != "all"]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"{text!r}: ops are a comma list of {', '.join(known)}, or 'all' (unknown: {', '.join(bad) or 'none given'})")
    ops = [op for x in names for op in (OPS if x == "all" else (x,))]
    return tuple(dict.fromkeys(ops))


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
    from ..planner.plan import LaneKind
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


# ---------------------------------------------------------------------------------------------
# options (added in the order `--help` lists them)
# ---------------------------------------------------------------------------------------------

def add_launch_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=_positive_int, default=None,
                   help="ranks to spawn (default: number of GPUs, or 2 on the CPU lanes with fewer than 2 GPUs or --cpu); "
                        "more ranks than GPUs share them (BRAID_SHARED_GPU: exact results, host-cost times, not "
                        "link speeds); ignored under torchrun")
    p.add_argument("--lanes", type=parse_lanes, default=None,
                   help="restrict braid to these lanes, e.g. ce,host (sets BRAID_LANES in the workers)")
    p.add_argument("--cpu", action="store_true",
                   help="CPU tensors and CPU lanes (gloo ranks) even where GPUs are visible; the default on a "
                        "machine with one GPU, where braid has no GPU peer to join")


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--op", type=parse_ops, default=None, metavar="OP[,OP...]",
                   help=f"op to run, a comma list run in turn, or 'all' for every op but moe (default: all_gather); "
                        f"ops: {', '.join(OPS + EXTRA_OPS)}; moe = one MoE layer: dispatch + combine with a "
                        f"Zipf-skewed expert load (time per layer)")
    p.add_argument("--workload", default=None, metavar="NAME[,NAME...]",
                   help="instead of an op sweep: time training steps under the braid backend against the same "
                        "steps on the baseline (and a floor without communication): ddp, fsdp, moe_layer, "
                        "a comma list, or 'all'")
    add_launch_arguments(p)
    _add_sweep_arguments(p)
    _add_skew_arguments(p)
    _add_workload_arguments(p)
    _add_output_arguments(p)


def _add_sweep_arguments(p: argparse.ArgumentParser) -> None:
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
                        "small calls whose call count was raised: at least 10 shorter windows, each side's median; "
                        "with --workload: timed windows per side, the median is kept, default 9 on GPUs, 5 on CPUs)")
    p.add_argument("--shares", type=parse_shares, default=None, metavar="LANE=FRAC,...",
                   help="fixed shares, e.g. ce=0.9,host=0.1: bypass the model (and the calibration)")
    p.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                   help="do not measure the lanes first: use the cached calibration (none: NCCL whole on GPUs, the built-in lane model on CPU lanes)")


def _add_skew_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hot-bytes", type=parse_size, default=None, metavar="SIZE",
                   help="all_to_all_single skew: rank0->rank1 carries SIZE, every other pair --cold-bytes "
                        "(one point instead of the --sizes sweep)")
    p.add_argument("--cold-bytes", type=parse_size, default=None, metavar="SIZE",
                   help="bytes of every other pair with --hot-bytes (default 0)")
    p.add_argument("--hot-fraction", type=_hot_fractions, default=None, metavar="H[,H...]",
                   help="all_to_all_single: every rank sends this fraction of its bytes to the last rank, "
                        "the rest evenly to the others (one hot destination); one sweep per value")


def _add_workload_arguments(p: argparse.ArgumentParser) -> None:
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


def _add_output_arguments(p: argparse.ArgumentParser) -> None:
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
# the Config of a command
# ---------------------------------------------------------------------------------------------

def config_from_args(task: str, args: argparse.Namespace) -> Config:
    if task == "bench":
        if getattr(args, "workload", None) is not None:
            return _workload_config(args)
        return _sweep_config(args)
    if task == "calibrate":
        ops = tuple(x.strip() for x in args.ops.split(",") if x.strip())
        bad = [x for x in ops if x not in OPS]
        if bad or not ops:
            raise SystemExit(f"braid calibrate: --ops {args.ops!r}: ops are a comma list of {list(OPS)}")
        return Config(task, ops=ops, lanes=args.lanes, cpu=args.cpu)
    return Config(task, lanes=getattr(args, "lanes", None), cpu=getattr(args, "cpu", False))


def _sweep_config(args: argparse.Namespace) -> Config:
    """`braid bench` without --workload: the op sweep (or --trace)."""
    ops = args.op or ("all_gather",)
    if args.cold_bytes is not None and args.hot_bytes is None:
        raise SystemExit("braid bench: --cold-bytes needs --hot-bytes")
    notes = []
    shape = [f for f in ("width", "depth", "batch", "bucket_mb", "tokens", "steps")
             if getattr(args, f, None) is not None]
    if shape:
        notes.append(f"--{', --'.join(f.replace('_', '-') for f in shape)} only apply with --workload; ignored")
    if args.trace is not None and len(ops) > 1:
        raise SystemExit(f"braid bench: --trace follows one op; give one --op (got {','.join(ops)})")
    if args.hot_bytes is not None and "all_to_all_single" not in ops:
        notes.append("--hot-bytes/--cold-bytes only apply to all_to_all_single; ignored")
    if args.hot_fraction is not None and args.hot_bytes is not None:
        raise SystemExit("braid bench: use --hot-fraction or --hot-bytes, not both")
    if args.hot_fraction is not None and "all_to_all_single" not in ops:
        notes.append("--hot-fraction only applies to all_to_all_single; ignored")
    return Config("bench", ops=ops, sizes=args.sizes, factor=args.factor, dtype=args.dtype, iters=args.iters,
                  auto_iters=not args.fixed_iters, trace=args.trace, slow=args.slow, warmup=args.warmup,
                  repeat=args.repeat if args.repeat is not None else 2, lanes=args.lanes, shares=args.shares,
                  calibrate=args.calibrate, hot_bytes=args.hot_bytes,
                  cold_bytes=(args.cold_bytes or 0) if args.hot_bytes is not None else None,
                  hot_fraction=args.hot_fraction,
                  json_path=args.json_path, plot_path=args.plot_path, check=args.check, plain=args.plain,
                  cpu=args.cpu, notes=notes)


def _workload_config(args: argparse.Namespace) -> Config:
    """`braid bench --workload ...`: training steps (braid.jobs) instead of the op sweep."""
    from ..jobs import parse_workloads
    if args.op is not None:
        raise SystemExit(f"braid bench: --op {','.join(args.op)} and --workload {args.workload} both choose what to run; "
                         f"give one of them")
    workloads = parse_workloads(args.workload)
    sweep = {"--sizes": args.sizes, "--iters": args.iters, "--hot-bytes": args.hot_bytes,
             "--cold-bytes": args.cold_bytes, "--hot-fraction": args.hot_fraction, "--trace": args.trace,
             "--slow": args.slow, "--plot": args.plot_path}
    ignored = [flag for flag, value in sweep.items() if value is not None]
    notes = [f"{', '.join(ignored)} only apply to the op sweep; ignored with --workload"] if ignored else []
    return Config("bench", ops=(), dtype=args.dtype, warmup=args.warmup,
                  repeat=args.repeat, lanes=args.lanes, shares=args.shares,
                  calibrate=args.calibrate, json_path=args.json_path, plain=args.plain, cpu=args.cpu, notes=notes,
                  workloads=workloads, width=args.width, depth=args.depth, batch=args.batch,
                  bucket_mb=args.bucket_mb, tokens=args.tokens, steps=args.steps)
