"""`braid sim`: the simulator from the command line.

    braid sim reproduce flexlink|fuselink|nimble [--json P] [--plot P]
    braid sim scale [--gpu h100,h200,h800|nimble] [--nodes 2,8,32,128] [--nics 1,4,8] [--op OP] [--size 256M]
                    [--hot 0.7] [--json P]      multi-node: braid's steps vs NCCL, routed skewed all-to-all
    braid sim scale --proxy --op all_reduce|all_gather|alltoallv [...]    the two-node link proxy
    braid sim own [--data P] [--json P]     the recorded H200 bench (braid/sim/data) vs the simulator
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
    s = sub.add_parser("scale", help="braid's hierarchical collectives and routed skewed all-to-all on N nodes",
                       description="Predicted time of braid's multi-node steps (node steps on braid's lanes, rail "
                                   "steps on NCCL over the NICs) against NCCL's flat ring / tree, and of skewed "
                                   "all-to-all routed by the hierarchical planner against one path per demand. "
                                   "--proxy: the two-node link proxy (single / multi / borrow variants).")
    s.add_argument("--gpu", default="h100,h200,h800",
                   help="comma list of machines: h100, h200, h800 (8 GPUs per node), nimble (4 x H100 per node); "
                        "default h100,h200,h800")
    s.add_argument("--op", default=None,
                   choices=["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "alltoallv"],
                   help="one op (alltoallv: the skewed all-to-all); default every collective and the skewed one "
                        "(--proxy: all_reduce)")
    s.add_argument("--nodes", default="2,8,32,128", help="comma list of node counts (default 2,8,32,128)")
    s.add_argument("--nics", default=None, help="comma list of NICs per node, each dividing the GPUs per node "
                                                "(default 1,4,8; nimble 1,2,4; --proxy 8)")
    s.add_argument("--hot", type=float, default=0.7, help="alltoallv: share of each rank's bytes to the hot GPU")
    s.add_argument("--size", default="256M", help="bytes per GPU (K/M/G suffixes, default 256M)")
    s.add_argument("--proxy", action="store_true", help="the two-node link proxy (the earlier model)")
    s.add_argument("--json", dest="json_path", metavar="PATH")
    o = sub.add_parser("own", help="the simulator against braid's bench recorded on 2 and 4 x H200 (2026-11-22)")
    o.add_argument("--data", default=None, metavar="PATH",
                   help="recorded points (JSON); default the H200 bench shipped with braid "
                        "(braid/sim/data/sim_bench_h200.json)")
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


def _ints(text: str, flag: str, example: str) -> list[int]:
    out = []
    for x in text.split(","):
        if x.strip():
            try:
                out.append(int(x))
            except ValueError:
                raise MisuseError(f"{flag} {text!r}: {x.strip()!r} is not a whole number; give a list like "
                                  f"{example}") from None
    if not out:
        raise MisuseError(f"{flag} {text!r}: empty; give a list like {example}")
    return out


def _scale_proxy(args: argparse.Namespace, nodes: list[int], size: int) -> int:
    from .scale import SCALE_OPS, sweep
    op = args.op or "all_reduce"
    if op not in SCALE_OPS:
        raise MisuseError(f"--proxy --op {op}: the proxy models {', '.join(SCALE_OPS)}")
    nics = _ints(args.nics or "8", "--nics", "1,4,8")
    rows = [r for k in nics for r in sweep(op, nodes, k, args.hot, per_gpu_bytes=size)]
    print(f"# braid sim scale --proxy --op {op}" + (f" --hot {args.hot}" if op == "alltoallv" else "")
          + f" --size {args.size}  (two-node link proxy, latency-free; 8 Hopper GPUs per node; preset "
            f"hopper8-8nic-fuselink)")
    print(f"{'nodes':>5s} {'NICs':>4s} {'variant':>7s} {'time us':>10s} {'algbw':>7s} {'busbw':>7s} "
          f"{'plan cold us':>12s} {'cached us':>9s}  path shares")
    for r in rows:
        shares = " ".join(f"{k}={v:.2f}" for k, v in r.path_shares.items())
        print(f"{r.nodes:5d} {r.nics:4d} {r.variant:>7s} {r.time_us:10.0f} {r.algbw_gbps:7.1f} {r.busbw_gbps:7.1f} "
              f"{r.plan_cold_us:12.0f} {r.plan_cached_us:9.1f}  {shares}")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump([r.to_dict() for r in rows], f, indent=1)
    return 0


def _cell(a: float, b: float) -> str:
    return f"{a:.0f}/{b:.0f} {b / a:.2f}x"


def scale(args: argparse.Namespace) -> int:
    from . import scale as sc
    nodes = _nodes(args.nodes)
    if args.op == "alltoallv" and min(nodes) < 2:
        raise MisuseError(f"--nodes {args.nodes!r}: alltoallv needs >= 2 nodes (the hot expert is on the "
                          f"next node)")
    checks.real(args.hot, "--hot", strict=False, high=1.0, hint="the share of each rank's bytes to the hot GPU")
    size = _size(args.size)
    if args.proxy:
        return _scale_proxy(args, nodes, size)
    gpus = [g.strip() for g in args.gpu.split(",") if g.strip()]
    bad = [g for g in gpus if g not in sc.MACHINES]
    if bad or not gpus:
        raise MisuseError(f"--gpu {args.gpu!r}: {'unknown ' + repr(bad[0]) if bad else 'no machine'}; "
                          f"known: {', '.join(sc.MACHINES)}")
    nics_of = {g: (_ints(args.nics, "--nics", "1,4,8") if args.nics else
                   [1, 4, 8] if sc.MACHINES[g].gpus == 8 else [k for k in (1, 2, 4) if sc.MACHINES[g].gpus % k == 0])
               for g in gpus}
    ops = [args.op] if args.op else list(sc.MODEL_OPS) + ["alltoallv"]
    coll = [o for o in ops if o != "alltoallv"]
    rows = [sc.hier(g, op, n, k, size) for g in gpus for k in nics_of[g] for op in coll for n in nodes]
    skew_nodes = [n for n in nodes if n >= 2]
    skews, seen = [], {}
    if "alltoallv" in ops:
        for g in gpus:
            m = sc.MACHINES[g]
            for k in nics_of[g]:
                for hot in (args.hot, 0.0):
                    if hot == 0.0 and k != max(nics_of[g]):
                        continue                      # balanced: one NIC count shows it
                    for n in skew_nodes:
                        key = (m.gpus, m.c("nic_gbps"), m.c("nvlink_gbps"), k, n, hot)
                        if key not in seen:           # same links: the same plan (h100 and h200)
                            seen[key] = sc.skew(g, n, k, hot, size)
                        r = sc.SkewRow(**dict(seen[key].__dict__, gpu=g))
                        skews.append(r)
    w = 20
    print(f"# braid sim scale --size {args.size}: per GPU, nccl-tests' sizes (all_reduce message, all_gather "
          f"output, reduce_scatter input, all_to_all bytes sent); a model, not measured across nodes")
    if rows:
        print("# collectives: braid = node steps on braid's lanes + rail steps on NCCL over the NICs, one after "
              "the other;")
        print("#   NCCL = its own algorithm over every GPU (all_reduce: faster of ring and tree; all_gather, "
              "reduce_scatter: ring; all_to_all: all peers at once)")
        print("#   cell: braid us / NCCL us, speedup = NCCL / braid (> 1: braid faster)")
        print(f"{'gpu':6s} {'NICs':>4s} {'op':14s} " + " ".join(f"{f'{n} nodes':>{w}s}" for n in nodes))
        for g in gpus:
            for k in nics_of[g]:
                for op in coll:
                    rs = [r for r in rows if r.gpu == g and r.nics == k and r.op == op]
                    print(f"{g:6s} {k:4d} {op:14s} " + " ".join(f"{_cell(r.braid_us, r.nccl_us):>{w}s}" for r in rs))
    if skews:
        print(f"# skewed all_to_all (hot {args.hot}: each rank sends that share to GPU 0 of the next node; hot 0: "
              f"balanced): busiest link us,")
        print("#   one path per demand (NCCL, PXN: the destination's rail) / the hierarchical router's plan, gain")
        print(f"{'gpu':6s} {'NICs':>4s} {'hot':>5s}          " + " ".join(f"{f'{n} nodes':>{w}s}" for n in skew_nodes))
        for g in gpus:
            for k in nics_of[g]:
                for hot in (args.hot, 0.0):
                    rs = [r for r in skews if r.gpu == g and r.nics == k and r.hot == hot]
                    if rs:
                        print(f"{g:6s} {k:4d} {hot:5.2f}          " + " ".join(
                            f"{f'{r.direct_us:.0f}/{r.routed_us:.0f} {r.gain:.2f}x':>{w}s}" for r in rs))
    for line in sc.verdict(rows, skews):
        print("# " + line)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"collectives": [r.to_dict() for r in rows], "skewed": [r.to_dict() for r in skews]},
                      f, indent=1)
    return 0


def own(args: argparse.Namespace) -> int:
    from .own import compare, load_points, recorded_bench
    rows = compare(load_points(args.data or recorded_bench()))
    print("# braid sim own: recorded braid benches (2026-11-22) vs the simulator on h200x2 / h200x4")
    w = max([46] + [len(c.name) for c in rows])
    print(f"{'point':{w}s} {'kind':10s} {'measured':>9s} {'simulated':>9s} {'error':>7s}  shares")
    for c in rows:
        sh = " ".join(f"{k}={v:.2f}" for k, v in c.shares.items())
        print(f"{c.name:{w}s} {c.kind:10s} {c.measured_us:9.0f} {c.simulated_us:9.0f} {100 * c.error:+6.1f}%  {sh}")
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
