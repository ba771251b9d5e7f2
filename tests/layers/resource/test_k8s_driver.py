"""The kubernetes driver through the real kubernetes client against the stub API server: manifests
valid for Kubernetes 1.30, one launch per key, Job status to phases, cancel, pod logs."""

from __future__ import annotations

import base64
import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from layers.resource.drivers.base import DriverError, JobLaunch, SubtaskLaunch
from layers.resource.drivers.kubernetes import (
    KubernetesDriver,
    job_manifest,
    resource_name,
    secret_manifest,
    service_manifest,
    shape,
)
from layers.resource.drivers.local import driver_for
from tests.kube_stub import KubeStub, Request

NS = "train"
TOKEN = "cpn_worker_s3cr3t"
TOPOLOGY = {"sites": [{"name": "east", "ranks": 4, "leader": 0}, {"name": "west", "ranks": 8, "leader": 0}],
            "links": [{"a": "east", "b": "west", "bandwidth_mbps": 1000.0, "rtt_ms": 40.0}]}


def spec(kubeconfig: str | None = None, gpus_per_node: int | None = 4, **kube: Any) -> dict[str, Any]:
    pools = [{"name": "h100", "gpu": {"model": "H100", "memoryGB": 80, "tflops": 989},
              "gpusPerNode": gpus_per_node, "nodes": 4, "pricePerGpuHour": "2.50"}] if gpus_per_node else []
    ref = {"kubeconfigSecret": f"file:{kubeconfig}"} if kubeconfig else {}
    return {"site": "west", "driver": "kubernetes", "kubernetes": {**ref, "namespace": NS, **kube},
            "nodePools": pools}


def launch_of(attempt: int = 1, token: str | None = TOKEN) -> JobLaunch:
    return JobLaunch(job="llm", attempt=attempt, topology=TOPOLOGY, train={"model": "tiny", "tokens": 4096},
                     master_port=29500, metrics_url="https://cpn.example/api/v1/jobs/llm/metrics",
                     metrics_token=token, run_root=Path("/nonexistent"), elastic=False, image="cpn:test")


def sub_of(cluster_spec: dict[str, Any], *, site: int = 1, ranks: int = 8, name: str = "llm-gpu-west",
           attempt: int = 1) -> SubtaskLaunch:
    return SubtaskLaunch(subtask=name, cluster=name.removeprefix("llm-"), site_index=site, ranks=ranks,
                         key=f"llm/{name}/{attempt}", cluster_spec=cluster_spec)


def job_controller(stub: KubeStub, job: dict[str, Any]) -> None:
    """What the Job controller does on create: one Pending pod per completion index."""
    name = job["metadata"]["name"]
    for i in range(job["spec"]["completions"]):
        stub.add({"apiVersion": "v1", "kind": "Pod",
                  "metadata": {"name": f"{name}-{i}-x7k2p", "namespace": job["metadata"]["namespace"],
                               "labels": {"batch.kubernetes.io/job-name": name, "job-name": name}},
                  "spec": job["spec"]["template"]["spec"], "status": {"phase": "Pending"}})


def set_field(stub: KubeStub, gv: str, plural: str, name: str, field: str, value: Any) -> None:
    with stub.lock:
        stub.store[(gv, NS, plural)][name][field] = value


@pytest.fixture
def cluster(kube_stub: KubeStub, kubeconfig: Path) -> dict[str, Any]:
    kube_stub.on("create", "jobs", job_controller)
    return spec(str(kubeconfig))


def env_of(job: dict[str, Any]) -> dict[str, Any]:
    container = job["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


# --------------------------------------------------------------------------------- manifests
@pytest.mark.parametrize("sub", [sub_of(spec("/k")), sub_of(spec("/k", None), ranks=3, name="x" * 80)])
def test_manifests_are_valid_kubernetes(sub: SubtaskLaunch) -> None:
    job = launch_of()
    for obj in (job_manifest(job, sub, NS), service_manifest(job, sub, NS), secret_manifest(job, sub, NS)):
        kubernetes_validate.validate(obj, "1.30", strict=True)


def test_names_are_dns_labels_and_deterministic() -> None:
    long = "x" * 40 + "/" + "Y_" * 40 + "/12"
    for key in (long, "llm/llm-gpu-west/1", "7b/7b-a/2"):
        name = resource_name(key)
        assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 52
        assert resource_name(key) == name
    assert resource_name("a/b-c/1") != resource_name("a-b/c/1")


def test_shape_fits_ranks_to_nodes() -> None:
    assert shape(sub_of(spec("/k", 4), ranks=8)) == (2, 4)
    assert shape(sub_of(spec("/k", 8), ranks=12)) == (2, 6)  # 12 ranks cannot fill 8-GPU nodes evenly
    assert shape(sub_of(spec("/k", 8), ranks=2)) == (1, 2)
    assert shape(sub_of(spec("/k", None), ranks=3)) == (3, 1)  # GPUs per node unknown: a pod per rank


def test_job_manifest_runs_torchrun_with_the_topology() -> None:
    job = job_manifest(launch_of(), sub_of(spec("/k", 4, queue="research")), NS)
    name = resource_name("llm/llm-gpu-west/1")
    pod = job["spec"]["template"]
    command = pod["spec"]["containers"][0]["command"]
    assert command[:9] == ["torchrun", "--nnodes", "2", "--nproc-per-node", "4", "--node-rank",
                           "$(JOB_COMPLETION_INDEX)", "--master-addr", f"{name}-0.{name}.{NS}.svc"]
    assert command[-2:] == ["-m", "cpn.runtime.train"]
    assert job["spec"] | {"template": None} == {"completionMode": "Indexed", "completions": 2, "parallelism": 2,
                                                "backoffLimit": 0, "ttlSecondsAfterFinished": 86400,
                                                "template": None}
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "research"
    assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == name
    assert pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == name
    env = env_of(job)
    assert env["CPN_RANK_OFFSET"] == "4" and json.loads(env["CPN_TOPOLOGY"]) == TOPOLOGY
    assert list(env)[0] == "JOB_COMPLETION_INDEX"  # defined before the command expands it


# ------------------------------------------------------------------------------- launch
async def test_launch_creates_service_secret_and_job(kube_stub: KubeStub, cluster: dict[str, Any]) -> None:
    site0 = sub_of(cluster, site=0, ranks=4, name="llm-gpu-east")
    site1 = sub_of(cluster)
    handles = await KubernetesDriver().launch(launch_of(), [site1, site0])
    name0, name1 = resource_name(site0.key), resource_name(site1.key)
    assert handles["llm-gpu-west"] | {"kubeconfig": None} == {
        "key": site1.key, "cluster": "gpu-west", "namespace": NS, "name": name1, "siteIndex": 1,
        "kubeconfig": None, "context": None, "server": None}
    assert sorted(s["metadata"]["name"] for s in kube_stub.objects("services", NS)) == sorted([name0, name1])
    job = kube_stub.get("jobs", name1, NS, gv="batch/v1")
    service, secret = kube_stub.get("services", name1, NS), kube_stub.get("secrets", name1, NS)
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": name1}
    assert TOKEN not in json.dumps(job) + json.dumps(handles)
    assert base64.b64decode(secret["data"]["metrics-token"]).decode() == TOKEN
    env = env_of(job)
    assert env["CPN_METRICS_TOKEN"] == {"secretKeyRef": {"name": name1, "key": "metrics-token"}}
    assert env["CPN_RANK_OFFSET"] == "4" and env["CPN_TRAIN_CONFIG"] == json.dumps(launch_of().train)
    assert env["MASTER_ADDR"] == f"{name0}-0.{name0}.{NS}.svc" == env["CPN_MASTER_ADDR"]
    assert env["CPN_METRICS_URL"].endswith("/jobs/llm/metrics")
    assert job["spec"]["template"]["spec"]["containers"][0]["resources"] == {"limits": {"nvidia.com/gpu": "4"}}
    assert job["metadata"]["labels"] | {"kueue.x-k8s.io/queue-name": "cpn"} == {
        "app.kubernetes.io/managed-by": "cpn", "cpn.io/job": "llm", "cpn.io/subtask": "llm-gpu-west",
        "cpn.io/attempt": "1", "kueue.x-k8s.io/queue-name": "cpn"}
    owner = {"apiVersion": "batch/v1", "kind": "Job", "name": name1, "uid": job["metadata"]["uid"],
             "blockOwnerDeletion": False}
    assert service["metadata"]["ownerReferences"] == [owner] == secret["metadata"]["ownerReferences"]
    assert len([p for p in kube_stub.pods if p["metadata"]["name"].startswith(name1)]) == 2
    patches = [r for r in kube_stub.requests if r.method == "PATCH"]
    assert {r.headers["content-type"] for r in patches} == {"application/strategic-merge-patch+json"}


async def test_second_launch_of_a_key_creates_nothing(kube_stub: KubeStub, cluster: dict[str, Any]) -> None:
    driver, sub = KubernetesDriver(), sub_of(cluster)
    first = await driver.launch(launch_of(), [sub])
    counts = [len(kube_stub.objects(p, NS, gv)) for p, gv in
              (("jobs", "batch/v1"), ("services", "v1"), ("secrets", "v1"), ("pods", "v1"))]
    assert counts == [1, 1, 1, 2]
    assert await driver.launch(launch_of(), [sub]) == first
    assert [len(kube_stub.objects(p, NS, gv)) for p, gv in
            (("jobs", "batch/v1"), ("services", "v1"), ("secrets", "v1"), ("pods", "v1"))] == counts
    await driver.launch(launch_of(attempt=2), [sub_of(cluster, attempt=2)])  # a new attempt is a new launch
    assert len(kube_stub.objects("jobs", NS, "batch/v1")) == 2


async def test_a_foreign_job_with_the_name_is_refused(kube_stub: KubeStub, cluster: dict[str, Any]) -> None:
    sub = sub_of(cluster)
    kube_stub.add({"apiVersion": "batch/v1", "kind": "Job",
                   "metadata": {"name": resource_name(sub.key), "namespace": NS},
                   "spec": {"template": {"spec": {"containers": [{"name": "x", "image": "x"}]}}}})
    with pytest.raises(DriverError, match="was not launched for"):
        await KubernetesDriver().launch(launch_of(), [sub])


async def test_without_a_token_no_secret(kube_stub: KubeStub, cluster: dict[str, Any]) -> None:
    await KubernetesDriver().launch(launch_of(token=None), [sub_of(cluster)])
    assert kube_stub.objects("secrets", NS) == []
    assert "CPN_METRICS_TOKEN" not in env_of(kube_stub.objects("jobs", NS, "batch/v1")[0])


# --------------------------------------------------------------------------------- poll
async def test_poll_maps_job_status_to_phases(kube_stub: KubeStub, cluster: dict[str, Any]) -> None:
    driver, sub, job = KubernetesDriver(), sub_of(cluster), launch_of()
    handles = await driver.launch(job, [sub])
    name = resource_name(sub.key)
    pods = sorted(p["metadata"]["name"] for p in kube_stub.pods)

    state = (await driver.poll(job, handles))["llm-gpu-west"]
    assert state.phase == "Launching" and f"{pods[0]} (Pending)" in state.message

    set_field(kube_stub, "batch/v1", "jobs", name, "status", {"active": 2})
    for pod in pods:
        set_field(kube_stub, "v1", "pods", pod, "status", {"phase": "Running"})
    state = (await driver.poll(job, handles))["llm-gpu-west"]
    assert state.phase == "Running" and state.message.startswith("2/2 pods running") and pods[1] in state.message

    done = {"type": "Complete", "status": "True", "reason": "CompletionsReached", "message": "Reached expected"}
    set_field(kube_stub, "batch/v1", "jobs", name, "status", {"succeeded": 2, "conditions": [done]})
    for pod in pods:
        set_field(kube_stub, "v1", "pods", pod, "status", {"phase": "Succeeded", "containerStatuses": [
            {"name": "trainer", "image": "cpn:test", "imageID": "", "ready": False, "restartCount": 0,
             "state": {"terminated": {"exitCode": 0}}}]})
    state = (await driver.poll(job, handles))["llm-gpu-west"]
    assert state.phase == "Succeeded" and state.exit_codes == dict.fromkeys(pods, 0)

    failed = {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
              "message": "Job has reached the specified backoff limit"}
    set_field(kube_stub, "batch/v1", "jobs", name, "status", {"failed": 1, "conditions": [failed]})
    state = (await driver.poll(job, handles))["llm-gpu-west"]
    assert state.phase == "Failed" and state.message.startswith("BackoffLimitExceeded")


async def test_a_failed_pod_fails_the_subtask_early(kube_stub: KubeStub, cluster: dict[str, Any]) -> None:
    driver, job = KubernetesDriver(), launch_of()
    handles = await driver.launch(job, [sub_of(cluster)])
    pod = kube_stub.pods[0]["metadata"]["name"]
    set_field(kube_stub, "v1", "pods", pod, "status", {"phase": "Failed", "containerStatuses": [
        {"name": "trainer", "image": "cpn:test", "imageID": "", "ready": False, "restartCount": 0,
         "state": {"terminated": {"exitCode": 137}}}]})
    state = (await driver.poll(job, handles))["llm-gpu-west"]
    assert state.phase == "Failed" and state.exit_codes == {pod: 137}


# ------------------------------------------------------------------------------- cancel
async def test_cancel_deletes_job_service_and_secret(kube_stub: KubeStub, cluster: dict[str, Any]) -> None:
    driver, job = KubernetesDriver(), launch_of()
    handles = await driver.launch(job, [sub_of(cluster)])
    await driver.cancel(job, handles)
    assert kube_stub.objects("jobs", NS, "batch/v1") == []
    assert kube_stub.objects("services", NS) == kube_stub.objects("secrets", NS) == []
    delete = next(r for r in kube_stub.requests if r.method == "DELETE" and "/jobs/" in r.path)
    assert delete.query["propagationPolicy"] == "Background"
    await driver.cancel(job, handles)  # again: nothing left, no error
    assert (await driver.poll(job, handles))["llm-gpu-west"].phase == "Lost"


# --------------------------------------------------------------------------------- logs
class PodLogs:
    """`GET …/pods/{name}/log` with `timestamps` and `sinceSeconds`, as the kubelet serves it."""

    def __init__(self, stub: KubeStub):
        self.lines: dict[str, list[tuple[datetime, str]]] = {}
        stub.route("GET", r"/api/v1/namespaces/(?P<ns>[^/]+)/pods/(?P<pod>[^/]+)/log", self.serve)

    def write(self, pod: str, *lines: str) -> None:
        self.lines.setdefault(pod, []).extend((datetime.now(UTC), line) for line in lines)

    def serve(self, stub: KubeStub, req: Request) -> tuple[int, Any]:
        assert req.match is not None and req.query.get("container") == "trainer"
        since = req.query.get("sinceSeconds")
        cutoff = datetime.now(UTC) - timedelta(seconds=int(since)) if since else datetime.min.replace(tzinfo=UTC)
        stamp = req.query.get("timestamps") == "true"
        out = [f"{at.strftime('%Y-%m-%dT%H:%M:%S.%f')}Z {line}" if stamp else line
               for at, line in self.lines.get(req.match["pod"], []) if at >= cutoff]
        return 200, "".join(f"{line}\n" for line in out)


async def test_logs_read_every_pod(kube_stub: KubeStub, cluster: dict[str, Any]) -> None:
    logs = PodLogs(kube_stub)
    driver, job = KubernetesDriver(), launch_of()
    handle = (await driver.launch(job, [sub_of(cluster)]))["llm-gpu-west"]
    pods = sorted(p["metadata"]["name"] for p in kube_stub.pods)
    logs.write(pods[0], "step 1 loss 4.2", "step 2 loss 3.9")
    logs.write(pods[1], "step 1 loss 4.3")
    lines = [line async for line in driver.logs(handle)]
    assert lines == [f"[{pods[0]}] step 1 loss 4.2", f"[{pods[0]}] step 2 loss 3.9", f"[{pods[1]}] step 1 loss 4.3"]


async def test_logs_follow_until_the_job_finishes(kube_stub: KubeStub, cluster: dict[str, Any]) -> None:
    logs = PodLogs(kube_stub)
    driver, job = KubernetesDriver(log_interval=0.01), launch_of()
    handle = (await driver.launch(job, [sub_of(cluster)]))["llm-gpu-west"]
    pod = sorted(p["metadata"]["name"] for p in kube_stub.pods)[0]
    logs.write(pod, "a", "a")  # the same line twice within one timestamp is still two lines
    seen = []
    async for line in driver.logs(handle, follow=True):
        seen.append(line.split("] ", 1)[1])
        if len(seen) == 2:
            logs.write(pod, "b", "c")
        if len(seen) == 4:
            set_field(kube_stub, "batch/v1", "jobs", handle["name"], "status",
                      {"conditions": [{"type": "Complete", "status": "True"}]})
            logs.write(pod, "d")
    assert seen == ["a", "a", "b", "c", "d"]


# ------------------------------------------------------------------------- where the cluster is
@pytest.mark.parametrize("ref", ["vault:kv/clusters/west", "secret://ns/kubeconfig", "/no/such/kubeconfig"])
async def test_a_bad_kubeconfig_reference_names_the_field(ref: str) -> None:
    sub = sub_of({"kubernetes": {"kubeconfigSecret": ref, "namespace": NS}})
    with pytest.raises(DriverError, match=r"spec\.kubernetes\.kubeconfigSecret") as err:
        await KubernetesDriver().launch(launch_of(), [sub])
    assert err.value.field == "spec.kubernetes.kubeconfigSecret"


async def test_a_broken_kubeconfig_names_the_field(tmp_path: Path) -> None:
    (tmp_path / "kc").write_text("apiVersion: v1\nkind: Config\nclusters: []\n")
    with pytest.raises(DriverError, match=r"spec\.kubernetes\.kubeconfigSecret"):
        await KubernetesDriver().launch(launch_of(), [sub_of(spec(str(tmp_path / "kc")))])


async def test_env_overrides_the_kubeconfig(kube_stub: KubeStub, kubeconfig: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CPN_KUBECONFIG_GPU_WEST", str(kubeconfig))
    handles = await KubernetesDriver().launch(launch_of(), [sub_of(spec("/no/such/file"))])
    assert handles["llm-gpu-west"]["kubeconfig"] == str(kubeconfig)
    assert len(kube_stub.objects("jobs", NS, "batch/v1")) == 1


async def test_server_alone_talks_without_auth() -> None:
    with KubeStub(token=None) as stub:
        handles = await KubernetesDriver().launch(launch_of(), [sub_of(spec(server=stub.url))])
        assert handles["llm-gpu-west"]["server"] == stub.url
        assert len(stub.objects("jobs", NS, "batch/v1")) == 1


async def test_api_errors_become_driver_errors(kube_stub: KubeStub, cluster: dict[str, Any]) -> None:
    kube_stub.token = "rotated"
    with pytest.raises(DriverError, match="HTTP 401"):
        await KubernetesDriver().launch(launch_of(), [sub_of(cluster)])
    with pytest.raises(DriverError, match="unreachable"):
        await KubernetesDriver().launch(launch_of(), [sub_of(spec(server="http://127.0.0.1:9"))])
    with pytest.raises(DriverError, match="spec.kubernetes"):
        await KubernetesDriver().launch(launch_of(), [sub_of({"kubernetes": {"namespace": NS}})])


def test_driver_for_kubernetes() -> None:
    assert driver_for("kubernetes").name == "kubernetes"
