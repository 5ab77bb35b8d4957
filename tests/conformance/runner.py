"""Run torch's own collective tests (`torch.testing._internal.distributed.distributed_test`)
against one backend, 2 ranks, and write one outcome per test.

    python3 tests/conformance/runner.py --backend braid --tests test_all_reduce_sum,test_broadcast
    python3 tests/conformance/runner.py --compare            # gloo and braid, the CI list, a table
    python3 tests/conformance/runner.py --compare --full     # every listed test

The list of tests, the ones left out and why, the name-based skips this harness lifts and the
known failures are in `torch_tests.py` beside this file; `docs/conformance.md` has the results.

How torch's harness is used (the same pieces torch's test_distributed_spawn.py combines):
`TestDistBackend` (one process per rank, each calls init_process_group(BACKEND) from a shared
file, then the test, then a file barrier) + `DistributedTest._DistTestBase` (the tests). Here:
- BACKEND (an environment variable that distributed_test reads once, when imported) is the backend
  under test: "braid", or "gloo"/"nccl" for the reference run. So init_process_group("braid") runs
  in every rank, and every check torch makes on the name sees "braid".
- `import braid` (which registers the backend) happens here, before torch's test modules are
  imported; ranks are forked from this process (CPU), or spawned (CUDA), and then import this file
  again: in both cases every rank has the backend before init_process_group.
- torch gates some tests on backend feature sets (`DistTestCases.backend_feature`: "ddp",
  "subgroup", "gpu", "cuda", and "plugin", its hook for backends from outside torch). braid
  claims each of them; they are filled in before distributed_test is imported, as its decorators
  read them at import time.
- Other skips are made on the backend's name (`BACKEND != "gloo"`, "Only MPI supports CPU
  all_to_all_single"...). Those listed in torch_tests.LIFTED are lifted here, for the reference
  backend too, so that both run the same test body; each lift names the check it overrides.
  Everything else torch decides stays as it is.
- A few test bodies pick their set-up by the backend's name and do nothing for another name
  (torch_tests.REFERENCE_BODY); in braid's ranks the test module's BACKEND reads the reference
  name ("gloo"/"nccl") once init_process_group("braid") has run, so the body takes the reference
  path while every call still goes to braid's group.
- torch checks the profiler's "<backend>:<op>" events (one per call, asynchronous, the input
  shapes) only for the backends it lists (PROFILING_SUPPORTED_BACKENDS...). On CPU braid is added
  to those lists, so its "braid:<op>" events are checked as gloo's are (--no-profiler-checks:
  not); on CUDA only with --profiler-checks, until a GPU run has checked them.
- Each test runs in this process through unittest, which starts the ranks, waits for them (a
  per-test time limit, see --timeout) and turns a rank's exception into a failure.

torch's test modules are imported only in the worker interpreters this file starts (they change
global torch settings when imported, which must not leak into the caller): importing this file,
as tests/test_conformance.py does, imports none of them, nor torch.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import torch_tests  # noqa: E402  (the list: pure data)

WORLD_SIZE = 2


def _configure_environment(backend: str, device: str, timeout: int) -> None:
    """Settings that torch's test modules and braid read when imported: before any import. The
    world size: BRAID_CONFORMANCE_WORLD (run_in_subprocess sets it), else WORLD_SIZE."""
    os.environ["BACKEND"] = backend
    os.environ["WORLD_SIZE"] = os.environ.get("BRAID_CONFORMANCE_WORLD") or str(WORLD_SIZE)
    os.environ["DISTRIBUTED_TESTS_DEFAULT_TIMEOUT"] = str(timeout)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("BRAID_CALIBRATE", "off")      # braid's built-in lane model, no cache
    os.environ.setdefault("BRAID_SPLIT_UNMEASURED", "1")  # ... splitting GPU calls too
    os.environ.setdefault("BRAID_TIMEOUT_S", "60")
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""           # braid then is a CPU backend, like gloo


# the worker's settings travel in the environment (spawned ranks import this file again)
_WORKER = json.loads(os.environ["BRAID_CONFORMANCE_WORKER"]) if (
    __name__ in ("__main__", "__mp_main__") and os.environ.get("BRAID_CONFORMANCE_WORKER")) else None
if _WORKER:
    _configure_environment(_WORKER["backend"], _WORKER["device"], _WORKER["timeout"])


def _install_expecttest_stand_in() -> bool:
    """torch's TestCase derives from expecttest.TestCase (a test-only package torch does not
    install). Where it is missing, a stand-in with the same base class is put in its place: it
    only lacks the inline-expectation asserts (assertExpectedInline), which none of the listed
    tests use. Returns True when the stand-in was installed."""
    try:
        import expecttest  # noqa: F401
        return False
    except ImportError:
        pass
    import types
    import unittest

    mod = types.ModuleType("expecttest")
    mod.ACCEPT = False

    class TestCase(unittest.TestCase):
        longMessage = True

        def assertExpectedInline(self, *args, **kwargs):   # noqa: N802 (expecttest's name)
            raise unittest.SkipTest("expecttest is not installed")

    mod.TestCase = TestCase
    sys.modules["expecttest"] = mod
    return True


# ------------------------------------------------------------------------------------------------
# worker: one backend, a list of tests, in this process
# ------------------------------------------------------------------------------------------------

def _load(backend: str, device: str, variant: str, profiler_checks: bool = False):
    """Import braid and torch's test modules (in that order) and build the test class."""
    _install_expecttest_stand_in()
    import braid  # noqa: F401  (registers the "braid" backend)
    import torch
    import torch.distributed as dist
    from torch.testing._internal import common_distributed as cd

    if backend == "braid":
        for feature in ("ddp", "subgroup", "gpu", "cuda", "plugin"):
            cd.DistTestCases.backend_feature.setdefault(feature, set()).add("braid")
    from torch.testing._internal.distributed import distributed_test as dt

    assert dt.BACKEND == backend, (dt.BACKEND, backend)
    if profiler_checks and backend not in ("gloo", "nccl", "mpi", "ucc"):
        # torch checks the profiler's "<backend>:<op>" events only for the backends it lists;
        # listing this one applies those checks to it too
        for listed in (dt.PROFILING_SUPPORTED_BACKENDS, dt.CUDA_PROFILING_SUPPORTED_BACKENDS,
                       dt.SEND_RECV_PROFILING_SUPPORTED_BACKENDS):
            listed.append(backend)

    _quicken_harness_polls(cd, dt)
    shared = _shared_gpus(device)
    if shared:
        _pretend_gpus(cd, dt, shared)

    class ConformanceCase(dt.TestDistBackend, dt.DistributedTest._DistTestBase):
        """torch's distributed tests, 2 ranks, on `backend` (see the module text)."""

        start_method = "fork" if device == "cpu" else "spawn"

        @classmethod
        def _run(cls, rank, test_name, file_name, pipe, **kwargs):
            if shared:      # before NCCL starts in this rank: a host id of its own (braid.share_gpu)
                from braid.envs import share_gpu
                share_gpu(rank)
            return super()._run(rank, test_name, file_name, pipe, **kwargs)

        def setUp(self):
            super().setUp()
            import torch.multiprocessing as tmp
            self._start_processes(tmp.get_context(self.start_method).Process)

        def run_test(self, test_name, parent_pipe):
            # in every rank, after init_process_group and torch's barrier, before the test
            if device == "cuda" and torch.cuda.is_available():
                torch.cuda.set_device(self.rank % torch.cuda.device_count())
            if variant != "default":
                _apply_variant(variant)
            if test_name in torch_tests.REFERENCE_BODY and backend not in ("gloo", "nccl", "mpi"):
                # the body branches on the backend's name (see torch_tests.REFERENCE_BODY): it
                # reads the reference name from here on, the default group stays `backend`'s
                dt.BACKEND = "nccl" if device == "cuda" else "gloo"
            return super().run_test(test_name, parent_pipe)

    ConformanceCase.__name__ = ConformanceCase.__qualname__ = "ConformanceCase"
    ConformanceCase.__module__ = __name__
    globals()["ConformanceCase"] = ConformanceCase      # ranks find it by name (pickled target)
    return ConformanceCase, dt, dist


HARNESS_POLL_S = 0.005


class _PollingTime:
    """The `time` module as one of torch's test modules sees it, except that a sleep called
    directly from one of `pollers` (functions that sleep between checks of a condition) lasts at
    most HARNESS_POLL_S. Every other sleep, including those in the test bodies, is unchanged."""

    def __init__(self, real, pollers):
        self._real, self._codes = real, frozenset(pollers)

    def sleep(self, seconds):
        if sys._getframe(1).f_code in self._codes:
            seconds = min(seconds, HARNESS_POLL_S)
        self._real.sleep(seconds)

    def __getattr__(self, name):
        return getattr(self._real, name)


def _quicken_harness_polls(cd, dt) -> None:
    """torch's harness waits for the ranks to exit (MultiProcessTestCase._join_processes) and for
    its file barrier before and after every test (Barrier.sync) by polling every 0.1 s: about a
    quarter of a second per test of idle waiting, most of a 2-rank test's time. Here the polls come
    every HARNESS_POLL_S; what they wait for, and their time limits, stay torch's."""
    def code(fn):
        fn = getattr(fn, "__func__", fn)
        return getattr(fn, "__code__", None)
    join = code(getattr(cd.MultiProcessTestCase, "_join_processes", None))
    sync = code(getattr(getattr(dt, "Barrier", None), "sync", None))
    if join is not None and getattr(cd, "time", None) is time:
        cd.time = _PollingTime(time, [join])
    if sync is not None and getattr(dt, "time", None) is time:
        dt.time = _PollingTime(time, [sync])


def _shared_gpus(device: str) -> int:
    """The number of GPUs the ranks share (ranks sharing them, rank r on GPU r % n), or 0 where
    every rank has a GPU of its own (or the run is on CPU)."""
    if device != "cuda":
        return 0
    import torch
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    world = int(os.environ.get("WORLD_SIZE") or WORLD_SIZE)
    return n if 0 < n < world else 0


class _CudaView:
    """torch.cuda as torch's test harness sees it with ranks sharing `real` GPUs: a GPU per rank
    counted (device_count() = world), device indices folded onto the real ones (set_device,
    device); everything else is torch.cuda itself."""

    def __init__(self, cuda, real: int, world: int):
        self._cuda, self._real, self._world = cuda, real, world

    def device_count(self) -> int:
        return max(self._real, self._world)

    def _fold(self, d):
        return d % self._real if isinstance(d, int) else d

    def set_device(self, d):
        return self._cuda.set_device(self._fold(d))

    def device(self, d):
        return self._cuda.device(self._fold(d))

    def __getattr__(self, name):
        return getattr(self._cuda, name)


class _TorchView:
    """The `torch` module of torch's test modules, with torch.cuda seen through _CudaView."""

    def __init__(self, torch_mod, cuda_view):
        self._torch, self.cuda = torch_mod, cuda_view

    def __getattr__(self, name):
        return getattr(self._torch, name)


def _pretend_gpus(cd, dt, real: int) -> None:
    """With fewer GPUs than ranks (ranks sharing them, each with its own NCCL host id), torch's
    harness would skip every test that asks for a GPU per rank. Its modules `common_distributed`
    and `distributed_test` see a torch whose device_count() is the world size and whose
    set_device/device fold an index onto the GPUs there are; the rank-to-GPU map gives rank r
    GPU r % real. Everything else (torch.device("cuda", r), tensors, NCCL, braid) is untouched, so
    a test that names device r itself fails the same way for NCCL and for braid."""
    import torch
    world = int(os.environ["WORLD_SIZE"])
    view = _TorchView(torch, _CudaView(torch.cuda, real, world))
    cd.torch = view
    dt.torch = view

    def rank_to_gpu(world_size, backend):
        return {r: [r % real] for r in range(world_size)}
    cd.init_multigpu_helper = dt.init_multigpu_helper = rank_to_gpu


# braid variants: shares fixed for every call braid takes, on a communicator made right after
# init_process_group (so send/recv go through braid from the start too)
VARIANTS = {
    "split": {"gloo": 0.5, "shm": 0.5},     # every call over both CPU lanes
    "shm": {"shm": 1.0},                    # every call over braid's shared-memory lane alone
}


def _apply_variant(variant: str) -> None:
    """Runs in every rank, before the test: the default group must be braid's. Each variant makes
    braid's communicator now and fixes every call's shares (VARIANTS), so that the calls braid
    takes run over its own lanes rather than being handed to gloo's collective whole."""
    from braid.backend import world_group
    pg = world_group()
    if pg is None:
        return
    comm = pg.ensure_communicator()
    comm.fixed_shares(VARIANTS[variant]).__enter__()     # for the rest of the rank's life


def _lift(dt, names) -> dict[str, str]:
    """Remove torch's name-based skip from these tests (see torch_tests.LIFTED); returns
    {test: the skip reason torch gave} for the ones torch did skip here."""
    base = dt.DistributedTest._DistTestBase
    lifted = {}
    for name in names:
        fn = base.__dict__.get(name)
        if fn is None or not getattr(fn, "__unittest_skip__", False):
            continue
        lifted[name] = getattr(fn, "__unittest_skip_why__", "")
        fn.__unittest_skip__ = False
    return lifted


def list_worker(out_json: str) -> list[str]:
    """The names of every test of _DistTestBase in this torch (for the completeness check)."""
    _, dt, _ = _load("gloo", "cpu", "default")
    names = sorted(n for n in dir(dt.DistributedTest._DistTestBase) if n.startswith("test_"))
    import torch
    with open(out_json, "w") as f:
        json.dump({"torch": torch.__version__, "names": names}, f)
    return names


def torch_test_names(timeout: float = 300) -> dict:
    """{"torch": version, "names": [...]}: the tests of _DistTestBase in the installed torch,
    read in a fresh interpreter (torch's test modules are never imported into the caller)."""
    with tempfile.TemporaryDirectory(prefix="braid-conformance-") as tmp:
        out = os.path.join(tmp, "names.json")
        env = dict(os.environ)
        env["BRAID_CONFORMANCE_WORKER"] = json.dumps({"backend": "gloo", "device": "cpu",
                                                      "timeout": 60, "variant": "default"})
        cmd = [sys.executable, os.path.abspath(__file__), "--list-names", "--json", out]
        proc = subprocess.run(cmd, env=env, cwd=tmp, timeout=timeout, capture_output=True, text=True)
        if proc.returncode or not os.path.exists(out):
            raise RuntimeError(f"listing torch's distributed tests failed ({proc.returncode}): "
                               f"{proc.stderr[-2000:]}")
        return json.load(open(out))


def _profiler_checks(device: str, asked: bool | None) -> bool:
    """Whether torch's profiler-event checks apply to braid: `asked` if given, else on CPU only."""
    return (device == "cpu") if asked is None else bool(asked)


def _build_native_libraries() -> None:
    """braid compiles its C libraries on first use into BRAID_CACHE_DIR, a fresh folder for each
    worker (run_in_subprocess): left to the ranks, every rank of the worker's first test runs the
    compiler at once (8 of them in the subgroup run). A child of this process builds them once
    instead (this process's braid stays as it was), and the ranks load them from the folder."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            from braid.comm import native_cpu, native_rounds
            native_rounds.build()
            native_cpu.build()
            code = 0
        finally:
            os._exit(code)
    os.waitpid(pid, 0)


# Modules the ranks import on first use (torch's harness, and braid's lanes, planner and
# calibration on their first calls). A test's ranks are forked from the worker and end with the
# test, so each rank of each test imported them again: ~45 ms of CPU per rank, 2 to 8 ranks per
# test. The worker imports them once before its first test; a name missing here is skipped.
RANK_IMPORTS = ("resource", "multiprocessing.popen_fork", "psutil")
BRAID_RANK_IMPORTS = (
    "braid.calibrate", "braid.collectives.routed", "braid.comm.arbiter", "braid.comm.cpup2p",
    "braid.comm.cpushm", "braid.comm.native_cpu", "braid.lanes.gloo", "braid.lanes.relay",
    "braid.lanes.shm", "braid.planner.checks", "braid.planner.hier", "braid.planner.hierplan",
    "braid.planner.paths", "braid.planner.reuse", "braid.planner.routeplan", "braid.planner.router",
    "braid.planner.solver", "braid.planner.topologies",
)


def _import_for_the_ranks(backend: str) -> None:
    import importlib
    for name in RANK_IMPORTS + (BRAID_RANK_IMPORTS if backend == "braid" else ()):
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def run_worker(backend: str, device: str, names: list[str], variant: str, timeout: int,
               out_json: str | None, profiler_checks: bool = False) -> dict:
    import logging
    import unittest

    Case, dt, _ = _load(backend, device, variant, profiler_checks)
    if backend == "braid" and hasattr(os, "fork"):
        _build_native_libraries()
    if device == "cpu":             # CUDA ranks are spawned: they import everything afresh
        _import_for_the_ranks(backend)
    lifted = _lift(dt, [n for n in names if n in torch_tests.LIFTED])
    # torch's harness logs each rank's exception at ERROR level; the result carries it anyway
    logging.getLogger("torch.testing._internal.common_distributed").setLevel(logging.CRITICAL)
    results = {}
    for name in names:
        if not hasattr(Case, name):
            results[name] = {"outcome": "missing", "detail": f"{name} is not in this torch's distributed_test",
                             "seconds": 0.0}
            continue
        t0 = time.monotonic()
        res = unittest.TestResult()
        Case(name).run(res)
        dt_s = time.monotonic() - t0
        if res.errors or res.failures:
            outcome, detail = "failed", (res.errors + res.failures)[0][1]
        elif res.skipped:
            outcome, detail = "skipped", str(res.skipped[0][1])
        elif res.testsRun:
            outcome, detail = "passed", ""
        else:
            outcome, detail = "failed", "did not run"
        results[name] = {"outcome": outcome, "detail": detail[-6000:], "seconds": round(dt_s, 2)}
        if name in lifted:
            results[name]["lifted"] = lifted[name]
        why = f": {_why(detail)}" if outcome == "failed" else ""
        print(f"[{backend}{'' if variant == 'default' else '/' + variant}] {name}: {outcome} "
              f"({dt_s:.1f} s){why}", flush=True)
    import torch
    report = {"backend": backend, "device": device, "variant": variant, "torch": torch.__version__,
              "profiler_checks": bool(profiler_checks), "results": results,
              # every test of this torch's _DistTestBase, as list_worker gives them
              "names": sorted(n for n in dir(dt.DistributedTest._DistTestBase) if n.startswith("test_"))}
    if out_json:
        with open(out_json, "w") as f:
            json.dump(report, f, indent=1)
    return report


# ------------------------------------------------------------------------------------------------
# driver: run workers in fresh interpreters, compare
# ------------------------------------------------------------------------------------------------

def run_in_subprocess(backend: str, device: str, names: list[str], variant: str = "default",
                      timeout: int = 120, total_timeout: float | None = None,
                      log_path: str | None = None, profiler_checks: bool | None = None,
                      world: int = WORLD_SIZE, progress: bool = False) -> dict:
    """Run a worker in a fresh interpreter (its own torch imports, its own BACKEND) and return
    its report. A worker that dies or runs past `total_timeout` makes every test it had not
    reported "failed". profiler_checks: apply torch's profiler-event checks to braid (None: on
    CPU, see _profiler_checks). progress: print each test's outcome line as the worker reports it
    (a run cut short by a machine's time limit still shows how far it got)."""
    profiler_checks = _profiler_checks(device, profiler_checks)
    with tempfile.TemporaryDirectory(prefix="braid-conformance-") as tmp:
        out = os.path.join(tmp, "report.json")
        env = {k: v for k, v in os.environ.items() if k != "CI"}   # torch's CI-only behaviour off
        # the worker runs in a folder of its own: a relative PYTHONPATH (PYTHONPATH=src) would
        # lose braid there, and every test would fail with "the worker exited with 1"
        if env.get("PYTHONPATH"):
            env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) if p else p
                                                for p in env["PYTHONPATH"].split(os.pathsep))
        env["BRAID_CONFORMANCE_WORKER"] = json.dumps({"backend": backend, "device": device,
                                                      "timeout": timeout, "variant": variant,
                                                      "profiler_checks": profiler_checks})
        env["BRAID_CACHE_DIR"] = os.path.join(tmp, "braid-cache")
        # torch's harness makes each test's rendezvous file with tempfile and never removes it:
        # in this folder they go with it
        env["TMPDIR"] = tmp
        env["BRAID_CONFORMANCE_WORLD"] = str(world)
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--backend", backend,
               "--device", device, "--variant", variant, "--timeout", str(timeout),
               "--json", out, "--tests", ",".join(names),
               "--profiler-checks" if profiler_checks else "--no-profiler-checks"]
        log = open(log_path, "w") if log_path else subprocess.DEVNULL
        try:
            if progress:
                why = _run_echoing(cmd, env, tmp, total_timeout, log if log_path else None)
            else:
                proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      timeout=total_timeout, cwd=tmp)
                why = f"the worker exited with {proc.returncode}" if proc.returncode else ""
        except subprocess.TimeoutExpired:
            why = f"the worker ran past {total_timeout:.0f} s"
        finally:
            if log_path:
                log.close()
        report = json.load(open(out)) if os.path.exists(out) else {"results": {}}
        report.setdefault("backend", backend)
        report.setdefault("variant", variant)
        for name in names:
            report["results"].setdefault(name, {"outcome": "failed", "detail": why or "no report",
                                                "seconds": 0.0})
        return report


_OUTCOME_LINE = re.compile(r"\[\w+(/\w+)?\] \S+: \w+ \(")


def _run_echoing(cmd, env, cwd, total_timeout, log) -> str:
    """Run the worker, printing its per-test outcome lines as they come (the rest goes to `log`
    when given). Returns why the worker failed, or ""."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=cwd,
                            text=True, errors="replace")

    def pump():
        for line in proc.stdout:
            if log is not None:
                log.write(line)
            if _OUTCOME_LINE.match(line):
                print(line.rstrip(), flush=True)
    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=total_timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        reader.join(5)
        raise
    reader.join(5)
    return f"the worker exited with {code}" if code else ""


def _why(detail: str) -> str:
    """The line of a failure's text that says what went wrong: the last exception line (torch's
    "To execute this test..." footer left out), else the last line."""
    lines = [ln.strip() for ln in detail.splitlines() if ln.strip()]
    lines = [ln for ln in lines if "PYTORCH_PRINT_REPRO_ON_FAILURE" not in ln
             and not ln.startswith(("To execute this test", "python runner.py"))]
    for ln in reversed(lines):
        head = ln.split(":", 1)[0]
        if head.endswith(("Error", "Exception", "Interrupt", "Exit")) and " " not in head:
            return ln[:300]
    return lines[-1][:300] if lines else ""


def _mark(r: dict | None) -> str:
    if r is None:
        return "-"
    o = r["outcome"]
    return {"passed": "pass", "failed": "FAIL", "skipped": "skip", "missing": "n/a"}.get(o, o)


def compare(pairs: list[tuple[str, str]], device: str, names: list[str], timeout: int,
            profiler_checks: bool | None = None, world: int = WORLD_SIZE, parallel: bool = False) -> int:
    reports: list = [None] * len(pairs)

    def one(i, backend, variant):
        t0 = time.monotonic()
        rep = run_in_subprocess(backend, device, names, variant, timeout, profiler_checks=profiler_checks,
                                world=world, progress=True)
        rep["wall"] = time.monotonic() - t0
        reports[i] = rep
    if parallel:            # every backend's worker at once (their outcome lines interleave)
        threads = [threading.Thread(target=one, args=(i, b, v)) for i, (b, v) in enumerate(pairs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for i, (b, v) in enumerate(pairs):
            one(i, b, v)
    heads = [b if v == "default" else f"{b}/{v}" for b, v in pairs]
    width = max(len(n) for n in names) + 2
    print("\n" + "test".ljust(width) + "".join(h.ljust(12) for h in heads))
    diffs = 0
    for n in names:
        marks = [_mark(r["results"].get(n)) for r in reports]
        flag = "" if len(set(marks)) == 1 else "   <- differs"
        diffs += bool(flag)
        print(n.ljust(width) + "".join(m.ljust(12) for m in marks) + flag)
    print()
    for h, r in zip(heads, reports):
        counts: dict[str, int] = {}
        for v in r["results"].values():
            counts[v["outcome"]] = counts.get(v["outcome"], 0) + 1
        print(f"{h}: " + ", ".join(f"{k} {counts[k]}" for k in sorted(counts))
              + f" ({r['wall']:.0f} s, torch {r.get('torch', '?')})")
    for h, r in zip(heads, reports):
        for n in names:
            v = r["results"].get(n, {})
            if v.get("outcome") == "failed":
                print(f"  {h} {n}: {_why(v.get('detail', ''))}")
    return 1 if diffs else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default=None, help="backend under test (worker): braid, gloo, nccl")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="cpu (gloo/braid) or cuda (nccl/braid); default: BRAID_CONFORMANCE, else cpu")
    p.add_argument("--tests", default=None, help="comma list of test names (default: the list)")
    p.add_argument("--full", action="store_true", help="the full list, not only the CI one")
    p.add_argument("--variant", default="default", choices=["default", *VARIANTS],
                   help="braid variant (see VARIANTS): default, split (both CPU lanes), shm")
    p.add_argument("--timeout", type=int, default=120, help="seconds one test may take")
    p.add_argument("--world", type=int, default=WORLD_SIZE,
                   help="ranks (default 2; 3 for the subgroup tests, torch_tests.CPU_GROUP3)")
    p.add_argument("--json", default=None, help="worker: write the report here")
    p.add_argument("--compare", action="store_true",
                   help="run the reference backend and braid (and braid/split) and print a table")
    p.add_argument("--pairs", default=None,
                   help="with --compare: comma list of backend[/variant], e.g. gloo,braid,braid/split")
    p.add_argument("--profiler-checks", action=argparse.BooleanOptionalAction, default=None,
                   help="apply torch's profiler-event checks to braid too (torch makes them only "
                        "for the backends it lists); default: on for --device cpu, off for cuda")
    p.add_argument("--shard", default=None, metavar="I/N",
                   help="only every N-th test of the list, from the I-th (0-based): N runs at once "
                        "cover it in 1/N of the time")
    p.add_argument("--parallel", action="store_true",
                   help="with --compare: run every backend's worker at the same time (a GPU shared "
                        "by the ranks of both; half the wall time)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--list-names", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.list_names:
        list_worker(a.json)
        return 0
    device = a.device or ("cuda" if os.environ.get("BRAID_CONFORMANCE", "").lower() == "cuda" else "cpu")
    if a.tests:
        names = [n.strip() for n in a.tests.split(",") if n.strip()]
    else:
        names = torch_tests.selected(device, full=a.full or torch_tests.full_requested())
    if a.shard:
        try:
            i, k = (int(x) for x in a.shard.split("/"))
            assert 0 <= i < k
        except (ValueError, AssertionError):
            p.error(f"--shard {a.shard!r}: want I/N with 0 <= I < N, e.g. 0/2")
        names = names[i::k]
    if a.worker:
        run_worker(a.backend, device, names, a.variant, a.timeout, a.json,
                   _profiler_checks(device, a.profiler_checks))
        return 0
    if a.compare or not a.backend:
        ref = "nccl" if device == "cuda" else "gloo"
        spec = a.pairs or f"{ref},braid"
        pairs = [(s.split("/")[0], s.split("/")[1] if "/" in s else "default") for s in spec.split(",")]
        bad = [f"{b}/{v}" for b, v in pairs if v != "default" and v not in VARIANTS]
        if bad:
            p.error(f"--pairs {spec!r}: unknown variant in {bad}; variants: {sorted(VARIANTS)}")
        return compare(pairs, device, names, a.timeout, a.profiler_checks, a.world, a.parallel)
    rep = run_in_subprocess(a.backend, device, names, a.variant, a.timeout, profiler_checks=a.profiler_checks,
                            world=a.world)
    for n in names:
        print(f"{n}: {_mark(rep['results'][n])}")
    return 0


if __name__ == "__mp_main__" and _WORKER:
    _load(_WORKER["backend"], _WORKER["device"], _WORKER["variant"],
          _WORKER.get("profiler_checks", False))                   # a spawned rank: the test class

if __name__ == "__main__":
    sys.exit(main())
