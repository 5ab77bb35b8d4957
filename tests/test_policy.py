"""The split policy (braid.comm.policy) on its own: a new calibration table and fixed shares
invalidate what they touch (the per-shape answers, the balancer, the pending observations),
errors name the lanes that are missing, and the balancer's observations round-trip from a split
call's handle to its next move. No processes: the policy is plain state."""
from __future__ import annotations

import pytest

from braid.comm.policy import DEFAULT_COSTS, SplitPolicy
from braid.errors import LaneUnavailableError
from braid.planner.model import LaneCost

GPU = ["ce", "host", "nccl"]


def _policy(world=2, cuda=True, check=False, lanes=GPU, unavailable=None):
    return SplitPolicy(world, cuda, check, lambda: list(lanes), unavailable or {}, None)


def _table(nccl_bw, ce_bw, pays=None):
    t = {"all_gather/2": {"nccl": LaneCost(10.0, nccl_bw).to_dict(), "ce": LaneCost(12.0, ce_bw).to_dict(),
                          "host": LaneCost(30.0, 20.0).to_dict()}}
    if pays is not None:
        t["all_gather/2/pays"] = pays
    return t


class _Done:
    """A finished split call's handle: its lanes' times."""

    def __init__(self, times):
        self.times = times

    def is_completed(self):
        return True

    def lane_times_us(self):
        return dict(self.times)


def test_a_new_table_changes_the_digest_and_the_answers_and_restarts_the_balancer():
    p = _policy()
    assert p.digest == "default" and p.native_for("all_gather", 1 << 20) in (True, False)
    p.set_table(_table(320.0, 330.0, {"20": False}))          # the calibration: NCCL alone at 1 MiB
    first = p.digest
    assert first != "default" and p.native_for("all_gather", 1 << 20) is True
    bal = p.balancer
    p.pending["all_gather"] = ("bucket", {"ce": 1.0}, _Done({}))
    p.set_table(_table(320.0, 330.0, {"20": "ce"}))           # now the copy engines alone there
    assert p.digest != first and p.balancer is not bal and p.pending == {}
    assert p.native_for("all_gather", 1 << 20) is False       # the cached answer did not survive
    assert p.shares_for("all_gather", 1 << 20, GPU) == {"ce": 1.0}
    p.set_table({})
    assert p.digest == "default" and p.calib == {} and p.pays == {}


def test_fixed_shares_override_the_table_and_clear_the_cached_answers():
    p = _policy()
    p.set_table(_table(320.0, 330.0, {"20": False}))
    assert p.native_for("all_gather", 1 << 20) is True
    p.set_fixed({"all_gather": {"ce": 0.7, "host": 0.3, "nccl": 0.0}})
    assert p.fixed_for("all_gather") == {"ce": 0.7, "host": 0.3, "nccl": 0.0} and p.fixed_for("broadcast") is None
    assert p.shares_for("all_gather", 1 << 20, GPU) == {"ce": 0.7, "host": 0.3}   # zero shares dropped
    assert p.native_for("all_gather", 1 << 20) is False
    p.set_fixed({"*": {"nccl": 1.0}})                        # NCCL alone: its own call, as users get it
    assert p.native_for("broadcast", 1 << 20) is True
    cpu = _policy(cuda=False, lanes=["gloo", "shm"])
    cpu.set_fixed({"*": {"gloo": 1.0}})
    assert cpu.native_for("all_gather", 1 << 20) is False    # CPU: fixed shares drive the lanes themselves
    p.set_fixed(None)
    assert p.fixed_for("all_gather") is None and p.native_for("all_gather", 1 << 20) is True


def test_what_the_calibration_has_not_measured_goes_to_nccl_whole_on_gpus(monkeypatch):
    """No calibration, or one without the op: a GPU call goes to NCCL whole (the built-in model
    alone split DDP's buckets over ce, host and NCCL, 1.9x slower steps on 2 x H200), a measured op
    keeps its verdicts; BRAID_SPLIT_UNMEASURED=1 and CPU lanes keep the model's split."""
    n = 256 << 20
    p = _policy()
    assert p.split_rule("all_gather", {k: DEFAULT_COSTS[k] for k in GPU}, n) != {"nccl": 1.0}   # the model splits
    assert p.shares_for("all_gather", n, GPU) == {"nccl": 1.0} and p.native_for("all_gather", n) is True
    assert p.shares_for("all_reduce", n, GPU) == {"nccl": 1.0}
    assert p.shares_for("all_gather", n, ["ce", "host"]) != {"nccl": 1.0}   # no NCCL among the lanes asked for
    p.set_table(_table(320.0, 330.0, {"28": "ce"}))
    assert p.shares_for("all_gather", n, GPU) == {"ce": 1.0}                 # measured: its verdict
    assert p.shares_for("reduce_scatter", n, GPU) == {"nccl": 1.0}          # another op, not measured
    monkeypatch.setenv("BRAID_SPLIT_UNMEASURED", "1")
    m = _policy()
    assert len(m.shares_for("all_gather", n, GPU)) > 1 and m.native_for("all_gather", n) is False
    monkeypatch.delenv("BRAID_SPLIT_UNMEASURED")
    cpu = _policy(cuda=False, lanes=["gloo", "shm"])
    assert cpu.model_unmeasured and cpu.shares_for("all_gather", n, ["gloo", "shm"]) == \
        cpu.split_rule("all_gather", {k: DEFAULT_COSTS[k] for k in ("gloo", "shm")}, n)


def test_missing_lanes_are_named():
    p = _policy(unavailable={"host": "no pinned memory"})
    with pytest.raises(LaneUnavailableError, match="no lane can move"):
        p.shares_for("all_gather", 1 << 20, [])
    p.set_fixed({"*": {"ce": 0.5, "host": 0.5}})
    with pytest.raises(LaneUnavailableError, match=r"lanes \['host'\].*no pinned memory"):
        p.shares_for("all_gather", 1 << 20, ["ce", "nccl"])


def test_check_mode_never_gives_a_call_to_the_native_library():
    p = _policy(check=True)
    assert p.native_for("all_gather", 1 << 10) is False and not p.native_ok({"nccl": 1.0})


def test_a_split_calls_times_reach_the_balancer_once_every_rank_reported_them():
    p = _policy()
    table = {"all_gather/2": {"ce": LaneCost(12.0, 300.0).to_dict(), "host": LaneCost(30.0, 60.0).to_dict(),
                              "nccl": LaneCost(10.0, 1.0).to_dict()},
             "all_gather/2/pays": {"28": True}}                     # measured: the model's split pays
    p.set_table(table)
    n = 256 << 20
    shares = p.shares_for("all_gather", n, GPU)
    assert set(shares) == {"ce", "host"}                     # the model splits it
    version = p.balancer.version
    p.learn([{"obs": None}, {"obs": None}])                 # nothing reported: nothing to learn
    for _ in range(p.balancer.min_samples):                 # the host lane finishes last every call
        p.note_pending("all_gather", n, GPU, shares, _Done({"ce": 900.0, "host": 1500.0}))
        obs = p.observation("all_gather")
        assert obs is not None and p.observation("all_gather") is None      # taken once
        p.learn([{"obs": obs}, {"obs": None}])               # a rank without it: no sample
    assert p.balancer.version == version
    for _ in range(p.balancer.min_samples):
        p.note_pending("all_gather", n, GPU, shares, _Done({"ce": 900.0, "host": 1500.0}))
        obs = p.observation("all_gather")
        p.learn([{"obs": obs}, {"obs": obs}])                # both ranks reported the same call
    assert p.balancer.version != version                     # a move, alike on every rank
    moved = p.shares_for("all_gather", n, GPU)
    assert moved["host"] < shares["host"]
    p.adapt = False                                          # stage 2 off: nothing kept to report
    p.note_pending("all_gather", n, GPU, moved, _Done({"ce": 1.0, "host": 2.0}))
    assert p.observation("all_gather") is None



def test_the_bench_header_says_what_unmeasured_calls_do(monkeypatch):
    from types import SimpleNamespace
    from braid.bench.sweep import _unmeasured
    gpu, cpu = _policy(), _policy(cuda=False, lanes=["gloo", "shm"])
    assert "NCCL whole" in _unmeasured(SimpleNamespace(cuda=True, policy=gpu))
    assert _unmeasured(SimpleNamespace(cuda=False, policy=cpu)) == "built-in lane model"
    monkeypatch.setenv("BRAID_SPLIT_UNMEASURED", "1")
    assert _unmeasured(SimpleNamespace(cuda=True, policy=_policy())) == "built-in lane model"


def _unmeasured_worker(rank, w):
    """Rank 1 says otherwise than rank 0 about unmeasured calls: the calibration's load, which
    every rank makes together, gives it rank 0's."""
    import braid
    comm = braid.init()
    pol = comm.policy
    before = (pol.model_unmeasured, pol.near_factor)
    if rank == 1:
        pol.model_unmeasured, pol.near_factor = not before[0], before[1] + 1.0
    comm.load_calibration()
    got = (pol.model_unmeasured, pol.near_factor)
    comm.close()
    return before, got


def test_every_rank_takes_rank_0s_answer_for_unmeasured_calls_and_near_trials():
    from conftest import run_world
    res = run_world(_unmeasured_worker, 2, timeout=120)
    assert res[0][1] == res[0][0] and res[1][1] == res[0][0]


def _near_table(op, nccl_us, ce_us, bucket=24):
    """NCCL alone won the calibration's timing at 2**bucket bytes, against the copy engines' `ce_us`."""
    t = _table(320.0, 330.0)
    t[f"{op}/2"] = t.pop("all_gather/2")
    t[f"{op}/2/pays"] = {str(bucket): False}
    t[f"{op}/2/timed"] = {str(bucket): {"nccl": nccl_us, "ce": ce_us, "split": 2 * nccl_us,
                                        "split_shares": {"ce": 0.6, "nccl": 0.4}}}
    return t


@pytest.fixture
def near(monkeypatch):
    monkeypatch.setenv("BRAID_NEAR_TRIAL", "1.5")


def test_near_trials_are_off_by_default():
    p = _policy()
    p.set_table(_near_table("all_reduce", 80.0, 81.0))
    p.set_near_trials(True)
    assert p.near_factor == 0 and p.native_for("all_reduce", 25 << 20) is True


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter", "all_gather"])
def test_nccls_near_wins_go_on_trial_in_the_job_only(op, near):
    p = _policy()
    p.set_table(_near_table(op, 80.0, 97.0))               # NCCL won by 21%
    n = 25 << 20
    assert p.native_for(op, n) is True                      # trials off (the op sweep, fixed verdicts): NCCL
    assert p.shares_for(op, n, GPU) == {"nccl": 1.0}
    assert p.set_near_trials(True) is True and p.set_near_trials(True) is False
    assert p.native_for(op, n) is False                     # the cached answer went with the change
    assert p.shares_for(op, n, GPU) == {"ce": 1.0}
    assert p.shares_for(op, n, ["host", "nccl"]) == {"nccl": 1.0}     # no copy engines here: NCCL
    p.set_near_trials(False)
    assert p.native_for(op, n) is True and p.shares_for(op, n, GPU) == {"nccl": 1.0}


def test_a_clear_nccl_win_an_untimed_op_and_cpu_stay_whole(near):
    p = _policy()
    p.set_table(_near_table("all_reduce", 80.0, 130.0))    # NCCL won by 62%: beyond NEAR_TRIAL
    p.set_near_trials(True)
    assert p.native_for("all_reduce", 25 << 20) is True
    p.set_table(_near_table("broadcast", 80.0, 90.0))      # not an op whose calls share SMs with compute
    assert p.native_for("broadcast", 25 << 20) is True
    t = _near_table("all_reduce", 80.0, 90.0)
    del t["all_reduce/2/timed"]                             # nothing timed: nothing on trial
    p.set_table(t)
    assert p.native_for("all_reduce", 25 << 20) is True
    cpu = _policy(cuda=False, lanes=["gloo", "shm"])
    cpu.set_table(_near_table("all_reduce", 80.0, 90.0))
    cpu.set_near_trials(True)
    assert cpu.near("all_reduce", 25 << 20) is False


def test_near_trials_off_by_setting(monkeypatch):
    monkeypatch.setenv("BRAID_NEAR_TRIAL", "0")
    p = _policy()
    p.set_table(_near_table("all_reduce", 80.0, 81.0))
    p.set_near_trials(True)
    assert p.native_for("all_reduce", 25 << 20) is True
    monkeypatch.setenv("BRAID_NEAR_TRIAL", "1.02")        # a tighter factor: 81 against 80 is within it
    p = _policy()
    p.set_table(_near_table("all_reduce", 80.0, 81.0))
    p.set_near_trials(True)
    assert p.native_for("all_reduce", 25 << 20) is False
