"""The `braid` command (also `python -m braid`).

    braid bench      --op all_gather --sizes 1M:1G [--json out.json] [--plot out.png]
    braid calibrate  [--nproc N]      measure every lane per op, cache it, print the LaneCosts
    braid env                         every BRAID_* setting, its value and meaning
    braid topo                        GPUs, peer access, and which lanes braid can use here
    braid route      --matrix M.json --topology h200x4   plan a traffic matrix over every path
    braid sim        reproduce flexlink|fuselink|nimble | scale --op ... | own | presets
    braid --version                   braid's version (with torch's and Python's)

bench/calibrate/topo spawn one rank per GPU (2 CPU ranks without GPUs), or run inside torchrun:
    torchrun --nproc-per-node 4 -m braid bench --op all
"""
from __future__ import annotations

import argparse
import os
import sys

from . import bench


def _bench(args: argparse.Namespace) -> int:
    return bench.launch(bench.config_from_args("bench", args), args.nproc)


def _calibrate(args: argparse.Namespace) -> int:
    return bench.launch(bench.config_from_args("calibrate", args), args.nproc)


def _topo(args: argparse.Namespace) -> int:
    return bench.launch(bench.config_from_args("topo", args), args.nproc)


def _route(args: argparse.Namespace) -> int:
    from . import route_cli
    return route_cli.run(args)


def _sim(args: argparse.Namespace) -> int:
    from .sim import cli
    return cli.run(args)


def _env(args: argparse.Namespace) -> int:
    bench.print_env()
    return 0


def version_line() -> str:
    """What `braid --version` prints: braid's version, the distribution to install or pin it by
    (`pip install braid-collectives==VERSION`), then torch's and Python's versions."""
    import platform
    import torch
    from ._version import __version__
    return (f"braid {__version__} (braid-collectives; torch {torch.__version__}, "
            f"Python {platform.python_version()})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="braid", description="braid: one collective split across every path "
                                     "between GPUs. Benchmark, calibrate and inspect it.")
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("bench", help="time braid against NCCL (or gloo on CPU) over a size sweep",
                       description="Time braid against its baseline (NCCL on GPUs, gloo on CPUs) across N ranks, "
                                   "nccl-tests style. Spawns the ranks itself, or joins torchrun's world.")
    bench.add_bench_arguments(p)
    p.set_defaults(func=_bench)

    p = sub.add_parser("calibrate", help="measure every lane per op, cache and print the lane costs",
                       description="Run braid.calibrate.calibrate over the ops on N ranks, cache the result "
                                   "(BRAID_CACHE_DIR) and print each lane's latency and bandwidth.")
    bench.add_calibrate_arguments(p)
    p.set_defaults(func=_calibrate)

    p = sub.add_parser("env", help="print every BRAID_* setting", description="Every BRAID_* setting: value, "
                       "default and meaning.")
    p.set_defaults(func=_env)

    p = sub.add_parser("topo", help="GPUs, peer access and the lanes braid can use here",
                       description="Start N ranks and report the lanes braid finds (and why others are off), "
                                   "the GPUs and their peer access.")
    bench.add_launch_arguments(p)
    p.set_defaults(func=_topo)

    from . import route_cli
    p = sub.add_parser("route", help="plan a traffic matrix over every path (the router)",
                       description="Spread a traffic matrix over direct, relay, host-staged and NIC-rail paths "
                                   "so the most loaded link is as light as possible; compare with the LP optimum.")
    route_cli.add_arguments(p)
    p.set_defaults(func=_route)

    from .sim import cli as sim_cli
    p = sub.add_parser("sim", help="the flow-level simulator: published testbeds, braid's H200 bench, scale",
                       description="Run braid's plans on modelled machines: reproduce FlexLink, FuseLink and NIMBLE's "
                                   "figures, compare with braid's recorded bench, or scale to 128 nodes x 8 GPUs.")
    sim_cli.add_arguments(p)
    p.set_defaults(func=_sim)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:      # `braid env | head`: stop quietly, with the status of a writer SIGPIPE ended
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return bench.config.PIPE_EXIT


if __name__ == "__main__":
    sys.exit(main())
