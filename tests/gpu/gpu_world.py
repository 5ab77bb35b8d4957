"""The GPU tier's harness: one spawned process per GPU with NCCL and braid set up, and every
rank's traceback in the failure message. A test passes a top-level `body(rank, world, comm, dev)`
and the BRAID_* settings it needs beyond the defaults here (small rings, so large cases wrap)."""
from __future__ import annotations

import os
import socket
import traceback

import pytest
import torch

BASE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
            "BRAID_HOST_BUFFER_MB": "8", "BRAID_HOST_CHUNK_KB": "512", "BRAID_TIMEOUT_S": "60"}


def needs(n: int):
    return pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < n,
                              reason=f"needs {n} GPUs")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, err_path, body, env):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **BASE_ENV, **env)
    import torch.distributed as dist
    import braid
    try:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world)
        comm = braid.init()
        body(rank, world, comm, torch.device("cuda", rank))
        braid.close()
        dist.destroy_process_group()
    except BaseException:
        with open(f"{err_path}.{rank}", "w") as f:
            f.write(traceback.format_exc())
        raise


def run(world: int, tmp_path, body, env: dict | None = None) -> None:
    """Run `body` on `world` GPUs; fail with every rank's traceback."""
    import torch.multiprocessing as mp
    err = str(tmp_path / "err")
    try:
        mp.spawn(_entry, args=(world, _port(), err, body, dict(env or {})), nprocs=world)
    except Exception:
        msgs = [open(p).read() for p in (f"{err}.{r}" for r in range(world)) if os.path.exists(p)]
        pytest.fail("\n".join(msgs) or "worker failed")
