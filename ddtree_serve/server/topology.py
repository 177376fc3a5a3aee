"""The GPU topology a TP server starts on, and the NCCL settings it calls for (docs/DEPLOY.md, "PCIe hosts").

``probe_topology`` reads the facts (CUDA peer access between every pair of the local GPUs; the link matrix of
``nvidia-smi topo -m`` when the tool exists; the kernel command line's IOMMU setting; the ``NCCL_*``
environment); ``topology_report`` turns facts into log lines and warnings, a pure function tested on CPU with
given facts. Start-up logs both on CUDA with more than one local rank (ddtree_serve/server/scheduling/
scheduler_factory.py), before NCCL's first collective, where a platform that breaks peer traffic would hang.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

NVLINK_PREFIX = "NV"  # nvidia-smi topo -m: NV# = that many NVLinks between the pair
PCIE_LINKS = ("PIX", "PXB", "PHB", "NODE", "SYS")  # one switch, several switches, host bridge, root ports, sockets


@dataclass(frozen=True)
class Topology:
    """Facts about the local GPUs: ``names[i]``; ``p2p[i][j]`` CUDA peer access; ``links[i][j]`` the
    ``nvidia-smi topo -m`` entry (None without the tool); the kernel command line; the NCCL environment."""

    names: tuple[str, ...]
    p2p: tuple[tuple[bool, ...], ...]
    links: tuple[tuple[str, ...], ...] | None = None
    cmdline: str = ""
    nccl_env: Mapping[str, str] = field(default_factory=dict)


def _pairs(n: int) -> list[tuple[int, int]]:
    return [(i, j) for i in range(n) for j in range(n) if i != j]


def topology_report(t: Topology) -> tuple[list[str], list[str]]:
    """(info lines, warnings). Warnings: a pair without peer access (NCCL falls back to host memory, or hangs
    where the platform redirects peer writes) and no ``NCCL_P2P_DISABLE``; PCIe links with an IOMMU left in
    translated mode; PCIe links across root ports or sockets (slower all-reduces: keep the verify batch
    small, the PCIe preset's bound)."""
    n = len(t.names)
    info = [f"GPU topology: {n} local GPUs ({', '.join(sorted(set(t.names)))})"]
    warn: list[str] = []
    no_p2p = [(i, j) for i, j in _pairs(n) if not t.p2p[i][j]]
    info.append("peer access: " + ("every pair" if not no_p2p else
                                   f"missing for {len(no_p2p)} of {len(_pairs(n))} ordered pairs"))
    kinds: set[str] = set()
    if t.links is not None:
        kinds = {t.links[i][j] for i, j in _pairs(n)}
        nvlink = all(k.startswith(NVLINK_PREFIX) for k in kinds)
        info.append("links: " + ("NVLink between every pair" if nvlink else
                                 f"PCIe ({', '.join(sorted(kinds))}; nvidia-smi topo -m)"))
    else:
        info.append("links: unknown (no nvidia-smi)")
    pcie = t.links is None or any(k in PCIE_LINKS for k in kinds)
    p2p_off = t.nccl_env.get("NCCL_P2P_DISABLE", "0") not in ("", "0")
    if no_p2p and not p2p_off:
        warn.append(f"CUDA peer access is missing between {len(no_p2p)} GPU pairs (e.g. {no_p2p[0]}): NCCL's "
                    "first all-reduce may hang on this platform. Fix the platform (IOMMU passthrough, ACS off: "
                    "docs/DEPLOY.md 'PCIe hosts') or set NCCL_P2P_DISABLE=1 (through host memory, slower)")
    iommu_translated = not any(w in t.cmdline.split() for w in ("iommu=pt", "amd_iommu=off", "intel_iommu=off"))
    if pcie and not no_p2p and t.links is not None and iommu_translated and not p2p_off:
        warn.append("PCIe peer traffic with the IOMMU in translated mode (no iommu=pt / amd_iommu=off / "
                    "intel_iommu=off on the kernel command line): it can intercept peer writes and hang NCCL; "
                    "run benchmarks/allreduce_check.py before serving (docs/DEPLOY.md 'PCIe hosts')")
    if kinds & {"NODE", "SYS"}:
        warn.append("GPU pairs cross root ports or sockets (NODE/SYS): all-reduces are slower there; keep "
                    "speculative_ddtree_max_budget low (the PCIe preset's 32)")
    if t.nccl_env:
        info.append("NCCL environment: " + " ".join(f"{k}={v}" for k, v in sorted(t.nccl_env.items())))
    return info, warn


def _nvidia_smi_links(n: int) -> tuple[tuple[str, ...], ...] | None:
    """The GPU x GPU block of ``nvidia-smi topo -m`` (None when the tool is missing or its output unexpected)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [line.split() for line in out.splitlines() if line.startswith("GPU")]
    rows = [r for r in rows if len(r) > n and r[0][3:].isdigit()][:n]
    if len(rows) != n:
        return None
    return tuple(tuple(r[1:n + 1]) for r in rows)


def probe_topology(n: int) -> Topology:
    """The facts of this machine's first ``n`` CUDA devices."""
    import torch

    names = tuple(torch.cuda.get_device_name(i) for i in range(n))
    p2p = tuple(tuple(i == j or torch.cuda.can_device_access_peer(i, j) for j in range(n)) for i in range(n))
    try:
        with open("/proc/cmdline") as f:
            cmdline = f.read()
    except OSError:
        cmdline = ""
    nccl = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
    return Topology(names, p2p, _nvidia_smi_links(n), cmdline, nccl)


def log_topology(n: int) -> None:
    """Probe and log the topology of ``n`` local GPUs (start-up, CUDA, more than one local rank)."""
    info, warn = topology_report(probe_topology(n))
    for line in info:
        logger.info(line)
    for line in warn:
        logger.warning(line)
