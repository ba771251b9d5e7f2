"""The `kubernetes` driver: runs each sub-task of a job attempt as an Indexed Job on the sub-task's
cluster, one pod per node, the workers started by torchrun.

Per sub-task it creates three objects with one deterministic name derived from the launch key:

    Service  headless, selects the Job's pods, so pod 0 is `<name>-0.<name>.<ns>.svc`
    Secret   the worker's metrics token (never in the Job spec in clear)
    Job      completionMode Indexed, completions = parallelism = nodes, backoffLimit 0

The Job is created last: once it exists the launch has happened, and a second launch of the same
key (HTTP 409 on create) returns the same handle. The Service and Secret are then owned by the Job,
so Kubernetes collects them with it. Ranks are numbered site by site (see `cpn.runtime.topology`):
torchrun numbers the sub-task's ranks from 0 and `CPN_RANK_OFFSET` carries the site's first
global rank. The kubernetes client is synchronous; the driver calls it in a thread. Its errors
become :class:`DriverError` here, at the edge.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import re
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException, OpenApiException
from kubernetes.config.config_exception import ConfigException

from layers.resource.drivers.base import DriverError, JobLaunch, SubtaskLaunch, SubtaskState

__all__ = ["KubernetesDriver", "job_manifest", "resource_name", "secret_manifest", "service_manifest"]

GPU_RESOURCE = "nvidia.com/gpu"
GPU_TOLERATION = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}  # tainted GPU nodes
RDZV_PORT = 29400  # torchrun's rendezvous among the sub-task's pods
MASTER_PORT = 29500  # the job-wide process group, served by global rank 0 on site 0
CONTAINER = "trainer"
TTL_SECONDS = 24 * 3600
DEFAULT_QUEUE = "cpn"
REQUEST_TIMEOUT = 15.0
MAX_NAME = 52  # pod hostnames are `<job name>-<index>`, a 63-character DNS label
KUBECONFIG_ENV_PREFIX = "CPN_KUBECONFIG_"
KUBECONFIG_FIELD = "spec.kubernetes.kubeconfigSecret"

JOB_NAME_LABEL = "batch.kubernetes.io/job-name"  # set on the pods by the Job controller
MANAGED_BY = ("app.kubernetes.io/managed-by", "cpn")
LAUNCH_KEY = "cpn.io/launch-key"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
POD_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"  # scheduler-plugins coscheduling
VOLCANO_GROUP = "scheduling.k8s.io/group-name"  # Volcano
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"


# ---------------------------------------------------------------------------------------- names
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
def _kube(sub: SubtaskLaunch) -> dict[str, Any]:
    return sub.cluster_spec.get("kubernetes") or {}


def _namespace(sub: SubtaskLaunch) -> str:
    return _kube(sub).get("namespace") or "default"


def _gpus_per_node(sub: SubtaskLaunch) -> int | None:
    sizes = [int(p["gpusPerNode"]) for p in sub.cluster_spec.get("nodePools", []) if p.get("gpusPerNode")]
    return max(sizes) if sizes else None


def shape(sub: SubtaskLaunch) -> tuple[int, int]:
    """(nodes, GPUs per node) for the sub-task's ranks: the most GPUs per pod that divide the ranks
    evenly and fit a node, so torchrun's nnodes × nproc-per-node is exactly the rank count."""
    per_node = _gpus_per_node(sub) or 1
    gpus = max(g for g in range(1, min(per_node, sub.ranks) + 1) if sub.ranks % g == 0)
    return sub.ranks // gpus, gpus


def rank_offset(job: JobLaunch, sub: SubtaskLaunch) -> int:
    """The sub-task's first global rank: the ranks of the sites before it in the topology."""
    return sum(int(site["ranks"]) for site in job.topology.get("sites", [])[: sub.site_index])


def _pod0(name: str, namespace: str) -> str:
    """Pod 0 of an Indexed Job (hostname `<job>-0`) through the headless Service of the same name."""
    return f"{name}-0.{name}.{namespace}.svc"


def master_addr(sub: SubtaskLaunch) -> str:
    return _pod0(resource_name(sub.key), _namespace(sub))


def _labels(job: JobLaunch, sub: SubtaskLaunch) -> dict[str, str]:
    return {MANAGED_BY[0]: MANAGED_BY[1], "cpn.io/job": _label_value(job.job),
            "cpn.io/subtask": _label_value(sub.subtask), "cpn.io/attempt": str(job.attempt)}


def _metadata(job: JobLaunch, sub: SubtaskLaunch, namespace: str) -> dict[str, Any]:
    return {"name": resource_name(sub.key), "namespace": namespace, "labels": _labels(job, sub),
            "annotations": {LAUNCH_KEY: sub.key}}


def service_manifest(job: JobLaunch, sub: SubtaskLaunch, namespace: str) -> dict[str, Any]:
    """Headless, and publishing pods before they are ready, so torchrun's peers resolve at once."""
    return {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(job, sub, namespace),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": {JOB_NAME_LABEL: resource_name(sub.key)},
                     "ports": [{"name": "rdzv", "port": RDZV_PORT, "targetPort": RDZV_PORT},
                               {"name": "master", "port": MASTER_PORT, "targetPort": MASTER_PORT}]}}


def secret_manifest(job: JobLaunch, sub: SubtaskLaunch, namespace: str) -> dict[str, Any]:
    token = base64.b64encode((job.metrics_token or "").encode()).decode()
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": _metadata(job, sub, namespace),
            "data": {"metrics-token": token}}


def _env(job: JobLaunch, sub: SubtaskLaunch, master: str, offset: int) -> list[dict[str, Any]]:
    plain = {"CPN_RANK_OFFSET": str(offset), "CPN_SITE_INDEX": str(sub.site_index),
             "CPN_TOPOLOGY": json.dumps(job.topology), "CPN_TRAIN_CONFIG": json.dumps(job.train),
             "MASTER_ADDR": master, "MASTER_PORT": str(MASTER_PORT),
             "CPN_MASTER_ADDR": master, "CPN_MASTER_PORT": str(MASTER_PORT)}
    if job.metrics_url:
        plain["CPN_METRICS_URL"] = job.metrics_url
    env: list[dict[str, Any]] = [  # first, so that $(JOB_COMPLETION_INDEX) expands in the command
        {"name": "JOB_COMPLETION_INDEX",
         "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX}']"}}}]
    env += [{"name": k, "value": v} for k, v in plain.items()]
    if job.metrics_token:
        env.append({"name": "CPN_METRICS_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": resource_name(sub.key), "key": "metrics-token"}}})
    return env


def job_manifest(job: JobLaunch, sub: SubtaskLaunch, namespace: str, image: str | None = None, *,
                 master: str | None = None, offset: int | None = None) -> dict[str, Any]:
    """The Indexed Job of one sub-task. `master` is the job-wide rendezvous (site 0's pod 0, this
    sub-task's own when omitted); `offset` the first global rank (from the topology when omitted)."""
    name = resource_name(sub.key)
    nodes, gpus = shape(sub)
    local_master = _pod0(name, namespace)
    command = ["torchrun", "--nnodes", str(nodes), "--nproc-per-node", str(gpus),
               "--node-rank", "$(JOB_COMPLETION_INDEX)", "--master-addr", local_master,
               "--master-port", str(RDZV_PORT), "-m", "cpn.runtime.train"]
    queue = _kube(sub).get("queue") or DEFAULT_QUEUE
    meta = _metadata(job, sub, namespace)
    meta["labels"][QUEUE_LABEL] = _label_value(queue)
    container = {"name": CONTAINER, "image": image or job.image, "command": command,
                 "env": _env(job, sub, master or local_master, rank_offset(job, sub) if offset is None else offset),
                 "ports": [{"name": "rdzv", "containerPort": RDZV_PORT},
                           {"name": "master", "containerPort": MASTER_PORT}],
                 "resources": {"limits": {GPU_RESOURCE: str(gpus)}},
                 "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}]}
    pod_meta = {"labels": {**_labels(job, sub), POD_GROUP_LABEL: name},
                "annotations": {VOLCANO_GROUP: name, LAUNCH_KEY: sub.key}}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta,
            "spec": {"completionMode": "Indexed", "completions": nodes, "parallelism": nodes,
                     "backoffLimit": 0, "ttlSecondsAfterFinished": TTL_SECONDS,
                     "template": {"metadata": pod_meta,
                                  "spec": {"subdomain": name, "restartPolicy": "Never",
                                           "containers": [container], "tolerations": [GPU_TOLERATION],
                                           "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]}}}}


# ------------------------------------------------------------------------------------ connection
def kubeconfig_path(sub: SubtaskLaunch) -> Path | None:
    """The kubeconfig file for the sub-task's cluster: `CPN_KUBECONFIG_<CLUSTER>` overrides
    `spec.kubernetes.kubeconfigSecret` (`file:/path` or a path); None means `server` alone."""
    override = os.environ.get(KUBECONFIG_ENV_PREFIX + re.sub(r"[^A-Z0-9]", "_", sub.cluster.upper()))
    ref = override or _kube(sub).get("kubeconfigSecret")
    if not ref:
        if not _kube(sub).get("server"):
            raise DriverError(f"cluster {sub.cluster}: spec.kubernetes needs kubeconfigSecret or server",
                              field="spec.kubernetes")
        return None
    if ref.startswith("file:"):
        ref = ref.removeprefix("file:").removeprefix("//")
    elif re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", ref):
        raise DriverError(f"cluster {sub.cluster}: {KUBECONFIG_FIELD} {ref.split(':')[0]}: references are not "
                          "supported; use file:/path/to/kubeconfig or set "
                          f"{KUBECONFIG_ENV_PREFIX}<CLUSTER>", field=KUBECONFIG_FIELD)
    path = Path(ref).expanduser()
    if not path.is_file():
        raise DriverError(f"cluster {sub.cluster}: {KUBECONFIG_FIELD} {path} is not a readable file",
                          field=KUBECONFIG_FIELD)
    return path


def _connection(sub: SubtaskLaunch) -> dict[str, Any]:
    """Where a handle's cluster is: a kubeconfig reference (never its contents) or a server URL."""
    path = kubeconfig_path(sub)
    return {"kubeconfig": str(path) if path else None, "context": _kube(sub).get("context"),
            "server": None if path else _kube(sub)["server"]}


def _api_client(conn: dict[str, Any]) -> k8s.ApiClient:
    if conn.get("kubeconfig"):
        try:
            return k8s_config.new_client_from_config(config_file=conn["kubeconfig"], context=conn.get("context"),
                                                     persist_config=False)
        except (ConfigException, OSError, ValueError) as exc:
            raise DriverError(f"{KUBECONFIG_FIELD} {conn['kubeconfig']}: {exc}", field=KUBECONFIG_FIELD) from exc
    return k8s.ApiClient(k8s.Configuration(host=conn["server"]))


@contextmanager
def _apis(conn: dict[str, Any]) -> Iterator[tuple[k8s.CoreV1Api, k8s.BatchV1Api]]:
    """Core and batch APIs of one cluster; kubernetes and urllib3 errors leave as DriverError."""
    api_client = _api_client(conn)
    host = api_client.configuration.host
    with api_client:
        try:
            yield k8s.CoreV1Api(api_client), k8s.BatchV1Api(api_client)
        except OpenApiException as exc:
            raise DriverError(f"Kubernetes API at {host}: {_describe(exc)}") from exc
        except urllib3.exceptions.HTTPError as exc:
            raise DriverError(f"Kubernetes API at {host} is unreachable: {exc}") from exc


def _describe(exc: OpenApiException) -> str:
    status, reason = getattr(exc, "status", None), getattr(exc, "reason", None)
    if not status:
        return str(exc).splitlines()[0]
    try:
        message = json.loads(getattr(exc, "body", None) or "{}").get("message")
    except (ValueError, AttributeError):
        message = None
    return f"HTTP {status} {reason}" + (f": {message}" if message else "")


def _status(exc: Exception) -> int | None:
    return getattr(exc, "status", None) if isinstance(exc, ApiException) else None


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


# ----------------------------------------------------------------------------------------- state
def _pods(core: k8s.CoreV1Api, name: str, namespace: str) -> list[Any]:
    pods = core.list_namespaced_pod(namespace, label_selector=f"{JOB_NAME_LABEL}={name}",
                                    _request_timeout=REQUEST_TIMEOUT).items
    return sorted(pods, key=lambda p: p.metadata.name)


def _exit_codes(pods: list[Any]) -> dict[str, int]:
    codes = {}
    for pod in pods:
        for cs in (pod.status.container_statuses if pod.status else None) or []:
            if cs.name == CONTAINER and cs.state and cs.state.terminated:
                codes[pod.metadata.name] = cs.state.terminated.exit_code
    return codes


def _condition(job: Any, kind: str) -> Any:
    return next((c for c in (job.status.conditions if job.status else None) or []
                 if c.type == kind and c.status == "True"), None)


def job_state(job: Any, pods: list[Any]) -> SubtaskState:
    """The sub-task's phase from its Job's status and its pods'."""
    status = job.status
    completions = job.spec.completions or 1
    phases = {p.metadata.name: (p.status.phase if p.status else None) or "Pending" for p in pods}
    listing = ", ".join(f"{name} ({phase})" for name, phase in phases.items()) or "no pods yet"
    codes = _exit_codes(pods)
    failed = _condition(job, "Failed")
    if failed or (status and status.failed) or "Failed" in phases.values():
        why = f"{failed.reason}: {failed.message}" if failed else "a worker pod failed"
        return SubtaskState(phase="Failed", message=f"{why}; pods: {listing}", exit_codes=codes)
    if _condition(job, "Complete") or (status and (status.succeeded or 0) >= completions):
        return SubtaskState(phase="Succeeded", message=f"pods: {listing}", exit_codes=codes)
    running = sum(1 for phase in phases.values() if phase == "Running")
    if running:
        return SubtaskState(phase="Running", message=f"{running}/{completions} pods running: {listing}",
                            exit_codes=codes)
    waiting = "suspended, waiting for admission" if job.spec.suspend else "waiting for pods"
    return SubtaskState(phase="Launching", message=f"{waiting}; pods: {listing}", exit_codes=codes)


# ---------------------------------------------------------------------------------------- driver
class KubernetesDriver:
    name = "kubernetes"

    def __init__(self, *, log_interval: float = 2.0):
        self.log_interval = log_interval

    async def launch(self, job: JobLaunch, subtasks: list[SubtaskLaunch]) -> dict[str, dict[str, Any]]:
        offsets = _offsets(job, subtasks)
        first = min(subtasks, key=lambda s: s.site_index, default=None)
        master = master_addr(first) if first else ""
        handles = {}
        for sub in subtasks:
            handles[sub.subtask] = await asyncio.to_thread(self._launch_one, job, sub, master, offsets[sub.key])
        return handles

    def _launch_one(self, job: JobLaunch, sub: SubtaskLaunch, master: str, offset: int) -> dict[str, Any]:
        namespace, name = _namespace(sub), resource_name(sub.key)
        handle = {"key": sub.key, "cluster": sub.cluster, "namespace": namespace, "name": name,
                  "siteIndex": sub.site_index, **_connection(sub)}
        with _apis(handle) as (core, batch):
            _create(core.create_namespaced_service, namespace, service_manifest(job, sub, namespace))
            if job.metrics_token:
                _create(core.create_namespaced_secret, namespace, secret_manifest(job, sub, namespace))
            body = job_manifest(job, sub, namespace, _kube(sub).get("image"), master=master, offset=offset)
            _create(batch.create_namespaced_job, namespace, body)
            created = batch.read_namespaced_job(name, namespace, _request_timeout=REQUEST_TIMEOUT).metadata
            if (created.annotations or {}).get(LAUNCH_KEY) != sub.key:
                raise DriverError(f"Job {namespace}/{name} exists but was not launched for {sub.key}; "
                                  "delete it or rename the job")
            owner = {"metadata": {"ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": name,
                                                       "uid": created.uid, "blockOwnerDeletion": False}]}}
            patch = {"_content_type": "application/strategic-merge-patch+json", "_request_timeout": REQUEST_TIMEOUT}
            core.patch_namespaced_service(name, namespace, owner, **patch)
            if job.metrics_token:
                core.patch_namespaced_secret(name, namespace, owner, **patch)
        return handle

    async def poll(self, job: JobLaunch, handles: dict[str, dict[str, Any]]) -> dict[str, SubtaskState]:
        return {subtask: await asyncio.to_thread(_poll_one, handle) for subtask, handle in handles.items()}

    async def cancel(self, job: JobLaunch, handles: dict[str, dict[str, Any]]) -> None:
        for handle in handles.values():
            await asyncio.to_thread(_cancel_one, handle)

    async def logs(self, handle: dict[str, Any], follow: bool = False) -> AsyncIterator[str]:
        seen: dict[str, tuple[str, int]] = {}  # pod → (last timestamp, lines yielded at it)
        while True:
            done, lines = await asyncio.to_thread(_read_logs, handle, seen)
            for line in lines:
                yield line
            if not follow or done:
                return
            await asyncio.sleep(self.log_interval)


def _offsets(job: JobLaunch, subtasks: list[SubtaskLaunch]) -> dict[str, int]:
    """First global rank per sub-task; sub-tasks sharing a site follow each other in list order."""
    taken: dict[int, int] = {}
    out = {}
    for sub in subtasks:
        out[sub.key] = rank_offset(job, sub) + taken.get(sub.site_index, 0)
        taken[sub.site_index] = taken.get(sub.site_index, 0) + sub.ranks
    return out


def _poll_one(handle: dict[str, Any]) -> SubtaskState:
    with _apis(handle) as (core, batch):
        try:
            job = batch.read_namespaced_job(handle["name"], handle["namespace"], _request_timeout=REQUEST_TIMEOUT)
        except ApiException as exc:
            if exc.status == 404:
                return SubtaskState(phase="Lost", message=f"Job {handle['namespace']}/{handle['name']} is gone")
            raise
        return job_state(job, _pods(core, handle["name"], handle["namespace"]))


def _cancel_one(handle: dict[str, Any]) -> None:
    name, namespace = handle["name"], handle["namespace"]
    with _apis(handle) as (core, batch):
        _delete(batch.delete_namespaced_job, name, namespace, propagation_policy="Background")
        _delete(core.delete_namespaced_service, name, namespace)
        _delete(core.delete_namespaced_secret, name, namespace)


def _read_logs(handle: dict[str, Any], seen: dict[str, tuple[str, int]]) -> tuple[bool, list[str]]:
    """New log lines of every pod since `seen` (updated), and whether the Job has finished."""
    name, namespace = handle["name"], handle["namespace"]
    now = datetime.now(UTC)
    with _apis(handle) as (core, batch):
        try:
            job = batch.read_namespaced_job(name, namespace, _request_timeout=REQUEST_TIMEOUT)
            done = bool(_condition(job, "Complete") or _condition(job, "Failed"))
        except ApiException as exc:
            if exc.status != 404:
                raise
            done = True
        lines: list[str] = []
        for pod in _pods(core, name, namespace):
            pod_name = pod.metadata.name
            since = _since_seconds(seen.get(pod_name), now)
            try:
                text = core.read_namespaced_pod_log(pod_name, namespace, container=CONTAINER, timestamps=True,
                                                    since_seconds=since, _request_timeout=REQUEST_TIMEOUT)
            except ApiException as exc:
                if exc.status in (400, 404):  # not started yet, or gone
                    continue
                raise
            lines += [f"[{pod_name}] {line}" for line in _fresh(text or "", pod_name, seen)]
    return done, lines


def _since_seconds(last: tuple[str, int] | None, now: datetime) -> int | None:
    if last is None:
        return None
    try:
        at = datetime.fromisoformat(last[0][:26].rstrip("Z") + "+00:00")
    except ValueError:
        return None
    return max(1, int((now - at).total_seconds()) + 2)


def _ts_key(stamp: str) -> str:
    """RFC3339Nano with the fraction padded to 9 digits, so that timestamps sort as strings."""
    m = re.fullmatch(r"([^.]+?)(?:\.(\d+))?Z", stamp)
    return f"{m[1]}.{(m[2] or '').ljust(9, '0')}Z" if m else stamp


def _fresh(text: str, pod: str, seen: dict[str, tuple[str, int]]) -> list[str]:
    """Lines after the last one yielded for `pod`: later timestamps, or more lines at the last one."""
    last, yielded_at_last = seen.get(pod, ("", 0))
    out, at_last = [], 0
    for raw in text.splitlines():
        stamp, _, line = raw.partition(" ")
        key = _ts_key(stamp)
        if key < last:
            continue
        if key == last:
            at_last += 1
            if at_last <= yielded_at_last:
                continue
            yielded_at_last = at_last
        else:
            last, yielded_at_last, at_last = key, 1, 1
        out.append(line)
    seen[pod] = (last, yielded_at_last)
    return out
