"""A Kubernetes cluster's settings (issue 30, deliver 3) are validated with the field named, stored,
and reach the site agent's driver, at start and after a change (the heartbeat's answer); the fabric
an agent finds is stored as reported, unknowns as null."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from cpn.agent.heartbeat import (
    AgentConfig,
    _check_server,
    _heartbeats,
    _settings_sink,
    kubernetes_settings,
    make_driver,
)
from cpn.cli.agent import agent_cmd
from cpn.client import Client
from cpn.core.errors import InvalidInput
from layers.resource.schemas import KubernetesRef
from tests.kube_stub import KubeStub, make_node

SITE = {"apiVersion": "cpn/v1", "kind": "Site", "metadata": {"name": "fra-1"}, "spec": {"region": "eu-central"}}
KUBE = {"server": "https://k8s.fra-1.example:6443", "namespace": "ml", "queue": "research",
        "image": "ghcr.io/acme/cpn:0.1-cu128", "priorityClassName": "ml-high",
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}]}


def _cluster(kube: dict[str, Any] | None, driver: str = "kubernetes", name: str = "fra-k8s") -> dict[str, Any]:
    spec: dict[str, Any] = {"site": "fra-1", "driver": driver, "nodePools": [{
        "name": "h100", "gpu": {"model": "H100", "memoryGB": 80, "tflops": 989}, "gpusPerNode": 4, "nodes": 2,
        "pricePerGpuHour": "2.45"}]}
    if kube is not None:
        spec["kubernetes"] = kube
    return {"apiVersion": "cpn/v1", "kind": "Cluster", "metadata": {"name": name}, "spec": spec}


async def _apply(api, *docs: dict[str, Any]):  # type: ignore[no-untyped-def]
    return await api.client.post("/api/v1/apply", json={"items": list(docs)}, headers=api.auth("prov-a"))


async def test_the_settings_are_stored_and_read_back(api) -> None:  # type: ignore[no-untyped-def]
    resp = await _apply(api, SITE, _cluster({**KUBE, "kubeconfigSecret": "fra-kubeconfig"}))
    assert resp.status == 200, await resp.text()
    got = await (await api.client.get("/api/v1/clusters/fra-k8s", headers=api.auth("prov-a"))).json()
    assert got["spec"]["kubernetes"] == KUBE  # kubeconfigSecret is write-only
    stored = kubernetes_settings(got["spec"])
    assert stored is not None and stored.queue == "research" and stored.tolerations[0].value == "ml"


@pytest.mark.parametrize(("kube", "field", "says"), [
    ({"nodeSelector": {"gpu type": "h100"}}, "spec.kubernetes.nodeSelector", "label key 'gpu type'"),
    ({"nodeSelector": {"example.com/pool": "a b"}}, "spec.kubernetes.nodeSelector", "label value 'a b'"),
    ({"tolerations": [{"operator": "Exists", "value": "ml"}]}, "spec.kubernetes.tolerations", "takes no value"),
    ({"tolerations": [{"key": "x", "tolerationSeconds": 30}]}, "spec.kubernetes.tolerations", "NoExecute only"),
    ({"tolerations": [{"key": "x", "effect": "Sometimes"}]}, "spec.kubernetes.tolerations", ""),
    ({"namespace": "ML_Team"}, "spec.kubernetes.namespace", ""),
    ({"queue": "Research Queue"}, "spec.kubernetes.queue", ""),
    ({"priorityClassName": "High!"}, "spec.kubernetes.priorityClassName", ""),
    ({"image": "not an image"}, "spec.kubernetes.image", "not an image reference"),
    ({"nodeSelecter": {"a": "b"}}, "spec.kubernetes.nodeSelecter", ""),
])
async def test_what_kubernetes_would_refuse_is_refused_naming_the_field(  # type: ignore[no-untyped-def]
        api, kube: dict[str, Any], field: str, says: str) -> None:
    await _apply(api, SITE)
    resp = await api.client.post("/api/v1/clusters", json=_cluster(kube), headers=api.auth("prov-a"))
    assert resp.status == 422, await resp.text()
    error = (await resp.json())["error"]
    assert error["field"].startswith(field), error
    assert says in error["message"], error


async def test_kubernetes_settings_on_a_local_cluster_are_refused(api) -> None:  # type: ignore[no-untyped-def]
    await _apply(api, SITE)
    resp = await api.client.post("/api/v1/clusters", json=_cluster({"namespace": "ml"}, driver="local", name="lab"),
                                 headers=api.auth("prov-a"))
    assert resp.status == 422, await resp.text()
    error = (await resp.json())["error"]
    assert error["field"] == "spec.kubernetes" and "driver is local" in error["message"]


async def test_the_agents_driver_takes_the_settings_and_their_changes(  # type: ignore[no-untyped-def]
        api, kube_stub: KubeStub, kubeconfig: Path) -> None:
    """At start from the cluster's spec, then from a heartbeat's answer after `cpnctl apply` changed it."""
    assert (await _apply(api, SITE, _cluster(KUBE))).status == 200
    kube_stub.add(make_node("h100-a", gpu_product="NVIDIA-H100-80GB-HBM3", gpus=4))
    server = str(api.client.make_url("")).rstrip("/")
    cfg = AgentConfig(cluster="fra-k8s", server=server, token=api.tokens["prov-a"], kubeconfig=kubeconfig, once=True)
    client = Client(server, api.tokens["prov-a"])
    try:
        spec = (await (await api.client.get("/api/v1/clusters/fra-k8s", headers=api.auth("prov-a"))).json())["spec"]
        driver = make_driver(cfg, kubernetes_settings(spec))
        assert (driver.namespace, driver.image, driver.cluster.priority_class_name) == (
            "ml", "ghcr.io/acme/cpn:0.1-cu128", "ml-high")

        changed = {**KUBE, "namespace": "ml-2", "queue": None, "nodeSelector": {"example.com/pool": "big"}}
        assert (await _apply(api, _cluster({k: v for k, v in changed.items() if v is not None}))).status == 200
        await _heartbeats(client, cfg, spec, None, _settings_sink(driver))
    finally:
        client.close()

    assert driver.namespace == "ml-2" and driver.cluster.queue is None
    settings = driver._settings(_spec_without_image())
    assert dict(settings.node_selector or {}) == {"example.com/pool": "big"} and settings.queue is None


def _spec_without_image():  # type: ignore[no-untyped-def]
    from tests.layers.resource.test_k8s_driver import spec_of

    return spec_of(image=None)


async def test_the_fabric_an_agent_finds_is_stored_with_its_unknowns(api) -> None:  # type: ignore[no-untyped-def]
    assert (await _apply(api, SITE, _cluster(KUBE))).status == 200
    fabric = {"kind": "unknown", "hcas": None, "gpuDirectRdma": None, "nvlink": None, "nodes": 2, "rdmaNodes": 2,
              "source": "node labels: 2 of 2 GPU nodes RDMA-capable (link layer not visible)"}
    resp = await api.client.post("/api/v1/clusters/fra-k8s/heartbeat", headers=api.auth("prov-a"), json={
        "allocatableGpus": 8, "capacityGpus": 8, "conditions": [{"type": "Ready", "status": "True"}],
        "fabric": fabric})
    assert resp.status == 200, await resp.text()
    got = await (await api.client.get("/api/v1/clusters/fra-k8s", headers=api.auth("prov-a"))).json()
    assert got["status"]["fabric"] == fabric
    bad = await api.client.post("/api/v1/clusters/fra-k8s/heartbeat", headers=api.auth("prov-a"), json={
        "allocatableGpus": 8, "fabric": {**fabric, "kind": "warp"}})
    assert bad.status == 422 and (await bad.json())["error"]["field"] == "fabric.kind"


def test_agent_network_options_are_checked_and_become_worker_variables(tmp_path: Path) -> None:
    cfg = AgentConfig(cluster="lab", server="http://x", local=True, socket_ifname="ib0",
                      nccl_env={"NCCL_IB_TIMEOUT": "22"}, state_dir=tmp_path)
    assert cfg.network_env() == {"NCCL_IB_TIMEOUT": "22", "NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "ib0"}
    assert make_driver(cfg).env == cfg.network_env()  # a local run's workers inherit them
    with pytest.raises(InvalidInput, match="only NCCL_"):
        AgentConfig(cluster="lab", server="http://x", local=True, nccl_env={"LD_PRELOAD": "/tmp/x.so"})
    with pytest.raises(InvalidInput, match="not an interface name"):
        AgentConfig(cluster="lab", server="http://x", local=True, socket_ifname="eth0; rm -rf /")


@pytest.mark.parametrize(("args", "message"), [
    (["--nccl-env", "NCCL_IB_TIMEOUT"], "write KEY=VALUE"),
    (["--nccl-env", "LD_PRELOAD=/tmp/x.so"], "only NCCL_"),
    (["--socket-ifname", "eth0 eth1"], "not an interface name"),
])
def test_cli_network_options_are_refused_with_the_fix(args: list[str], message: str, tmp_path: Path,
                                                      monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("CPN_CONFIG", str(tmp_path / "none"))
    result = CliRunner().invoke(agent_cmd, ["--cluster", "c", "--local", "--once", "--server", "http://127.0.0.1:9",
                                            "--token", "t", *args])
    assert result.exit_code in (1, 2) and message in result.stderr, result.output


def test_a_kubeconfig_for_another_server_is_warned_about(kubeconfig: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    cfg = AgentConfig(cluster="fra-k8s", server="http://cpn.example", kubeconfig=kubeconfig)
    caplog.set_level("WARNING", logger="cpn.agent")
    driver = make_driver(cfg, KubernetesRef(server="https://k8s.fra-1.example:6443"))
    _check_server(driver, driver.cluster)
    assert "spec.kubernetes.server is https://k8s.fra-1.example:6443" in caplog.text
    caplog.clear()
    _check_server(driver, KubernetesRef(server=driver.server + "/"))
    assert caplog.text == ""
