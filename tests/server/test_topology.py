"""The start-up topology report (ddtree_serve/server/topology.py) on given facts: NVLink, PCIe behind a switch,
PCIe across root ports with missing peer access, the IOMMU and NCCL settings; and the nvidia-smi parser."""

from __future__ import annotations

from ddtree_serve.server.topology import Topology, topology_report


def _topo(n: int, link: str, p2p: bool = True, cmdline: str = "", env: dict | None = None) -> Topology:
    return Topology(("RTX PRO 6000",) * n, tuple(tuple(p2p or i == j for j in range(n)) for i in range(n)),
                    tuple(tuple("X" if i == j else link for j in range(n)) for i in range(n)), cmdline, env or {})


def test_nvlink_box_gets_no_warning() -> None:
    info, warn = topology_report(_topo(8, "NV18"))
    assert "NVLink between every pair" in " ".join(info) and not warn


def test_pcie_switch_with_iommu_passthrough_is_quiet_and_translated_warns() -> None:
    info, warn = topology_report(_topo(4, "PIX", cmdline="BOOT_IMAGE=x iommu=pt"))
    assert "PCIe (PIX" in " ".join(info) and not warn
    _, warn = topology_report(_topo(4, "PIX", cmdline="BOOT_IMAGE=x"))
    assert len(warn) == 1 and "IOMMU" in warn[0]


def test_missing_peer_access_warns_unless_p2p_is_disabled() -> None:
    info, warn = topology_report(_topo(2, "SYS", p2p=False))
    assert "missing for 2 of 2" in " ".join(info)
    assert any("NCCL_P2P_DISABLE=1" in w for w in warn) and any("NODE/SYS" in w for w in warn)
    info, warn = topology_report(_topo(2, "SYS", p2p=False, env={"NCCL_P2P_DISABLE": "1"}))
    assert not any("peer access is missing" in w for w in warn)
    assert "NCCL environment: NCCL_P2P_DISABLE=1" in info


def test_unknown_links_without_nvidia_smi() -> None:
    t = Topology(("H200",) * 2, ((True, True), (True, True)), None, "", {})
    info, warn = topology_report(t)
    assert "links: unknown" in " ".join(info) and not warn
