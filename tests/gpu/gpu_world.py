"""The GPU tier's harness: one spawned process per rank with NCCL and braid set up, and every
rank's traceback in the failure message. A test passes a top-level `body(rank, world, comm, dev)`
and the BRAID_* settings it needs beyond the defaults here (small rings, so large cases wrap).

Each rank has a GPU of its own where there are enough; with fewer GPUs than ranks (one GPU, or
CUDA_VISIBLE_DEVICES=0) the ranks share them in braid's shared-GPU mode (`start_rank`), with the
same assertions: results are exact there, only speeds differ. A test that needs a GPU per rank
(bandwidth, peer access between GPUs) skips with `pytest.mark.skipif(GPUS < n, reason=...)`."""
from __future__ import annotations

import os
import socket
import traceback

import pytest
import torch

BASE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
            "BRAID_HOST_BUFFER_MB": "8", "BRAID_HOST_CHUNK_KB": "512", "BRAID_TIMEOUT_S": "60",
            # no calibration here: the built-in model's splits, so that calls go through braid's lanes
            "BRAID_SPLIT_UNMEASURED": "1"}


GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs(n: int):
    """A test of `n` ranks: runs with any GPU (fewer GPUs than ranks: the ranks share them)."""
    return pytest.mark.skipif(GPUS == 0, reason=f"needs a GPU ({n} ranks, sharing the GPUs where there are fewer)")


def start_rank(rank: int, world: int) -> torch.device:
    """This process as rank `rank` of `world`: its GPU, made the current device. With fewer GPUs
    than ranks, GPU rank % GPUS in shared-GPU mode (BRAID_SHARED_GPU=1 and an NCCL_HOSTID of its
    own, set here before NCCL starts), as `braid bench --nproc` places its ranks."""
    from braid.bench.config import placement
    gpu, env = placement(rank, world, GPUS)
    os.environ.update(env)
    torch.cuda.set_device(gpu)
    return torch.device("cuda", gpu)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, err_path, body, env):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **BASE_ENV, **env)
    import torch.distributed as dist
    import braid
    import faulthandler
    # a rank still running after GPU_WORLD_DUMP_S prints every thread's stack (pytest's timeout
    # sees only its own process) and ends
    faulthandler.dump_traceback_later(float(os.environ.get("GPU_WORLD_DUMP_S", "900")), exit=True)
    try:
        dev = start_rank(rank, world)
        dist.init_process_group("nccl", rank=rank, world_size=world)
        comm = braid.init()
        body(rank, world, comm, dev)
        open(f"{err_path}.done.{rank}", "w").close()
        braid.close()
        dist.destroy_process_group()
    except BaseException:
        with open(f"{err_path}.{rank}", "w") as f:
            f.write(traceback.format_exc())
        raise


ENDED_BY_BRAID = 70     # the exit code of a process braid ended after NCCL's abort did not return


def run(world: int, tmp_path, body, env: dict | None = None, may_end: bool = False) -> None:
    """Run `body` on `world` ranks (sharing the GPUs if there are fewer); fail with every rank's
    traceback. may_end: a body that leaves a call hung in NCCL on purpose; braid may end a rank's
    process after the body returned (exit code 70, NCCL's abort did not return), which passes
    when every rank's body had returned."""
    import torch.multiprocessing as mp
    err = str(tmp_path / "err")
    try:
        mp.spawn(_entry, args=(world, _port(), err, body, dict(env or {})), nprocs=world)
    except mp.ProcessExitedException as exc:
        done = all(os.path.exists(f"{err}.done.{r}") for r in range(world))
        if not (may_end and done and exc.exit_code == ENDED_BY_BRAID):
            msgs = [open(p).read() for p in (f"{err}.{r}" for r in range(world)) if os.path.exists(p)]
            pytest.fail("\n".join(msgs) or f"worker failed: {exc}")
    except Exception:
        msgs = [open(p).read() for p in (f"{err}.{r}" for r in range(world)) if os.path.exists(p)]
        pytest.fail("\n".join(msgs) or "worker failed")
