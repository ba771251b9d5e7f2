"""What a site's network is, as its agent can see it: RDMA devices in sysfs and `nvidia-smi topo -m`
on the agent's machine (local sites), the nodes' feature labels and allocatable RDMA resources on
Kubernetes. What cannot be seen is reported as unknown (null, or kind `unknown`): a container without
/sys/class/infiniband mounted, a cluster without Node Feature Discovery, a machine without
nvidia-smi. The agent reports; the provider declares `spec.fabric` (the planner and NCCL read that).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from layers.resource.schemas import FabricReport

__all__ = ["RDMA_LABELS", "local_fabric", "nodes_fabric", "nvlink_from_topo"]

SYS_CLASS = Path("/sys/class")
SYS_MODULE = Path("/sys/module")
PEERMEM_MODULES = ("nvidia_peermem", "nv_peer_mem")  # GPUDirect RDMA through the HCA
RDMA_LABELS = ("feature.node.kubernetes.io/rdma.available", "feature.node.kubernetes.io/rdma.capable")
NFD_PREFIX = "feature.node.kubernetes.io/"  # Node Feature Discovery runs when nodes carry its labels
RDMA_RESOURCE_PREFIXES = ("rdma/", "nvidia.com/hostdev", "nvidia.com/rdma")  # RDMA device plugins
TOPO_TIMEOUT = 5.0


def _link_layers(device: Path) -> set[str]:
    layers = set()
    for port in sorted((device / "ports").glob("*")):
        try:
            layers.add((port / "link_layer").read_text().strip())
        except OSError:
            continue
    return layers


def local_fabric(sys_class: Path = SYS_CLASS, sys_module: Path = SYS_MODULE,
                 topo: str | None = None) -> FabricReport:
    """This machine's RDMA devices (their ports' link layer: InfiniBand, or Ethernet for RoCE), a loaded
    GPUDirect RDMA module, and NVLink from `topo` (`nvidia-smi topo -m`'s text; read here when None)."""
    ib = sys_class / "infiniband"
    if not sys_class.is_dir():
        return FabricReport(kind="unknown", source=f"{sys_class} is not readable here")
    devices = sorted(ib.iterdir()) if ib.is_dir() else []
    hcas = [d.name for d in devices]
    layers = set().union(*(_link_layers(d) for d in devices)) if devices else set()
    if not devices:
        kind, seen = "ethernet", f"no RDMA device in {ib}"
    elif "InfiniBand" in layers:
        kind, seen = "infiniband", f"{ib}: link layer InfiniBand"
    elif layers == {"Ethernet"}:
        kind, seen = "roce", f"{ib}: link layer Ethernet (RoCE)"
    else:
        kind, seen = "unknown", f"{ib}: devices without a readable link layer"
    peermem = any((sys_module / m).exists() for m in PEERMEM_MODULES)
    nvlink = nvlink_from_topo(_topo() if topo is None else topo)
    return FabricReport(kind=kind, hcas=hcas, gpu_direct_rdma=True if peermem and devices else None, nvlink=nvlink,
                        source=f"{seen}; NVLink {'unknown (no nvidia-smi topo -m)' if nvlink is None else 'from nvidia-smi'}")


def _topo() -> str:
    """`nvidia-smi topo -m`, or "" where there is no nvidia-smi or it fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return ""
    try:
        done = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=TOPO_TIMEOUT, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout if done.returncode == 0 else ""


def nvlink_from_topo(text: str) -> bool | None:
    """True when the GPU matrix links two GPUs by NV<n>, False when it lists GPUs joined otherwise
    (PIX, PXB, PHB, NODE, SYS), None when there is no matrix to read."""
    rows = [line.split() for line in text.splitlines() if line.strip().startswith("GPU")]
    cells = [cell for row in rows[1:] for cell in row[1:]]  # rows[0] is the header line
    if not cells:
        return None
    if any(cell.startswith("NV") and cell[2:].isdigit() for cell in cells):
        return True
    gpus = sum(1 for row in rows[1:] if row and row[0][3:].isdigit())
    return False if gpus > 1 else None


def _labels(node: Any) -> dict[str, str]:
    return dict((node.metadata.labels if node.metadata else None) or {})


def _rdma(node: Any) -> bool | None:
    """True: labelled or allocatable as RDMA-capable; False: NFD labels the node and says nothing of
    RDMA; None: no way to tell."""
    labels = _labels(node)
    allocatable = (node.status.allocatable if node.status else None) or {}
    if any(labels.get(k) == "true" for k in RDMA_LABELS) or any(
            k.startswith(RDMA_RESOURCE_PREFIXES) and str(v) not in ("0", "") for k, v in allocatable.items()):
        return True
    if any(k.startswith(NFD_PREFIX) for k in labels):
        return False
    return None


def nodes_fabric(nodes: Iterable[Any]) -> FabricReport:
    """The GPU nodes' fabric from their labels and allocatable resources (typed V1Node objects).
    Kubernetes does not say whether an RDMA NIC runs InfiniBand or RoCE, nor which HCAs: those stay
    unknown; so does NVLink."""
    found = [_rdma(n) for n in nodes]
    rdma = sum(1 for f in found if f)
    if not found or (not rdma and None in found):
        kind, seen = "unknown", "no GPU node, or nodes without Node Feature Discovery labels"
    elif rdma:
        kind, seen = "unknown", f"{rdma} of {len(found)} GPU nodes RDMA-capable (link layer not visible)"
    else:
        kind, seen = "ethernet", f"Node Feature Discovery labels no RDMA on {len(found)} GPU nodes"
    return FabricReport(kind=kind, nodes=len(found), rdma_nodes=rdma if None not in found or rdma else None,
                        source=f"node labels: {seen}; HCAs, GPUDirect RDMA and NVLink not visible from the API")
