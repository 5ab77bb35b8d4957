"""NIC discovery and GPU -> NIC distances from a sysfs tree built in a temporary folder (two NUMA
nodes, two PCIe switches on one root port, NICs beside GPUs as on an 8-GPU server)."""
from __future__ import annotations

import os

from braid import nics


def _dev(root, chain, numa):
    """Create /sys/devices/<chain...> and /sys/bus/pci/devices/<function> -> it."""
    path = os.path.join(root, "sys/devices", *chain)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "numa_node"), "w") as f:
        f.write(f"{numa}\n")
    bus = os.path.join(root, "sys/bus/pci/devices")
    os.makedirs(bus, exist_ok=True)
    os.symlink(path, os.path.join(bus, chain[-1]))
    return chain[-1]


def _ib(root, name, pci_chain, numa, state="4: ACTIVE", rate="400 Gb/sec (4X NDR)"):
    addr = _dev(root, pci_chain, numa)
    d = os.path.join(root, "sys/class/infiniband", name)
    os.makedirs(os.path.join(d, "ports/1"))
    os.symlink(os.path.join(root, "sys/devices", *pci_chain), os.path.join(d, "device"))
    for k, v in (("state", state), ("rate", rate)):
        with open(os.path.join(d, "ports/1", k), "w") as f:
            f.write(v + "\n")
    return addr


def _machine(root):
    # socket 0: root port 00:01.0 -> switch 01:00.0 -> ports 02:08.0 (GPU0), 02:10.0 (NIC0),
    #           and a second switch behind 02:18.0 -> 04:00.0 -> 05:08.0 (GPU1)
    # root port 00:02.0 -> GPU2 directly (another root port, same root complex)
    # socket 1: root complex pci0000:80 -> 80:01.0 -> 81:00.0 -> 82:08.0 (NIC1)
    sw = ["pci0000:00", "0000:00:01.0", "0000:01:00.0"]
    g0 = _dev(root, sw + ["0000:02:08.0", "0000:03:00.0"], 0)
    g1 = _dev(root, sw + ["0000:02:18.0", "0000:04:00.0", "0000:05:08.0", "0000:06:00.0"], 0)
    g2 = _dev(root, ["pci0000:00", "0000:00:02.0", "0000:07:00.0"], 0)
    _ib(root, "mlx5_0", sw + ["0000:02:10.0", "0000:08:00.0"], 0)
    _ib(root, "mlx5_1", ["pci0000:80", "0000:80:01.0", "0000:81:00.0", "0000:82:08.0", "0000:83:00.0"], 1,
        state="1: DOWN", rate="")
    return [g0, g1, g2]


def test_discover_and_distances(tmp_path):
    root = str(tmp_path)
    gpus = _machine(root)
    found = nics.discover(root)
    assert [n.name for n in found] == ["mlx5_0", "mlx5_1"]
    assert found[0].pci == "0000:08:00.0" and found[0].numa == 0 and found[1].numa == 1
    assert found[0].ports == [(1, "ACTIVE", "400 Gb/sec (4X NDR)")] and found[1].ports[0][1] == "DOWN"
    table = nics.affinity(gpus, found, root)
    assert table[0] == ["PIX", "SYS"]        # same switch; other socket
    assert table[1] == ["PXB", "SYS"]        # behind a second switch
    assert table[2] == ["PHB", "SYS"]        # another root port of the same root complex
    assert nics.home_nics(table) == [0, 0, 0]
    # a GPU and a NIC under the root complexes of two NUMA nodes
    assert nics.distance("0000:03:00.0", "0000:83:00.0", root) == "SYS"


def test_home_nic_prefers_the_nearest_then_the_lowest_index():
    assert nics.home_nics([["SYS", "PIX", "PIX"], ["PHB", "NODE", "PXB"], []]) == [1, 2, -1]


def test_report_lines(tmp_path):
    root = str(tmp_path)
    gpus = _machine(root)
    lines = nics.report(root, gpus=gpus)
    text = "\n".join(lines)
    assert lines[0] == "NICs: 2 (/sys/class/infiniband)"
    assert "mlx5_0     0000:08:00.0   numa 0  port 1 ACTIVE 400 Gb/sec (4X NDR)" in text
    assert "GPU0" in text and "home NIC" in text and text.count("mlx5_0  (") == 3


def test_no_nics_is_said_not_an_error(tmp_path):
    lines = nics.report(str(tmp_path), gpus=[])
    assert len(lines) == 1 and lines[0].startswith("NICs: none found")
    assert nics.discover(str(tmp_path)) == [] and nics.pci_chain("0000:00:00.0", str(tmp_path)) == []
