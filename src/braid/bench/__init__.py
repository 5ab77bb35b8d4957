"""`braid bench`, `braid calibrate`, `braid topo` and `braid env`: braid against its baseline across N ranks.

One module per job:
  config.py    the Config every rank receives, and the bench's fixed numbers
  cli.py       argument types, options and help texts, Config from the parsed arguments
  launcher.py  spawning the ranks (or joining torchrun's world) and running each rank's task
  sweep.py     the op sweep: check, then time braid and the baseline in alternating windows
  trace.py     --trace: shares and lane times call by call, with a lane slowed on purpose
  output.py    the header, the rich/plain tables, the trace table, the JSON
  plots.py     PNG plots of the sweep and of a trace
  commands.py  calibrate, topo and env

GPU ranks use NCCL (baseline: NCCL alone); without GPUs, with one GPU, or with --cpu the ranks use
gloo and braid runs its CPU lanes (shm, gloo) against gloo alone.
"""
from __future__ import annotations

from .cli import (add_bench_arguments, add_calibrate_arguments, add_launch_arguments, config_from_args, parse_lanes,
                  parse_shares, parse_size, parse_size_range)
from .commands import print_env
from .config import (CPU_LINE, CPU_SIZES, DTYPES, EXTRA_OPS, GPU_ENV, GPU_SIZES, NO_GPU_LINE, ONE_GPU_LINE, OPS,
                     SMALL_ROUNDS, WRONG_EXIT, Config, set_gpu_env)
from . import launcher
from .launcher import launch, under_torchrun
from .output import (COLUMNS, PlainUi, RichUi, format_shares, header_line, machine_info, make_ui, nccl_version,
                     write_json)
from .plots import plot, plot_trace
from .sweep import calibrate_for_bench

# one rank's torch.distributed init, for the tests that start it alone
_init_rank = launcher._init_rank

__all__ = [
    "CPU_LINE", "CPU_SIZES", "COLUMNS", "DTYPES", "EXTRA_OPS", "GPU_ENV", "GPU_SIZES", "NO_GPU_LINE", "ONE_GPU_LINE",
    "OPS", "SMALL_ROUNDS", "WRONG_EXIT", "Config", "PlainUi", "RichUi", "add_bench_arguments",
    "add_calibrate_arguments", "add_launch_arguments", "calibrate_for_bench", "config_from_args", "format_shares",
    "header_line", "launch", "machine_info", "make_ui", "nccl_version", "parse_lanes", "parse_shares", "parse_size",
    "parse_size_range", "plot", "plot_trace", "print_env", "set_gpu_env", "under_torchrun", "write_json",
]
