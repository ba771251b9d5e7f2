"""The kubernetes driver through the real kubernetes client against the stub API server: manifests
valid for Kubernetes 1.30, one launch per (job, attempt, sub-task), re-adoption by a new driver,
Job status to phases, cancel, pod logs by rank, the token only in a Secret, the advertised rendezvous,
each pod running the site's job runner (user code, resumed attempts) with the pod's ephemeral ports
in the agent's --port-range."""

from __future__ import annotations

import base64
import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from cpn.runtime.config import TrainConfig
from cpn.runtime.contract import AttemptSpec, CodeRef, Endpoint, worker_env
from cpn.runtime.jobrunner import pod_share
from cpn.runtime.launcher import PortRange
from cpn.runtime.topology import Topology
from layers.resource.drivers.base import DriverError, LogLine
from layers.resource.drivers.kubernetes import (
    KubernetesDriver,
    PodSettings,
    Shape,
    container_env,
    job_manifest,
    launch_key,
    resource_name,
    runner_command,
    secret_manifest,
    service_manifest,
    shape,
)
from tests.kube_stub import KubeStub, Request, make_node

NS = "train"
TOKEN = "cpn_worker_s3cr3t"
RDZV = Endpoint(host="203.0.113.7", port=41234)  # what the first site's agent advertised
TOPOLOGY = Topology(sites=[{"name": "east", "ranks": 4}, {"name": "west", "ranks": 8}],
                    links=[{"a": "east", "b": "west", "bandwidth_mbps": 1000.0, "rtt_ms": 40.0}])
SETTINGS = PodSettings(image="cpn:test")
CODE = CodeRef(digest="sha256:" + "ab" * 32, entrypoint="mymodel.train:main", args={"lr": 0.001})
RUNNER = ["python", "-m", "cpn.runtime.jobrunner", "/var/lib/cpn/run", "--contract", "/var/run/cpn/spec.json",
          "--job-dir", "/var/lib/cpn", "--pod-index", "$(JOB_COMPLETION_INDEX)"]


def spec_of(*, lead: bool = False, attempt: int = 1, token: str | None = TOKEN, image: str | None = "cpn:test",
            rendezvous: Endpoint | None = RDZV, code: CodeRef | None = None) -> AttemptSpec:
    site = {"subtask": "llm-gpu-east", "cluster": "gpu-east", "site_index": 0, "first_rank": 0, "workers": 4} if lead \
        else {"subtask": "llm-gpu-west", "cluster": "gpu-west", "site_index": 1, "first_rank": 4, "workers": 8}
    return AttemptSpec(job="llm", attempt=attempt, topology=TOPOLOGY, train=TrainConfig(model="tiny", tokens=16384),
                       elastic=False, rendezvous=rendezvous, server="https://cpn.example", worker_token=token,
                       image=image, code=code, **site)


def job_controller(stub: KubeStub, job: dict[str, Any]) -> None:
    """What the Job controller does on create: one Pending pod per completion index, owned by the Job."""
    name, meta = job["metadata"]["name"], job["metadata"]
    owner = {"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": meta["uid"], "controller": True}
    for i in range(job["spec"]["completions"]):
        index = {"batch.kubernetes.io/job-completion-index": str(i)}
        stub.add({"apiVersion": "v1", "kind": "Pod",
                  "metadata": {"name": f"{name}-{i}-x7k2p", "namespace": meta["namespace"], "ownerReferences": [owner],
                               "labels": {"batch.kubernetes.io/job-name": name, "job-name": name, **index},
                               "annotations": index},
                  "spec": job["spec"]["template"]["spec"], "status": {"phase": "Pending"}})


def set_field(stub: KubeStub, gv: str, plural: str, name: str, field: str, value: Any) -> None:
    with stub.lock:
        stub.store[(gv, NS, plural)][name][field] = value


def terminated(code: int, phase: str) -> dict[str, Any]:
    return {"phase": phase, "containerStatuses": [{"name": "trainer", "image": "cpn:test", "imageID": "",
                                                   "ready": False, "restartCount": 0,
                                                   "state": {"terminated": {"exitCode": code}}}]}


@pytest.fixture
def gpu_site(kube_stub: KubeStub) -> KubeStub:
    """A cluster of 4-GPU nodes whose Job controller makes pods."""
    kube_stub.add(*(make_node(f"gpu-{i}", gpu_product="NVIDIA-H100-80GB-HBM3", gpus=4) for i in range(3)),
                  make_node("cpu-0"))
    kube_stub.on("create", "jobs", job_controller)
    return kube_stub


@pytest.fixture
def driver(gpu_site: KubeStub, kubeconfig: Path) -> KubernetesDriver:
    return KubernetesDriver(kubeconfig, namespace=NS)


def env_of(job: dict[str, Any]) -> dict[str, Any]:
    container = job["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def counts(stub: KubeStub) -> list[int]:
    return [len(stub.objects(p, NS, gv)) for p, gv in
            (("jobs", "batch/v1"), ("services", "v1"), ("secrets", "v1"), ("pods", "v1"))]


# --------------------------------------------------------------------------------- manifests
@pytest.mark.parametrize(("spec", "pods"), [(spec_of(), Shape(2, 4, 4)), (spec_of(lead=True), Shape(4, 1, 0)),
                                            (spec_of(token=None), Shape(1, 8, 8))])
def test_manifests_are_valid_kubernetes(spec: AttemptSpec, pods: Shape) -> None:
    for obj in (job_manifest(spec, NS, pods, PodSettings(image="cpn:test", queue="research")),
                service_manifest(spec, NS), secret_manifest(spec, NS)):
        kubernetes_validate.validate(obj, "1.30", strict=True)


def test_names_are_dns_labels_and_deterministic() -> None:
    long = "x" * 40 + "/" + "Y_" * 40 + "/12"
    for key in (long, launch_key(spec_of()), "7b/7b-a/2"):
        name = resource_name(key)
        assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 52
        assert resource_name(key) == name
    assert resource_name("a/b-c/1") != resource_name("a-b/c/1")
    assert launch_key(spec_of()) != launch_key(spec_of(attempt=2))


def test_shape_fits_ranks_to_nodes() -> None:
    assert shape(8, 4) == Shape(2, 4, 4)
    assert shape(12, 8) == Shape(2, 6, 6)  # 12 ranks cannot fill 8-GPU nodes evenly
    assert shape(2, 8) == Shape(1, 2, 2)
    assert shape(3, 0) == Shape(3, 1, 0)  # no GPUs: a pod per rank, none requested
    assert shape(4, 0, cpu_ranks_per_pod=2) == Shape(2, 2, 0)


def test_each_pod_runs_the_sites_job_runner_on_the_gpus() -> None:
    spec = spec_of()
    name = resource_name(launch_key(spec))
    job = job_manifest(spec, NS, Shape(2, 4, 4), PodSettings(image="cpn:test", queue="research"))
    pod = job["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert container["command"] == [*RUNNER, "--ranks-per-pod", "4", "--termination-log", "/dev/termination-log"]
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert job["spec"] | {"template": None} == {"completionMode": "Indexed", "completions": 2, "parallelism": 2,
                                                "backoffLimit": 0, "ttlSecondsAfterFinished": 86400,
                                                "suspend": True, "template": None}  # Kueue unsuspends it
    assert container["resources"] == {"requests": {"nvidia.com/gpu": "4"}, "limits": {"nvidia.com/gpu": "4"}}
    assert pod["spec"]["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "research"
    assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == name
    assert pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == name
    assert container["ports"] == []  # only the lead serves the job's store
    assert "sysctls" not in pod["spec"]["securityContext"]  # no --port-range: the node's ephemeral ports
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True  # user code: no root, no privilege to gain
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    contract = next(v for v in pod["spec"]["volumes"] if v["name"] == "contract")
    assert contract["secret"] == {"secretName": name, "defaultMode": 0o400,
                                  "items": [{"key": "spec.json", "path": "spec.json"}]}
    assert {"name": "contract", "mountPath": "/var/run/cpn", "readOnly": True} in container["volumeMounts"]


def test_a_cpu_cluster_requests_no_gpus_and_sets_no_nccl() -> None:
    job = job_manifest(spec_of(), NS, Shape(8, 1, 0), PodSettings(image="cpn:test", socket_ifname="net1"))
    pod = job["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"] == {"requests": {"cpu": "1"}}
    assert "tolerations" not in pod and "kueue.x-k8s.io/queue-name" not in job["metadata"]["labels"]
    env = env_of(job)
    assert env["GLOO_SOCKET_IFNAME"] == "net1"
    assert not any(k.startswith("NCCL_") for k in env)


def test_the_pod_network_is_named_for_nccl_and_gloo() -> None:
    settings = PodSettings(image="cpn:test", socket_ifname="eth1", nccl_env={"NCCL_IB_DISABLE": "1"})
    env = {e["name"]: e.get("value") for e in container_env(spec_of(), settings, gpus=4)}
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth1"
    assert env["NCCL_IB_DISABLE"] == "1" and env["NCCL_DEBUG"] == "WARN"
    default = {e["name"]: e.get("value") for e in container_env(spec_of(), SETTINGS, gpus=4)}
    assert default["NCCL_SOCKET_IFNAME"] == default["GLOO_SOCKET_IFNAME"] == "eth0"


def test_the_pod_environment_holds_the_network_only_and_no_token() -> None:
    spec = spec_of()
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container_env(spec, SETTINGS, gpus=4)}
    assert list(env)[0] == "JOB_COMPLETION_INDEX"  # defined before the command expands it
    assert set(env) == {"JOB_COMPLETION_INDEX", "PYTHONUNBUFFERED", "HOME", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME",
                        "NCCL_DEBUG", "TORCH_NCCL_ASYNC_ERROR_HANDLING"}
    assert TOKEN not in json.dumps(env) and "secretKeyRef" not in json.dumps(env)


def test_the_runner_gives_each_pods_workers_the_job_ranks_at_the_advertised_store() -> None:
    """Pod 1 of the second site (4 ranks a pod): the environment the runner builds for its third worker."""
    share = pod_share(spec_of(), 1, 4)
    assert (share.first_rank, share.workers, list(share.ranks)) == (8, 4, [8, 9, 10, 11])
    assert share.worker_token == TOKEN and not share.leads_rendezvous
    env = worker_env(share, 10, run_dir="/var/lib/cpn/run", checkpoint_dir="/var/lib/cpn/checkpoints", base={})
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("10", "12", "2", "4")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("203.0.113.7", "41234")
    assert ".svc" not in json.dumps(env) and TOKEN not in json.dumps(env)
    with pytest.raises(ValueError, match="outside sub-task"):
        pod_share(spec_of(), 2, 4)


def test_the_port_range_sets_the_pods_ephemeral_ports() -> None:
    settings = PodSettings(image="cpn:test", port_range=PortRange(30000, 30099))
    job = job_manifest(spec_of(lead=True), NS, Shape(4, 1, 0), settings)
    kubernetes_validate.validate(job, "1.30", strict=True)
    assert job["spec"]["template"]["spec"]["securityContext"]["sysctls"] == [
        {"name": "net.ipv4.ip_local_port_range", "value": "30000 30099"}]


# ------------------------------------------------------------------------------- launch
async def test_launch_creates_secret_service_and_job(gpu_site: KubeStub, driver: KubernetesDriver) -> None:
    spec = spec_of()
    handle = await driver.launch(spec)
    name = resource_name(launch_key(spec))
    assert handle == {"namespace": NS, "name": name, "pods": 2, "ranksPerPod": 4}
    job = gpu_site.get("jobs", name, NS, gv="batch/v1")
    service, secret = gpu_site.get("services", name, NS), gpu_site.get("secrets", name, NS)
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": name}
    assert service["spec"]["ports"] == []
    assert TOKEN not in json.dumps(job) + json.dumps(handle) + json.dumps(service)
    data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert list(data) == ["spec.json"]
    assert AttemptSpec.model_validate_json(data["spec.json"]) == spec  # the whole contract, token included
    assert job["spec"]["template"]["spec"]["containers"][0]["resources"] == {"requests": {"nvidia.com/gpu": "4"},
                                                                             "limits": {"nvidia.com/gpu": "4"}}
    expected = {"app.kubernetes.io/managed-by": "cpn", "cpn.io/job": "llm", "cpn.io/subtask": "llm-gpu-west",
                "cpn.io/attempt": "1", "cpn.io/cluster": "gpu-west"}
    assert job["metadata"]["labels"] == expected == service["metadata"]["labels"] == secret["metadata"]["labels"]
    assert expected.items() <= job["spec"]["template"]["metadata"]["labels"].items()
    owner = {"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": job["metadata"]["uid"],
             "blockOwnerDeletion": False}
    assert service["metadata"]["ownerReferences"] == [owner] == secret["metadata"]["ownerReferences"]
    assert counts(gpu_site) == [1, 1, 1, 2]
    patches = [r for r in gpu_site.requests if r.method == "PATCH"]
    assert {r.headers["content-type"] for r in patches} == {"application/strategic-merge-patch+json"}


async def test_a_user_code_job_resumed_runs_the_runner_with_its_contract(gpu_site: KubeStub,
                                                                         driver: KubernetesDriver) -> None:
    """Attempt 2 of a job with spec.code: the same command as any pod (the runner fetches the bundle and
    the newest checkpoint from the contract), never the built-in LM, and the contract carries both."""
    spec = spec_of(attempt=2, code=CODE)
    handle = await driver.launch(spec)
    job = gpu_site.get("jobs", handle["name"], NS, gv="batch/v1")
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == runner_command(Shape(2, 4, 4)) == [
        *RUNNER, "--ranks-per-pod", "4", "--termination-log", "/dev/termination-log"]
    assert "cpn.runtime.train" not in json.dumps(job) and "torchrun" not in json.dumps(job)
    assert set(env_of(job)) == {"JOB_COMPLETION_INDEX", "PYTHONUNBUFFERED", "HOME", "GLOO_SOCKET_IFNAME",
                                "NCCL_SOCKET_IFNAME", "NCCL_DEBUG", "TORCH_NCCL_ASYNC_ERROR_HANDLING"}
    assert {"name": "work", "mountPath": "/var/lib/cpn"} in container["volumeMounts"]  # --job-dir: code, checkpoints
    secret = gpu_site.get("secrets", handle["name"], NS)
    contract = AttemptSpec.model_validate_json(base64.b64decode(secret["data"]["spec.json"]))
    assert (contract.attempt, contract.code, contract.worker_token) == (2, CODE, TOKEN)
    assert pod_share(contract, 1, 4).code == CODE  # each pod's share keeps the code and the attempt


async def test_the_lead_serves_the_advertised_rendezvous(gpu_site: KubeStub, driver: KubernetesDriver) -> None:
    lead, other = spec_of(lead=True), spec_of()
    await driver.launch(lead)
    await driver.launch(other)
    jobs = {j["metadata"]["labels"]["cpn.io/subtask"]: j for j in gpu_site.objects("jobs", NS, "batch/v1")}
    for spec, job in ((lead, jobs["llm-gpu-east"]), (other, jobs["llm-gpu-west"])):
        secret = gpu_site.get("secrets", job["metadata"]["name"], NS)
        contract = AttemptSpec.model_validate_json(base64.b64decode(secret["data"]["spec.json"]))
        assert contract.rendezvous == RDZV and contract == spec  # what every pod's runner reads
    container = jobs["llm-gpu-east"]["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "master", "containerPort": 41234} in container["ports"]
    service = gpu_site.get("services", resource_name(launch_key(lead)), NS)
    assert {"name": "master", "port": 41234, "targetPort": 41234} in service["spec"]["ports"]


async def test_launching_twice_makes_one_job(gpu_site: KubeStub, driver: KubernetesDriver,
                                             kubeconfig: Path) -> None:
    first = await driver.launch(spec_of())
    assert counts(gpu_site) == [1, 1, 1, 2]
    assert await driver.launch(spec_of()) == first
    assert await KubernetesDriver(kubeconfig, namespace=NS).launch(spec_of()) == first  # after a restart too
    assert counts(gpu_site) == [1, 1, 1, 2]
    assert len([r for r in gpu_site.requests if r.method == "POST" and r.path.endswith("/jobs")]) == 1
    await driver.launch(spec_of(attempt=2))  # a new attempt is a new launch
    assert len(gpu_site.objects("jobs", NS, "batch/v1")) == 2


async def test_a_foreign_job_with_the_name_is_refused(gpu_site: KubeStub, driver: KubernetesDriver) -> None:
    gpu_site.add({"apiVersion": "batch/v1", "kind": "Job",
                  "metadata": {"name": resource_name(launch_key(spec_of())), "namespace": NS},
                  "spec": {"template": {"spec": {"containers": [{"name": "x", "image": "x"}]}}}})
    with pytest.raises(DriverError, match="was not launched for"):
        await driver.launch(spec_of())


async def test_without_a_token_the_secret_holds_the_contract_only(gpu_site: KubeStub,
                                                                  driver: KubernetesDriver) -> None:
    await driver.launch(spec_of(token=None))
    (secret,) = gpu_site.objects("secrets", NS)
    assert list(secret["data"]) == ["spec.json"]
    assert AttemptSpec.model_validate_json(base64.b64decode(secret["data"]["spec.json"])).worker_token is None


async def test_a_launch_that_cannot_run_creates_nothing(gpu_site: KubeStub, kubeconfig: Path) -> None:
    with pytest.raises(DriverError, match="no container image") as err:
        await KubernetesDriver(kubeconfig, namespace=NS).launch(spec_of(image=None))
    assert err.value.field == "image"
    with pytest.raises(DriverError, match="no rendezvous"):
        await KubernetesDriver(kubeconfig, namespace=NS).launch(spec_of(rendezvous=None))
    assert counts(gpu_site) == [0, 0, 0, 0]
    await KubernetesDriver(kubeconfig, namespace=NS, image="registry.example/cpn:1").launch(spec_of(image=None))
    job = gpu_site.objects("jobs", NS, "batch/v1")[0]
    assert job["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.example/cpn:1"


async def test_gpus_per_node_from_the_nodes_or_as_given(kube_stub: KubeStub, kubeconfig: Path) -> None:
    kube_stub.add(make_node("cpu-0"), make_node("cpu-1"))
    kube_stub.on("create", "jobs", job_controller)
    cpu = await KubernetesDriver(kubeconfig, namespace=NS).launch(spec_of(lead=True))
    assert (cpu["pods"], cpu["ranksPerPod"]) == (4, 1)
    job = kube_stub.get("jobs", cpu["name"], NS, gv="batch/v1")
    assert "nvidia.com/gpu" not in json.dumps(job)
    given = await KubernetesDriver(kubeconfig, namespace=NS, gpus_per_node=8).launch(spec_of())
    assert (given["pods"], given["ranksPerPod"]) == (1, 8)


# -------------------------------------------------------------------------------- adopt
async def test_a_restarted_agent_adopts_its_jobs(gpu_site: KubeStub, driver: KubernetesDriver,
                                                 kubeconfig: Path) -> None:
    lead, other = spec_of(lead=True), spec_of()
    handles = {lead.subtask: await driver.launch(lead), other.subtask: await driver.launch(other)}
    gpu_site.add({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "someone-else", "namespace": NS},
                  "spec": {"template": {"spec": {"containers": [{"name": "x", "image": "x"}]}}}})
    restarted = KubernetesDriver(kubeconfig, namespace=NS)
    found = await restarted.adopt()
    assert sorted((s.subtask, h == handles[s.subtask]) for s, h in found) == [("llm-gpu-east", True),
                                                                             ("llm-gpu-west", True)]
    assert {s.subtask: s for s, _ in found} == {lead.subtask: lead, other.subtask: other}
    assert await KubernetesDriver(kubeconfig, namespace="elsewhere").adopt() == []
    assert (await restarted.poll(other, handles[other.subtask])).phase == "Launching"


async def test_a_job_without_its_contract_is_not_adopted(gpu_site: KubeStub, driver: KubernetesDriver) -> None:
    handle = await driver.launch(spec_of())
    with gpu_site.lock:
        del gpu_site.store[("v1", NS, "secrets")][handle["name"]]
    assert await driver.adopt() == []


# --------------------------------------------------------------------------------- poll
async def test_poll_maps_job_status_to_phases(gpu_site: KubeStub, driver: KubernetesDriver) -> None:
    spec = spec_of()
    handle = await driver.launch(spec)
    pods = sorted(p["metadata"]["name"] for p in gpu_site.pods)

    state = await driver.poll(spec, handle)
    assert state.phase == "Launching" and f"{pods[0]} (Pending)" in state.message

    set_field(gpu_site, "batch/v1", "jobs", handle["name"], "status", {"active": 2})
    for pod in pods:
        set_field(gpu_site, "v1", "pods", pod, "status", {"phase": "Running"})
    state = await driver.poll(spec, handle)
    assert state.phase == "Running" and state.message.startswith("2/2 pods running") and pods[1] in state.message

    done = {"type": "Complete", "status": "True", "reason": "CompletionsReached", "message": "Reached expected"}
    set_field(gpu_site, "batch/v1", "jobs", handle["name"], "status", {"succeeded": 2, "conditions": [done]})
    for pod in pods:
        set_field(gpu_site, "v1", "pods", pod, "status", terminated(0, "Succeeded"))
    state = await driver.poll(spec, handle)
    assert state.phase == "Succeeded" and state.exit_codes == {str(r): 0 for r in range(4, 12)}

    failed = {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
              "message": "Job has reached the specified backoff limit"}
    set_field(gpu_site, "batch/v1", "jobs", handle["name"], "status", {"failed": 1, "conditions": [failed]})
    state = await driver.poll(spec, handle)
    assert state.phase == "Failed" and state.message.startswith("BackoffLimitExceeded")


async def test_a_failed_pod_fails_the_subtask_with_its_exit_code(gpu_site: KubeStub,
                                                                 driver: KubernetesDriver) -> None:
    spec = spec_of()
    handle = await driver.launch(spec)
    second = next(p["metadata"]["name"] for p in gpu_site.pods if p["metadata"]["name"].endswith("-1-x7k2p"))
    set_field(gpu_site, "v1", "pods", second, "status", terminated(137, "Failed"))
    state = await driver.poll(spec, handle)
    assert state.phase == "Failed" and state.exit_codes == {str(r): 137 for r in range(8, 12)}  # pod 1: ranks 8..11


async def test_a_failed_pod_reports_its_runners_last_words(gpu_site: KubeStub, driver: KubernetesDriver) -> None:
    spec = spec_of()
    handle = await driver.launch(spec)
    pod = sorted(p["metadata"]["name"] for p in gpu_site.pods)[1]
    status = terminated(1, "Failed")
    status["containerStatuses"][0]["state"]["terminated"]["message"] = "rank 9 exited 1: ValueError: bad lr"
    set_field(gpu_site, "v1", "pods", pod, "status", status)
    state = await driver.poll(spec, handle)
    assert state.phase == "Failed" and state.message.endswith(f"{pod}: rank 9 exited 1: ValueError: bad lr")


# ------------------------------------------------------------------------------- cancel
async def test_cancel_deletes_the_job_and_its_pods(gpu_site: KubeStub, driver: KubernetesDriver,
                                                   kubeconfig: Path) -> None:
    spec = spec_of()
    handle = await driver.launch(spec)
    await driver.cancel(spec, handle)
    assert counts(gpu_site) == [0, 0, 0, 0]
    delete = next(r for r in gpu_site.requests if r.method == "DELETE" and "/jobs/" in r.path)
    assert delete.query["propagationPolicy"] == "Background"
    assert (await driver.poll(spec, handle)).phase == "Cancelled"
    await driver.cancel(spec, handle)  # again: nothing left, no error
    assert (await KubernetesDriver(kubeconfig, namespace=NS).poll(spec, handle)).phase == "Lost"


async def test_cancel_after_success_stays_succeeded(gpu_site: KubeStub, driver: KubernetesDriver) -> None:
    spec = spec_of()
    handle = await driver.launch(spec)
    set_field(gpu_site, "batch/v1", "jobs", handle["name"], "status", {"succeeded": 2})
    driver._cancelled.add(handle["name"])  # cancel sent, the Job not deleted yet
    assert (await driver.poll(spec, handle)).phase == "Succeeded"


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
        if req.match["pod"] not in self.lines:
            return 400, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 400,
                         "reason": "BadRequest", "message": "container \"trainer\" is waiting to start"}
        since = req.query.get("sinceSeconds")
        cutoff = datetime.now(UTC) - timedelta(seconds=int(since)) if since else datetime.min.replace(tzinfo=UTC)
        stamp = req.query.get("timestamps") == "true"
        out = [f"{at.strftime('%Y-%m-%dT%H:%M:%S.%f')}Z {line}" if stamp else line
               for at, line in self.lines[req.match["pod"]] if at >= cutoff]
        return 200, "".join(f"{line}\n" for line in out)[: int(req.query.get("limitBytes") or 10**9)]


async def test_logs_by_rank_since_the_cursor(gpu_site: KubeStub, driver: KubernetesDriver) -> None:
    logs = PodLogs(gpu_site)
    spec = spec_of()
    handle = await driver.launch(spec)
    pod0, pod1 = sorted(p["metadata"]["name"] for p in gpu_site.pods)
    logs.write(pod0, "[rank4]:step 1 loss 4.2", "[rank7]: step 1 loss 4.3", "resuming from the checkpoint of step 4",
               "[rank0]: not a rank of this sub-task")
    lines, cursor = await driver.logs(spec, handle, {})
    assert lines == [LogLine(4, "step 1 loss 4.2"), LogLine(7, "step 1 loss 4.3"),
                     LogLine(4, "resuming from the checkpoint of step 4"),  # the runner's own: the pod's first rank
                     LogLine(4, "[rank0]: not a rank of this sub-task")]
    assert json.loads(json.dumps(cursor)) == cursor  # the agent keeps it as JSON

    logs.write(pod0, "[rank4]:step 2", "[rank4]:step 2")  # the same line twice is still two lines
    logs.write(pod1, "[rank9]:step 2", "runner on pod 1")
    lines, cursor = await driver.logs(spec, handle, cursor)
    assert lines == [LogLine(4, "step 2"), LogLine(4, "step 2"), LogLine(9, "step 2"), LogLine(8, "runner on pod 1")]
    assert (await driver.logs(spec, handle, cursor))[0] == []


# ------------------------------------------------------------------------------- errors
async def test_api_errors_become_driver_errors(gpu_site: KubeStub, kubeconfig: Path, tmp_path: Path) -> None:
    gpu_site.token = "rotated"
    with pytest.raises(DriverError, match="HTTP 401"):
        await KubernetesDriver(kubeconfig, namespace=NS).launch(spec_of())
    down = KubeStub(token="t")
    with down:
        path = down.write_kubeconfig(tmp_path / "down")
    with pytest.raises(DriverError, match="unreachable"):
        await KubernetesDriver(path, namespace=NS).poll(spec_of(), {"name": "x", "namespace": NS})


async def test_a_broken_kubeconfig_names_the_option(tmp_path: Path) -> None:
    (tmp_path / "kc").write_text("apiVersion: v1\nkind: Config\nclusters: []\n")
    for path in (tmp_path / "kc", tmp_path / "missing"):
        with pytest.raises(DriverError, match=str(path)) as err:
            await KubernetesDriver(path, namespace=NS).adopt()
        assert err.value.field == "kubeconfig"
