"""torch's own distributed tests as a conformance suite for backend "braid" (CPU, 2 ranks).

The CI list of tests/conformance/torch_tests.py runs through tests/conformance/runner.py three
times at once, each in a fresh interpreter: against gloo (the reference), braid, and braid with
every call split over both CPU lanes (braid/split). A test gloo passes must pass on braid and braid/split,
except those in KNOWN_FAILURES, which must still fail (one that passes should leave the list).
torch's profiler-event checks apply to braid as to gloo (one "braid:<op>" event per call, with the
call's input shapes). torch's test modules are never imported into this process: they change global torch settings.

BRAID_CONFORMANCE_FULL=1 runs the full list instead. Results and exclusions: docs/conformance.md.
"""
from __future__ import annotations

import os
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conformance")
sys.path.insert(0, HERE)
from conftest import concurrently  # noqa: E402
import runner  # noqa: E402  (imports no torch test module; its workers run in subprocesses)
import torch_tests  # noqa: E402

sys.path.remove(HERE)

_DT = os.path.join(os.path.dirname(torch.__file__), "testing", "_internal", "distributed",
                   "distributed_test.py")
if not os.path.exists(_DT):
    pytest.skip(f"torch's internal distributed tests are not installed ({_DT} is missing; some "
                "torch builds leave torch.testing._internal out)", allow_module_level=True)
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

SAME_TORCH = torch.__version__.startswith(torch_tests.LISTS_MADE_WITH + ".")
PER_TEST_S = 120            # torch's limit for one test (both ranks)
PER_RUN_S = 900             # one backend's whole run, start-up included
RUNS = [("gloo", "default"), ("braid", "default"), ("braid", "split")]


@pytest.fixture(scope="module")
def worker_reports() -> dict[str, dict]:
    """Each run's whole report: its results, and the names of every test in torch's
    distributed_test as the worker found them."""
    names = torch_tests.selected("cpu", full=torch_tests.full_requested())
    out = {}
    with tempfile.TemporaryDirectory(prefix="braid-conformance-logs-") as logs:
        def run(backend, variant, log):
            return lambda: runner.run_in_subprocess(backend, "cpu", names, variant, timeout=PER_TEST_S,
                                                    total_timeout=PER_RUN_S, log_path=log, profiler_checks=True)
        jobs, logs_of = {}, {}
        for backend, variant in RUNS:
            key = backend if variant == "default" else f"{backend}/{variant}"
            logs_of[key] = os.path.join(logs, key.replace("/", "-") + ".log")
            jobs[key] = run(backend, variant, logs_of[key])
        for key, rep in concurrently(jobs).items():     # at once: 27 s on 2 cores
            log = logs_of[key]
            if "torch" not in rep:          # the worker wrote no report: it died or ran too long
                tail = open(log, errors="replace").read()[-3000:] if os.path.exists(log) else ""
                pytest.fail(f"the {key} conformance worker produced no results; its log ends:\n{tail}")
            assert rep.get("profiler_checks") is True, (
                f"the {key} worker ran without torch's profiler-event checks: {rep.get('profiler_checks')!r}")
            out[key] = rep
    return out


@pytest.fixture(scope="module")
def reports(worker_reports) -> dict[str, dict]:
    return {key: rep["results"] for key, rep in worker_reports.items()}


def _summary(results: dict, names) -> str:
    return "\n".join(f"  {n}: {results[n]['outcome']}: {runner._why(results[n].get('detail', ''))}"
                     for n in names)


def test_reference_passes_the_list(reports):
    """The list holds tests gloo passes: a failure here means the list is stale for this torch."""
    if not SAME_TORCH:
        pytest.skip(f"the lists were made on torch {torch_tests.LISTS_MADE_WITH}, this is {torch.__version__}")
    gloo = reports["gloo"]
    bad = [n for n, v in gloo.items() if v["outcome"] != "passed"]
    assert not bad, f"gloo does not pass {len(bad)} listed test(s):\n{_summary(gloo, bad)}"


@pytest.mark.parametrize("key", [k if v == "default" else f"{k}/{v}" for k, v in RUNS[1:]])
def test_braid_passes_what_gloo_passes(reports, key):
    gloo, braid = reports["gloo"], reports[key]
    expected = [n for n, v in gloo.items() if v["outcome"] == "passed"]
    assert expected, "gloo passed none of the listed tests: nothing was compared"
    new = [n for n in expected if braid[n]["outcome"] != "passed" and n not in torch_tests.KNOWN_FAILURES]
    fixed = [n for n in expected if braid[n]["outcome"] == "passed" and n in torch_tests.KNOWN_FAILURES]
    assert not new, (f"{key} fails {len(new)} test(s) that gloo passes (fix braid, or list them in "
                     f"torch_tests.KNOWN_FAILURES with the reason):\n{_summary(braid, new)}")
    assert not fixed, (f"{key} now passes {fixed}: remove them from torch_tests.KNOWN_FAILURES")


def test_lifts_still_needed(reports):
    """Every LIFTED test of the list was skipped by torch for braid (else the entry is stale)."""
    if not SAME_TORCH:
        pytest.skip(f"the lists were made on torch {torch_tests.LISTS_MADE_WITH}, this is {torch.__version__}")
    braid = reports["braid"]
    stale = [n for n in braid if n in torch_tests.LIFTED and "lifted" not in braid[n]]
    assert not stale, f"torch no longer skips these for braid; drop them from torch_tests.LIFTED: {stale}"


def test_lists_cover_the_families(worker_reports):
    """Every collective/p2p/DDP test of this torch is in the full list or EXCLUDED (with a reason),
    never both, and every name the lists give exists. The names: as the gloo run's worker read
    them from torch's distributed_test (no interpreter of its own)."""
    if not SAME_TORCH:
        pytest.skip(f"the lists were made on torch {torch_tests.LISTS_MADE_WITH}, this is {torch.__version__}")
    names = set(worker_reports["gloo"]["names"])
    assert len(names) > 100, f"only {len(names)} tests found in torch's distributed_test"
    full = set(torch_tests.selected("cpu", full=True)) | set(torch_tests.group_tests())
    excluded = set(torch_tests.EXCLUDED)
    unlisted = sorted(n for n in names if torch_tests.in_families(n) and n not in full | excluded)
    assert not unlisted, f"tests of the families in no list: add them to a list or to EXCLUDED: {unlisted}"
    assert not full & excluded, f"listed and excluded at once: {sorted(full & excluded)}"
    given = full | excluded | set(torch_tests.CUDA) | set(torch_tests.LIFTED) | set(torch_tests.REFERENCE_BODY)
    unknown = sorted(given - names)
    assert not unknown, f"names in torch_tests.py that torch {torch.__version__} lacks: {unknown}"
    empty = [n for n, why in torch_tests.EXCLUDED.items() if not why.strip()]
    assert not empty, f"EXCLUDED entries without a reason: {empty}"


@pytest.fixture(scope="module")
def group_reports() -> dict[str, dict]:
    """The subgroup tests (torch runs them from 8 ranks): gloo, braid, braid split."""
    names = torch_tests.group_tests()

    def run(backend, variant):
        return lambda: runner.run_in_subprocess(backend, "cpu", names, variant, timeout=PER_TEST_S,
                                                total_timeout=PER_RUN_S, profiler_checks=True,
                                                world=torch_tests.GROUP_WORLD)
    reps = concurrently({backend if variant == "default" else f"{backend}/{variant}": run(backend, variant)
                          for backend, variant in RUNS})
    out = {}
    for key, rep in reps.items():
        assert "torch" in rep, f"the {key} worker of the subgroup tests produced no results"
        out[key] = rep["results"]
    return out


@pytest.mark.parametrize("key", [k if v == "default" else f"{k}/{v}" for k, v in RUNS[1:]])
def test_braid_subgroups_pass_what_gloo_passes(group_reports, key):
    """Subgroups of backend braid (new_group() under the braid default) on 8 CPU ranks."""
    gloo, braid = group_reports["gloo"], group_reports[key]
    expected = [n for n, v in gloo.items() if v["outcome"] == "passed"]
    if SAME_TORCH:
        assert len(expected) == len(gloo), f"gloo does not pass:\n{_summary(gloo, [n for n in gloo if n not in expected])}"
    assert expected, "gloo passed none of the subgroup tests: nothing was compared"
    new = [n for n in expected if braid[n]["outcome"] != "passed"]
    assert not new, f"{key} fails {len(new)} subgroup test(s) that gloo passes:\n{_summary(braid, new)}"


def test_shared_gpu_view_folds_ranks_onto_the_gpus_there_are():
    """With fewer GPUs than ranks the harness's torch counts a GPU per rank and folds indices onto
    the real ones; the rank-to-GPU map gives rank r GPU r % real; everything else is torch.cuda."""
    calls = []

    class FakeCuda:
        def set_device(self, d):
            calls.append(("set", d))

        def device(self, d):
            calls.append(("device", d))
            return d

        def is_available(self):
            return True

    class Mod:
        pass

    cd, dt = Mod(), Mod()
    saved = dict(os.environ)
    try:
        os.environ["WORLD_SIZE"] = "4"
        view = runner._CudaView(FakeCuda(), 1, 4)
        assert view.device_count() == 4 and view.is_available()
        view.set_device(3)
        assert view.device(2) == 0 and calls == [("set", 0), ("device", 0)]
        assert runner._CudaView(FakeCuda(), 2, 4).device_count() == 4
        assert runner._CudaView(FakeCuda(), 8, 4).device_count() == 8
        runner._pretend_gpus(cd, dt, 2)
        assert cd.torch is dt.torch and cd.torch.cuda.device_count() == 4
        assert cd.torch.float32 is torch.float32
        assert dt.init_multigpu_helper(4, "nccl") == {0: [0], 1: [1], 2: [0], 3: [1]}
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert runner._shared_gpus("cpu") == 0
