"""Discovery through the official kubernetes client against the stub API server."""

from __future__ import annotations

from pathlib import Path

import pytest

from cpn.core.errors import InvalidInput, Unavailable
from layers.resource.discovery import kubernetes as discovery
from layers.resource.discovery.kubernetes import discover
from tests.kube_stub import KubeStub, make_node, make_pod


@pytest.fixture
def gpu_site(kube_stub: KubeStub) -> KubeStub:
    kube_stub.add(
        make_node("h100-a", gpu_product="NVIDIA-H100-80GB-HBM3", gpus=8),
        make_node("h100-b", gpu_product="NVIDIA-H100-80GB-HBM3", gpus=8),
        make_node("h100-c", gpu_product="NVIDIA-H100-80GB-HBM3", gpus=8, ready=False),
        make_node("a100-a", gpu_product="NVIDIA-A100-SXM4-40GB", gpus=8, unschedulable=True),
        make_node("l40s-a", gpu_product="NVIDIA-L40S", gpus=4),
        make_node("cpu-a"),
        make_pod("train-0", node="h100-a", gpus=4),
        make_pod("train-1", node="h100-b", gpus=2, phase="Pending", use_limits_only=True),
        make_pod("done-0", node="h100-b", gpus=8, phase="Succeeded"),
        make_pod("failed-0", node="l40s-a", gpus=4, phase="Failed", namespace="team-a"),
        make_pod("queued-0", node=None, gpus=1, phase="Pending"),
        make_pod("stuck-0", node="h100-c", gpus=8),
        make_pod("web-0", node="cpu-a"),
        make_pod("infer-0", node="l40s-a", gpus=1, namespace="team-a"),
    )
    return kube_stub


def test_pools_capacity_and_allocatable(gpu_site: KubeStub, kubeconfig: Path) -> None:
    found = discover(kubeconfig)

    assert found.server_version == "v1.30.4"
    pools = {p.name: p for p in found.node_pools}
    assert sorted(pools) == ["a100", "h100", "l40s"]
    h100 = pools["h100"]
    assert (h100.gpu_model, h100.memory_gb, h100.tflops, h100.gpus_per_node) == ("H100", 80, 989.0, 8)
    assert (h100.nodes, h100.ready_nodes, h100.allocatable_gpus) == (3, 2, 16 - 4 - 2)
    assert (pools["a100"].memory_gb, pools["a100"].ready_nodes, pools["a100"].allocatable_gpus) == (40, 0, 0)
    assert (pools["l40s"].memory_gb, pools["l40s"].allocatable_gpus) == (48, 3)
    assert found.capacity_gpus == 3 * 8 + 8 + 4
    assert found.allocatable_gpus == 10 + 3
    assert found.conditions[0]["type"] == "Ready" and found.conditions[0]["status"] == "True"
    assert h100.manifest() == {"name": "h100", "gpu": {"model": "H100", "memoryGB": 80, "tflops": 989.0},
                               "gpusPerNode": 8, "nodes": 3}


def test_requests_carry_the_kubeconfig_token(gpu_site: KubeStub, kubeconfig: Path) -> None:
    discover(kubeconfig, context="stub")

    paths = [r.path for r in gpu_site.requests]
    assert paths == ["/version/", "/api/v1/nodes", "/api/v1/pods"]
    assert all(r.headers["authorization"] == "Bearer stub-token" for r in gpu_site.requests)
    assert gpu_site.requests[-1].query["fieldSelector"] == "status.phase!=Succeeded,status.phase!=Failed"


def test_no_ready_gpu_node_is_not_ready(kube_stub: KubeStub, kubeconfig: Path) -> None:
    kube_stub.add(make_node("h100-x", gpu_product="NVIDIA-H100-80GB-HBM3", ready=False), make_node("cpu-a"))

    found = discover(kubeconfig)

    assert (found.capacity_gpus, found.allocatable_gpus) == (8, 0)
    assert found.conditions[0] | {"message": ""} == {"type": "Ready", "status": "False",
                                                      "reason": "NoReadyGpuNodes", "message": ""}


def test_unknown_product_keeps_its_label_and_memory(kube_stub: KubeStub, kubeconfig: Path) -> None:
    kube_stub.add(make_node("t4-a", gpu_product="Tesla-T4", gpus=1))

    (pool,) = discover(kubeconfig).node_pools

    assert (pool.name, pool.gpu_model, pool.tflops, pool.memory_gb) == ("tesla-t4", "Tesla-T4", None, 16)
    assert "tflops" not in pool.manifest()["gpu"]


def test_wrong_token_is_unavailable_naming_the_server(kube_stub: KubeStub, tmp_path: Path) -> None:
    path = kube_stub.write_kubeconfig(tmp_path / "kubeconfig", token="wrong")

    with pytest.raises(Unavailable, match=f"Kubernetes API at {kube_stub.url}: HTTP 401"):
        discover(path)


def test_unreachable_server_is_unavailable(tmp_path: Path) -> None:
    with KubeStub() as stub:
        path, url = stub.write_kubeconfig(tmp_path / "kubeconfig"), stub.url

    with pytest.raises(Unavailable, match=f"Kubernetes API at {url} is unreachable") as info:
        discover(path, timeout=2)
    assert info.value.__cause__ is not None


def test_missing_context_is_invalid_input(kubeconfig: Path) -> None:
    with pytest.raises(InvalidInput, match="kubeconfig") as info:
        discover(kubeconfig, context="nope")
    assert info.value.field == "kubeconfig"


def test_large_lists_are_read_in_chunks(kube_stub: KubeStub, kubeconfig: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(discovery, "PAGE_SIZE", 2)
    kube_stub.add(*(make_node(f"4090-{i}", gpu_product="NVIDIA-GeForce-RTX-4090", gpus=4) for i in range(5)),
                  *(make_pod(f"job-{i}", node=f"4090-{i}", gpus=1) for i in range(3)))

    found = discover(kubeconfig)

    assert (found.node_pools[0].name, found.node_pools[0].nodes) == ("rtx4090", 5)
    assert (found.capacity_gpus, found.allocatable_gpus) == (20, 17)
    node_pages = [r.query.get("continue") for r in kube_stub.requests if r.path == "/api/v1/nodes"]
    assert node_pages == [None, "2", "4"]


def test_a_node_with_a_failed_gpu_forms_its_own_pool(kube_stub: KubeStub, kubeconfig: Path) -> None:
    degraded = make_node("h100-b", gpu_product="NVIDIA-H100-80GB-HBM3")
    degraded["status"]["allocatable"]["nvidia.com/gpu"] = "7"
    kube_stub.add(make_node("h100-a", gpu_product="NVIDIA-H100-80GB-HBM3"),
                  make_node("h100-c", gpu_product="NVIDIA-H100-80GB-HBM3"), degraded)

    found = discover(kubeconfig)

    assert [(p.name, p.gpus_per_node, p.nodes) for p in found.node_pools] == [("h100", 8, 2), ("h100-7g", 7, 1)]
    assert (found.capacity_gpus, found.allocatable_gpus) == (24, 23)
