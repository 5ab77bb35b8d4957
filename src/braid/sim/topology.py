"""Modelled machines: presets (JSON in `presets/`), generated clusters, and the router's view.

A preset names its shape (nodes, GPUs per node, `nvswitch` or `mesh` fabric, NICs per node) and
a set of constants, each an object {value, unit, source}: the source is a spec sheet, a paper's
figure, a measurement on the 2 and 4 x H200 machines (device probes of 2026-11-22, or a bench
run in bench_results/), or a stated assumption. One set per
testbed; nothing in the simulator changes them per experiment.

Links (capacities in GB/s, per direction):
    nv_out{g}, nv_in{g}   a GPU's NVLink port toward the switch (nvswitch fabric)
    nv{a}-{b}             the direct link from GPU a to GPU b (mesh fabric)
    d2h{g}, h2d{g}        a GPU's PCIe toward host memory and back; pcie{g} both together
    pcie_up{g}, pcie_dn{g}  a GPU's PCIe x16 where the preset gives one rate for everything on it
    host_mem              host memory, crossed once by every staged byte in and once out
    nic_tx{node}.{k}, nic_rx{node}.{k}   NIC k of a node
    relay{g}              a virtual link: the store-and-forward pipeline through GPU g's relay
                          buffer (its capacity is the pipeline's rate, flow.pipeline_rate_gbps);
                          mesh fabrics only (on a switch a relay adds no NVLink bandwidth)
    nicrelay{g}           the same for a borrowed NIC: NVLink into g's buffer, g's NIC, NVLink
                          out of the peer's buffer on the far side (three stages)

`to_router()` builds a `braid.planner.router.Topology` from a preset, so the router plans over the
same links and capacities the flow model runs; it is the only path model in the simulator.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from importlib import resources

from ..planner import checks
from ..planner.checks import MisuseError
from ..planner.router import Path, Topology
from .busbw import algbytes, bus_factor
from .flow import pipeline_rate_gbps

PRESETS = ("h800x8-flexlink", "hopper8-8nic-fuselink", "h100x4-mesh-4rail-nimble", "h200x4", "h200x2")


@dataclass
class SimTopology:
    name: str
    nodes: int
    gpus_per_node: int
    fabric: str                       # "nvswitch" or "mesh"
    nics_per_node: int
    constants: dict[str, dict]        # name -> {value, unit, source}
    summary: str = ""
    nccl_busbw: dict[str, dict] = field(default_factory=dict)   # measured NCCL per op (own machines)

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def c(self, key: str) -> float:
        try:
            return self.constants[key]["value"]
        except KeyError:
            raise KeyError(f"preset {self.name!r} has no constant {key!r}") from None

    def has(self, key: str) -> bool:
        return key in self.constants

    def node_of(self, gpu: int) -> int:
        return gpu // self.gpus_per_node

    def nic_owner(self, node: int, k: int) -> int:
        """The GPU whose PCIe switch holds NIC k of a node (NICs spread evenly over the GPUs)."""
        return node * self.gpus_per_node + k * self.gpus_per_node // self.nics_per_node

    def home_nic(self, gpu: int) -> int:
        """The NIC nearest a GPU (its own, or the one it shares when there are fewer NICs)."""
        return (gpu % self.gpus_per_node) * self.nics_per_node // self.gpus_per_node

    def nccl_measured_us(self, op: str, world: int, nbytes: float) -> float | None:
        """NCCL's time from the preset's measured bus bandwidths (own machines), linear in bytes
        between the measured sizes and along the last segment beyond them; None if not measured
        (the op is not in the table, or `world` is not the preset's GPU count: the table was
        measured on every GPU of the machine)."""
        seg = self.nccl_measured_segment(op, world, nbytes)
        return None if seg is None else seg[0] + nbytes / (seg[1] * 1e3)

    def nccl_measured_segment(self, op: str, world: int, nbytes: float) -> tuple[float, float] | None:
        """The measured table's straight segment under `nbytes` as (intercept us, op bytes per us
        / 1e3 = GB/s of op bytes): time = intercept + nbytes / rate. Below the first measured size
        the segment goes through zero; beyond the last it extends the last one."""
        table = self.nccl_busbw.get(op)
        if not table or world != self.num_gpus:
            return None
        pts = [(mib << 20, algbytes(op, world, mib << 20) * bus_factor(op, world) / (bw * 1e3))
               for mib, bw in table["points_mib_gbps"]]
        if nbytes <= pts[0][0]:
            return 0.0, pts[0][0] / pts[0][1] / 1e3
        for (a, ta), (b, tb) in zip(pts, pts[1:]):
            if nbytes <= b or (a, ta) == pts[-2]:
                rate = (b - a) / (tb - ta) / 1e3
                return ta - a / (rate * 1e3), rate
        return 0.0, pts[-1][0] / pts[-1][1] / 1e3          # one measured size: through zero

    def sources(self) -> list[tuple[str, object, str, str]]:
        return [(k, v["value"], v.get("unit", ""), v["source"]) for k, v in self.constants.items()]

    def with_shape(self, nodes: int | None = None, nics_per_node: int | None = None, name: str | None = None) -> "SimTopology":
        out = copy.deepcopy(self)
        out.nodes = nodes if nodes is not None else self.nodes
        out.nics_per_node = nics_per_node if nics_per_node is not None else self.nics_per_node
        out.name = name or out.name
        _check_shape(out)
        return out

    # ---- links -----------------------------------------------------------------------------
    def capacity(self) -> dict[str, float]:
        cap: dict[str, float] = {}
        n = self.num_gpus
        if self.fabric == "nvswitch" and self.has("nvlink_gbps"):
            for g in range(n):
                cap[f"nv_out{g}"] = cap[f"nv_in{g}"] = self.c("nvlink_gbps")
        if self.fabric == "mesh":
            for a in range(n):
                for b in range(n):
                    if a != b and self.node_of(a) == self.node_of(b):
                        cap[f"nv{a}-{b}"] = self.c("pair_gbps")
        if self.has("pcie_gbps"):          # FlexLink: one x16 per GPU under the host lane and the NIC
            for g in range(n):
                cap[f"pcie_up{g}"] = cap[f"pcie_dn{g}"] = self.c("pcie_gbps")
        if self.has("d2h_gbps"):
            for g in range(n):
                cap[f"d2h{g}"] = self.c("d2h_gbps")
                cap[f"h2d{g}"] = self.c("h2d_gbps")
                cap[f"pcie{g}"] = self.c("pcie_duplex_gbps")
            cap["host_mem"] = self.c("host_mem_gbps")
        for a in range(self.nodes):
            for k in range(self.nics_per_node):
                if self.has("nic_gbps"):
                    cap[f"nic_tx{a}.{k}"] = cap[f"nic_rx{a}.{k}"] = self.c("nic_gbps")
        intra, nic = self.relay_rate_gbps(), self.relay_rate_gbps(nic=True)
        for g in range(n):
            if intra and self.fabric == "mesh":
                cap[f"relay{g}"] = intra
            if nic and self.nics_per_node:
                cap[f"nicrelay{g}"] = nic
        return cap

    def nv_links(self, a: int, b: int) -> tuple[tuple[str, float], ...]:
        """The NVLink hop from GPU a to GPU b of the same node."""
        if self.fabric == "mesh":
            return ((f"nv{a}-{b}", 1.0),)
        return ((f"nv_out{a}", 1.0), (f"nv_in{b}", 1.0))

    def relay_rate_gbps(self, hops: int = 2, nic: bool = False) -> float | None:
        """The rate of one relay pipeline (bounded buffer on the relay GPU, chunks in flight), or
        None when the preset does not model relays."""
        if self.has("relay_window"):        # NIMBLE: W chunks in flight, a handshake per hop
            nv = self.c("pair_gbps")
            stages = [nv, self.c("nic_gbps"), nv] if nic else [nv] * hops
            return pipeline_rate_gbps(stages, int(self.c("relay_window")), self.c("relay_chunk_bytes"),
                                      self.c("relay_hop_us") * len(stages))
        if self.has("borrowed_inflight_cap"):   # FuseLink: borrowed NIC, NVLink on both sides
            if not nic:
                return None
            nv = self.c("nvlink_relay_gbps")
            return pipeline_rate_gbps([nv, self.c("nic_gbps"), nv], int(self.c("borrowed_inflight_cap")),
                                      self.c("relay_chunk_bytes"), self.c("control_us"))
        return None


def _check_shape(t: SimTopology) -> None:
    """nodes and GPUs per node >= 1, NICs per node >= 0 (a single node needs none; more nodes
    talk only through NICs), a known fabric."""
    checks.whole(t.nodes, f"preset {t.name!r}: nodes", 1)
    checks.whole(t.gpus_per_node, f"preset {t.name!r}: gpus_per_node", 1)
    checks.whole(t.nics_per_node, f"preset {t.name!r}: nics_per_node", 0)
    if t.nodes > 1 and t.nics_per_node == 0:
        raise MisuseError(f"preset {t.name!r}: {t.nodes} nodes with nics_per_node = 0; nodes reach each other "
                          f"only through NICs, so give at least 1 NIC per node (or use 1 node)")
    if t.fabric not in ("nvswitch", "mesh"):
        raise MisuseError(f"preset {t.name!r}: fabric = {t.fabric!r}; must be 'nvswitch' or 'mesh'")


def _from_dict(obj: dict) -> SimTopology:
    for k, v in obj["constants"].items():
        if not isinstance(v, dict) or not str(v.get("source", "")).strip() or "value" not in v:
            raise ValueError(f"preset {obj.get('name')!r}: constant {k!r} needs a value and a source")
    t = SimTopology(obj["name"], obj["nodes"], obj["gpus_per_node"], obj["fabric"],
                    obj["nics_per_node"], obj["constants"], obj.get("summary", ""),
                    obj.get("nccl_busbw", {}))
    _check_shape(t)
    return t


def preset_text(name: str) -> str:
    if name not in PRESETS:
        raise ValueError(f"unknown simulator preset {name!r}; known: {', '.join(PRESETS)} "
                         f"(and cluster(nodes, nics) for N x 8 GPUs)")
    return resources.files("braid.sim").joinpath("presets", f"{name}.json").read_text()


def load(name: str) -> SimTopology:
    """A preset shipped in the package (braid/sim/presets/NAME.json)."""
    return _from_dict(json.loads(preset_text(name)))


def cluster(nodes: int, nics: int = 8) -> SimTopology:
    """N nodes x 8 Hopper GPUs on NVSwitch with 1, 4 or 8 NICs per node: FuseLink's testbed
    constants (NVLink, 400 Gb/s NICs, relay pipeline), repeated."""
    nics = checks.whole(nics, "cluster: nics (NICs per node)", 1, "1, 2, 4 or 8")
    if nics not in (1, 2, 4, 8):
        raise MisuseError(f"cluster: nics = {nics}: NICs per node must divide 8 (1, 2, 4 or 8)")
    nodes = checks.whole(nodes, "cluster: nodes", 1)
    return load("hopper8-8nic-fuselink").with_shape(nodes, nics, f"{nodes}x8-hopper-{nics}nic")


# -------------------------------------------------------------------------------------------------
# the router's view
# -------------------------------------------------------------------------------------------------

def to_router(topo: SimTopology, relays: bool = True, host: bool = False, max_rails: int | None = None,
              max_relays: int | None = None) -> Topology:
    """A router Topology over the preset's links. Candidate paths, first = the single path a
    one-path library (NCCL with PXN) would take:
      same node: direct, then relays through each other GPU of the node (at most `max_relays`),
                 then host-staged (PCIe, host memory, PCIe) when `host`;
      across nodes: first the NIC of the destination's rail (PXN: NVLink to the GPU of that rail,
                 NIC to NIC, straight into the destination), then every other rail (at most
                 `max_rails` in all), reaching a NIC owned by another GPU through its relay buffer.
    Relay paths cross the virtual link relay{g} / nicrelay{g} of every GPU they pass through (the
    bounded store-and-forward pipeline), so the router balances over effective, not raw, path
    rates. `max_relays` limits the intra-node relays offered (NIMBLE's 0/1/2-relay experiment)."""
    if max_rails is not None:
        checks.whole(max_rails, "to_router: max_rails", 1, "None offers every rail")
    if max_relays is not None:
        checks.whole(max_relays, "to_router: max_relays", 0, "None offers every relay")
    cap = topo.capacity()
    n = topo.num_gpus
    out = Topology(topo.name, n, cap, source="braid.sim preset " + topo.name)
    relay_ok = relays and any(k.startswith("relay") for k in cap)
    nic_relay_ok = any(k.startswith("nicrelay") for k in cap)
    g_per = topo.gpus_per_node
    for s in range(n):
        for d in range(n):
            if s == d:
                continue
            sa, da = topo.node_of(s), topo.node_of(d)
            paths: list[Path] = []
            if sa == da:
                paths.append(Path("direct", topo.nv_links(s, d)))
                if relays:
                    ms = [m for m in range(sa * g_per, (sa + 1) * g_per) if m not in (s, d)]
                    for m in ms[:max_relays]:
                        links = topo.nv_links(s, m) + topo.nv_links(m, d)
                        if relay_ok:
                            links += ((f"relay{m}", 1.0),)
                        paths.append(Path("relay", links, (m,)))
                if host and "host_mem" in cap:
                    paths.append(Path("host", ((f"d2h{s}", 1.0), (f"pcie{s}", 1.0), ("host_mem", 2.0),
                                               (f"h2d{d}", 1.0), (f"pcie{d}", 1.0))))
            else:
                if topo.nics_per_node == 0:
                    raise ValueError(f"{topo.name}: GPUs {s} and {d} are on different nodes and there is no NIC")
                home = topo.home_nic(d)
                ks = [home] + [k for k in range(topo.nics_per_node) if k != home]
                ks = ks[:max_rails]
                for k in ks:
                    o_s, o_d = topo.nic_owner(sa, k), topo.nic_owner(da, k)
                    borrowed = nic_relay_ok and k != home   # the home rail is NCCL's PXN path: deep pipeline
                    links: tuple[tuple[str, float], ...] = ()
                    if o_s != s:
                        links += topo.nv_links(s, o_s) + (((f"nicrelay{o_s}", 1.0),) if borrowed else ())
                    links += ((f"nic_tx{sa}.{k}", 1.0), (f"nic_rx{da}.{k}", 1.0))
                    if o_d != d:
                        links += topo.nv_links(o_d, d) + (((f"nicrelay{o_d}", 1.0),) if borrowed else ())
                    paths.append(Path("rail", links, (k,)))
            out.paths[(s, d)] = paths
    return out
