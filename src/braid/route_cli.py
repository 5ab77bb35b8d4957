"""`braid route`: plan a traffic matrix over a topology and print the plan, the most loaded link,
the planning times (cold, and a cache hit: the same matrix planned again through a Router) and
(with scipy) the LP optimum and the ratio."""
from __future__ import annotations

import argparse
import json
import sys

from .planner.router import Router, direct_only, preset


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--matrix", required=True, metavar="FILE",
                   help="JSON list of rows of byte counts; row = source rank, column = destination")
    p.add_argument("--topology", required=True,
                   help="h200x2, h200x4 (links as measured on 2 and 4 x H200, 2026-11-22), mesh4, nvswitch8, "
                        "nvswitch16, or multinode")
    p.add_argument("--nodes", type=int, default=2, help="multinode: number of 8-GPU nodes (default 2)")
    p.add_argument("--nics", type=int, default=8, help="multinode: NICs (rails) per node (default 8)")
    p.add_argument("--json", dest="json_path", default=None, metavar="OUT", help="write the plan as JSON")


def _fail(message: str) -> int:
    print(f"braid route: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    for flag, value, what in (("--nodes", args.nodes, "8-GPU nodes"), ("--nics", args.nics, "NICs (rails) per node")):
        if value < 1:
            return _fail(f"{flag} {value}: the number of {what} must be >= 1")
    try:
        with open(args.matrix, "rb") as f:
            text = f.read()
    except OSError as exc:
        return _fail(f"cannot read --matrix {args.matrix}: {exc.strerror or exc}")
    try:
        matrix = json.loads(text)
    except ValueError as exc:                  # JSONDecodeError, or bytes that are not text
        return _fail(f"--matrix {args.matrix} is not JSON ({exc}); it must hold a list of rows of byte counts, "
                     f"e.g. [[0, 1048576], [4096, 0]]")
    try:
        topo = preset(args.topology, nodes=args.nodes, nics=args.nics)
    except ValueError as exc:
        return _fail(str(exc))
    n = topo.num_gpus
    try:
        router = Router(topo)
        router.plan(matrix)                       # compiles the topology's arrays (once per topology)
        router = Router(topo)
        plan, _ = router.plan(matrix)             # cold: a full solve
        again, hit = router.plan(matrix)          # a cache hit: the cached fractions, rescaled
        direct = direct_only(topo, matrix)
        try:
            from .planner.lp import lp_optimum
            opt = lp_optimum(topo, matrix)
        except ImportError:
            opt = None
    except ValueError as exc:                     # MisuseError: the message names the bad cell
        return _fail(f"--matrix {args.matrix}: {exc}")
    print(f"# braid route: {topo.name} ({n} GPUs)  {topo.source}")
    print("#  src  dst        bytes  paths")
    for (s, d), flows in sorted(plan.flows.items()):
        total = sum(b for _, b in flows)
        cells = "  ".join(f"{p.name()}={b / total:.2f}" for p, b in flows)
        print(f"  {s:4d} {d:4d} {total:12d}  {cells}")
    busiest = max(plan.link_load, key=lambda e: plan.link_load[e] / topo.capacity[e]) if plan.link_load else "-"
    print(f"max link load: {plan.max_load_us:.1f} us (link {busiest}); direct paths only: {direct:.1f} us "
          f"({direct / plan.max_load_us if plan.max_load_us else 1:.2f}x)")
    print(f"planning time: {plan.plan_time_us:.0f} us cold, {again.plan_time_us:.0f} us on a cache hit"
          f"{'' if hit else ' (replanned: the hit check failed)'}; proven lower bound {plan.lower_bound_us:.1f} us")
    if opt is not None:
        print(f"LP optimum: {opt:.1f} us; router / LP = {plan.max_load_us / opt if opt else 1:.3f}")
    else:
        print("LP optimum: not computed (install scipy)")
    if args.json_path:
        obj = plan.to_dict()
        obj.update(max_load=plan.max_load_us, lp_optimum=opt, direct_only=direct,
                   ratio=(plan.max_load_us / opt) if opt else None, plan_time_us=plan.plan_time_us,
                   plan_time_hit_us=again.plan_time_us)
        try:
            with open(args.json_path, "w") as f:
                json.dump(obj, f, indent=1)
        except OSError as exc:
            return _fail(f"cannot write --json {args.json_path}: {exc.strerror or exc}")
    return 0
