"""The `kubernetes` driver: runs one sub-task of a job attempt as an Indexed Job on the site's own
Kubernetes, one pod per node, torchrun in each pod for the sub-task's ranks on that node. The site
agent builds it (`cpn agent --kubeconfig PATH [--context C]`) and it talks to that cluster only;
the API server never calls a site's Kubernetes API.

Per (job, attempt, sub-task) it creates three objects under one deterministic name:

    Secret   the whole attempt contract (`spec.json`; it holds the worker token) and the token alone
             (`worker-token`). Pods mount the contract at /var/run/cpn/spec.json and read the token
             through `secretKeyRef`: it is never in the Job spec, never on a command line.
    Service  headless, selecting the Job's pods: pod 0 is `<name>-0.<name>.<ns>.svc`, where torchrun's
             rendezvous among this sub-task's pods meets. The sub-task holding global rank 0 also
             publishes the job-wide rendezvous port on it.
    Job      completionMode Indexed, completions = parallelism = pods, backoffLimit 0

The Job is created last: once it exists the launch has happened, and launching the same key again
returns the same handle. Service and Secret are then owned by the Job, so Kubernetes collects them
with it. Every object carries `cpn.io/job`, `cpn.io/attempt`, `cpn.io/subtask`, `cpn.io/cluster`
and managed-by=cpn: a restarted agent finds its Jobs by label and reads each contract back from
its Secret (:meth:`KubernetesDriver.adopt`).

Ranks: torchrun numbers the sub-task's ranks from 0, pod by pod; `CPN_RANK_OFFSET` carries the
sub-task's first global rank and :func:`cpn.runtime.siteenv.globalise` turns torchrun's numbers
into CPN's and points MASTER_ADDR/PORT at the job-wide rendezvous. The container environment is
:func:`cpn.runtime.contract.worker_env` without the variables torchrun sets per process.

Rendezvous across sites, and its limits. The job-wide store is at `spec.rendezvous` — the address
the first site's agent advertised, never a cluster-local `.svc` name — so sub-tasks on different
Kubernetes clusters can meet. Global rank 0 (pod 0 of the sub-task with `first_rank == 0`) serves
that store on `spec.rendezvous.port` inside its pod; the driver publishes that port on pod 0's
container and on the headless Service, without hostNetwork. Routing the advertised address to it
is the provider's part: run the agent with `--advertise-address` naming a LoadBalancer, NodePort
or gateway that forwards the port to pod 0 (select `batch.kubernetes.io/job-name=<name>` and
`batch.kubernetes.io/job-completion-index=0`); since the agent picks the port per attempt, such a
route must forward a port range or be set up per attempt. The collectives (Gloo, NCCL) then connect
pod to pod on the addresses the pods register in that store, so pods of different clusters must
reach each other's pod IPs (a flat or meshed pod network: Submariner, Cilium Cluster Mesh, …);
behind NAT they cannot, and the attempt fails at its first collective, reported as a failed
sub-task. `NCCL_SOCKET_IFNAME`/`GLOO_SOCKET_IFNAME` name the pod's interface (`eth0` unless
configured). Checkpoints go to an emptyDir and live as long as the pod.

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

from cpn.runtime.config import ENV_METRICS_URL
from cpn.runtime.contract import ENV, AttemptSpec, torchrun_env, worker_env
from cpn.runtime.siteenv import ENV_MASTER_ADDR, ENV_MASTER_PORT
from layers.resource.discovery.kubernetes import GPU_RESOURCE
from layers.resource.drivers.base import DriverError, LogLine, SubtaskState

__all__ = ["KubernetesDriver", "PodSettings", "Shape", "container_env", "job_manifest", "launch_key",
           "resource_name", "secret_manifest", "service_manifest", "shape"]

log = logging.getLogger("cpn.agent.kubernetes")

GPU_TOLERATION = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}  # tainted GPU nodes
RDZV_PORT = 29400  # torchrun's rendezvous among one sub-task's pods
CONTAINER = "trainer"
TTL_SECONDS = 24 * 3600
REQUEST_TIMEOUT = 15.0
MAX_NAME = 52  # pod hostnames are `<job name>-<index>`, a 63-character DNS label
MAX_LOG_BYTES = 256 * 1024  # per pod and poll: a chatty worker cannot flood the agent's report
CONTRACT_DIR = "/var/run/cpn"
SPEC_KEY, TOKEN_KEY = "spec.json", "worker-token"
WORK_DIR = "/var/lib/cpn"
RUN_DIR, CHECKPOINT_DIR = f"{WORK_DIR}/run", f"{WORK_DIR}/checkpoints"
LOG_PREFIX_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"  # torchrun's per-process line prefix (with --tee)
LOG_PREFIX = "[rank${rank}]:"  # torchrun's ${rank}: the rank within the sub-task
LOG_LINE = re.compile(r"\[rank(\d+)\]:\s?(.*)")
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
    """What the provider tunes about the pods (the agent's options)."""

    image: str
    socket_ifname: str = "eth0"
    nccl_env: Mapping[str, str] | None = None
    queue: str | None = None  # a Kueue LocalQueue; no label without one


@dataclass(frozen=True)
class Shape:
    pods: int
    ranks_per_pod: int
    gpus_per_pod: int


def shape(workers: int, gpus_per_node: int, cpu_ranks_per_pod: int = 1) -> Shape:
    """Pods for the sub-task's ranks: the most ranks per pod that divide them evenly and fit a node's
    GPUs (or `cpu_ranks_per_pod` on a cluster without GPUs), so nnodes × nproc-per-node = workers."""
    fit = gpus_per_node or cpu_ranks_per_pod
    per_pod = max(n for n in range(1, min(max(fit, 1), workers) + 1) if workers % n == 0)
    return Shape(workers // per_pod, per_pod, per_pod if gpus_per_node else 0)


def _pod0(name: str, namespace: str) -> str:
    """Pod 0 of an Indexed Job (hostname `<job>-0`) through the headless Service of the same name."""
    return f"{name}-0.{name}.{namespace}.svc"


def _local_port(spec: AttemptSpec) -> int:
    """torchrun's port among the sub-task's pods; never the job-wide one, which pod 0 may serve too."""
    return RDZV_PORT + 1 if spec.rendezvous is not None and spec.rendezvous.port == RDZV_PORT else RDZV_PORT


def labels(spec: AttemptSpec) -> dict[str, str]:
    return {MANAGED_BY[0]: MANAGED_BY[1], LABEL_JOB: _label_value(spec.job), LABEL_ATTEMPT: str(spec.attempt),
            LABEL_SUBTASK: _label_value(spec.subtask), LABEL_CLUSTER: _label_value(spec.cluster)}


def _metadata(spec: AttemptSpec, namespace: str) -> dict[str, Any]:
    return {"name": resource_name(launch_key(spec)), "namespace": namespace, "labels": labels(spec),
            "annotations": {LAUNCH_KEY: launch_key(spec)}}


def _ports(spec: AttemptSpec) -> list[tuple[str, int]]:
    ports = [("rdzv", _local_port(spec))]
    if spec.leads_rendezvous and spec.rendezvous is not None:
        ports.append(("master", spec.rendezvous.port))
    return ports


def service_manifest(spec: AttemptSpec, namespace: str) -> dict[str, Any]:
    """Headless, and publishing pods before they are ready, so torchrun's peers resolve at once."""
    name = resource_name(launch_key(spec))
    return {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(spec, namespace),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": {JOB_NAME_LABEL: name},
                     "ports": [{"name": n, "port": p, "targetPort": p} for n, p in _ports(spec)]}}


def secret_manifest(spec: AttemptSpec, namespace: str) -> dict[str, Any]:
    data = {SPEC_KEY: spec.model_dump_json()}
    if spec.worker_token:
        data[TOKEN_KEY] = spec.worker_token
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": _metadata(spec, namespace),
            "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}}


def _network_env(settings: PodSettings, gpus: int) -> dict[str, str]:
    env = {"GLOO_SOCKET_IFNAME": settings.socket_ifname}
    if gpus:
        env |= {"NCCL_SOCKET_IFNAME": settings.socket_ifname, **NCCL_DEFAULTS, **(settings.nccl_env or {})}
    return env


def container_env(spec: AttemptSpec, settings: PodSettings, gpus: int) -> list[dict[str, Any]]:
    """The pod's environment: the worker's (one source, :func:`worker_env`) minus what torchrun sets
    per process, plus the rank offset, the job-wide rendezvous, the network, and the token by reference."""
    if spec.rendezvous is None:
        raise DriverError(f"{launch_key(spec)}: the contract has no rendezvous endpoint yet")
    plain = worker_env(spec, spec.first_rank, run_dir=RUN_DIR, checkpoint_dir=CHECKPOINT_DIR, base={})
    per_process = set(torchrun_env(spec.topology, spec.first_rank, 0, 1, "-", 1)) - set(spec.topology.to_env())
    plain = {k: v for k, v in plain.items() if k not in per_process and k != "PYTHONPATH"}  # the image has its own
    plain |= {ENV.RANK_OFFSET: str(spec.first_rank), ENV_MASTER_ADDR: spec.rendezvous.host,
              ENV_MASTER_PORT: str(spec.rendezvous.port), LOG_PREFIX_ENV: LOG_PREFIX, **_network_env(settings, gpus)}
    if spec.metrics_url:
        plain[ENV_METRICS_URL] = spec.metrics_url
    env: list[dict[str, Any]] = [  # first, so that $(JOB_COMPLETION_INDEX) expands in the command
        {"name": "JOB_COMPLETION_INDEX",
         "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX}']"}}}]
    env += [{"name": k, "value": v} for k, v in plain.items()]
    if spec.worker_token:
        env.append({"name": ENV.METRICS_TOKEN, "valueFrom": {"secretKeyRef": {
            "name": resource_name(launch_key(spec)), "key": TOKEN_KEY}}})
    return env


def _container(spec: AttemptSpec, namespace: str, pods: Shape, settings: PodSettings) -> dict[str, Any]:
    name = resource_name(launch_key(spec))
    command = ["torchrun", "--nnodes", str(pods.pods), "--nproc-per-node", str(pods.ranks_per_pod),
               "--node-rank", "$(JOB_COMPLETION_INDEX)", "--master-addr", _pod0(name, namespace),
               "--master-port", str(_local_port(spec)), "--tee", "3", "-m", "cpn.runtime.train"]
    resources = ({"limits": {GPU_RESOURCE: str(pods.gpus_per_pod)}} if pods.gpus_per_pod
                 else {"requests": {"cpu": str(pods.ranks_per_pod)}})
    return {"name": CONTAINER, "image": settings.image, "command": command,
            "env": container_env(spec, settings, pods.gpus_per_pod),
            "ports": [{"name": n, "containerPort": p} for n, p in _ports(spec)], "resources": resources,
            "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"},
                             {"name": "contract", "mountPath": CONTRACT_DIR, "readOnly": True},
                             {"name": "work", "mountPath": WORK_DIR}]}


def job_manifest(spec: AttemptSpec, namespace: str, pods: Shape, settings: PodSettings) -> dict[str, Any]:
    """The Indexed Job of one sub-task: `pods.pods` pods of `pods.ranks_per_pod` ranks each."""
    name = resource_name(launch_key(spec))
    meta = _metadata(spec, namespace)
    meta["annotations"][RANKS_PER_POD] = str(pods.ranks_per_pod)
    if settings.queue:
        meta["labels"][QUEUE_LABEL] = _label_value(settings.queue)
    pod_spec: dict[str, Any] = {
        "subdomain": name, "restartPolicy": "Never", "enableServiceLinks": False,
        "automountServiceAccountToken": False,  # workers never call the Kubernetes API
        "containers": [_container(spec, namespace, pods, settings)],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}},
                    {"name": "contract", "secret": {"secretName": name, "defaultMode": 0o400,
                                                    "items": [{"key": SPEC_KEY, "path": SPEC_KEY}]}},
                    {"name": "work", "emptyDir": {}}]}
    if pods.gpus_per_pod:
        pod_spec["tolerations"] = [GPU_TOLERATION]
    template = {"metadata": {"labels": {**labels(spec), POD_GROUP_LABEL: name},
                             "annotations": {VOLCANO_GROUP: name, LAUNCH_KEY: launch_key(spec)}},
                "spec": pod_spec}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta,
            "spec": {"completionMode": "Indexed", "completions": pods.pods, "parallelism": pods.pods,
                     "backoffLimit": 0, "ttlSecondsAfterFinished": TTL_SECONDS, "template": template}}


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
    """Each terminated pod's exit code (torchrun's, for all of its ranks), keyed by global rank."""
    codes = {}
    for index, pod in pods:
        for cs in (pod.status.container_statuses if pod.status else None) or []:
            if cs.name == CONTAINER and cs.state and cs.state.terminated:
                first = spec.first_rank + index * per_pod
                codes |= {str(rank): cs.state.terminated.exit_code for rank in range(first, first + per_pod)}
    return codes


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
        return SubtaskState("Failed", f"{why}; pods: {listing}", codes)
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
    """Launches sub-tasks on the Kubernetes cluster at `kubeconfig` (in-cluster config when None)."""

    name = "kubernetes"

    def __init__(self, kubeconfig: Path | None = None, context: str | None = None, namespace: str = "default",
                 image: str | None = None, *, gpus_per_node: int | None = None, socket_ifname: str = "eth0",
                 nccl_env: Mapping[str, str] | None = None, queue: str | None = None,
                 cpu_ranks_per_pod: int = 1):
        self.kubeconfig, self.context, self.namespace, self.image = kubeconfig, context, namespace, image
        self.gpus_per_node = gpus_per_node  # None: read from the nodes at the first launch
        self.socket_ifname, self.nccl_env, self.queue = socket_ifname, dict(nccl_env or {}), queue
        self.cpu_ranks_per_pod = cpu_ranks_per_pod
        self._client: k8s.ApiClient | None = None
        self._lock = threading.Lock()
        self._cancelled: set[str] = set()

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
            raise DriverError(f"{launch_key(spec)}: no container image: give the job an image or the agent one",
                              field="image")
        return PodSettings(image=image, socket_ifname=self.socket_ifname, nccl_env=self.nccl_env, queue=self.queue)

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
    """torchrun prefixes each worker's line with its rank in the sub-task; its own lines go to the pod's first."""
    m = LOG_LINE.fullmatch(line)
    if m and spec.first_rank + int(m[1]) in spec.ranks:
        return LogLine(spec.first_rank + int(m[1]), m[2])
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
