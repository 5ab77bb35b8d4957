"""Topology builders: one NVSwitch node, one directly wired (mesh) node, N NVSwitch nodes joined by
NIC rails, and presets by name. Pure Python, no torch."""
from __future__ import annotations

from . import checks
from .checks import MisuseError
from .paths import Path, Topology


def nvswitch(n: int, nvlink_gbps: float = 390.0, pcie_gbps: float = 53.0, host_gbps: float | None = None,
             relays: bool = True, name: str | None = None, source: str = "") -> Topology:
    """n GPUs on an NVSwitch: every GPU has one NVLink port out and one in; PCIe to host memory.
    n >= 1 (one GPU: a topology with no pairs); rates in GB/s, finite and > 0; host_gbps None means
    pcie_gbps * n."""
    n = checks.whole(n, "nvswitch: n (GPUs on the switch)", 1)
    checks.rate(nvlink_gbps, "nvswitch: nvlink_gbps")
    checks.rate(pcie_gbps, "nvswitch: pcie_gbps")
    if host_gbps is not None:
        checks.rate(host_gbps, "nvswitch: host_gbps", "GB/s through host memory, or None for pcie_gbps * n")
    cap: dict[str, float] = {}
    for g in range(n):
        cap[f"nv_out{g}"] = nvlink_gbps
        cap[f"nv_in{g}"] = nvlink_gbps
        cap[f"d2h{g}"] = pcie_gbps
        cap[f"h2d{g}"] = pcie_gbps
    host_gbps = host_gbps or pcie_gbps * n
    cap["host_mem"] = host_gbps                  # staged bytes cross host memory twice: weight 2
    topo = Topology(name or f"nvswitch{n}", n, cap, source=source)
    for s in range(n):
        for d in range(n):
            if s == d:
                continue
            ps = [Path("direct", ((f"nv_out{s}", 1.0), (f"nv_in{d}", 1.0)))]
            if relays:
                ps += [Path("relay", ((f"nv_out{s}", 1.0), (f"nv_in{m}", 1.0), (f"nv_out{m}", 1.0), (f"nv_in{d}", 1.0)), (m,))
                       for m in range(n) if m not in (s, d)]
            ps.append(Path("host", ((f"d2h{s}", 1.0), ("host_mem", 2.0), (f"h2d{d}", 1.0))))
            topo.paths[(s, d)] = ps
    return topo


def mesh(n: int, pair_gbps: float = 120.0, pcie_gbps: float = 50.0, host_gbps: float | None = None,
         name: str | None = None, source: str = "") -> Topology:
    """n GPUs wired directly to each other (a link per ordered pair), plus PCIe to host memory.
    n >= 1; rates in GB/s, finite and > 0; host_gbps None means pcie_gbps * n."""
    n = checks.whole(n, "mesh: n (GPUs)", 1)
    checks.rate(pair_gbps, "mesh: pair_gbps")
    checks.rate(pcie_gbps, "mesh: pcie_gbps")
    if host_gbps is not None:
        checks.rate(host_gbps, "mesh: host_gbps", "GB/s through host memory, or None for pcie_gbps * n")
    cap: dict[str, float] = {}
    for a in range(n):
        cap[f"d2h{a}"] = pcie_gbps
        cap[f"h2d{a}"] = pcie_gbps
        for b in range(n):
            if a != b:
                cap[f"nv{a}-{b}"] = pair_gbps
    cap["host_mem"] = host_gbps or pcie_gbps * n
    topo = Topology(name or f"mesh{n}", n, cap, source=source)
    for s in range(n):
        for d in range(n):
            if s == d:
                continue
            ps = [Path("direct", ((f"nv{s}-{d}", 1.0),))]
            ps += [Path("relay", ((f"nv{s}-{m}", 1.0), (f"nv{m}-{d}", 1.0)), (m,)) for m in range(n) if m not in (s, d)]
            ps.append(Path("host", ((f"d2h{s}", 1.0), ("host_mem", 2.0), (f"h2d{d}", 1.0))))
            topo.paths[(s, d)] = ps
    return topo


def multi_node(nodes: int, gpus_per_node: int = 8, nics: int = 8, nic_gbps: float = 50.0,
               nvlink_gbps: float = 390.0, name: str | None = None, source: str = "") -> Topology:
    """`nodes` NVSwitch nodes; NIC k of a node belongs to GPU k * gpus_per_node // nics. Inside a
    node: direct and one-relay NVLink paths. Across nodes: one path per rail k (rail-matched: NIC k
    to NIC k), reaching the rail's owner GPU over NVLink when the endpoint is another GPU.
    nodes, gpus_per_node and nics >= 1 (the NICs are the only way between nodes, and every NIC
    needs an owner GPU); rates in GB/s, finite and > 0. Two or more nodes give a cluster topology
    (planner.cluster): its paths are built on demand, and route() plans it hierarchically above
    planner.hier.FLAT_MAX_GPUS GPUs."""
    nodes = checks.whole(nodes, "multi_node: nodes", 1)
    G = checks.whole(gpus_per_node, "multi_node: gpus_per_node", 1)
    nics = checks.whole(nics, "multi_node: nics (NICs per node)", 1, "the NICs are the only links between nodes")
    checks.rate(nic_gbps, "multi_node: nic_gbps")
    checks.rate(nvlink_gbps, "multi_node: nvlink_gbps")
    name = name or f"{nodes}x{G}gpu-{nics}nic"

    def links(a: int) -> dict[str, float]:
        cap = {}
        for g in range(a * G, (a + 1) * G):
            cap[f"nv_out{g}"] = nvlink_gbps
            cap[f"nv_in{g}"] = nvlink_gbps
        for k in range(nics):
            cap[f"nic_tx{a}.{k}"] = nic_gbps
            cap[f"nic_rx{a}.{k}"] = nic_gbps
        return cap

    def owner(node: int, k: int) -> int:
        return node * G + k * G // nics

    def intra(a: int, i: int, j: int) -> list[Path]:
        s, d = a * G + i, a * G + j
        return [Path("direct", ((f"nv_out{s}", 1.0), (f"nv_in{d}", 1.0)))] + [
            Path("relay", ((f"nv_out{s}", 1.0), (f"nv_in{m}", 1.0), (f"nv_out{m}", 1.0), (f"nv_in{d}", 1.0)), (m,))
            for m in range(a * G, (a + 1) * G) if m not in (s, d)]

    def rail(sa: int, i: int, da: int, j: int, k: int) -> Path:
        s, d = sa * G + i, da * G + j
        links_: list[tuple[str, float]] = []
        o_s, o_d = owner(sa, k), owner(da, k)
        if o_s != s:
            links_ += [(f"nv_out{s}", 1.0), (f"nv_in{o_s}", 1.0)]
        links_ += [(f"nic_tx{sa}.{k}", 1.0), (f"nic_rx{da}.{k}", 1.0)]
        if o_d != d:
            links_ += [(f"nv_out{o_d}", 1.0), (f"nv_in{d}", 1.0)]
        return Path("rail", tuple(links_), (k,))

    if nodes >= 2:
        from .cluster import Cluster, topology
        cl = Cluster(nodes, G, nics, links, intra, rail, lambda i, j: range(nics),
                     [i * nics // G for i in range(G)])
        return topology(name, cl, source)
    topo = Topology(name, G, links(0), source=source)
    for i in range(G):
        for j in range(G):
            if i != j:
                topo.paths[(i, j)] = intra(0, i, j)
    return topo


def preset(name: str, nodes: int = 1, nics: int = 8) -> Topology:
    """Topologies by name: the 2 and 4 x H200 machines braid was measured on, and synthetic ones.
    `nodes` and `nics` (per node) are used by "multinode" only, but must be >= 1 whatever the name."""
    if not isinstance(name, str):
        raise MisuseError(f"preset: name = {name!r} is not a topology name; pass one of h200x2, h200x4, "
                          f"mesh4, nvswitchN (N GPUs, e.g. nvswitch8), multinode")
    nodes = checks.whole(nodes, "preset: nodes", 1, "the number of 8-GPU nodes")
    nics = checks.whole(nics, "preset: nics", 1, "NICs (rails) per node")
    if name == "h200x2":
        return nvswitch(2, 390.0, 53.0, 136.0, name=name,
                        source="probes on 2 and 4 x H200, 2026-11-22: copy engine 387-396 GB/s, PCIe pair 53, "
                               "host total 136 (2 GPUs)")
    if name == "h200x4":
        return nvswitch(4, 390.0, 53.0, 163.0, name=name,
                        source="probes on 4 x H200 (NVSwitch), 2026-11-22: copy engine 389-396 GB/s, PCIe 53-55, "
                               "host total 163")
    if name == "mesh4":
        return mesh(4, 120.0, 50.0, name=name, source="NIMBLE testbed (arXiv 2604.00317): 120 GB/s direct per pair")
    if name.startswith("nvswitch") and name[8:].isdigit():
        return nvswitch(int(name[8:]), name=name, source="H200-class NVLink 390 GB/s, PCIe 53 GB/s")
    if name == "multinode":
        return multi_node(nodes, 8, nics, source="8 GPUs per node, 400 Gb/s (50 GB/s) NICs")
    raise MisuseError(f"unknown topology {name!r}: h200x2, h200x4, mesh4, nvswitchN (N GPUs, e.g. nvswitch8), "
                      f"multinode")

