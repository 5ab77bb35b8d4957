"""What NCCL (through torch's process group) accepts, op x dtype x ReduceOp, on one GPU (a world of
one rank: acceptance is NCCL's and torch's type tables, not the world size; values are not checked
here), beside what braid's own checks accept for CUDA tensors (`check_reduce_dtype(..., cuda=True)`,
the rule of braid's GPU paths). Prints one JSON object per cell and a summary of the cells where the
two differ.

    NCCL_NVLS_ENABLE=0 PYTHONPATH=src python3 scripts/probes/nccl_accepts.py > nccl_accepts.jsonl
"""
import json
import os

import torch
import torch.distributed as dist

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29541")
torch.cuda.set_device(0)
dist.init_process_group("nccl", rank=0, world_size=1)
from braid.collectives.reduce import check_reduce_dtype, op_name  # noqa: E402
from braid.errors import MisuseError  # noqa: E402

R = dist.ReduceOp
OPS = {"SUM": R.SUM, "PRODUCT": R.PRODUCT, "MIN": R.MIN, "MAX": R.MAX, "AVG": R.AVG,
       "PREMUL_SUM": dist._make_nccl_premul_sum(1.25), "BAND": R.BAND, "BOR": R.BOR, "BXOR": R.BXOR}
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int32, torch.int64,
          torch.uint8, torch.bool, torch.int16, torch.uint16, torch.complex64,
          getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)]
dev = torch.device("cuda", 0)
diff = []
for coll in ("all_reduce", "reduce", "reduce_scatter_tensor"):
    for dt in [d for d in DTYPES if d is not None]:
        for name, op in OPS.items():
            t = torch.ones(8, device=dev).to(dt)
            try:
                if coll == "all_reduce":
                    dist.all_reduce(t, op=op)
                elif coll == "reduce":
                    dist.reduce(t, dst=0, op=op)
                else:
                    dist.reduce_scatter_tensor(torch.empty_like(t), t, op=op)
                torch.cuda.synchronize()
                nccl = "yes"
                why = ""
            except Exception as exc:  # noqa: BLE001
                nccl, why = "no", (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
            try:
                check_reduce_dtype(dt, op_name(op), coll, cuda=True)
                braid = "yes"
            except MisuseError as exc:
                braid = "no"
                why = why or str(exc)[:160]
            except Exception as exc:  # noqa: BLE001
                braid = f"error {type(exc).__name__}"
            row = {"op": coll, "dtype": str(dt).replace("torch.", ""), "red": name, "nccl": nccl, "braid_gpu": braid,
                   "why": why}
            print(json.dumps(row), flush=True)
            if nccl != braid:
                diff.append(row)
print(json.dumps({"differ": len(diff), "cells": [f"{d['op']} {d['dtype']} {d['red']}: nccl {d['nccl']}, "
                                                 f"braid {d['braid_gpu']}" for d in diff]}))
dist.destroy_process_group()
