"""Discover a site's GPU inventory from its Kubernetes API (official client, synchronous).

Nodes are grouped into pools by the GPU operator's `nvidia.com/gpu.product` label and the
number of GPUs they offer. Capacity counts every GPU node; allocatable counts only nodes that
are Ready and schedulable, minus the GPUs that Running or (scheduled) Pending pods request.
Kubernetes and urllib3 errors become :class:`cpn.core.errors.Unavailable` here, at the edge;
a kubeconfig that cannot be loaded becomes :class:`cpn.core.errors.InvalidInput`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import OpenApiException
from kubernetes.config.config_exception import ConfigException
from kubernetes.utils import parse_quantity
from pydantic import BaseModel, Field

from cpn.core.errors import InvalidInput, Unavailable
from layers.resource import gpus
from layers.resource.discovery.fabric import nodes_fabric
from layers.resource.schemas import FabricReport

GPU_RESOURCE = "nvidia.com/gpu"
PRODUCT_LABEL = "nvidia.com/gpu.product"
MEMORY_LABEL = "nvidia.com/gpu.memory"  # MiB
COUNT_LABEL = "nvidia.com/gpu.count"
ACTIVE_PHASES = ("Running", "Pending")
DEFAULT_TIMEOUT_SECONDS = 10.0
PAGE_SIZE = 500


class DiscoveredPool(BaseModel):
    name: str
    gpu_model: str
    product: str
    memory_gb: int
    tflops: float | None = Field(description="None when the product is not in the GPU catalogue.")
    gpus_per_node: int
    nodes: int
    ready_nodes: int
    allocatable_gpus: int

    def manifest(self) -> dict[str, Any]:
        """The pool in the shape of a Cluster manifest's `spec.nodePools[]` entry (no price)."""
        gpu: dict[str, Any] = {"model": self.gpu_model, "memoryGB": self.memory_gb}
        if self.tflops is not None:
            gpu["tflops"] = self.tflops
        return {"name": self.name, "gpu": gpu, "gpusPerNode": self.gpus_per_node, "nodes": self.nodes}


class Discovery(BaseModel):
    node_pools: list[DiscoveredPool]
    capacity_gpus: int
    allocatable_gpus: int
    server_version: str
    conditions: list[dict[str, Any]]
    fabric: FabricReport | None = None


def discover(kubeconfig: str | Path, context: str | None = None, *,
             timeout: float = DEFAULT_TIMEOUT_SECONDS) -> Discovery:
    """Read nodes and pods through the kubeconfig's credentials and summarise the GPUs."""
    api_client = _api_client(kubeconfig, context)
    server = api_client.configuration.host
    with api_client:
        try:
            version = k8s.VersionApi(api_client).get_code(_request_timeout=timeout).git_version
            core = k8s.CoreV1Api(api_client)
            nodes = _list_all(core.list_node, timeout)
            pods = _list_all(core.list_pod_for_all_namespaces, timeout,
                             field_selector="status.phase!=Succeeded,status.phase!=Failed")
        except OpenApiException as exc:
            raise Unavailable(f"Kubernetes API at {server}: {_describe(exc)}") from exc
        except urllib3.exceptions.HTTPError as exc:
            raise Unavailable(f"Kubernetes API at {server} is unreachable: {_reason(exc)}") from exc
    return summarise(nodes, pods, server_version=version)


def _list_all(list_fn: Callable[..., Any], timeout: float, **kwargs: Any) -> list[Any]:
    """Every item of a list call, fetched in chunks so that large clusters do not time out."""
    items: list[Any] = []
    token: str | None = None
    while True:
        page = list_fn(limit=PAGE_SIZE, _continue=token, _request_timeout=timeout, **kwargs)
        items += page.items
        token = page.metadata._continue if page.metadata else None
        if not token:
            return items


def summarise(nodes: Iterable[k8s.V1Node], pods: Iterable[k8s.V1Pod], *, server_version: str) -> Discovery:
    """Pure part of discovery: typed node and pod objects in, pools and counts out."""
    gpu_nodes = [n for n in nodes if _gpus(n.status.capacity if n.status else None) > 0]
    usable = {n.metadata.name for n in gpu_nodes if _usable(n)}
    used = _gpus_in_use(pods, usable)
    groups: dict[tuple[str, int], list[k8s.V1Node]] = {}
    for node in gpu_nodes:
        groups.setdefault((_labels(node).get(PRODUCT_LABEL, "unknown"), _gpus_per_node(node)), []).append(node)
    pools: list[DiscoveredPool] = []
    # The biggest group of a product names itself first: one degraded node does not rename a pool.
    for (product, per_node), members in sorted(groups.items(), key=lambda g: (g[0][0], -len(g[1]), -g[0][1])):
        free = sum(max(0, _gpus(n.status.allocatable) - used.get(n.metadata.name, 0))
                   for n in members if n.metadata.name in usable)
        pools.append(_pool(product, per_node, members, free, {p.name for p in pools}))
    capacity = sum(_gpus(n.status.capacity) for n in gpu_nodes)
    allocatable = sum(p.allocatable_gpus for p in pools)
    return Discovery(node_pools=pools, capacity_gpus=capacity, allocatable_gpus=allocatable,
                     server_version=server_version, fabric=nodes_fabric(gpu_nodes),
                     conditions=[_ready_condition(len(gpu_nodes), len(usable), allocatable, capacity)])


def _gpus_per_node(node: k8s.V1Node) -> int:
    """What the device plugin offers (allocatable), else the operator's count label, else capacity."""
    count = _labels(node).get(COUNT_LABEL, "")
    return _gpus(node.status.allocatable) or (int(count) if count.isdigit() else 0) or _gpus(node.status.capacity)


def _api_client(kubeconfig: str | Path, context: str | None) -> k8s.ApiClient:
    try:
        return k8s_config.new_client_from_config(config_file=str(kubeconfig), context=context,
                                                 persist_config=False)
    except (ConfigException, OSError) as exc:
        raise InvalidInput(f"kubeconfig {kubeconfig}: {exc}", field="kubeconfig") from exc


def _pool(product: str, per_node: int, members: list[k8s.V1Node], free: int, taken: set[str]) -> DiscoveredPool:
    info = gpus.lookup(product)
    model = info.model if info else product
    memory = _memory_gb(_labels(members[0]).get(MEMORY_LABEL), info)
    return DiscoveredPool(
        name=_unique_name(_slug(model), per_node, taken), gpu_model=model, product=product, memory_gb=memory,
        tflops=info.tflops if info else None, gpus_per_node=per_node, nodes=len(members),
        ready_nodes=sum(1 for n in members if _usable(n)), allocatable_gpus=free,
    )


def _gpus_in_use(pods: Iterable[k8s.V1Pod], on_nodes: set[str]) -> dict[str, int]:
    used: dict[str, int] = {}
    for pod in pods:
        node = pod.spec.node_name if pod.spec else None
        phase = pod.status.phase if pod.status else None
        if node in on_nodes and phase in ACTIVE_PHASES:
            used[node] = used.get(node, 0) + _pod_gpus(pod.spec)
    return used


def _pod_gpus(spec: k8s.V1PodSpec) -> int:
    """A pod's effective request: the larger of its containers' sum and its largest init container."""
    main = sum(_container_gpus(c) for c in spec.containers or [])
    init = max((_container_gpus(c) for c in spec.init_containers or []), default=0)
    return max(main, init)


def _container_gpus(container: k8s.V1Container) -> int:
    res = container.resources
    if res is None:
        return 0
    # For extended resources the request defaults to the limit.
    return _gpus(res.requests) or _gpus(res.limits)


def _usable(node: k8s.V1Node) -> bool:
    if node.spec and node.spec.unschedulable:
        return False
    conditions = (node.status.conditions if node.status else None) or []
    return any(c.type == "Ready" and c.status == "True" for c in conditions)


def _gpus(resources: dict[str, str] | None) -> int:
    value = (resources or {}).get(GPU_RESOURCE)
    return int(parse_quantity(value)) if value else 0


def _labels(node: k8s.V1Node) -> dict[str, str]:
    return (node.metadata.labels if node.metadata else None) or {}


def _memory_gb(mib: str | None, info: gpus.GpuModelInfo | None) -> int:
    """GB from the MiB label; a known model's nearest nominal size (46068 MiB on an L40S is 48 GB)."""
    try:
        measured = int(mib or 0) / 1024
    except ValueError:
        measured = 0
    if info is None:
        return round(measured)
    if not measured:
        return info.memory_gb
    return min(info.memory_variants_gb, key=lambda nominal: abs(nominal - measured))


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:50] or "gpu"


def _unique_name(base: str, per_node: int, taken: set[str]) -> str:
    for candidate in (base, f"{base}-{per_node}g", *(f"{base}-{per_node}g-{i}" for i in range(2, 100))):
        if candidate not in taken:
            return candidate
    raise AssertionError("more than 100 pools share one GPU model")


def _ready_condition(gpu_nodes: int, usable: int, allocatable: int, capacity: int) -> dict[str, Any]:
    if usable:
        return {"type": "Ready", "status": "True", "reason": "NodesReady",
                "message": f"{usable}/{gpu_nodes} GPU nodes ready, {allocatable}/{capacity} GPUs allocatable"}
    reason = "NoReadyGpuNodes" if gpu_nodes else "NoGpuNodes"
    return {"type": "Ready", "status": "False", "reason": reason,
            "message": f"0/{gpu_nodes} GPU nodes ready and schedulable"}


def _describe(exc: OpenApiException) -> str:
    """`HTTP 403 Forbidden: nodes is forbidden: …` from the Status body the server sent."""
    status, reason = getattr(exc, "status", None), getattr(exc, "reason", None)
    if not status:
        return str(exc).splitlines()[0]
    try:
        message = json.loads(getattr(exc, "body", None) or "{}").get("message")
    except (ValueError, AttributeError):
        message = None
    return f"HTTP {status} {reason}" + (f": {message}" if message else "")


def _reason(exc: urllib3.exceptions.HTTPError) -> str:
    inner = getattr(exc, "reason", None)
    return str(inner or exc).split(": ", 1)[-1]
