"""The stub Kubernetes API answers the official client's typed calls for Jobs and Services too."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from tests.kube_stub import KubeStub, make_node, make_pod


@pytest.fixture
def kube_api(kubeconfig: Path) -> Iterator[k8s.ApiClient]:
    with k8s_config.new_client_from_config(config_file=str(kubeconfig)) as api_client:
        yield api_client


def _job(name: str) -> k8s.V1Job:
    container = k8s.V1Container(name="worker", image="python:3.11", command=["python", "-c", "print(1)"])
    template = k8s.V1PodTemplateSpec(spec=k8s.V1PodSpec(containers=[container], restart_policy="Never"))
    return k8s.V1Job(api_version="batch/v1", kind="Job",
                     metadata=k8s.V1ObjectMeta(name=name, labels={"cpn.io/job": "j1"}),
                     spec=k8s.V1JobSpec(template=template, backoff_limit=0))


def test_jobs_create_get_list_patch_delete(kube_stub: KubeStub, kube_api: k8s.ApiClient) -> None:
    batch = k8s.BatchV1Api(kube_api)
    created = batch.create_namespaced_job("cpn", _job("j1-site-a"))
    assert created.metadata.uid and created.metadata.namespace == "cpn"

    with pytest.raises(k8s.ApiException) as dup:
        batch.create_namespaced_job("cpn", _job("j1-site-a"))
    assert dup.value.status == 409

    batch.patch_namespaced_job_status("j1-site-a", "cpn", {"status": {"succeeded": 1}})
    assert batch.read_namespaced_job("j1-site-a", "cpn").status.succeeded == 1
    listed = batch.list_namespaced_job("cpn", label_selector="cpn.io/job=j1").items
    assert [j.metadata.name for j in listed] == ["j1-site-a"]
    assert batch.list_namespaced_job("cpn", label_selector="cpn.io/job=other").items == []

    batch.delete_namespaced_job("j1-site-a", "cpn")
    with pytest.raises(k8s.ApiException) as gone:
        batch.read_namespaced_job("j1-site-a", "cpn")
    assert gone.value.status == 404


def test_services_get_a_cluster_ip(kube_stub: KubeStub, kube_api: k8s.ApiClient) -> None:
    body = k8s.V1Service(metadata=k8s.V1ObjectMeta(name="j1-rdzv"),
                         spec=k8s.V1ServiceSpec(selector={"app": "j1"}, ports=[k8s.V1ServicePort(port=29500)]))
    created = k8s.CoreV1Api(kube_api).create_namespaced_service("cpn", body)

    assert created.spec.cluster_ip
    assert kube_stub.get("services", "j1-rdzv", "cpn")["spec"]["ports"] == [{"port": 29500}]


def test_hooks_and_custom_routes_extend_the_stub(kube_stub: KubeStub, kube_api: k8s.ApiClient) -> None:
    def run_job(stub: KubeStub, job: dict) -> None:
        stub.add(make_pod(job["metadata"]["name"] + "-x1", node="n1", namespace=job["metadata"]["namespace"]))

    kube_stub.on("create", "jobs", run_job)
    kube_stub.route("GET", r"/api/v1/namespaces/(?P<ns>[^/]+)/pods/(?P<name>[^/]+)/log",
                    lambda stub, req: (200, f"logs of {req.match['name']}\n"))

    k8s.BatchV1Api(kube_api).create_namespaced_job("cpn", _job("j2"))
    core = k8s.CoreV1Api(kube_api)
    (pod,) = core.list_namespaced_pod("cpn").items
    assert pod.metadata.name == "j2-x1"
    assert core.read_namespaced_pod_log("j2-x1", "cpn") == "logs of j2-x1\n"


def test_fixtures_are_valid_kubernetes_objects() -> None:
    import kubernetes_validate

    for obj in (make_node("gpu-a", gpu_product="NVIDIA-H100-80GB-HBM3", unschedulable=True), make_node("cpu-a"),
                make_node("down-a", gpu_product="NVIDIA-L40S", gpus=4, ready=False),
                make_pod("train-0", node="gpu-a", gpus=8), make_pod("queued-0", node=None, gpus=1, phase="Pending")):
        kubernetes_validate.validate(obj, "1.30", strict=True)


def test_secrets_and_selectors_and_the_garbage_collector(kube_stub: KubeStub, kube_api: k8s.ApiClient) -> None:
    core, batch = k8s.CoreV1Api(kube_api), k8s.BatchV1Api(kube_api)
    job = batch.create_namespaced_job("cpn", _job("j3"))
    owned = k8s.V1ObjectMeta(name="j3", labels={"cpn.io/job": "j1", "tier": "a"}, owner_references=[
        k8s.V1OwnerReference(api_version="batch/v1", kind="Job", name="j3", uid=job.metadata.uid)])
    core.create_namespaced_secret("cpn", k8s.V1Secret(metadata=owned, string_data=None, data={"k": "dg=="}))
    assert core.read_namespaced_secret("j3", "cpn").data == {"k": "dg=="}
    assert [s.metadata.name for s in core.list_namespaced_secret("cpn", label_selector="cpn.io/job=j1,tier").items] \
        == ["j3"]
    assert core.list_namespaced_secret("cpn", label_selector="cpn.io/job=j1,!tier").items == []
    assert core.list_namespaced_secret("cpn", label_selector="tier!=a").items == []

    batch.delete_namespaced_job("j3", "cpn")  # Jobs orphan their dependents by default
    assert kube_stub.get("secrets", "j3", "cpn") is not None
    batch.create_namespaced_job("cpn", _job("j4"))
    core.patch_namespaced_secret("j3", "cpn", {"metadata": {"ownerReferences": [
        {"apiVersion": "batch/v1", "kind": "Job", "name": "j4", "uid": kube_stub.get("jobs", "j4", "cpn", "batch/v1")[
            "metadata"]["uid"]}]}})
    batch.delete_namespaced_job("j4", "cpn", propagation_policy="Background")
    assert kube_stub.get("secrets", "j3", "cpn") is None
