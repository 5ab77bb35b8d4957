"""Several ranks on one GPU (BRAID_SHARED_GPU=1), on CPU: braid's per-host GPU check, where the
bench places its ranks and what each adds to its environment (NCCL_HOSTID), the torchrun path at
`import braid`, and the bench header's line. The GPU tier runs the ranks themselves that way."""
from __future__ import annotations

import os
import types

import pytest

from braid import envs
from braid.bench import config
from braid.errors import MisuseError

SHARED_VARS = ("BRAID_SHARED_GPU", "NCCL_HOSTID", "RANK")


@pytest.fixture
def clean_env(monkeypatch):
    """None of the shared-GPU variables set; whatever the code under test writes is undone after."""
    for name in SHARED_VARS:
        monkeypatch.setenv(name, "")     # recorded, so monkeypatch restores the original afterwards
        monkeypatch.delenv(name)
    return monkeypatch


def test_gpu_check_lets_ranks_share_a_gpu_only_when_asked(clean_env):
    from braid.comm.communicator import _check_gpus_per_host
    shared = [("a", "b1", 10, 0), ("a", "b1", 11, 0)]
    with pytest.raises(MisuseError, match=r"ranks 0 and 1 both use GPU 0 of host a") as info:
        _check_gpus_per_host(shared)
    assert "BRAID_SHARED_GPU=1" in str(info.value)
    with envs.override(BRAID_SHARED_GPU="1"):
        _check_gpus_per_host(shared)
        _check_gpus_per_host([("a", "b1", 10, 0), ("a", "b1", 11, 0), ("a", "b1", 12, 0), ("a", "b1", 13, 0)])
    with envs.override(BRAID_SHARED_GPU="0"):
        with pytest.raises(MisuseError, match="BRAID_SHARED_GPU=1"):
            _check_gpus_per_host(shared)


def test_setting_defaults_off_and_says_what_times_mean(clean_env):
    assert envs.get("BRAID_SHARED_GPU") is False
    doc = dict((name, doc) for name, _, doc in envs.describe())["BRAID_SHARED_GPU"]
    assert "NCCL_HOSTID" in doc and "host-cost figures, not link speeds" in doc


def test_placement_one_gpu_per_rank_while_they_last():
    assert [config.placement(r, 4, 4) for r in range(4)] == [(r, {}) for r in range(4)]
    assert [config.placement(r, 2, 8) for r in range(2)] == [(0, {}), (1, {})]


def test_placement_shares_gpus_when_ranks_outnumber_them():
    for world, ngpu in ((2, 1), (4, 1), (4, 2), (3, 2)):
        placed = [config.placement(r, world, ngpu) for r in range(world)]
        assert [gpu for gpu, _ in placed] == [r % ngpu for r in range(world)]
        assert all(env["BRAID_SHARED_GPU"] == "1" for _, env in placed)
        ids = [env["NCCL_HOSTID"] for _, env in placed]
        assert len(set(ids)) == world and all(ids), ids        # a host of its own for NCCL, every rank
        assert placed == [(r % ngpu, envs.shared_gpu_env(r)) for r in range(world)]
    # BRAID_SHARED_GPU=1 asked for with enough GPUs: own GPUs, but shared-GPU mode all the same
    assert config.placement(1, 2, 2, shared=True) == (1, envs.shared_gpu_env(1))


def test_share_gpu_and_the_torchrun_path(clean_env):
    envs.share_gpu(3)
    assert os.environ["NCCL_HOSTID"] == envs.shared_gpu_env(3)["NCCL_HOSTID"]
    assert envs.get("BRAID_SHARED_GPU") is True
    clean_env.delenv("NCCL_HOSTID")
    clean_env.delenv("BRAID_SHARED_GPU")
    # what `import braid` does: only with the setting on, torchrun's RANK set and no NCCL_HOSTID
    clean_env.setenv("RANK", "5")
    envs.share_gpu_under_torchrun()
    assert "NCCL_HOSTID" not in os.environ                     # setting off: nothing
    clean_env.setenv("BRAID_SHARED_GPU", "1")
    envs.share_gpu_under_torchrun()
    assert os.environ["NCCL_HOSTID"] == envs.shared_gpu_env(5)["NCCL_HOSTID"]
    clean_env.setenv("NCCL_HOSTID", "mine")
    envs.share_gpu_under_torchrun()
    assert os.environ["NCCL_HOSTID"] == "mine"                 # the user's own is kept
    clean_env.delenv("NCCL_HOSTID")
    clean_env.delenv("RANK")
    envs.share_gpu_under_torchrun()
    assert "NCCL_HOSTID" not in os.environ                     # no rank known: nothing


def test_spawned_rank_takes_its_shared_gpu_and_host_id(clean_env):
    """A rank the bench spawns as rank 1 of 2 on one GPU: GPU 0, shared-GPU mode, its own NCCL_HOSTID,
    all before torch.distributed starts."""
    import torch
    import torch.distributed as dist

    from braid import bench
    got = {}
    clean_env.setattr(torch.cuda, "is_available", lambda: True)
    clean_env.setattr(torch.cuda, "device_count", lambda: 1)
    clean_env.setattr(torch.cuda, "set_device", lambda i: got.setdefault("set_device", i))

    def init(backend, **kw):
        got.update(backend=backend, hostid=os.environ.get("NCCL_HOSTID"), shared=envs.get("BRAID_SHARED_GPU"))
    clean_env.setattr(dist, "init_process_group", init)
    clean_env.setattr(bench.config, "set_gpu_env", lambda: None)
    assert bench._init_rank(1, 2, 12345) is True
    assert got == {"set_device": 0, "backend": "nccl", "hostid": envs.shared_gpu_env(1)["NCCL_HOSTID"],
                   "shared": True}


def test_header_says_ranks_share_gpus(clean_env):
    import torch

    from braid.bench.output import header_line, machine_info
    clean_env.setattr(torch.cuda, "device_count", lambda: 1)
    clean_env.setattr(torch.cuda, "get_device_name", lambda dev=None: "NVIDIA H100 80GB HBM3")
    comm = types.SimpleNamespace(world_size=2, cuda=True, device=torch.device("cuda", 0))
    info = machine_info(comm)
    assert info["shared_gpu"] is False and "\n" not in header_line("bench", info)
    with envs.override(BRAID_SHARED_GPU="1"):
        info = machine_info(comm)
    assert info["shared_gpu"] is True
    first, second = header_line("bench", info).split("\n")
    assert first.startswith("braid bench ") and "| 1x NVIDIA H100 80GB HBM3 shared by 2 ranks |" in first
    assert second == config.shared_gpu_line(2, 1) == (
        "shared GPUs: 2 ranks on 1 GPU(s) (BRAID_SHARED_GPU=1, NCCL over its network transport): "
        "results are exact, times are host-cost figures, not link speeds")
    cpu = machine_info(types.SimpleNamespace(world_size=2, cuda=False, device=torch.device("cpu")))
    assert "shared_gpu" not in cpu and "\n" not in header_line("bench", cpu)


def test_cpu_ranks_share_the_cores_this_process_may_use(clean_env):
    """A CPU rank's intra-op threads: the cores of the process's affinity (taskset, a cpuset) over
    the ranks, not the machine's count; the header names both counts when they differ."""
    import torch
    import torch.distributed as dist

    from braid import bench
    from braid.bench.config import cores_text, usable_cores
    got = {}
    clean_env.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    clean_env.setattr(os, "cpu_count", lambda: 32)
    clean_env.setattr(dist, "init_process_group", lambda backend, **kw: got.setdefault("backend", backend))
    clean_env.setattr(torch, "set_num_threads", lambda n: got.setdefault("threads", n))
    clean_env.setattr(bench.config, "set_gpu_env", lambda: None)
    assert usable_cores() == 16 and cores_text() == "16 of 32 cores"
    assert bench._init_rank(3, 8, 12345, cpu=True) is False
    assert got == {"backend": "gloo", "threads": 2}
    clean_env.setattr(os, "sched_getaffinity", lambda pid: set(range(32)), raising=False)
    assert cores_text() == "32 cores"
