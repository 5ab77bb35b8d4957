"""The router against the exact LP optimum (docs/router.md, "Quality against the LP optimum").

    PYTHONPATH=src python scripts/router_quality.py [--old path/to/router.py]

Per topology, 27 matrices: the tests' 5 classes (tests/test_router.py `matrices`) and 4
adversarial ones (`adversarial`), 3 seeds each (all-zero matrices skipped). `min_split_bytes=0`
(the solver alone). Prints worst and median plan / LP, the worst plan / own lower bound
("certified") and the mean number of paths per demand. Needs scipy (the LP).
"""
from __future__ import annotations

import argparse
import importlib.util
import pathlib
import random
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))

from braid.planner import router as new  # noqa: E402
from braid.planner.lp import lp_optimum  # noqa: E402
from test_router import adversarial, matrices  # noqa: E402

from bench_router import TOPOS  # noqa: E402  (the same topologies as the timing table)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", help="another router.py to score the same way")
    a = ap.parse_args()
    mods = {"now": new}
    if a.old:
        spec = importlib.util.spec_from_file_location("router_old", a.old)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        mods = {"before": mod, "now": new}
    print("| topology | router | matrices | worst / LP | median / LP | worst certified | paths per demand |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, make in TOPOS.items():
        n = make(new).num_gpus
        cases = [m for seed in range(3) for source in (matrices, adversarial)
                 for _, m in source(n, random.Random(seed)) if any(any(row) for row in m)]
        opts = [lp_optimum(make(new), m) for m in cases]
        for label, mod in mods.items():
            topo = make(mod)
            ratios, cert, paths = [], [], []
            for m, opt in zip(cases, opts):
                plan = mod.route(topo, m, min_split_bytes=0)
                ratios.append(plan.max_load_us / opt)
                cert.append(plan.max_load_us / plan.lower_bound_us)
                paths += [len(fl) for fl in plan.flows.values()]
            print(f"| {name} | {label} | {len(cases)} | {max(ratios):.3f} | {statistics.median(ratios):.3f} | "
                  f"{max(cert):.3f} | {statistics.mean(paths):.1f} |", flush=True)


if __name__ == "__main__":
    main()
