"""Router planning time: cold route() and Router.plan() cache hits per topology (docs/router.md).

    PYTHONPATH=src python scripts/bench_router.py [--old path/to/router.py] [--reps 21] [--kind random|skewed]
    PYTHONPATH=src python scripts/bench_router.py --clusters 2,4,16,64,128 [--reps 5] [--kind random|skewed]

After one warm-up plan of another matrix (imports, the topology's compile), the median over
`reps` matrices of: cold = route(topo, m); hit = Router.plan(m drifted by +-1% per demand) after
Router.plan(m); "+ flows" adds building the plan's `flows` dict. With --old, a second router
module (e.g. a copy of the previous router.py) runs interleaved in the same process.

--clusters: multi_node(N, 8 GPUs, 8 NICs) per N: the topology's build, the first route() (cold),
the median of `reps` further route() calls on new matrices (warm), a Router.plan hit on a matrix
drifted by +-1%, the plan's distance to its certified bound, and the peak memory of one plan
(tracemalloc: numpy's arrays included, the matrix itself not).
"""
from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import sys
import time

from braid.planner import router as new

TOPOS = {
    "h200x4": lambda r: r.preset("h200x4"),
    "mesh4": lambda r: r.preset("mesh4"),
    "nvswitch8": lambda r: r.preset("nvswitch8"),
    "mesh8": lambda r: r.mesh(8),
    "2x4gpu-4nic": lambda r: r.multi_node(2, gpus_per_node=4, nics=4),
    "nvswitch16": lambda r: r.preset("nvswitch16"),
    "2x8gpu-8nic": lambda r: r.multi_node(2, gpus_per_node=8, nics=8),
}


def matrix(n, rng, kind):
    mib = 1 << 20
    if kind == "random":
        return [[0 if s == d else rng.randint(1, 64) * mib for d in range(n)] for s in range(n)]
    hot = rng.randrange(n)          # skewed: one hot destination, the rest 1-64 MiB
    return [[0 if s == d else (rng.randint(128, 512) * mib if d == hot else rng.randint(1, 64) * mib)
             for d in range(n)] for s in range(n)]


def drift(m, rng, rel=0.01):
    return [[0 if b == 0 else max(1, int(b * (1 + rng.uniform(-rel, rel)))) for b in row] for row in m]


def measure(mods, name, ms, ds, flows=False):
    """Median cold and hit times (us) per module, the modules interleaved matrix by matrix (the
    container's load moves; interleaving keeps the comparison fair)."""
    topos = {k: TOPOS[name](mod) for k, mod in mods.items()}
    for k, mod in mods.items():
        mod.route(topos[k], ms[-1])                          # warm-up on another matrix
    cold = {k: [] for k in mods}
    hit = {k: [] for k in mods}
    hits = {k: 0 for k in mods}
    for m, m2 in zip(ms[:-1], ds[:-1]):
        for k, mod in mods.items():
            t = time.perf_counter()
            p = mod.route(topos[k], m)
            if flows:
                p.flows
            cold[k].append(time.perf_counter() - t)
            r = mod.Router(topos[k])
            r.plan(m)
            t = time.perf_counter()
            p, h = r.plan(m2)
            if flows:
                p.flows
            hit[k].append(time.perf_counter() - t)
            hits[k] += h
    return {k: (statistics.median(cold[k]) * 1e6, statistics.median(hit[k]) * 1e6, hits[k]) for k in mods}


def clusters(sizes, reps, kind):
    import tracemalloc
    import numpy as np
    from braid.planner import hier
    print(f"{'nodes x 8':>9s} {'planner':>7s} {'build ms':>9s} {'cold ms':>9s} {'warm ms':>9s} {'hit ms':>8s} "
          f"{'plan/bound':>10s} {'peak MB':>8s}")
    for nodes in sizes:
        n = nodes * 8
        rng = np.random.default_rng(nodes)

        def one():
            m = rng.integers(1, 65, (n, n)) << 20
            if kind == "skewed":                   # Zipf-heavy demands: a few pairs carry most bytes
                m = m * rng.zipf(1.5, (n, n)).clip(1, 64)
            np.fill_diagonal(m, 0)
            return m.tolist()
        ms = [one() for _ in range(reps + 1)]
        t = time.perf_counter()
        topo = new.multi_node(nodes, 8, 8)
        build = time.perf_counter() - t
        t = time.perf_counter()
        plan = new.route(topo, ms[0])
        cold = time.perf_counter() - t
        warm = []
        for m in ms[1:]:
            t = time.perf_counter()
            plan = new.route(topo, m)
            warm.append(time.perf_counter() - t)
        r = new.Router(topo)
        r.plan(ms[0])
        d = drift(ms[0], random.Random(nodes))
        t = time.perf_counter()
        _, hit = r.plan(d)
        hit_s = time.perf_counter() - t
        tracemalloc.start()
        new.route(topo, ms[1])
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        kind_ = "hier" if hier.hierarchical(topo) else "flat"
        print(f"{nodes:9d} {kind_:>7s} {build * 1e3:9.1f} {cold * 1e3:9.1f} {statistics.median(warm) * 1e3:9.1f} "
              f"{hit_s * 1e3:7.1f}{'' if hit else '*':1s} {plan.max_load_us / plan.lower_bound_us:10.4f} "
              f"{peak / 2 ** 20:8.1f}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", action="append", default=[], help="another router.py to time beside this one (repeatable)")
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--kind", default="random", choices=("random", "skewed"))
    ap.add_argument("--topos", default=",".join(TOPOS))
    ap.add_argument("--clusters", default="", help="node counts of 8-GPU nodes, e.g. 2,4,16,64,128: the cluster table")
    a = ap.parse_args()
    if a.clusters:
        clusters([int(x) for x in a.clusters.split(",")], a.reps, a.kind)
        return
    mods = {}
    for i, path in enumerate(a.old):
        name = "before" if len(a.old) == 1 else f"old{i + 1}"
        spec = importlib.util.spec_from_file_location(f"router_{name}", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod          # dataclasses look their module up
        spec.loader.exec_module(mod)
        mods[name] = mod
    mods["now"] = new
    print(f"{'topology':12s} " + " ".join(f"{k + ' ' + c:>22s}" for k in mods for c in ("cold/+flows", "hit/+flows")))
    for name in a.topos.split(","):
        n = TOPOS[name](new).num_gpus
        rng = random.Random(1)
        ms = [matrix(n, rng, a.kind) for _ in range(a.reps + 1)]
        ds = [drift(m, rng) for m in ms]
        row = []
        plain, withflows = measure(mods, name, ms, ds), measure(mods, name, ms, ds, flows=True)
        for k in mods:
            c, h, hits = plain[k]
            cf, hf, _ = withflows[k]
            row.append(f"{c:9.0f}/{cf:6.0f} us {h:7.1f}/{hf:6.1f} us ({hits}/{a.reps})")
        print(f"{name:12s} " + " ".join(row), flush=True)


if __name__ == "__main__":
    main()
