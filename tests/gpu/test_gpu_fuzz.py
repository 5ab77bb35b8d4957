"""GPU tier: the fuzz sequence of tests/test_fuzz.py on CUDA tensors, and a soak.

Fuzz: every rank draws the CPU fuzz's seeded call sequence (every op, dtype and ReduceOp, roots,
odd and zero sizes, even and uneven all_to_all, send/recv and ring shifts, ~15% async calls
checked one or two calls later), its tensors on the rank's GPU and its references on the CPU from
every rank's seeded data. Blocks of 100 calls alternate between braid's own calibration and one
that gives NCCL the small calls whole, the copy engines the middle ones and a split the large ones
(GPU_LANES), and every path is asserted used. Through braid's direct API (over an NCCL default
group) and through dist.* on the braid backend; 2,000 calls at 2 ranks and 1,000 at 4
(BRAID_GPU_FUZZ_OPS scales them). Ranks share the GPUs where there are fewer (gpu_world.py).

Soak: 10,000 calls of a training loop's few shapes (split on the copy engines and whole, async
and blocking, send/recv among them); after 2,000 calls of warm-up, GPU memory in use, open file
descriptors, /dev/shm entries and the copy engines' peer mappings stay where they were, braid's
prepared entries within their bound (BRAID_PREPARED_MAX).
"""
from __future__ import annotations

import datetime
import json
import os
import traceback

import pytest
import torch

from gpu_world import BASE_ENV, _port, needs, start_rank

OPS = int(os.environ.get("BRAID_GPU_FUZZ_OPS", "2000"))
SEED = int(os.environ.get("BRAID_FUZZ_SEED", "20261126"))
# NCCL's own call below ~100 KB, the copy engines alone to ~1 MB, a split above
GPU_LANES = {"nccl": {"latency_us": 10.0, "bw_gbps": 1.0, "floor_us": 10.0},
             "ce": {"latency_us": 100.0, "bw_gbps": 10.0, "floor_us": 100.0},
             "host": {"latency_us": 150.0, "bw_gbps": 8.0, "floor_us": 150.0}}


def _entry(rank, world, port, out_dir, mode, seed, n_ops):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **BASE_ENV, BRAID_MIN_SPLIT_KB="1")
    import torch.distributed as dist
    from test_fuzz import _fuzz_worker
    try:
        dev = start_rank(rank, world)
        if mode == "direct":
            dist.init_process_group("nccl", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
        res = _fuzz_worker(rank, world, mode, seed, n_ops, dev=dev, lanes=GPU_LANES)
        torch.cuda.synchronize()
        if mode == "direct":
            import braid
            braid.close()
            dist.destroy_process_group()
    except Exception:
        res = {"error": traceback.format_exc()[-4000:], "ops": 0, "n_wrong": 0, "wrong": [], "paths": {}}
    with open(os.path.join(out_dir, f"r{rank}.json"), "w") as f:
        json.dump(res, f)


def _fuzz(tmp_path, world: int, mode: str, n_ops: int) -> list[dict]:
    import torch.multiprocessing as mp
    mp.spawn(_entry, args=(world, _port(), str(tmp_path), mode, SEED + world, n_ops), nprocs=world)
    return [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(world)]


WORLDS = [(2, "direct"), (2, "backend"), (4, "direct"), (4, "backend")]


@needs(2)
@pytest.mark.parametrize("world,mode", WORLDS, ids=["direct-w2", "backend-w2", "direct-w4", "backend-w4"])
def test_gpu_fuzz(tmp_path, world, mode, capsys):
    n_ops = max(1, (OPS if world == 2 else OPS // 2) // 2)        # two APIs per world size
    res = _fuzz(tmp_path, world, mode, n_ops)
    with capsys.disabled():
        print(f"\ngpu fuzz {mode} w={world} seed={SEED + world}: ops={res[0]['ops']} "
              f"wrong={sum(r['n_wrong'] for r in res)} seconds={res[0].get('seconds')} paths={res[0]['paths']}")
    for r, out in enumerate(res):
        assert out["error"] is None, f"rank {r}: {out['error']}"
        assert out["n_wrong"] == 0, f"rank {r}: {out['n_wrong']} wrong, first {out['wrong'][:5]}"
        assert out["ops"] == n_ops
    paths = res[0]["paths"]
    assert paths.get("nccl", 0) > 0 and paths.get("ce", 0) > 0 and paths.get("split", 0) > 0, paths


def _shm_entries() -> int:
    return len([n for n in os.listdir("/dev/shm") if n.startswith("braid")])


def _soak_entry(rank, world, port, out_dir, calls):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **BASE_ENV, BRAID_MIN_SPLIT_KB="1")
    import torch.distributed as dist
    import braid
    report = {}
    try:
        dev = start_rank(rank, world)
        dist.init_process_group("nccl", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
        comm = braid.init()
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        bufs = {n: (torch.randn(n, device=dev), torch.empty(n * world, device=dev), torch.empty(n, device=dev))
                for n in (4097, 262_147, 1_000_003)}
        g = torch.Generator().manual_seed(11)             # the same sequence on every rank

        def one(i):
            n = (4097, 262_147, 1_000_003)[int(torch.randint(3, (1,), generator=g))]
            x, out, got = bufs[n]
            kind = int(torch.randint(5, (1,), generator=g))
            asyn = bool(torch.randint(4, (1,), generator=g) == 0)
            if kind == 0:
                h = comm.all_gather_into_tensor(out, x, async_op=asyn)
            elif kind == 1:
                y = x.clone()
                h = comm.all_reduce(y, async_op=asyn)
            elif kind == 2:
                h = comm.broadcast(got, i % world, async_op=asyn)
            else:
                hs = [comm.send(x, nxt, async_op=True), comm.recv(got, prv, async_op=True)]
                for wk in hs:
                    wk.wait()
                h = None
            if h is not None:
                h.wait()

        def marks():
            torch.cuda.synchronize()
            return {"gpu_bytes": torch.cuda.memory_allocated(dev), "fds": len(os.listdir("/proc/self/fd")),
                    "shm": _shm_entries(), "maps": len(comm._lanes["ce"].maps) if "ce" in comm._lanes else 0,
                    "entries": len(comm._prepared.entries),
                    "p2p_entries": sum(len(s.table) for s in comm._p2p.pairs.sends.values()) if comm._p2p.pairs else 0,
                    "events": len(comm._p2p.pairs.free_events) if comm._p2p.pairs else 0}

        with comm.fixed_shares({"ce": 1.0}):
            for i in range(600):         # every shape seen, every entry built
                one(i)
            report["warm"] = marks()
            for i in range(600, calls):
                one(i)
                if i % 2000 == 1999:
                    report[f"at{i + 1}"] = marks()
        report["stats"] = dict(comm._prepared.stats)
        report["max_entries"] = comm._prepared.max_entries
        braid.close()
        dist.destroy_process_group()
    except Exception:
        report["error"] = traceback.format_exc()[-4000:]
    with open(os.path.join(out_dir, f"r{rank}.json"), "w") as f:
        json.dump(report, f)


@needs(2)
def test_gpu_soak_holds_steady(tmp_path):
    import torch.multiprocessing as mp
    calls = int(os.environ.get("BRAID_GPU_SOAK_CALLS", "10000"))
    mp.spawn(_soak_entry, args=(2, _port(), str(tmp_path), calls), nprocs=2)
    for r in range(2):
        rep = json.loads((tmp_path / f"r{r}.json").read_text())
        print(f"\nsoak rank {r}: " + json.dumps(rep))
        assert "error" not in rep, rep["error"]
        # the first 2,000 calls warm up (the allocator's segments for the clones settle, the
        # prepared cache fills to its bound): nothing grows after them
        warm = rep["at2000"]
        for key, m in rep.items():
            if not key.startswith("at"):
                continue
            assert m["gpu_bytes"] <= warm["gpu_bytes"], (r, key, m, warm)
            assert m["fds"] <= warm["fds"] and m["shm"] <= warm["shm"], (r, key, m, warm)
            assert m["maps"] <= warm["maps"] and m["entries"] <= rep["max_entries"], (r, key, m, warm)
            assert m["p2p_entries"] <= warm["p2p_entries"] and m["events"] <= 64, (r, key, m, warm)
        assert rep["stats"]["replays"] > 1000 and rep["stats"]["p2p_hits"] > 1000, rep["stats"]
