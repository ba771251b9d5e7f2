"""The `kubernetes` driver: runs one sub-task of a job attempt as an Indexed Job on the site's own
Kubernetes, one pod per node. Each pod runs the same job runner as the `local` driver
(:mod:`cpn.runtime.jobrunner`) for its share of the sub-task's ranks, so both kinds of site behave
alike: the runner reads the contract from the mounted Secret, fetches, verifies and unpacks the
user's code bundle (``spec.code``), resumes from the newest complete checkpoint in the server's blob
store (or starts cleanly and says so), copies every new checkpoint there, relays metrics with the
per-attempt worker token and uploads the final weights. The site agent builds the driver
(`cpn agent --kubeconfig PATH [--context C]`) and it talks to that cluster only; the API server
never calls a site's Kubernetes API.

Per (job, attempt, sub-task) it creates three objects under one deterministic name:

    Secret   the whole attempt contract (`spec.json`; it holds the worker token), mounted read-only
             at /var/run/cpn/spec.json: the token is never in the Job spec, the environment or a
             command line.
    Service  headless, selecting the Job's pods (they are `<name>-<i>.<name>.<ns>.svc`); the
             sub-task holding global rank 0 publishes the job-wide rendezvous port on it.
    Job      completionMode Indexed, completions = parallelism = pods, backoffLimit 0

The Job is created last: once it exists the launch has happened, and launching the same key again
returns the same handle. Service and Secret are then owned by the Job, so Kubernetes collects them
with it. Every object carries `cpn.io/job`, `cpn.io/attempt`, `cpn.io/subtask`, `cpn.io/cluster`
and managed-by=cpn: a restarted agent finds its Jobs by label and reads each contract back from
its Secret (:meth:`KubernetesDriver.adopt`).

Ranks: pod `i` runs global ranks ``first_rank + i*R .. first_rank + (i+1)*R - 1`` (R ranks per
pod, the `--ranks-per-pod` of its command), each a process with :func:`cpn.runtime.contract.worker_env`'s
environment, built inside the pod from the contract: the same function the local runner uses. No
torchrun: every worker meets the others directly at the job-wide store. The pod's log carries each
worker's lines prefixed `[rank<global rank>]:`; the pod's exit code is its first failed worker's,
and its termination message the runner's last word (the failure, or how it resumed).

Rendezvous across sites, and its limits. The job-wide store is at `spec.rendezvous` — the address
the first site's agent advertised, never a cluster-local `.svc` name — so sub-tasks on different
Kubernetes clusters can meet. Global rank 0 (pod 0 of the sub-task with `first_rank == 0`) serves
that store on `spec.rendezvous.port` inside its pod; the driver publishes that port on pod 0's
container and on the headless Service, without hostNetwork. Routing the advertised address to it
is the provider's part: run the agent with `--advertise-address` naming a LoadBalancer, NodePort
or gateway that forwards the port to pod 0 (select `batch.kubernetes.io/job-name=<name>` and
`batch.kubernetes.io/job-completion-index=0`); with `--port-range LO-HI` the agent picks that port
from one range, so one route (or firewall rule) serves every attempt, and the pods' own ephemeral
ports (where Gloo and NCCL listen) come from the same range (the namespaced, Kubernetes-safe sysctl
`net.ipv4.ip_local_port_range`). The collectives then connect pod to pod on the addresses the pods
register in that store, so pods of different clusters must reach each other's pod IPs (a flat or
meshed pod network: Submariner, Cilium Cluster Mesh, …); behind NAT they cannot, and the attempt
fails at its first collective, reported as a failed sub-task. `NCCL_SOCKET_IFNAME` /
`GLOO_SOCKET_IFNAME` name the pod's interface (`eth0` unless configured). The pod's working
directory (checkpoints, code) is an emptyDir; what outlives the pod is in the server's blob store.

The kubernetes client is synchronous; the driver calls it in a thread. Its errors become
:class:`DriverError` here, at the edge.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException, OpenApiException
from kubernetes.config.config_exception import ConfigException
from pydantic import ValidationError

from cpn.runtime.contract import AttemptSpec
from cpn.runtime.launcher import PortRange, agent_port_range
from cpn.runtime.ranklog import RANK_LINE
from layers.resource.discovery.kubernetes import GPU_RESOURCE
from layers.resource.drivers.base import DriverError, LogLine, SubtaskState
from layers.resource.schemas import KubernetesRef, Toleration

__all__ = ["KubernetesDriver", "PodSettings", "Shape", "container_env", "job_manifest", "launch_key", "pod_spec",
           "resource_name", "runner_command", "secret_manifest", "service_manifest", "shape"]

log = logging.getLogger("cpn.agent.kubernetes")

GPU_TOLERATION = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}  # tainted GPU nodes
CONTAINER = "trainer"
TTL_SECONDS = 24 * 3600
REQUEST_TIMEOUT = 15.0
MAX_NAME = 52  # pod hostnames are `<job name>-<index>`, a 63-character DNS label
MAX_LOG_BYTES = 256 * 1024  # per pod and poll: a chatty worker cannot flood the agent's report
CONTRACT_DIR = "/var/run/cpn"
SPEC_KEY = "spec.json"
WORK_DIR = "/var/lib/cpn"  # the runner's job directory: checkpoints/, code/<digest>/
RUN_DIR = f"{WORK_DIR}/run"
HOME_DIR = f"{WORK_DIR}/home"  # the root filesystem is read-only: caches go to the pod's emptyDir
POD_USER = 65532  # non-root (the distroless "nonroot" uid); the emptyDirs and the contract are its group's
CONTAINER_SECURITY = {"runAsNonRoot": True, "runAsUser": POD_USER, "runAsGroup": POD_USER,
                      "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                      "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}
TERMINATION_LOG = "/dev/termination-log"  # Kubernetes' default terminationMessagePath
PORT_RANGE_SYSCTL = "net.ipv4.ip_local_port_range"  # namespaced and "safe": allowed in any pod
NCCL_DEFAULTS = {"NCCL_DEBUG": "WARN", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}  # a dead peer raises, not hangs

JOB_NAME_LABEL = "batch.kubernetes.io/job-name"  # set on the pods by the Job controller
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"  # pod annotation (and label since 1.28)
MANAGED_BY = ("app.kubernetes.io/managed-by", "cpn")
LABEL_JOB, LABEL_ATTEMPT, LABEL_SUBTASK, LABEL_CLUSTER = "cpn.io/job", "cpn.io/attempt", "cpn.io/subtask", "cpn.io/cluster"
LAUNCH_KEY = "cpn.io/launch-key"
RANKS_PER_POD = "cpn.io/ranks-per-pod"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
POD_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"  # scheduler-plugins coscheduling
VOLCANO_GROUP = "scheduling.k8s.io/group-name"  # Volcano


# ---------------------------------------------------------------------------------------- names
def launch_key(spec: AttemptSpec) -> str:
    return f"{spec.job}/{spec.subtask}/{spec.attempt}"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def resource_name(key: str) -> str:
    """The DNS-1035 name of a launch's objects: the slugged key (cut to fit) and a hash of the key,
    so keys that slug alike still get different names."""
    slug = _slug(key)
    if not slug[:1].isalpha():
        slug = f"cpn-{slug}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:8]
    return f"{slug[: MAX_NAME - 9].rstrip('-')}-{digest}"


def _label_value(text: str) -> str:
    """A label value (≤63, alphanumeric ends); long or unusual values keep a hash of the original."""
    clean = re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-_.")
    if len(clean) <= 63 and clean == text:
        return clean
    return f"{clean[:54].rstrip('-_.')}-{hashlib.sha256(text.encode()).hexdigest()[:8]}"


# ------------------------------------------------------------------------------------- manifests
@dataclass(frozen=True, kw_only=True)
class PodSettings:
    """What the provider tunes about the pods: the cluster's `spec.kubernetes` and the agent's options."""

    image: str
    socket_ifname: str = "eth0"
    nccl_env: Mapping[str, str] | None = None
    queue: str | None = None  # a Kueue LocalQueue: the Job is labelled for it and created suspended
    port_range: PortRange | None = None  # the pods' ephemeral ports (Gloo's, NCCL's) from this range
    priority_class_name: str | None = None
    node_selector: Mapping[str, str] | None = None
    tolerations: tuple[Toleration, ...] = ()


@dataclass(frozen=True)
class Shape:
    pods: int
    ranks_per_pod: int
    gpus_per_pod: int


def shape(workers: int, gpus_per_node: int, cpu_ranks_per_pod: int = 1) -> Shape:
    """Pods for the sub-task's ranks: the most ranks per pod that divide them evenly and fit a node's
    GPUs (or `cpu_ranks_per_pod` on a cluster without GPUs), so pods × ranks per pod = workers."""
    fit = gpus_per_node or cpu_ranks_per_pod
    per_pod = max(n for n in range(1, min(max(fit, 1), workers) + 1) if workers % n == 0)
    return Shape(workers // per_pod, per_pod, per_pod if gpus_per_node else 0)


def labels(spec: AttemptSpec) -> dict[str, str]:
    return {MANAGED_BY[0]: MANAGED_BY[1], LABEL_JOB: _label_value(spec.job), LABEL_ATTEMPT: str(spec.attempt),
            LABEL_SUBTASK: _label_value(spec.subtask), LABEL_CLUSTER: _label_value(spec.cluster)}


def _metadata(spec: AttemptSpec, namespace: str) -> dict[str, Any]:
    return {"name": resource_name(launch_key(spec)), "namespace": namespace, "labels": labels(spec),
            "annotations": {LAUNCH_KEY: launch_key(spec)}}


def _ports(spec: AttemptSpec) -> list[tuple[str, int]]:
    """Only the lead sub-task serves a port: the job-wide store, on its pod 0."""
    if spec.leads_rendezvous and spec.rendezvous is not None:
        return [("master", spec.rendezvous.port)]
    return []


def service_manifest(spec: AttemptSpec, namespace: str) -> dict[str, Any]:
    """Headless, and publishing pods before they are ready, so their names resolve at once."""
    name = resource_name(launch_key(spec))
    return {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(spec, namespace),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": {JOB_NAME_LABEL: name},
                     "ports": [{"name": n, "port": p, "targetPort": p} for n, p in _ports(spec)]}}


def secret_manifest(spec: AttemptSpec, namespace: str) -> dict[str, Any]:
    """The contract, token included: the pod's job runner reads it from the mounted file."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": _metadata(spec, namespace),
            "data": {SPEC_KEY: base64.b64encode(spec.model_dump_json().encode()).decode()}}


def _network_env(settings: PodSettings, gpus: int) -> dict[str, str]:
    env = {"GLOO_SOCKET_IFNAME": settings.socket_ifname}
    if gpus:
        env |= {"NCCL_SOCKET_IFNAME": settings.socket_ifname, **NCCL_DEFAULTS, **(settings.nccl_env or {})}
    return env


def container_env(spec: AttemptSpec, settings: PodSettings, gpus: int) -> list[dict[str, Any]]:
    """The runner's environment: the pod's completion index and the network. The workers' own
    environment the runner builds in the pod from the contract (:func:`cpn.runtime.contract.worker_env`),
    as the local runner does; the worker token stays in the mounted contract."""
    if spec.rendezvous is None:
        raise DriverError(f"{launch_key(spec)}: the contract has no rendezvous endpoint yet")
    env: list[dict[str, Any]] = [  # first, so that $(JOB_COMPLETION_INDEX) expands in the command
        {"name": "JOB_COMPLETION_INDEX",
         "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX}']"}}}]
    plain = {"PYTHONUNBUFFERED": "1", "HOME": HOME_DIR, **_network_env(settings, gpus)}
    return env + [{"name": k, "value": v} for k, v in plain.items()]


def runner_command(pods: Shape) -> list[str]:
    """The pod's command: the job runner for pod $(JOB_COMPLETION_INDEX)'s share of the sub-task."""
    return ["python", "-m", "cpn.runtime.jobrunner", RUN_DIR, "--contract", f"{CONTRACT_DIR}/{SPEC_KEY}",
            "--job-dir", WORK_DIR, "--pod-index", "$(JOB_COMPLETION_INDEX)", "--ranks-per-pod",
            str(pods.ranks_per_pod), "--termination-log", TERMINATION_LOG]


def _resources(pods: Shape) -> dict[str, Any]:
    """A GPU pod requests (and is limited to) its ranks' GPUs, which the device plugin gives it and Kueue
    counts against the queue's quota; a CPU pod requests a core per rank."""
    if pods.gpus_per_pod:
        gpus = {GPU_RESOURCE: str(pods.gpus_per_pod)}
        return {"requests": dict(gpus), "limits": gpus}
    return {"requests": {"cpu": str(pods.ranks_per_pod)}}


def _tolerations(settings: PodSettings, gpus: int) -> list[dict[str, Any]]:
    """The cluster's tolerations, and on GPU pods the GPU nodes' usual taint (once)."""
    out = [t.wire() for t in settings.tolerations]
    if gpus and GPU_TOLERATION not in out:
        out.insert(0, dict(GPU_TOLERATION))
    return out


def _container(spec: AttemptSpec, pods: Shape, settings: PodSettings) -> dict[str, Any]:
    resources = _resources(pods)
    return {"name": CONTAINER, "image": settings.image, "command": runner_command(pods),
            "env": container_env(spec, settings, pods.gpus_per_pod),
            "ports": [{"name": n, "containerPort": p} for n, p in _ports(spec)], "resources": resources,
            "terminationMessagePath": TERMINATION_LOG, "terminationMessagePolicy": "FallbackToLogsOnError",
            "securityContext": CONTAINER_SECURITY,
            "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"},
                             {"name": "contract", "mountPath": CONTRACT_DIR, "readOnly": True},
                             {"name": "work", "mountPath": WORK_DIR}, {"name": "tmp", "mountPath": "/tmp"}]}


def pod_spec(spec: AttemptSpec, pods: Shape, settings: PodSettings) -> dict[str, Any]:
    """The pod spec of every pod of a sub-task's Job: the runner container, its volumes, and where the
    cluster lets it run (priority class, node selector, tolerations). Pure: no API call."""
    name = resource_name(launch_key(spec))
    out: dict[str, Any] = {
        "subdomain": name, "restartPolicy": "Never", "enableServiceLinks": False,
        "automountServiceAccountToken": False,  # workers never call the Kubernetes API
        "containers": [_container(spec, pods, settings)],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}},
                    {"name": "contract", "secret": {"secretName": name, "defaultMode": 0o400,
                                                    "items": [{"key": SPEC_KEY, "path": SPEC_KEY}]}},
                    {"name": "work", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}],
        # user code runs here: not root, no privilege to gain, nothing written outside the emptyDirs
        "securityContext": {"runAsNonRoot": True, "fsGroup": POD_USER, "seccompProfile": {"type": "RuntimeDefault"}}}
    if tolerations := _tolerations(settings, pods.gpus_per_pod):
        out["tolerations"] = tolerations
    if settings.node_selector:
        out["nodeSelector"] = dict(settings.node_selector)
    if settings.priority_class_name:
        out["priorityClassName"] = settings.priority_class_name
    if settings.port_range is not None:
        out["securityContext"]["sysctls"] = [{"name": PORT_RANGE_SYSCTL, "value":
                                              f"{settings.port_range.low} {settings.port_range.high}"}]
    return out


def job_manifest(spec: AttemptSpec, namespace: str, pods: Shape, settings: PodSettings) -> dict[str, Any]:
    """The Indexed Job of one sub-task: `pods.pods` pods of `pods.ranks_per_pod` ranks each. With a
    queue it is created suspended and labelled for Kueue, which unsuspends it once the whole gang fits."""
    name = resource_name(launch_key(spec))
    meta = _metadata(spec, namespace)
    meta["annotations"][RANKS_PER_POD] = str(pods.ranks_per_pod)
    if settings.queue:
        meta["labels"][QUEUE_LABEL] = _label_value(settings.queue)
    template = {"metadata": {"labels": {**labels(spec), POD_GROUP_LABEL: name},
                             "annotations": {VOLCANO_GROUP: name, LAUNCH_KEY: launch_key(spec)}},
                "spec": pod_spec(spec, pods, settings)}
    job_spec = {"completionMode": "Indexed", "completions": pods.pods, "parallelism": pods.pods,
                "backoffLimit": 0, "ttlSecondsAfterFinished": TTL_SECONDS, "template": template}
    if settings.queue:
        job_spec["suspend"] = True
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": job_spec}


# ------------------------------------------------------------------------------------ API calls
def _describe(exc: OpenApiException) -> str:
    status, reason = getattr(exc, "status", None), getattr(exc, "reason", None)
    if not status:
        return str(exc).splitlines()[0]
    try:
        message = json.loads(getattr(exc, "body", None) or "{}").get("message")
    except (ValueError, AttributeError):
        message = None
    return f"HTTP {status} {reason}" + (f": {message}" if message else "")


def _create(fn: Callable[..., Any], namespace: str, body: dict[str, Any]) -> None:
    """Create, unless it already exists (HTTP 409)."""
    try:
        fn(namespace, body, _request_timeout=REQUEST_TIMEOUT)
    except ApiException as exc:
        if exc.status != 409:
            raise


def _delete(fn: Callable[..., Any], name: str, namespace: str, **kwargs: Any) -> None:
    try:  # raw response: the server answers some deletes with a Status, some with the object
        response = fn(name, namespace, _preload_content=False, _request_timeout=REQUEST_TIMEOUT, **kwargs)
        response.read()
        response.release_conn()
    except ApiException as exc:
        if exc.status != 404:
            raise


def _read(fn: Callable[..., Any], name: str, namespace: str) -> Any:
    """The object, or None when it does not exist."""
    try:
        return fn(name, namespace, _request_timeout=REQUEST_TIMEOUT)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def _pods(core: k8s.CoreV1Api, name: str, namespace: str) -> list[tuple[int, Any]]:
    """The Job's pods with their completion index, in index order."""
    pods = sorted(core.list_namespaced_pod(namespace, label_selector=f"{JOB_NAME_LABEL}={name}",
                                           _request_timeout=REQUEST_TIMEOUT).items, key=lambda p: p.metadata.name)
    return sorted(((_index(pod, order), pod) for order, pod in enumerate(pods)), key=lambda ip: ip[0])


def _index(pod: Any, order: int) -> int:
    meta = pod.metadata
    raw = (meta.annotations or {}).get(COMPLETION_INDEX) or (meta.labels or {}).get(COMPLETION_INDEX)
    return int(raw) if raw and raw.isdigit() else order


# ----------------------------------------------------------------------------------------- state
def _condition(job: Any, kind: str) -> Any:
    return next((c for c in (job.status.conditions if job.status else None) or []
                 if c.type == kind and c.status == "True"), None)


def _exit_codes(spec: AttemptSpec, pods: list[tuple[int, Any]], per_pod: int) -> dict[str, int]:
    """Each terminated pod's exit code (its runner's, for all of its ranks), keyed by global rank."""
    codes = {}
    for index, pod in pods:
        for cs in (pod.status.container_statuses if pod.status else None) or []:
            if cs.name == CONTAINER and cs.state and cs.state.terminated:
                first = spec.first_rank + index * per_pod
                codes |= {str(rank): cs.state.terminated.exit_code for rank in range(first, first + per_pod)}
    return codes


def _last_words(pods: list[tuple[int, Any]]) -> str:
    """The termination message of the first pod whose runner failed (which rank, and why)."""
    for _, pod in pods:
        for cs in (pod.status.container_statuses if pod.status else None) or []:
            done = cs.state.terminated if cs.name == CONTAINER and cs.state else None
            if done is not None and done.exit_code and done.message:
                return f"{pod.metadata.name}: {done.message.strip()[-500:]}"
    return ""


def job_state(spec: AttemptSpec, job: Any, pods: list[tuple[int, Any]], *, cancelled: bool = False) -> SubtaskState:
    """The sub-task's phase from its Job's status and its pods'."""
    status, completions = job.status, job.spec.completions or 1
    per_pod = int((job.metadata.annotations or {}).get(RANKS_PER_POD, "1"))
    phases = {p.metadata.name: (p.status.phase if p.status else None) or "Pending" for _, p in pods}
    listing = ", ".join(f"{name} ({phase})" for name, phase in phases.items()) or "no pods yet"
    codes = _exit_codes(spec, pods, per_pod)
    if _condition(job, "Complete") or (status and (status.succeeded or 0) >= completions):
        return SubtaskState("Succeeded", f"pods: {listing}", codes)
    if cancelled:
        return SubtaskState("Cancelled", f"cancelled; pods: {listing}", codes)
    failed = _condition(job, "Failed")
    if failed or (status and status.failed) or "Failed" in phases.values():
        why = f"{failed.reason}: {failed.message}" if failed else "a worker pod failed"
        said = _last_words(pods)
        return SubtaskState("Failed", f"{why}; pods: {listing}" + (f"; {said}" if said else ""), codes)
    running = sum(1 for phase in phases.values() if phase == "Running")
    if running:
        return SubtaskState("Running", f"{running}/{completions} pods running: {listing}", codes)
    waiting = "suspended, waiting for admission" if job.spec.suspend else "waiting for pods"
    return SubtaskState("Launching", f"{waiting}; pods: {listing}", codes)


def _handle(job: Any) -> dict[str, Any]:
    meta = job.metadata
    return {"namespace": meta.namespace, "name": meta.name, "pods": job.spec.completions or 1,
            "ranksPerPod": int((meta.annotations or {}).get(RANKS_PER_POD, "1"))}


# ---------------------------------------------------------------------------------------- driver
class KubernetesDriver:
    """Launches sub-tasks on the Kubernetes cluster at `kubeconfig` (in-cluster config when None).

    Where the pods go and what they run come from the cluster's `spec.kubernetes`
    (:meth:`use_cluster`; the agent calls it at start and after every heartbeat, whose answer is the
    cluster's manifest, so an applied change takes effect at the next launch). `namespace` and
    `image` given here (the agent's --namespace and --image) override the cluster's."""

    name = "kubernetes"

    def __init__(self, kubeconfig: Path | None = None, context: str | None = None, namespace: str | None = None,
                 image: str | None = None, *, gpus_per_node: int | None = None, socket_ifname: str = "eth0",
                 nccl_env: Mapping[str, str] | None = None, cluster: KubernetesRef | None = None,
                 cpu_ranks_per_pod: int = 1, port_range: PortRange | None = None):
        self.kubeconfig, self.context = kubeconfig, context
        self._namespace_flag, self._image_flag = namespace, image
        self.port_range = port_range or agent_port_range()  # default: the agent's --port-range
        self.gpus_per_node = gpus_per_node  # None: read from the nodes at the first launch
        self.socket_ifname, self.nccl_env = socket_ifname, dict(nccl_env or {})
        self.cpu_ranks_per_pod = cpu_ranks_per_pod
        self._client: k8s.ApiClient | None = None
        self._lock = threading.Lock()
        self._cancelled: set[str] = set()
        self.use_cluster(cluster)

    def use_cluster(self, cluster: KubernetesRef | None) -> None:
        """Take the cluster's registered settings (validated by the server when they were applied)."""
        self.cluster = cluster or KubernetesRef()
        self.namespace = self._namespace_flag or self.cluster.namespace
        self.image = self._image_flag or self.cluster.image

    @property
    def server(self) -> str:
        """The API server URL the kubeconfig (or in-cluster configuration) points at."""
        return str(self._api_client().configuration.host)

    # ------------------------------------------------------------ connection
    def _api_client(self) -> k8s.ApiClient:
        with self._lock:
            if self._client is None:
                self._client = self._load()
            return self._client

    def _load(self) -> k8s.ApiClient:
        try:
            if self.kubeconfig is not None:
                return k8s_config.new_client_from_config(config_file=str(self.kubeconfig), context=self.context,
                                                         persist_config=False)
            config = k8s.Configuration()
            k8s_config.load_incluster_config(client_configuration=config)
            return k8s.ApiClient(config)
        except (ConfigException, OSError, ValueError) as exc:
            where = f"kubeconfig {self.kubeconfig}" if self.kubeconfig else "in-cluster configuration"
            raise DriverError(f"{where}: {exc}", field="kubeconfig") from exc

    @contextmanager
    def _apis(self) -> Iterator[tuple[k8s.CoreV1Api, k8s.BatchV1Api]]:
        """Core and batch APIs; kubernetes and urllib3 errors leave as DriverError."""
        api_client = self._api_client()
        host = api_client.configuration.host
        try:
            yield k8s.CoreV1Api(api_client), k8s.BatchV1Api(api_client)
        except OpenApiException as exc:
            raise DriverError(f"Kubernetes API at {host}: {_describe(exc)}") from exc
        except urllib3.exceptions.HTTPError as exc:
            raise DriverError(f"Kubernetes API at {host} is unreachable: {exc}") from exc

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def _node_gpus(self, core: k8s.CoreV1Api) -> int:
        """GPUs per node: the largest allocatable `nvidia.com/gpu` of the cluster's nodes (0: no GPUs)."""
        if self.gpus_per_node is None:
            nodes = core.list_node(_request_timeout=REQUEST_TIMEOUT).items
            self.gpus_per_node = max((int((n.status.allocatable or {}).get(GPU_RESOURCE, 0) or 0)
                                      for n in nodes if n.status), default=0)
        return self.gpus_per_node

    # ------------------------------------------------------------ the interface
    async def launch(self, spec: AttemptSpec) -> dict[str, Any]:
        return await asyncio.to_thread(self._launch, spec)

    async def poll(self, spec: AttemptSpec, handle: dict[str, Any]) -> SubtaskState:
        return await asyncio.to_thread(self._poll, spec, handle)

    async def cancel(self, spec: AttemptSpec, handle: dict[str, Any]) -> None:
        await asyncio.to_thread(self._cancel, handle)

    async def adopt(self) -> list[tuple[AttemptSpec, dict[str, Any]]]:
        return await asyncio.to_thread(self._adopt)

    async def logs(self, spec: AttemptSpec, handle: dict[str, Any],
                   cursor: dict[str, Any]) -> tuple[list[LogLine], dict[str, Any]]:
        return await asyncio.to_thread(self._logs, spec, handle, cursor)

    # ------------------------------------------------------------ in a thread
    def _settings(self, spec: AttemptSpec) -> PodSettings:
        image = spec.image or self.image
        if not image:
            raise DriverError(f"{launch_key(spec)}: no container image: set the cluster's spec.kubernetes.image, "
                              "run the agent with --image, or give the job spec.image", field="image")
        kube = self.cluster
        return PodSettings(image=image, socket_ifname=self.socket_ifname, nccl_env=self.nccl_env, queue=kube.queue,
                           port_range=self.port_range, priority_class_name=kube.priority_class_name,
                           node_selector=kube.node_selector, tolerations=tuple(kube.tolerations))

    def _launch(self, spec: AttemptSpec) -> dict[str, Any]:
        key, namespace = launch_key(spec), self.namespace
        name = resource_name(key)
        with self._apis() as (core, batch):
            job = _read(batch.read_namespaced_job, name, namespace)
            if job is None:
                settings = self._settings(spec)
                pods = shape(spec.workers, self._node_gpus(core), self.cpu_ranks_per_pod)
                body = job_manifest(spec, namespace, pods, settings)  # before any object: bad input creates none
                _create(core.create_namespaced_service, namespace, service_manifest(spec, namespace))
                _create(core.create_namespaced_secret, namespace, secret_manifest(spec, namespace))
                _create(batch.create_namespaced_job, namespace, body)
                job = batch.read_namespaced_job(name, namespace, _request_timeout=REQUEST_TIMEOUT)
            if (job.metadata.annotations or {}).get(LAUNCH_KEY) != key:
                raise DriverError(f"Job {namespace}/{name} exists but was not launched for {key}; "
                                  "delete it or rename the job")
            self._own(core, job)
        return _handle(job)

    def _own(self, core: k8s.CoreV1Api, job: Any) -> None:
        """Make the Job own its Service and Secret, so they go when it goes (once)."""
        name, namespace = job.metadata.name, job.metadata.namespace
        owner = {"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": job.metadata.uid,
                 "blockOwnerDeletion": False}
        patch = {"_content_type": "application/strategic-merge-patch+json", "_request_timeout": REQUEST_TIMEOUT}
        for read, write in ((core.read_namespaced_service, core.patch_namespaced_service),
                            (core.read_namespaced_secret, core.patch_namespaced_secret)):
            current = _read(read, name, namespace)
            refs = (current.metadata.owner_references or []) if current is not None else None
            if refs is not None and not any(r.uid == job.metadata.uid for r in refs):
                write(name, namespace, {"metadata": {"ownerReferences": [owner]}}, **patch)

    def _poll(self, spec: AttemptSpec, handle: dict[str, Any]) -> SubtaskState:
        name, namespace = handle["name"], handle["namespace"]
        with self._apis() as (core, batch):
            job = _read(batch.read_namespaced_job, name, namespace)
            if job is None:
                if name in self._cancelled:
                    return SubtaskState("Cancelled", f"Job {namespace}/{name} deleted")
                return SubtaskState("Lost", f"Job {namespace}/{name} is gone")
            return job_state(spec, job, _pods(core, name, namespace), cancelled=name in self._cancelled)

    def _cancel(self, handle: dict[str, Any]) -> None:
        name, namespace = handle["name"], handle["namespace"]
        self._cancelled.add(name)
        with self._apis() as (core, batch):
            _delete(batch.delete_namespaced_job, name, namespace, propagation_policy="Background")
            _delete(core.delete_namespaced_service, name, namespace)
            _delete(core.delete_namespaced_secret, name, namespace)

    def _adopt(self) -> list[tuple[AttemptSpec, dict[str, Any]]]:
        found = []
        with self._apis() as (core, batch):
            jobs = batch.list_namespaced_job(self.namespace, label_selector="=".join(MANAGED_BY),
                                             _request_timeout=REQUEST_TIMEOUT).items
            for job in sorted(jobs, key=lambda j: j.metadata.name):
                spec = self._contract(core, job)
                if spec is not None:
                    found.append((spec, _handle(job)))
        return found

    def _contract(self, core: k8s.CoreV1Api, job: Any) -> AttemptSpec | None:
        """The contract a Job was launched with, from its Secret (None, logged, if it cannot be read)."""
        name, namespace = job.metadata.name, job.metadata.namespace
        secret = _read(core.read_namespaced_secret, name, namespace)
        try:
            raw = base64.b64decode((secret.data or {})[SPEC_KEY]) if secret is not None else None
            spec = AttemptSpec.model_validate_json(raw) if raw is not None else None
        except (KeyError, ValueError, ValidationError) as exc:
            log.warning("Job %s/%s: its contract cannot be read (%s); not adopting it", namespace, name, exc)
            return None
        if spec is None or (job.metadata.annotations or {}).get(LAUNCH_KEY) != launch_key(spec):
            log.warning("Job %s/%s: no matching contract in Secret %s; not adopting it", namespace, name, name)
            return None
        return spec

    def _logs(self, spec: AttemptSpec, handle: dict[str, Any],
              cursor: dict[str, Any]) -> tuple[list[LogLine], dict[str, Any]]:
        name, namespace, per_pod = handle["name"], handle["namespace"], int(handle.get("ranksPerPod", 1))
        now, cursor, out = datetime.now(UTC), dict(cursor), []
        with self._apis() as (core, _):
            for index, pod in _pods(core, name, namespace):
                pod_name = pod.metadata.name
                seen = tuple(cursor.get(pod_name) or ("", 0))
                try:
                    text = core.read_namespaced_pod_log(
                        pod_name, namespace, container=CONTAINER, timestamps=True, limit_bytes=MAX_LOG_BYTES,
                        since_seconds=_since_seconds(seen[0], now), _request_timeout=REQUEST_TIMEOUT)
                except ApiException as exc:
                    if exc.status in (400, 404):  # not started yet, or gone
                        continue
                    raise
                lines, cursor[pod_name] = _fresh(_whole_lines(text or ""), seen)
                out += [_rank_line(spec, spec.first_rank + index * per_pod, line) for line in lines]
        return out, cursor


# ------------------------------------------------------------------------------------------ logs
def _whole_lines(text: str) -> str:
    """The text up to its last newline when a byte limit cut it (the rest comes next time)."""
    if len(text.encode()) >= MAX_LOG_BYTES and not text.endswith("\n"):
        return text[: text.rfind("\n") + 1] or text
    return text


def _rank_line(spec: AttemptSpec, pod_rank: int, line: str) -> LogLine:
    """The runner prefixes each worker's line with its global rank; its own lines go to the pod's first."""
    m = RANK_LINE.fullmatch(line)
    if m and int(m[1]) in spec.ranks:
        return LogLine(int(m[1]), m[2])
    return LogLine(pod_rank, line)


def _since_seconds(last: str, now: datetime) -> int | None:
    if not last:
        return None
    try:
        at = datetime.fromisoformat(last[:26].rstrip("Z") + "+00:00")
    except ValueError:
        return None
    return max(1, int((now - at).total_seconds()) + 2)


def _ts_key(stamp: str) -> str:
    """RFC3339Nano with the fraction padded to 9 digits, so that timestamps sort as strings."""
    m = re.fullmatch(r"([^.]+?)(?:\.(\d+))?Z", stamp)
    return f"{m[1]}.{(m[2] or '').ljust(9, '0')}Z" if m else stamp


def _fresh(text: str, seen: tuple[str, int]) -> tuple[list[str], list[Any]]:
    """Lines after the last one read (later timestamps, or more lines at the last one), and the new
    cursor entry [last timestamp, lines read at it]."""
    last, read_at_last = seen
    out, at_last = [], 0
    for raw in text.splitlines():
        stamp, _, line = raw.partition(" ")
        key = _ts_key(stamp)
        if key < last:
            continue
        if key == last:
            at_last += 1
            if at_last <= read_at_last:
                continue
            read_at_last = at_last
        else:
            last, read_at_last, at_last = key, 1, 1
        out.append(line)
    return out, [last, read_at_last]
