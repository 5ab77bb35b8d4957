"""The rank work of `braid calibrate` and `braid topo`, and `braid env` (no ranks).

`calibrate` measures every lane per op (`braid.calibrate.calibrate`), merges the table into the
on-disk cache and prints each lane's fitted cost, the measured split-or-not verdicts per size
bucket and the shares the ops will start from. `topo` gathers every rank's view of its lanes and
prints the machine (CPU, /dev/shm, GPUs, peer access, `nvidia-smi topo -m`) and, per lane, whether
braid can use it here and why not. `print_env` lists every BRAID_* setting.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from .config import GPU_ENV, Config, cores_text
from .output import cpu_name, format_shares, header_line, human_bytes, machine_info


# ---------------------------------------------------------------------------------------------
# braid calibrate (every rank; rank 0 prints)
# ---------------------------------------------------------------------------------------------

def calibrate(comm, cfg: Config) -> None:
    from .. import calibrate as cal
    r0 = comm.rank == 0
    lanes = comm.lanes_for(comm.device)
    if r0:
        print(header_line("calibrate", machine_info(comm)))
        print(f"world {comm.world_size} ranks ({'nccl' if comm.cuda else 'gloo'}) | lanes: {', '.join(lanes)} | "
              f"ops: {', '.join(cfg.ops)}", flush=True)
    t0 = time.perf_counter()
    table = cal.calibrate(comm, ops=cfg.ops, save_to_disk=False)
    seconds = time.perf_counter() - t0
    if not r0:
        return
    merged = dict(cal.load(comm) or {})
    merged.update(table)
    path = cal.save(comm, merged)
    print(f"measured in {seconds:.1f} s")
    print()
    _print_lane_costs(table)
    _print_verdicts(table, "NCCL" if comm.cuda else "gloo")
    sizes = (1 << 20, 64 << 20, 1 << 30) if comm.cuda else (256 << 10, 8 << 20, 64 << 20)
    print()
    print("shares the ops start from:")
    print(f"{'op':<20}" + "".join(f"{human_bytes(n):>24}" for n in sizes))
    for op in cfg.ops:
        if f"{op}/{comm.world_size}" not in table:
            continue
        print(f"{op:<20}" + "".join(f"{format_shares(comm.shares_for(op, n, lanes)):>24}" for n in sizes))
    print()
    print(f"cached at {path}", flush=True)


def _print_lane_costs(table: dict) -> None:
    print(f"{'op/world':<22}{'lane':<7}{'latency_us':>12}{'bw_GB/s':>10}{'floor_us':>10}")
    for key, costs in table.items():
        if key.endswith(("/pays", "/timed")):
            continue
        if not costs:
            print(f"{key:<22}{'-':<7}  (one lane: nothing to split)")
        for lane, c in costs.items():
            print(f"{key:<22}{lane:<7}{c['latency_us']:>12.1f}{c['bw_gbps']:>10.2f}{c.get('floor_us', 0.0):>10.1f}")


def _print_verdicts(table: dict, native: str = "NCCL") -> None:
    """Per op and size bucket, what the measured check chose: the split (its shares), the native library
    alone (`native`: NCCL on GPUs, gloo on CPUs), or one lane."""
    measured = {k[: -len("/pays")]: v for k, v in table.items() if k.endswith("/pays") and v}
    if not measured:
        return
    print()
    print("split measured against the single lanes (size bucket: the split's balanced shares when it "
          f"was faster, 'no' when {native} alone was, or the lane alone that won):")

    def cell(ok) -> str:
        if isinstance(ok, dict):
            return "(" + format_shares(ok).replace(" ", ",") + ")"
        return ok if isinstance(ok, str) else "yes" if ok else "no"
    for key, verdicts in measured.items():
        cells = " ".join(f"{human_bytes(1 << int(b), sep='')}={cell(ok)}"
                         for b, ok in sorted(verdicts.items(), key=lambda kv: int(kv[0])))
        print(f"  {key:<22}{cells}")


# ---------------------------------------------------------------------------------------------
# braid topo (every rank; rank 0 prints)
# ---------------------------------------------------------------------------------------------

def topo(comm) -> None:
    view = {"rank": comm.rank, "pid": os.getpid(), "device": str(comm.device), "unavailable": dict(comm.unavailable),
            "gpu_lanes": comm.lanes_for(torch.device("cuda")) if comm.cuda else [],
            "cpu_lanes": comm.lanes_for(torch.device("cpu"))}
    views = [None] * comm.world_size
    dist.all_gather_object(views, view, group=comm.gloo_group)
    if comm.rank != 0:
        return
    print(header_line("topo", machine_info(comm)))
    print(f"CPU: {cpu_name()}, {cores_text()}")
    try:
        free = shutil.disk_usage("/dev/shm").free
        print(f"/dev/shm: {free / (1 << 30):.1f} GiB free (node segment of the host/shm lanes)")
    except OSError:
        print("/dev/shm: not available")
    if torch.cuda.is_available():
        _print_gpus()
    else:
        print("GPUs: none (torch.cuda.is_available() is False): braid has its CPU lanes only")
    from ..nics import report
    print("\n".join(report()))
    print(f"world: {comm.world_size} ranks, backend {dist.get_backend()}, single node: {comm.single_node}"
          + (f", node segment {comm.layout.total_bytes / (1 << 20):.0f} MiB" if comm.layout is not None else "")
          + (f", {comm.hier.num_nodes} nodes of {comm.hier.per_node} ranks: node steps on braid's lanes, "
             f"rail steps on {comm.hier.rail_lib} (one group per local rank)" if comm.hier is not None else
             f", {comm.num_nodes} nodes: calls go to the native library whole (BRAID_HIER=1 runs node and "
             f"rail steps)" if comm.num_nodes > 1 else ""))
    _print_lanes(comm, views)
    sys.stdout.flush()


def _print_gpus() -> None:
    """Every visible GPU, their peer access matrix, and `nvidia-smi topo -m` where it runs."""
    n = torch.cuda.device_count()
    print(f"GPUs: {n} (CUDA {torch.version.cuda})")
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        print(f"  {i}  {p.name}  {p.total_memory / (1 << 30):.1f} GiB  sm_{p.major}{p.minor}")
    print("peer access (torch.cuda.can_device_access_peer, row -> column):")
    print("      " + "".join(f"{j:>4}" for j in range(n)))
    for i in range(n):
        print(f"  {i:>3} " + "".join(f"{'-' if i == j else ('Y' if torch.cuda.can_device_access_peer(i, j) else 'n'):>4}"
                                     for j in range(n)))
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20)
            if out.returncode == 0 and out.stdout.strip():
                print("nvidia-smi topo -m:")
                print("\n".join("  " + line for line in out.stdout.rstrip().splitlines()))
        except (OSError, subprocess.SubprocessError):
            pass


def _print_lanes(comm, views: list[dict]) -> None:
    """Each lane kind: available here, or why not (per rank where the ranks disagree)."""
    from ..planner.plan import CPU_LANES, GPU_LANES
    wanted = os.environ.get("BRAID_LANES")
    print("lanes" + (f" (BRAID_LANES={wanted})" if wanted else "") + ":")
    usable_gpu, usable_cpu = set(views[0]["gpu_lanes"]), set(views[0]["cpu_lanes"])
    for kind in list(GPU_LANES) + list(CPU_LANES):
        name = kind.value
        tensors = "CUDA" if kind in GPU_LANES else "CPU"
        whys = {v["rank"]: v["unavailable"][name] for v in views if name in v["unavailable"]}
        if name in usable_gpu or name in usable_cpu:
            state = "available"
        elif whys:
            texts = set(whys.values())
            state = "not available: " + (next(iter(texts)) if len(texts) == 1 else
                                         "; ".join(f"rank {r}: {w}" for r, w in whys.items()))
        elif comm.wanted is not None and name not in comm.wanted:
            state = "off (not in BRAID_LANES)"
        elif kind in GPU_LANES and not comm.cuda:
            state = "not available: needs CUDA tensors and an NCCL backend"
        else:
            state = "not available"
        print(f"  {name:<5} {'(' + tensors + ' tensors)':<15} {state}")
    differ = [v for v in views if (v["gpu_lanes"], v["cpu_lanes"]) != (views[0]["gpu_lanes"], views[0]["cpu_lanes"])]
    for v in differ:
        print(f"  rank {v['rank']} differs: CUDA lanes {v['gpu_lanes']}, CPU lanes {v['cpu_lanes']}")


# ---------------------------------------------------------------------------------------------
# braid env (no ranks)
# ---------------------------------------------------------------------------------------------

def print_env() -> None:
    import textwrap
    from .. import envs
    from ..errors import MisuseError
    print("braid settings (environment variables; BRAID_* are read when used):")
    for name, default, doc in envs.describe():
        raw = os.environ.get(name)
        if raw is None:
            value = f"{default} (default)"
        else:
            try:
                value = f"{raw!r} -> {envs.get(name)!r}"
            except MisuseError:
                value = f"{raw!r} (INVALID)"
        print(f"\n{name} = {value}")
        print(textwrap.fill(doc, width=96, initial_indent="    ", subsequent_indent="    "))
    print("\nset by `braid bench/calibrate/topo` for GPU ranks (NVLink multicast off):")
    for k, v in GPU_ENV.items():
        now = os.environ.get(k)
        print(f"    {k}={v}" + (f"   (now in this shell: {now})" if now is not None else ""))
