"""PNG plots of the bench (matplotlib, imported only here and only when a plot is asked for): the
sweep's busbw against size per op, braid beside its baseline with the shares above each point, and
the `--trace` view of the shares and lane times call by call. Without matplotlib each says so and
writes nothing; the bench's other output is unaffected.
"""
from __future__ import annotations

import math
import os
import sys

from .output import format_shares, human, human_bytes


def plot(results: list[dict], path: str, info: dict) -> bool:
    """busbw vs size per op, braid against the baseline, as a PNG. False when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot {path}: matplotlib is not installed (pip install matplotlib, or pip install "
              f"'braid-collectives[bench]'); no plot written", file=sys.stderr)
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
        _plot_op(ax, op, [p for p in results if p["op"] == op], world, base_name, info)
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


def _plot_op(ax, op: str, points: list[dict], world: int, base_name: str, info: dict) -> None:
    """One op's panel: braid's and the baseline's busbw over size, the shares above braid's points."""
    from matplotlib.ticker import FuncFormatter
    pts = sorted(points, key=lambda p: p["nbytes"])
    xs = [p["nbytes"] for p in pts]
    ax.plot(xs, [p["busbw_gbps"] for p in pts], "o-", color="tab:blue", label="braid", linewidth=2)
    ax.plot(xs, [p["baseline"]["busbw_gbps"] for p in pts], "s--", color="tab:gray", label=base_name, linewidth=1.5)
    for p in pts:   # the split braid used, above each point
        ax.annotate(format_shares(p["shares"]).replace(" ", "\n"), (p["nbytes"], p["busbw_gbps"]),
                    textcoords="offset points", xytext=(0, 6), ha="center", fontsize=6, color="tab:blue")
    ax.set_xscale("log", base=2)
    if len(xs) == 1:   # one point (the skewed all_to_all): a tick at it, not at the powers of 2 around
        ax.set_xticks(xs)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: human(v)))
    ax.set_xlabel("size (bytes" + (", per rank)" if op in ("all_gather", "all_to_all_single") else ")"))
    ax.set_ylabel("busbw (GB/s)")
    ax.set_ylim(bottom=0, top=max(max(p["busbw_gbps"], p["baseline"]["busbw_gbps"]) for p in pts) * 1.25)
    title = f"{op}, {world} ranks, {info.get('machine', '')}"
    if pts[0].get("hot_nbytes") is not None and op == "all_to_all_single":
        title += f"\nhot 0->1 {human_bytes(pts[0]['hot_nbytes'])}, cold {human_bytes(pts[0]['cold_nbytes'])}"
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left")


def plot_trace(rows: list[dict], path: str, info: dict) -> bool:
    """Shares (top) and lane times (bottom) call by call, the slowed calls shaded. False without matplotlib."""
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
    fig.suptitle(f"braid online balancer: {r0.get('op')} {human_bytes(r0.get('nbytes', 0))}, "
                 f"{r0.get('world_size')} ranks, {info.get('machine', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
