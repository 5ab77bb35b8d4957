"""The node's RDMA NICs as the hardware exposes them, and each GPU's distance to each (for `braid
topo`, and the home NIC of every GPU that the NIC policy (`planner/nic.py`) and the rail groups
of a multi-node world assume).

Read from sysfs: `/sys/class/infiniband/<dev>` (the device's PCI function, its ports' state and
rate) and `/sys/bus/pci/devices/<address>` (where a PCI function sits in the PCIe tree, its NUMA
node). A GPU's PCI address comes from torch's device properties, else `nvidia-smi`. Distances are
named as `nvidia-smi topo -m` names them:
    PIX   through at most one PCIe switch (the GPU and the NIC hang off the same switch)
    PXB   through several PCIe bridges, not the host bridge
    PHB   through the CPU's PCIe host bridge
    NODE  across host bridges within one NUMA node
    SYS   across NUMA nodes
A GPU's home NIC is its nearest (PIX before PXB before PHB ...; the lowest index on a tie).
Nothing here needs a GPU or a NIC: without them the lists are empty. `root` points the reads at
another tree (tests).
"""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field

CLASSES = ("PIX", "PXB", "PHB", "NODE", "SYS")


@dataclass
class Nic:
    name: str                      # mlx5_0
    pci: str                       # 0000:3b:00.0 ("" when not a PCI device)
    numa: int                      # -1 when the kernel does not say
    ports: list[tuple[int, str, str]] = field(default_factory=list)   # (port, state, rate)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _numa(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        return -1


def pci_chain(address: str, root: str = "/") -> list[str]:
    """The PCIe path of a PCI function: its sysfs directory's components from the root complex
    (pciDDDD:BB) down to the function itself; [] when the address is unknown."""
    link = os.path.join(root, "sys/bus/pci/devices", address.lower())
    if not os.path.exists(link):
        return []
    real = os.path.realpath(link)
    parts = real.split(os.sep)
    for i, p in enumerate(parts):
        if p.startswith("pci") and ":" in p:
            return parts[i:]
    return []


def discover(root: str = "/") -> list[Nic]:
    """Every RDMA device under /sys/class/infiniband, in name order."""
    base = os.path.join(root, "sys/class/infiniband")
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return []
    nics = []
    for name in names:
        dev = os.path.join(base, name, "device")
        pci = os.path.basename(os.path.realpath(dev)) if os.path.exists(dev) else ""
        numa = _numa(_read(os.path.join(dev, "numa_node")))
        ports = []
        pdir = os.path.join(base, name, "ports")
        for port in sorted(os.listdir(pdir), key=lambda p: int(p) if p.isdigit() else 0) if os.path.isdir(pdir) else []:
            state = _read(os.path.join(pdir, port, "state")).split(":")[-1].strip()
            ports.append((int(port) if port.isdigit() else 0, state, _read(os.path.join(pdir, port, "rate"))))
        nics.append(Nic(name, pci, numa, ports))
    return nics


def distance(a: str, b: str, root: str = "/") -> str:
    """How PCIe joins PCI functions a and b (one of CLASSES), from their sysfs paths."""
    pa, pb = pci_chain(a, root), pci_chain(b, root)
    if not pa or not pb:
        return "SYS"
    if pa[0] != pb[0]:                      # different root complexes
        na = _numa(_read(os.path.join(root, "sys/bus/pci/devices", a.lower(), "numa_node")))
        nb = _numa(_read(os.path.join(root, "sys/bus/pci/devices", b.lower(), "numa_node")))
        return "NODE" if na == nb else "SYS"
    common = 0
    while common < min(len(pa), len(pb)) and pa[common] == pb[common]:
        common += 1
    if common <= 2:                         # they meet at the root port or above: the host bridge
        return "PHB"
    return "PIX" if max(len(pa), len(pb)) - common <= 2 else "PXB"


def gpu_addresses() -> list[str]:
    """PCI addresses of the visible GPUs in CUDA's order ([] without GPUs)."""
    try:
        import torch
        if not torch.cuda.is_available():
            return []
        out = []
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            dom, bus, dev = (getattr(p, k, None) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id"))
            if bus is None:
                raise AttributeError("no pci_bus_id")
            out.append(f"{dom or 0:04x}:{bus:02x}:{dev:02x}.0")
        return out
    except (AttributeError, RuntimeError, ImportError):
        pass
    if not shutil.which("nvidia-smi"):
        return []
    try:
        res = subprocess.run(["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return []
    # nvidia-smi prints 00000000:3B:00.0 (an 8-digit domain)
    return [line.strip()[-12:].lower() for line in res.stdout.splitlines() if line.strip()]


def affinity(gpus: list[str], nics: list[Nic], root: str = "/") -> list[list[str]]:
    """[gpu][nic] distance classes."""
    return [[distance(g, n.pci, root) if n.pci else "SYS" for n in nics] for g in gpus]


def home_nics(table: list[list[str]]) -> list[int]:
    """Each GPU's nearest NIC's index (-1 without NICs)."""
    return [min(range(len(row)), key=lambda k: (CLASSES.index(row[k]), k)) if row else -1 for row in table]


def report(root: str = "/", gpus: list[str] | None = None) -> list[str]:
    """The lines `braid topo` prints about NICs."""
    nics = discover(root)
    if not nics:
        return ["NICs: none found under /sys/class/infiniband (no RDMA devices visible here): across "
                "nodes braid's rail groups use whatever NCCL finds (sockets at worst)"]
    lines = [f"NICs: {len(nics)} (/sys/class/infiniband)"]
    for n in nics:
        ports = "; ".join(f"port {p} {s or '?'} {r or ''}".rstrip() for p, s, r in n.ports) or "no ports listed"
        lines.append(f"  {n.name:10s} {n.pci or '-':14s} numa {n.numa if n.numa >= 0 else '?'}  {ports}")
    gpus = gpu_addresses() if gpus is None else gpus
    if gpus:
        table = affinity(gpus, nics, root)
        lines.append("GPU -> NIC (PIX one PCIe switch, PXB several bridges, PHB host bridge, NODE same NUMA "
                     "node, SYS across NUMA nodes):")
        lines.append("        " + "".join(f"{n.name:>10s}" for n in nics) + "   home NIC")
        for g, (addr, row) in enumerate(zip(gpus, table)):
            home = nics[home_nics([row])[0]].name
            lines.append(f"  GPU{g:<3d} " + "".join(f"{c:>10s}" for c in row) + f"   {home}  ({addr})")
    return lines
