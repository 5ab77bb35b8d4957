"""Probe only, never for real jobs: with BRAID_PROBE_SLOW_US=N every prepared split call after the
first BRAID_PROBE_SLOW_AFTER of the process spins N us more on the host before it returns. It
turns a split that a job's trial kept into a host-bound one partway through the job, the state
DDP's split steps fell into in some runs (its host 6.9-7.0 ms a step against its GPU's 5.6), so
that the arbiter's watch of a kept split (comm/arbiter.py, `_watch`) can be seen acting on real
GPUs: with it the shape goes whole, without it the steps stay slowed.

    PYTHONPATH=scripts/probes/slowsplit BRAID_PROBE_SLOW_US=250 BRAID_PROBE_SLOW_AFTER=1200 \
        python3 -m braid bench --workload ddp --nproc 2
"""
import atexit
import os
import sys
import time

_US = float(os.environ.get("BRAID_PROBE_SLOW_US", "0") or 0)
if _US > 0:
    try:
        from braid.comm import callpath
    except ImportError:                 # not braid's process
        callpath = None
    if callpath is not None:
        _orig = callpath.CallPath.fast_prepared
        _after = int(os.environ.get("BRAID_PROBE_SLOW_AFTER", "0") or 0)
        _count = [0, 0]                 # split calls taken, of them slowed

        def _fast_prepared(self, tkey, inp, outs, async_op, redo=None):
            got = _orig(self, tkey, inp, outs, async_op, redo)
            if got is not None:         # a prepared split call ran
                _count[0] += 1
                if _count[0] > _after:
                    _count[1] += 1
                    end = time.perf_counter() + _US * 1e-6
                    while time.perf_counter() < end:
                        pass
            return got

        callpath.CallPath.fast_prepared = _fast_prepared
        atexit.register(lambda: _count[0] and print(f"slowsplit probe pid {os.getpid()}: {_count[0]} split calls, "
                                                    f"{_count[1]} slowed by {_US:.0f} us", file=sys.stderr))
