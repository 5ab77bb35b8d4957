"""One GPU, one rank: the bench's other baselines (torch's symmetric-memory kernels) prepare and
run with this torch, and give the identity a one-rank reduction must give. A check of names and
signatures, not a measurement (a world of one has nothing to move).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=src python3 scripts/probes/symm_baselines_one_gpu.py
"""
import os

import torch
import torch.distributed as dist

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29533")
torch.cuda.set_device(0)
dist.init_process_group("nccl", rank=0, world_size=1)
import braid  # noqa: E402
from braid.bench import baselines  # noqa: E402

comm = braid.init()
for alt in baselines.ALTERNATIVES:
    why = alt.why_not(comm, torch.bfloat16)
    if why:
        print(f"{alt.op:15s} {alt.name:25s} unavailable: {why}")
        continue
    try:
        p = alt.prepare(comm, 1 << 20, torch.bfloat16)
        p.copy_in()
        out = p.run()
        torch.cuda.synchronize()
        print(f"{alt.op:15s} {alt.name:25s} ran: out {tuple(out.shape) if out is not None else None}")
    except Exception as exc:  # noqa: BLE001
        print(f"{alt.op:15s} {alt.name:25s} FAILED: {type(exc).__name__}: {str(exc)[:300]}")
braid.close()
dist.destroy_process_group()
