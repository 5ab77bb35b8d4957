"""What rank 0 of the bench shows and writes: the header line that names the machine, the
nccl-tests style table (rich when importable and not --plain, plain text otherwise, both fed one
row per point as it is measured), the `--trace` table, and the JSON file (rewritten after every
point, so an interrupted sweep keeps what it measured). Plots are in `plots.py`.
"""
from __future__ import annotations

import datetime
import errno
import importlib
import json
import os
import platform
import socket
import statistics
import sys

import torch

from .. import envs
from .config import cores_text, shared_gpu_line

# ---------------------------------------------------------------------------------------------
# the machine, and numbers as the tables print them
# ---------------------------------------------------------------------------------------------


def cpu_name() -> str:
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
    from .. import __version__
    info = {"host": socket.gethostname(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "torch": torch.__version__, "nccl": nccl_version(), "braid_version": __version__,
            "world_size": comm.world_size}
    if comm.cuda:
        n = torch.cuda.device_count()
        name = torch.cuda.get_device_name(comm.device)
        if n < comm.world_size:         # ranks share the GPUs (BRAID_SHARED_GPU)
            info["machine"] = f"{n}x {name} shared by {comm.world_size} ranks"
        else:
            info["machine"] = f"{comm.world_size}x {name}" + (f" (of {n})" if n > comm.world_size else "")
        info["gpu"], info["gpus"], info["cuda"] = name, n, torch.version.cuda
        info["shared_gpu"] = bool(envs.get("BRAID_SHARED_GPU"))   # ranks may share GPUs: host-cost times
    else:
        info["machine"] = f"CPU {cpu_name()} ({cores_text()})"
    return info


def header_line(tool: str, info: dict) -> str:
    return (f"braid {tool} {info['braid_version']} | {info['machine']} | {info['date'].replace('T', ' ')} | "
            f"torch {info['torch']} | NCCL {info['nccl'] or 'n/a'} | host {info['host']}"
            + (f"\n{shared_gpu_line(info['world_size'], info['gpus'])}" if info.get("shared_gpu") else ""))


def human(n: float) -> str:
    """Bytes in binary units as the tables print them: 1048576 -> '1M', 1572864 -> '1.5M'."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f}{unit}" if abs(v - round(v)) < 1e-9 else f"{v:.3g}{unit}"
    return f"{int(n)}"


def human_bytes(n: float, sep: str = " ") -> str:
    """Bytes with a binary unit for text: 16777216 -> '16 MiB', 1536 -> '1.5 KiB', 100 -> '100 B'
    (`sep=""` for cells: '16MiB')."""
    text = human(n)
    return f"{text[:-1]}{sep}{text[-1]}iB" if text[-1:] in ("K", "M", "G") else f"{text}{sep}B"


def format_shares(shares: dict[str, float] | None) -> str:
    if not shares:
        return "-"
    return " ".join(f"{k}={v:.2f}" for k, v in shares.items())


def write_json(path: str, results: list[dict]) -> None:
    """`results` as indented JSON at `path`, replaced atomically (readers never see half a file)."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# the sweep's table: rich when importable, plain text otherwise
# ---------------------------------------------------------------------------------------------

COLUMNS = ("size", "count", "type", "time_us", "algbw", "busbw", "#wrong", "base_us", "base_busbw", "ratio",
           "host_us", "shares")


def _row_cells(p: dict) -> list[str]:
    wrong = "N/A" if p["wrong"] is None else str(p["wrong"])
    return [str(p["nbytes"]), str(p["count"]), p["dtype"], f"{p['time_us']:.1f}", f"{p['algbw_gbps']:.2f}",
            f"{p['busbw_gbps']:.2f}", wrong, f"{p['baseline']['time_us']:.1f}",
            f"{p['baseline']['busbw_gbps']:.2f}", f"{p['ratio']:.2f}", _host_cell(p),
            format_shares(p["shares"]) + _best_cell(p)]


def _best_cell(p: dict) -> str:
    """After the shares: the best baseline where another than the table's own ran faster."""
    best = p.get("best_baseline")
    if not best or best["name"] == p["baseline"]["name"]:
        return ""
    return f"  best: {best['name']} {best['time_us']:.1f} us, ratio {p['ratio_best']:.2f}"


def _host_cell(p: dict) -> str:
    """Host time per call, braid's / the baseline's (us)."""
    mine, base = p.get("host_us"), p["baseline"].get("host_us")
    return "-" if mine is None or base is None else f"{mine:.0f}/{base:.0f}"


def host_summary(points: list[dict]) -> dict | None:
    """One table's host cost: braid's host time per call as a ratio of the baseline's (median,
    min, max over the points that have both), each side's median host_us, and each side's first
    call of a shape (`first_call_us`: median, max). None when no point has both host times."""
    both = [p for p in points if p.get("host_us") and p["baseline"].get("host_us")]
    if not both:
        return None
    ratios = [p["host_us"] / p["baseline"]["host_us"] for p in both]
    out = {"op": points[-1]["op"], "baseline": points[-1]["baseline"]["name"], "points": len(both),
           "host_ratio_median": statistics.median(ratios), "host_ratio_min": min(ratios),
           "host_ratio_max": max(ratios),
           "host_us_median": statistics.median(p["host_us"] for p in both),
           "baseline_host_us_median": statistics.median(p["baseline"]["host_us"] for p in both)}
    if "hot_fraction" in points[-1]:
        out["hot_fraction"] = points[-1]["hot_fraction"]
    top = max(points, key=lambda p: p.get("nbytes", 0))
    ceiling = top.get("copy_ceiling_gbps")
    if ceiling and top.get("algbw_gbps") is not None:
        # CPU runs: how close the largest size's algorithm bandwidth gets to a plain copy's
        out["ceiling_nbytes"] = top["nbytes"]
        out["ceiling_fraction"] = top["algbw_gbps"] / ceiling
        if top["baseline"].get("algbw_gbps") is not None:
            out["baseline_ceiling_fraction"] = top["baseline"]["algbw_gbps"] / ceiling
    bounds = [(p["nbytes"], p["ratio_bound"]) for p in points if p.get("ratio_bound") is not None]
    if bounds:
        # the most any all_reduce could gain over the baseline here: the baseline's time over one
        # copy of the tensor on every rank at once, per size
        out["ratio_bound"] = bounds
    floors = [(p["nbytes"], p["ratio_floor"]) for p in points if p.get("ratio_floor") is not None]
    if floors:
        # ...and over braid's own copies and reductions with no wait (the native call's floor)
        out["ratio_floor"] = floors
    for key, get in (("first_call_us", lambda p: p.get("first_call_us")),
                     ("baseline_first_call_us", lambda p: p["baseline"].get("first_call_us"))):
        vals = [v for v in map(get, points) if v is not None]
        if vals:
            out[f"{key}_median"], out[f"{key}_max"] = statistics.median(vals), max(vals)
    return out


def _us(v: float) -> str:
    return f"{v:.0f} us" if v >= 10 else f"{v:.1f} us"


def split_calls_line(sc: dict) -> str:
    """One line of the prepared-call counters of rank 0 (`comm._prepared.stats`, those above 0):
    how many split calls were built, replayed, deferred, rebuilt off the caller's thread, launched
    natively, and the mean round of words per hit (GPU calls that replay a graph) and
    post-to-launch time per deferred call."""
    return ("braid's split calls (rank 0): "
            + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in sc.items()
                        if v and k not in ("round_us", "launch_us"))
            + (f", round of words {sc['round_us'] / sc['hits']:.1f} us per hit"
               if sc.get("hits") and sc.get("round_us") else "")
            + (f", post to launch {sc['launch_us'] / sc['deferred']:.1f} us per deferred call"
               if sc.get("deferred") else ""))


def summary_line(s: dict) -> str:
    """The line under a table: braid's host time per call against the baseline's, then the first
    call of a shape (braid's includes preparing it) on each side."""
    base = s["baseline"]
    line = (f"host per call: braid/{base} median {s['host_ratio_median']:.2f}x "
            f"(min {s['host_ratio_min']:.2f}x, max {s['host_ratio_max']:.2f}x over {s['points']} "
            f"point{'s' if s['points'] != 1 else ''}); median braid {_us(s['host_us_median'])}, "
            f"{base} {_us(s['baseline_host_us_median'])}")
    if "first_call_us_median" in s:
        line += (f" | first call (prepare): braid median {_us(s['first_call_us_median'])}, "
                 f"max {_us(s['first_call_us_max'])}")
        if "baseline_first_call_us_median" in s:
            line += (f"; {base} median {_us(s['baseline_first_call_us_median'])}, "
                     f"max {_us(s['baseline_first_call_us_max'])}")
    if "ceiling_fraction" in s:
        line += (f" | at {_size(s['ceiling_nbytes'])}: braid's algbw {100 * s['ceiling_fraction']:.0f}% of the "
                 f"copy ceiling")
        if "baseline_ceiling_fraction" in s:
            line += f", {base}'s {100 * s['baseline_ceiling_fraction']:.0f}%"
    if "ratio_bound" in s:
        line += (" | at one copy's time (every rank copying its tensor at once) the ratio could reach "
                 + ", ".join(f"{r:.1f} at {_size(n)}" for n, r in s["ratio_bound"]))
    if "ratio_floor" in s:
        line += (" | at the floor of braid's own copies and reductions (every rank at once in its own memory, no wait) "
                 + ", ".join(f"{r:.1f} at {_size(n)}" for n, r in s["ratio_floor"]))
    return line


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def _table_summary(p: dict | None) -> str | None:
    """The summary line of the table whose last row is `p` (None: nothing to say)."""
    s = p.get("host_summary") if p else None
    return summary_line(s) if s else None


class PlainUi:
    WIDTHS = (12, 11, 10, 11, 8, 8, 7, 12, 12, 7, 12)

    def __init__(self, total: int):
        self.total, self.done = total, 0
        self.tty = sys.stderr.isatty()
        self.last: dict | None = None      # the current table's last row

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
        self.last = p

    def status(self, what: str) -> None:
        if self.tty:
            sys.stderr.write(f"\r[{self.done + 1}/{self.total}] {what} ...")
            sys.stderr.flush()

    def advance(self) -> None:
        self.done += 1

    def end_op(self) -> None:
        text, self.last = _table_summary(self.last), None
        if text:
            self.line(f"# {text}")

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
        self.console.on_broken_pipe = self._broken_pipe
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=self.console)
        self.task = self.progress.add_task("sweep", total=total)
        self.table = None
        self.last: dict | None = None      # the current table's last row
        self.live = Live(self.progress, console=self.console, transient=True, refresh_per_second=4)
        self.live.start()

    def _broken_pipe(self) -> None:
        """stdout's reader went away (`braid bench | head`): rich would exit with status 1; raise
        BrokenPipeError instead, which the launcher turns into a quiet exit (status 141)."""
        self.console.quiet = True           # close() writes nothing more
        raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))

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
        self.last = p

    def status(self, what: str) -> None:
        self.progress.update(self.task, description=what)

    def advance(self) -> None:
        self.progress.advance(self.task)

    def end_op(self) -> None:
        if self.table is not None:
            self.live.update(self.progress)
            self.console.print(self.table)
            self.table = None
            text, self.last = _table_summary(self.last), None
            if text:
                self.line(f"  {text}")

    def close(self) -> None:
        self.end_op()
        self.live.stop()


def make_ui(total: int, plain: bool):
    if not plain:
        try:
            importlib.import_module("rich")
        except ImportError:
            return PlainUi(total)
        return RichUi(total)
    return PlainUi(total)


# ---------------------------------------------------------------------------------------------
# --trace: one line per call
# ---------------------------------------------------------------------------------------------

def print_trace(rows: list[dict], op: str, nbytes: int, calls: int, world: int, slow) -> None:
    """The trace table: each call's time, the shares braid used and each lane's time (slowest rank)."""
    print(f"# trace: {op} {human_bytes(nbytes)} x {calls} calls, {world} ranks"
          + (f", {slow[0]} x{slow[1]:g} slower in calls {slow[2]}..{slow[3] - 1}" if slow else ""))
    print("#  call   time_us  shares                          lane_time_us")
    for r in rows:
        lt = " ".join(f"{k}={v:.0f}" for k, v in r["lane_time_us"].items())
        mark = " (slowed)" if r["slowed"] else ""
        print(f"  {r['call']:5d} {r['time_us']:9.0f}  {format_shares(r['shares']):30s}  {lt}{mark}")
