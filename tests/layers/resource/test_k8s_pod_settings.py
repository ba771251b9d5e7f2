"""The cluster's Kubernetes settings (issue 30, deliver 3) reach the objects the driver creates:
`pod_spec` and `job_manifest` field by field (pure, no API), strict validation for Kubernetes 1.30,
the driver's precedence (agent flags over the cluster's settings, the job's image over both), and one
launch through the real client against the stub API."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest

from layers.resource.drivers.base import DriverError
from layers.resource.drivers.kubernetes import KubernetesDriver, PodSettings, Shape, job_manifest, pod_spec
from layers.resource.schemas import KubernetesRef, Toleration
from tests.kube_stub import KubeStub, make_node
from tests.layers.resource.test_k8s_driver import job_controller, spec_of

NS = "train"
GPU_TAINT = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
DEDICATED = Toleration(key="dedicated", value="ml", effect="NoSchedule")
SPOT = Toleration(key="cloud.example.com/spot", operator="Exists", effect="NoExecute", toleration_seconds=120)
SELECTOR = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "example.com/pool": "train"}
FULL = PodSettings(image="ghcr.io/acme/cpn:0.1-cu128", queue="research", priority_class_name="ml-high",
                   node_selector=SELECTOR, tolerations=(DEDICATED, SPOT))
CLUSTER = KubernetesRef.model_validate({
    "namespace": "ml", "queue": "research", "image": "ghcr.io/acme/cpn:0.1-cu128", "priorityClassName": "ml-high",
    "nodeSelector": SELECTOR, "tolerations": [{"key": "dedicated", "value": "ml", "effect": "NoSchedule"}]})


# ------------------------------------------------------------------------------ pod_spec, pure
def test_gpu_pods_request_their_gpus_and_run_where_the_cluster_says() -> None:
    pod = pod_spec(spec_of(), Shape(2, 4, 4), FULL)
    (container,) = pod["containers"]
    assert container["image"] == "ghcr.io/acme/cpn:0.1-cu128"
    assert container["resources"] == {"requests": {"nvidia.com/gpu": "4"}, "limits": {"nvidia.com/gpu": "4"}}
    assert pod["priorityClassName"] == "ml-high"
    assert pod["nodeSelector"] == SELECTOR
    assert pod["tolerations"] == [GPU_TAINT, {"key": "dedicated", "operator": "Equal", "value": "ml",
                                              "effect": "NoSchedule"},
                                  {"key": "cloud.example.com/spot", "operator": "Exists", "effect": "NoExecute",
                                   "tolerationSeconds": 120}]


def test_cpu_pods_keep_the_clusters_tolerations_but_not_the_gpu_taint() -> None:
    pod = pod_spec(spec_of(), Shape(8, 1, 0), FULL)
    assert pod["containers"][0]["resources"] == {"requests": {"cpu": "1"}}
    assert GPU_TAINT not in pod["tolerations"] and len(pod["tolerations"]) == 2
    assert pod["nodeSelector"] == SELECTOR and pod["priorityClassName"] == "ml-high"


def test_the_gpu_taint_is_tolerated_once_when_the_cluster_names_it_too() -> None:
    settings = PodSettings(image="cpn:test", tolerations=(Toleration(key="nvidia.com/gpu", operator="Exists",
                                                                     effect="NoSchedule"),))
    assert pod_spec(spec_of(), Shape(2, 4, 4), settings)["tolerations"] == [GPU_TAINT]


def test_without_settings_the_pod_has_no_selector_priority_or_extra_toleration() -> None:
    pod = pod_spec(spec_of(), Shape(2, 4, 4), PodSettings(image="cpn:test"))
    assert "nodeSelector" not in pod and "priorityClassName" not in pod
    assert pod["tolerations"] == [GPU_TAINT]
    assert "tolerations" not in pod_spec(spec_of(), Shape(8, 1, 0), PodSettings(image="cpn:test"))


def test_a_queue_labels_the_job_for_kueue_and_creates_it_suspended() -> None:
    job = job_manifest(spec_of(), NS, Shape(2, 4, 4), FULL)
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "research"
    assert job["spec"]["suspend"] is True
    assert job["spec"]["template"]["spec"] == pod_spec(spec_of(), Shape(2, 4, 4), FULL)
    plain = job_manifest(spec_of(), NS, Shape(2, 4, 4), PodSettings(image="cpn:test"))
    assert "suspend" not in plain["spec"] and "kueue.x-k8s.io/queue-name" not in plain["metadata"]["labels"]


@pytest.mark.parametrize("pods", [Shape(2, 4, 4), Shape(8, 1, 0)])
def test_the_job_with_every_setting_is_valid_kubernetes(pods: Shape) -> None:
    kubernetes_validate.validate(job_manifest(spec_of(), NS, pods, FULL), "1.30", strict=True)


# ---------------------------------------------------------------------------------- the driver
def test_the_clusters_settings_reach_the_pods_and_agent_flags_override() -> None:
    driver = KubernetesDriver(cluster=CLUSTER)
    assert (driver.namespace, driver.image) == ("ml", "ghcr.io/acme/cpn:0.1-cu128")
    settings = driver._settings(spec_of(image=None))
    assert (settings.image, settings.queue, settings.priority_class_name) == (
        "ghcr.io/acme/cpn:0.1-cu128", "research", "ml-high")
    assert dict(settings.node_selector or {}) == SELECTOR and settings.tolerations == (DEDICATED,)
    assert driver._settings(spec_of(image="ghcr.io/me/mine:1")).image == "ghcr.io/me/mine:1"  # the job's own

    flagged = KubernetesDriver(namespace="override", image="cpn:flag", cluster=CLUSTER)
    assert (flagged.namespace, flagged._settings(spec_of(image=None)).image) == ("override", "cpn:flag")
    flagged.use_cluster(CLUSTER.model_copy(update={"namespace": "other", "queue": None}))
    assert flagged.namespace == "override" and flagged._settings(spec_of()).queue is None


def test_no_image_anywhere_names_the_three_places() -> None:
    with pytest.raises(DriverError, match="spec.kubernetes.image.*--image.*spec.image"):
        KubernetesDriver(cluster=KubernetesRef())._settings(spec_of(image=None))


# ------------------------------------------------------------------------ through the stub API
async def test_a_launch_creates_the_job_with_the_clusters_settings(kube_stub: KubeStub, kubeconfig: Path) -> None:
    kube_stub.add(*(make_node(f"gpu-{i}", gpu_product="NVIDIA-H100-80GB-HBM3", gpus=4) for i in range(2)))
    kube_stub.on("create", "jobs", job_controller)
    driver = KubernetesDriver(kubeconfig, cluster=CLUSTER)

    handle = await driver.launch(spec_of(image=None))

    assert handle["namespace"] == "ml"
    job = kube_stub.get("jobs", handle["name"], "ml", gv="batch/v1")
    kubernetes_validate.validate(job, "1.30", strict=True)
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "research" and job["spec"]["suspend"] is True
    pod = job["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == "ml-high" and pod["nodeSelector"] == SELECTOR
    assert pod["tolerations"] == [GPU_TAINT, {"key": "dedicated", "operator": "Equal", "value": "ml",
                                              "effect": "NoSchedule"}]
    assert pod["containers"][0]["image"] == "ghcr.io/acme/cpn:0.1-cu128"
    assert pod["containers"][0]["resources"]["requests"] == {"nvidia.com/gpu": "4"}
    assert kube_stub.get("secrets", handle["name"], "ml") is not None  # every object in the cluster's namespace
    state = await driver.poll(spec_of(image=None), handle)
    assert state.phase == "Launching" and "suspended, waiting for admission" in state.message
