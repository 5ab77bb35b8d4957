"""What every rank of `braid bench`, `braid calibrate` and `braid topo` is told: the run's
`Config` (picklable, so spawned ranks receive it whole) and the bench's fixed numbers.

Defaults that depend on the machine kind (sizes, dtype, call counts) are filled in on the rank,
by `Config.resolved`, once it knows whether it runs on GPUs or on the CPU lanes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from .. import envs

OPS = ("all_gather", "broadcast", "send_recv", "all_to_all_single", "all_reduce", "reduce_scatter", "reduce")
EXTRA_OPS = ("moe",)      # not in `--op all`: one MoE layer (dispatch + combine), time per layer
# NVLink multicast (NVLS) off for NCCL, torch symmetric memory and NVSHMEM: set before any CUDA/NCCL init.
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
DTYPES = ("bfloat16", "float16", "float32", "float64", "int8", "uint8", "int32", "int64")
GPU_SIZES = (1 << 20, 1 << 30)
CPU_SIZES = (256 << 10, 16 << 20)   # with factor 4: a few minutes for every op on 2 cores
SMALL_ROUNDS = 10       # alternating windows per point for small (host-bound) calls
WRONG_EXIT = 3          # exit status when braid's output differs from the baseline's
PIPE_EXIT = 141         # exit status when stdout's reader went away (`braid topo | head -1`): 128 + SIGPIPE
NO_GPU_LINE = "no GPU: running braid's CPU lanes (gloo+shm) against gloo"
ONE_GPU_LINE = ("one GPU visible: braid's GPU lanes join two or more GPUs, so this runs on braid's CPU lanes "
                "(gloo+shm, 2 ranks); with 2+ GPUs braid runs against NCCL; --nproc 2 runs 2 ranks sharing "
                "this GPU (exact results, host-cost times, not link speeds)")
CPU_LINE = "--cpu: running braid's CPU lanes (gloo+shm) against gloo"


def shared_gpu_line(world: int, gpus: int) -> str:
    """The header line of a run whose ranks share GPUs (BRAID_SHARED_GPU=1)."""
    return (f"shared GPUs: {world} ranks on {gpus} GPU(s) (BRAID_SHARED_GPU=1, NCCL over its network "
            f"transport): results are exact, times are host-cost figures, not link speeds")


def set_gpu_env() -> None:
    """GPU_ENV into this process's environment (spawned ranks inherit it)."""
    os.environ.update(GPU_ENV)


def placement(rank: int, world: int, ngpu: int, shared: bool = False) -> tuple[int, dict[str, str]]:
    """Where spawned rank `rank` of `world` runs on a machine showing `ngpu` GPUs: its GPU index,
    and what it adds to its environment before NCCL starts. One GPU per rank while there are
    enough; with more ranks than GPUs, or `shared` (BRAID_SHARED_GPU=1 asked for), braid's
    shared-GPU mode: rank r on GPU r % ngpu, with BRAID_SHARED_GPU=1 and an NCCL_HOSTID of its
    own (`braid.envs.shared_gpu_env`)."""
    if world <= ngpu and not shared:
        return rank, {}
    return rank % ngpu, envs.shared_gpu_env(rank)


@dataclass
class Config:
    task: str                                   # bench | calibrate | topo
    ops: tuple[str, ...] = OPS
    sizes: tuple[int, int] | None = None
    factor: float = 2.0
    dtype: str | None = None
    iters: int | None = None
    auto_iters: bool = True
    trace: int | None = None
    slow: str | None = None
    warmup: int | None = None
    repeat: int = 2
    lanes: list[str] | None = None
    shares: dict[str, float] | None = None
    calibrate: bool = True
    hot_bytes: int | None = None
    cold_bytes: int | None = None
    hot_fraction: list[float] | None = None
    json_path: str | None = None
    plot_path: str | None = None
    check: bool = True
    plain: bool = False
    cpu: bool = False                           # gloo ranks and CPU tensors even where GPUs are visible
    notes: list[str] = field(default_factory=list)
    # training-step workloads (braid.jobs) instead of the op sweep; None: machine-kind defaults
    workloads: tuple[str, ...] = ()
    width: int | None = None
    depth: int | None = None
    batch: int | None = None
    bucket_mb: int | None = None
    tokens: int | None = None
    steps: int | None = None

    def resolved(self, cuda: bool) -> "Config":
        """Defaults that depend on GPU vs CPU."""
        c = Config(**self.__dict__)
        if self.sizes is None and not cuda and self.factor == 2.0:
            c.factor = 4.0                              # CPU default sweep: 256K, 1M, 4M, 16M
        c.sizes = self.sizes or (GPU_SIZES if cuda else CPU_SIZES)
        c.dtype = self.dtype or ("bfloat16" if cuda else "float32")
        c.iters = self.iters or (20 if cuda else 5)
        c.warmup = self.warmup if self.warmup is not None else (5 if cuda else 1)
        return c

    def size_list(self) -> list[int]:
        lo, hi = self.sizes
        out, n = [], float(lo)
        while n <= hi * (1 + 1e-9):
            size = int(round(n))
            if not out or size != out[-1]:
                out.append(size)
            n *= self.factor
        return out


def usable_cores() -> int:
    """The cores this process may run on (its affinity: taskset, cgroup cpusets), not the
    machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):       # not Linux
        return os.cpu_count() or 1


def cores_text() -> str:
    """'16 cores', or '16 of 32 cores' when this process may use only some."""
    n, total = usable_cores(), os.cpu_count() or 1
    return f"{n} cores" if n == total else f"{n} of {total} cores"
