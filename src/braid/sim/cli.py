"""`braid sim`: the simulator from the command line.

    braid sim reproduce flexlink|fuselink|nimble [--json P] [--plot P]
    braid sim scale --op all_reduce|all_gather|alltoallv --nodes 2,8,32,128 [--nics 1|4|8] [--hot 0.7] [--json P]
    braid sim own [--data tests/data/sim_bench_h200.json] [--json P]
    braid sim presets                       every preset constant with its source
"""
from __future__ import annotations

import argparse
import json
import math
import sys

from ..planner import checks
from ..planner.checks import MisuseError


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="sim_command", metavar="WHAT", required=True)
    r = sub.add_parser("reproduce", help="a published system's figures beside the simulated ones",
                       description="Print each published figure of FlexLink, FuseLink or NIMBLE beside the "
                                   "simulator's, from one constant set per testbed (braid sim presets).")
    r.add_argument("name", choices=["flexlink", "fuselink", "nimble"])
    r.add_argument("--json", dest="json_path", metavar="PATH", help="write the rows (name, published, simulated, unit, ...)")
    r.add_argument("--plot", dest="plot_path", metavar="PATH", help="bar chart published vs simulated (needs matplotlib)")
    s = sub.add_parser("scale", help="all_reduce / all_gather / skewed all-to-all-v on N nodes x 8 GPUs",
                       description="Predicted bandwidth, path shares and planning time per plan, single path vs "
                                   "multi-lane vs multi-lane with NIC borrowing.")
    s.add_argument("--op", default="all_reduce", choices=["all_reduce", "all_gather", "alltoallv"])
    s.add_argument("--nodes", default="2,8,32,128", help="comma list of node counts (default 2,8,32,128)")
    s.add_argument("--nics", type=int, default=8, choices=[1, 4, 8], help="NICs per node (default 8)")
    s.add_argument("--hot", type=float, default=0.7, help="alltoallv: share of each rank's bytes to the hot GPU")
    s.add_argument("--size", default="256M", help="bytes per GPU (K/M/G suffixes, default 256M)")
    s.add_argument("--json", dest="json_path", metavar="PATH")
    o = sub.add_parser("own", help="the simulator against braid's recorded bench on our H200 host")
    o.add_argument("--data", default="tests/data/sim_bench_h200.json", help="recorded points (JSON)")
    o.add_argument("--json", dest="json_path", metavar="PATH")
    sub.add_parser("presets", help="every preset constant and its source")


def _size(text: str) -> int:
    """A whole byte count >= 1 from text like 4096, 256M or 1.5G."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().rstrip("B")
    try:
        v = float(t[:-1]) * units[t[-1]] if t and t[-1] in units else int(t)
        ok = math.isfinite(v) and v >= 1
    except (ValueError, OverflowError):
        ok = False
    if not ok:
        raise MisuseError(f"--size {text!r}: expected a whole byte count >= 1 like 4096, 256M or 1G")
    return int(v)


def _nodes(text: str) -> list[int]:
    """--nodes: a comma list of node counts, each >= 1."""
    out = []
    for x in text.split(","):
        if not x.strip():
            continue
        try:
            out.append(int(x))
        except ValueError:
            raise MisuseError(f"--nodes {text!r}: {x.strip()!r} is not a whole number; give node counts "
                              f"like 2,8,32") from None
    if not out:
        raise MisuseError(f"--nodes {text!r}: no node counts; give some like 2,8,32")
    if min(out) < 1:
        raise MisuseError(f"--nodes {text!r}: {min(out)} nodes; node counts must be whole numbers >= 1, "
                          f"like 2,8,32")
    return out


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:.1f}" if isinstance(v, float) else str(v)


def reproduce(args: argparse.Namespace) -> int:
    from .repro import PRESET_OF, reproduce as run
    rows = run(args.name)
    print(f"# braid sim reproduce {args.name}  (preset {PRESET_OF[args.name]}; braid sim presets lists its constants)")
    print(f"{'figure':58s} {'published':>10s} {'simulated':>10s} {'unit':>5s}  within")
    for r in rows:
        ok = {True: "yes", False: "NO", None: ""}[r.ok]
        if r.ok is not None and r.rule == "at_least":
            ok += " (>=)"
        print(f"{r.name:58s} {_fmt(r.published):>10s} {r.simulated:10.1f} {r.unit:>5s}  {ok}"
              + (f"  [{r.note}]" if r.note else ""))
    checked = [r for r in rows if r.ok is not None]
    print(f"{sum(bool(r.ok) for r in checked)}/{len(checked)} checked figures within tolerance")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump([r.to_dict() for r in rows], f, indent=1)
    if args.plot_path:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("braid sim: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
            return 2
        shown = [r for r in rows if r.published is not None]
        fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(shown)), 4))
        xs = range(len(shown))
        ax.bar([x - 0.2 for x in xs], [r.published for r in shown], 0.4, label="published")
        ax.bar([x + 0.2 for x in xs], [r.simulated for r in shown], 0.4, label="simulated")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([r.name for r in shown], rotation=60, ha="right", fontsize=7)
        ax.set_title(f"{args.name}: published vs simulated")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot_path, dpi=120)
    return 0


def scale(args: argparse.Namespace) -> int:
    from .scale import sweep
    nodes = _nodes(args.nodes)
    if args.op == "alltoallv" and min(nodes) < 2:
        raise MisuseError(f"--nodes {args.nodes!r}: alltoallv needs >= 2 nodes (the hot expert is on the "
                          f"next node)")
    checks.real(args.hot, "--hot", strict=False, high=1.0, hint="the share of each rank's bytes to the hot GPU")
    rows = sweep(args.op, nodes, args.nics, args.hot, per_gpu_bytes=_size(args.size))
    print(f"# braid sim scale --op {args.op} --nics {args.nics}" + (f" --hot {args.hot}" if args.op == "alltoallv" else "")
          + f" --size {args.size}  (8 Hopper GPUs per node; preset hopper8-8nic-fuselink)")
    print(f"{'nodes':>5s} {'variant':>7s} {'time us':>10s} {'algbw':>7s} {'busbw':>7s} {'plan cold us':>12s} "
          f"{'cached us':>9s}  path shares")
    for r in rows:
        shares = " ".join(f"{k}={v:.2f}" for k, v in r.path_shares.items())
        print(f"{r.nodes:5d} {r.variant:>7s} {r.time_us:10.0f} {r.algbw_gbps:7.1f} {r.busbw_gbps:7.1f} "
              f"{r.plan_cold_us:12.0f} {r.plan_cached_us:9.1f}  {shares}")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump([r.to_dict() for r in rows], f, indent=1)
    return 0


def own(args: argparse.Namespace) -> int:
    from .own import compare, load_points
    rows = compare(load_points(args.data))
    print("# braid sim own: recorded braid benches (2026-11-22) vs the simulator on h200x2 / h200x4")
    print(f"{'point':46s} {'kind':10s} {'measured':>9s} {'simulated':>9s} {'error':>7s}  shares")
    for c in rows:
        sh = " ".join(f"{k}={v:.2f}" for k, v in c.shares.items())
        print(f"{c.name:46s} {c.kind:10s} {c.measured_us:9.0f} {c.simulated_us:9.0f} {100 * c.error:+6.1f}%  {sh}")
    pred = [c for c in rows if c.kind == "prediction"]
    print(f"# split points within 10%: {sum(abs(c.error) <= 0.10 for c in pred)} of {len(pred)}")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump([c.to_dict() for c in rows], f, indent=1)
    return 0


def presets(args: argparse.Namespace) -> int:
    from .topology import PRESETS, load
    for name in PRESETS:
        t = load(name)
        print(f"## {name}: {t.nodes} node(s) x {t.gpus_per_node} GPUs, {t.fabric}, {t.nics_per_node} NICs/node")
        for key, value, unit, source in t.sources():
            print(f"  {key:24s} {value!s:>12s} {unit:32s} {source}")
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        return {"reproduce": reproduce, "scale": scale, "own": own, "presets": presets}[args.sim_command](args)
    except BrokenPipeError:
        raise
    except (OSError, ValueError) as exc:
        print(f"braid sim: {exc}", file=sys.stderr)
        return 2
