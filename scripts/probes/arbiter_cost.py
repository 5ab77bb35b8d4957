"""What the in-job whole-or-split trial costs a job whose split loses (or wins), from the
arbiter's schedule alone: a model clock, one rank, calls of one shape that take split_us or
whole_us. Prints, per loss, the largest extra time of any 100 consecutive calls against taking
every call whole, and the extra time over a job of N calls.

    python3 scripts/probes/arbiter_cost.py [--calls 40000] [--old path/to/arbiter.py]

--old: another version of comm/arbiter.py to compare (for example `git show REV:src/braid/comm/arbiter.py`).
"""
from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import sys


def cost(mod, split_us: float, whole_us: float, calls: int) -> tuple[float, float]:
    """`mod.trial_cost` where the version has it, else the same computation on its Arbiter."""
    if hasattr(mod, "trial_cost"):
        return mod.trial_cost(split_us, whole_us, calls)
    t = [1.0]
    arb = mod.Arbiter(lambda v: [list(v)], clock=lambda: t[0])
    extra = []
    for _ in range(calls):
        w = arb.whole("shape")
        t[0] += (whole_us if w else split_us) * 1e-6
        extra.append(0.0 if w else split_us - whole_us)
    sums = [sum(extra[i:i + 100]) for i in range(0, max(calls - 99, 1))]
    return max(sums) / (100 * whole_us), sum(extra) / (calls * whole_us)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=40000)
    ap.add_argument("--old", default=None)
    a = ap.parse_args()
    from braid.comm import arbiter as new
    mods = {"braid": new}
    if a.old:
        # (a loader named outright: a path without .py, `<(git show ...)` say, gets none by default)
        spec = importlib.util.spec_from_file_location(
            "arbiter_old", a.old, loader=importlib.machinery.SourceFileLoader("arbiter_old", a.old))
        old = importlib.util.module_from_spec(spec)
        sys.modules["arbiter_old"] = old           # dataclasses look their module up
        spec.loader.exec_module(old)
        mods = {"old": old, "braid": new}
    print(f"{'split vs whole':>16} " + " ".join(f"{k + ' worst 100':>16} {k + ' job':>10}" for k in mods))
    for loss in (-0.2, -0.05, 0.0, 0.02, 0.05, 0.07, 0.1, 0.25, 0.5, 1.0):
        row = [cost(m, 100.0 * (1 + loss), 100.0, a.calls) for m in mods.values()]
        print(f"{100 * loss:+15.0f}% " + " ".join(f"{100 * w:+15.1f}% {100 * j:+9.2f}%" for w, j in row))


if __name__ == "__main__":
    main()
