"""Helpers of the frameworks tier: training runs of Lightning, accelerate and the transformers
Trainer, each on backend "braid" and on a reference backend, 2 ranks (DDP with create_graph=True,
torch's own test_ddp_create_graph, is in tests/test_semantics.py).

On CPU (the default) the reference is gloo. With BRAID_FW_DEVICE=cuda the same runs train on GPUs
against NCCL: each rank on a GPU of its own where there are enough, else the ranks share the GPUs
in braid's shared-GPU mode, each as the one rank of a node of its own (NODE_RANK = rank,
LOCAL_RANK = 0: the frameworks then place every rank on the GPU it was given; `rank_env`).

Every test starts its own world with `run_world` (tests/conftest.py): spawned processes, a local
rendezvous, a time limit. A worker runs the same seeded job once per backend, one after the
other, each on a fresh process group with a rendezvous port of its own, and returns what the job
produced (final weights bit for bit, logged metrics, gathered values) as JSON; the test compares
the braid run with the reference run.

Why the runs can be compared exactly: with 2 ranks every reduction adds or averages two values,
and a + b is the same float in either order, so braid (rank order), gloo and NCCL give the same
bits for every sum, mean, min and max. Where a framework reduces differently on gloo (Lightning
averages with SUM and a division on gloo, with AVG elsewhere), the result is still the same
float: (a + b) / 2 computed once. On GPUs the runs are made deterministic
(`torch.use_deterministic_algorithms`, CUBLAS_WORKSPACE_CONFIG) so that the two runs' own
kernels agree too.
"""
from __future__ import annotations

import importlib.util
import os
import socket

import pytest

DEVICE = os.environ.get("BRAID_FW_DEVICE", "cpu")
if DEVICE not in ("cpu", "cuda"):
    raise ValueError(f"BRAID_FW_DEVICE={DEVICE!r}: cpu or cuda")
REF = "gloo" if DEVICE == "cpu" else "nccl"          # the backend braid's runs are compared with

# what every framework worker gets: no hub, no telemetry
FW_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "WANDB_DISABLED": "true",
    "WANDB_MODE": "disabled",
    "DISABLE_MLFLOW_INTEGRATION": "TRUE",
    # braid splits every call above 1 KiB where its lanes model says a split pays (on CPU: over
    # its gloo and shm lanes), so the training runs go through braid's own paths, not only
    # through the calls it forwards whole
    "BRAID_MIN_SPLIT_KB": "1",
    "BRAID_SPLIT_UNMEASURED": "1",      # on GPUs too, with no calibration cached
}
if DEVICE == "cpu":           # no GPU, one thread per rank
    FW_ENV.update({"CUDA_VISIBLE_DEVICES": "", "ACCELERATE_USE_CPU": "true"})
else:                         # NVLink multicast off (it can take a shared host's GPUs down)
    FW_ENV.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
                   "CUBLAS_WORKSPACE_CONFIG": ":4096:8"})

BACKENDS = (REF, "braid")


def require(module: str, extra: str = "frameworks") -> None:
    """Skip the calling test when `module` is not installed (CI installs it with the extra)."""
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed: `pip install -e .[{extra}]` installs the frameworks tier's packages")


def free_ports(n: int) -> list[int]:
    """n distinct free local ports (one rendezvous per backend run inside a world)."""
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def rank_env(rank: int, world: int, port: int) -> None:
    """The variables a launcher (torchrun) sets, as the frameworks read them. On GPUs, with
    fewer GPUs than ranks, every rank is the one rank of a node of its own on GPU rank % GPUs,
    in braid's shared-GPU mode (set here, before NCCL starts)."""
    local, nodes, node = rank, 1, 0
    if DEVICE == "cuda":
        import torch
        from braid.bench.config import placement
        gpus = torch.cuda.device_count()
        gpu, env = placement(rank, world, gpus)
        os.environ.update(env)
        torch.cuda.set_device(gpu)
        torch.use_deterministic_algorithms(True, warn_only=True)
        steer_to_copy_engines(world)
        if gpus < world:
            local, nodes, node = gpu, world, rank
    os.environ.update({
        "RANK": str(rank), "LOCAL_RANK": str(local), "NODE_RANK": str(node), "GROUP_RANK": str(node),
        "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world // nodes),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    })


# on GPUs, the lane costs every braid communicator of a run is given (Communicator.set_calibration):
# NCCL made slow per byte, so the copy engines take every call of 1 KiB and up (the jobs' tensors
# are small: left to braid's own model, nearly every call would go to NCCL whole)
STEER = {"nccl": {"latency_us": 10.0, "bw_gbps": 0.01, "floor_us": 10.0},
         "ce": {"latency_us": 20.0, "bw_gbps": 10.0, "floor_us": 20.0}}
STEER_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all_single", "reduce", "send_recv")


def steer_to_copy_engines(world: int) -> None:
    """On GPUs: every braid communicator made in this process takes STEER as its calibration."""
    if DEVICE != "cuda":
        return
    from braid.comm.communicator import Communicator
    if getattr(Communicator.__init__, "_steered", False):
        return
    made = Communicator.__init__

    def init(self, *args, **kwargs):
        made(self, *args, **kwargs)
        if getattr(self, "cuda", False):
            self.set_calibration({f"{op}/{world}": dict(STEER) for op in STEER_OPS})
    init._steered = True
    Communicator.__init__ = init


def end_accelerate_run() -> None:
    """After a job that went through accelerate: forget its process-wide state and destroy the
    process group, so that the next backend's run starts as a fresh process would."""
    import torch.distributed as dist
    from accelerate.state import AcceleratorState, GradientState, PartialState
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()
    dist.destroy_process_group()


def layout(world: int) -> tuple[int, int]:
    """(devices per node, nodes) for a framework's trainer, as `rank_env` set them."""
    n = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return n, world // n


def braid_paths() -> dict:
    """What braid's communicator of the current default group did: calls, and the copy
    engines' prepared calls (built, replayed) where it has them."""
    import torch.distributed as dist
    pg = dist.distributed_c10d._get_default_group()
    comm = getattr(pg, "_comm", None)
    prep = getattr(comm, "_prepared", None)
    stats = dict(getattr(prep, "stats", {}) or {})
    return {"calls": braid_calls(), **{k: int(stats.get(k, 0)) for k in ("built", "hits", "replays")}}


def braid_calls() -> int:
    """How many calls braid's communicator of the current default group took (0: none, or the
    group is not braid's)."""
    import torch.distributed as dist
    if not dist.is_initialized():
        return 0
    pg = dist.distributed_c10d._get_default_group()
    comm = getattr(pg, "_comm", None)
    return int(getattr(comm, "ncalls", 0) or 0)


def report_paths(job: str, runs: list) -> None:
    """One line per job: the device, and what braid's communicator did on every rank (shown
    with pytest -s; the GPU runs' notes quote it)."""
    paths = [res.get("braid", {}).get("braid") for res in runs]
    print(f"\n{job} on {DEVICE}, braid against {REF}: braid's paths per rank {paths}")


def encode(t) -> dict:
    """A tensor as JSON, bit for bit."""
    import torch
    t = t.detach().to("cpu").contiguous()
    raw = t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)
    return {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape),
            "hex": raw.numpy().tobytes().hex()}


def decode(d: dict):
    import torch
    dtype = getattr(torch, d["dtype"])
    raw = torch.frombuffer(bytearray.fromhex(d["hex"]), dtype=torch.uint8) if d["hex"] else \
        torch.empty(0, dtype=torch.uint8)
    if dtype == torch.bool:
        return raw.to(torch.bool).reshape(d["shape"])
    return raw.view(dtype).reshape(d["shape"]).clone()


def encode_state(state: dict) -> dict:
    return {k: encode(v) for k, v in state.items()}


def assert_same_tensors(got: dict, want: dict, what: str, rtol: float = 0.0, atol: float = 0.0) -> None:
    """Two name -> encoded tensor maps agree: bit for bit (tolerances 0) or within rtol/atol."""
    import torch
    assert sorted(got) == sorted(want), f"{what}: names differ: {sorted(set(got) ^ set(want))}"
    bad = []
    for name in sorted(want):
        a, b = decode(got[name]), decode(want[name])
        if a.dtype != b.dtype or a.shape != b.shape:
            bad.append(f"{name}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}")
            continue
        if rtol == 0.0 and atol == 0.0:
            if not torch.equal(a, b):
                diff = (a.double() - b.double()).abs().max().item() if a.is_floating_point() else "n/a"
                bad.append(f"{name}: not bit-equal (max abs diff {diff})")
        elif not torch.allclose(a.double(), b.double(), rtol=rtol, atol=atol):
            bad.append(f"{name}: max abs diff {(a.double() - b.double()).abs().max().item():.3g}")
    assert not bad, f"{what}:\n  " + "\n  ".join(bad)
