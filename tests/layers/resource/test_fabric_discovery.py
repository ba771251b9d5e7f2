"""The fabric an agent reports (issue 30, deliver 2): from sysfs and `nvidia-smi topo -m` on its
machine, from node labels on Kubernetes; what it cannot see stays unknown."""

from __future__ import annotations

from pathlib import Path

from kubernetes import client as k8s

from cpn.agent.heartbeat import Observation, heartbeat_body
from layers.resource.discovery.fabric import local_fabric, nodes_fabric, nvlink_from_topo
from layers.resource.discovery.kubernetes import summarise
from layers.resource.schemas import HeartbeatRequest

TOPO_NVLINK = """\
\tGPU0\tGPU1\tNIC0\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV18\tPXB\t0-55\t0
GPU1\tNV18\t X \tPXB\t0-55\t0
NIC0\tPXB\tPXB\t X
"""
TOPO_PCIE = """\
\tGPU0\tGPU1\tCPU Affinity
GPU0\t X \tSYS\t0-15
GPU1\tSYS\t X \t16-31
"""


def sysfs(root: Path, devices: dict[str, str], modules: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """A /sys/class with RDMA devices {name: link layer} and a /sys/module with `modules`."""
    (root / "class" / "net").mkdir(parents=True)
    for name, layer in devices.items():
        port = root / "class" / "infiniband" / name / "ports" / "1"
        port.mkdir(parents=True)
        (port / "link_layer").write_text(layer + "\n")
    for module in modules:
        (root / "module" / module).mkdir(parents=True)
    (root / "module").mkdir(exist_ok=True)
    return root / "class", root / "module"


def test_infiniband_hcas_with_gpudirect_and_nvlink(tmp_path: Path) -> None:
    cls, mod = sysfs(tmp_path, {"mlx5_0": "InfiniBand", "mlx5_1": "InfiniBand"}, ("nvidia_peermem",))
    found = local_fabric(cls, mod, topo=TOPO_NVLINK)
    assert (found.kind, found.hcas, found.gpu_direct_rdma, found.nvlink) == (
        "infiniband", ["mlx5_0", "mlx5_1"], True, True)


def test_ethernet_link_layer_is_roce_and_unseen_things_stay_unknown(tmp_path: Path) -> None:
    cls, mod = sysfs(tmp_path, {"mlx5_0": "Ethernet"})
    found = local_fabric(cls, mod, topo="")
    assert (found.kind, found.hcas, found.gpu_direct_rdma, found.nvlink) == ("roce", ["mlx5_0"], None, None)
    assert "NVLink unknown" in found.source


def test_no_rdma_device_is_ethernet_and_no_sysfs_is_unknown(tmp_path: Path) -> None:
    cls, mod = sysfs(tmp_path, {})
    found = local_fabric(cls, mod, topo=TOPO_PCIE)
    assert (found.kind, found.hcas, found.nvlink) == ("ethernet", [], False)
    blind = local_fabric(tmp_path / "absent", mod, topo="")
    assert (blind.kind, blind.hcas, blind.nvlink) == ("unknown", None, None)


def test_nvlink_needs_a_matrix_of_two_gpus() -> None:
    assert nvlink_from_topo(TOPO_NVLINK) is True and nvlink_from_topo(TOPO_PCIE) is False
    assert nvlink_from_topo("\tGPU0\tCPU Affinity\nGPU0\t X \t0-7\n") is None  # one GPU: nothing to link
    assert nvlink_from_topo("NVIDIA-SMI has failed") is None


def node(name: str, labels: dict[str, str], allocatable: dict[str, str] | None = None) -> k8s.V1Node:
    gpus = {"nvidia.com/gpu": "8"}
    return k8s.V1Node(metadata=k8s.V1ObjectMeta(name=name, labels={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                                                                   **labels}),
                      status=k8s.V1NodeStatus(capacity=gpus, allocatable={**gpus, **(allocatable or {})}))


def test_nodes_rdma_from_feature_labels_or_rdma_resources() -> None:
    found = nodes_fabric([node("a", {"feature.node.kubernetes.io/rdma.available": "true"}),
                          node("b", {}, {"rdma/hca_shared_devices_a": "1000"})])
    assert (found.kind, found.nodes, found.rdma_nodes, found.hcas, found.nvlink) == ("unknown", 2, 2, None, None)
    assert "link layer not visible" in found.source


def test_nodes_without_rdma_are_ethernet_only_when_nfd_labels_them() -> None:
    nfd = nodes_fabric([node("a", {"feature.node.kubernetes.io/cpu-model.vendor_id": "Intel"})])
    assert (nfd.kind, nfd.rdma_nodes) == ("ethernet", 0)
    bare = nodes_fabric([node("a", {})])
    assert (bare.kind, bare.rdma_nodes) == ("unknown", None)


def test_discovery_reports_the_gpu_nodes_fabric_in_the_heartbeat() -> None:
    nodes = [node("a", {"feature.node.kubernetes.io/rdma.available": "true"}),
             k8s.V1Node(metadata=k8s.V1ObjectMeta(name="cpu", labels={}), status=k8s.V1NodeStatus(capacity={}))]
    found = summarise(nodes, [], server_version="v1.30.0")
    assert found.fabric is not None and (found.fabric.nodes, found.fabric.rdma_nodes) == (1, 1)
    body = heartbeat_body(Observation(8, 8, True, "", "", fabric=found.fabric), {})
    assert body["fabric"]["hcas"] is None and body["fabric"]["rdmaNodes"] == 1  # unknown sent as null
    assert HeartbeatRequest.model_validate(body).fabric == found.fabric
