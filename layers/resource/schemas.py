"""Wire schemas of the inventory kinds: Site, Cluster, Link (and the heartbeat body)."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, WithJsonSchema, field_validator, model_validator

from cpn.core.manifest import CamelModel, Condition, ManifestBase, Money, Name

REGION_RE = re.compile(r"^[a-z0-9][-a-z0-9]{0,62}$")


class Location(CamelModel):
    lat: float = Field(ge=-90, le=90)
    lon: float = Field(ge=-180, le=180)


class SiteSpec(CamelModel):
    region: str = Field(description="Region for data-residency constraints, e.g. eu-central",
                        json_schema_extra={"pattern": REGION_RE.pattern, "maxLength": 63})
    location: Location | None = None
    provider: str | None = Field(default=None, description="Set by the server from the token; ignored on input.")

    @field_validator("region")
    @classmethod
    def _region(cls, v: str) -> str:
        if not REGION_RE.match(v):
            raise ValueError("region must be lowercase letters, digits and '-'")
        return v


class SiteManifest(ManifestBase):
    kind: Literal["Site"] = "Site"
    spec: SiteSpec
    status: dict[str, Any] | None = None


class GpuSpec(CamelModel):
    model: str = Field(min_length=1, max_length=63, description="H100, A100, L40S, RTX4090 …")
    memory_gb: float = Field(alias="memoryGB", gt=0)
    tflops: float = Field(gt=0, description="Peak dense bf16 TFLOPs per GPU")


class NodePool(CamelModel):
    name: Name
    gpu: GpuSpec
    gpus_per_node: int = Field(gt=0, le=64)
    nodes: int = Field(gt=0, le=100_000)
    price_per_gpu_hour: Annotated[Money, WithJsonSchema({  # more than zero
        "anyOf": [{"type": "string", "pattern": r"^(?=[0-9.]*[1-9])[0-9]+(\.[0-9]{1,6})?$"},
                  {"type": "integer", "minimum": 1}], "description": "Price of one GPU-hour (more than 0)"})]

    @field_validator("price_per_gpu_hour")
    @classmethod
    def _positive(cls, v: Any) -> Any:
        if v <= 0:
            raise ValueError("must be greater than 0")
        return v

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes


# Kubernetes names (k8s.io/apimachinery/pkg/util/validation)
DNS_LABEL_RE = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"  # namespaces, LocalQueues: at most 63
DNS_SUBDOMAIN_RE = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"  # at most 253
LABEL_VALUE_RE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"  # at most 63
LABEL_NAME_RE = r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"  # the part of a key after its prefix
# an OCI image reference: [registry[:port]/]path[:tag][@sha256:digest]
IMAGE_RE = (r"^(?:[A-Za-z0-9.-]+(?::[0-9]{1,5})?/)?[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
            r"(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?"
            r"(?:@sha256:[0-9a-f]{64})?$")


def label_key_problem(key: str) -> str | None:
    """Why `key` is not a Kubernetes label key ([prefix/]name), or None."""
    prefix, _, name = key.rpartition("/")
    if "/" in prefix or (prefix and (len(prefix) > 253 or not re.match(DNS_SUBDOMAIN_RE, prefix))):
        return f"label key {key[:80]!r}: its prefix must be a DNS subdomain such as example.com"
    if not name or len(name) > 63 or not re.match(LABEL_NAME_RE, name):
        return (f"label key {key[:80]!r}: the name must be 1-63 letters, digits, '-', '_' or '.', starting and "
                "ending with a letter or digit")
    return None


def label_value_problem(value: str) -> str | None:
    if len(value) > 63 or not re.match(LABEL_VALUE_RE, value):
        return (f"label value {value[:80]!r} must be at most 63 letters, digits, '-', '_' or '.', starting and "
                "ending with a letter or digit")
    return None


class Toleration(CamelModel):
    """A pod toleration (core/v1 Toleration), so the workers may run on tainted nodes."""

    key: str | None = Field(default=None, max_length=317, description="The taint's key; none (with Exists): every taint")
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = Field(default=None, max_length=63)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="The taint effect tolerated; none: every effect")
    toleration_seconds: int | None = Field(default=None, ge=0, le=10**9,
                                           description="NoExecute only: how long the pod stays once tainted")

    @field_validator("key")
    @classmethod
    def _key(cls, v: str | None) -> str | None:
        if v is not None and (problem := label_key_problem(v)):
            raise ValueError(problem)
        return v

    @field_validator("value")
    @classmethod
    def _value(cls, v: str | None) -> str | None:
        if v is not None and (problem := label_value_problem(v)):
            raise ValueError(problem)
        return v

    @model_validator(mode="after")
    def _consistent(self) -> Toleration:
        if self.operator == "Exists" and self.value:
            raise ValueError("operator Exists takes no value: drop value, or use operator Equal")
        if self.operator == "Equal" and not self.key:
            raise ValueError("operator Equal needs a key (operator Exists without a key tolerates every taint)")
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError("tolerationSeconds applies to effect NoExecute only")
        return self


class KubernetesRef(CamelModel):
    """Where and how the cluster's agent runs sub-tasks on its Kubernetes: every field reaches the
    objects the driver creates (docs/kubernetes-driver.md)."""

    kubeconfig_secret: str | None = Field(default=None, description="Write-only reference to a kubeconfig")
    server: str | None = Field(default=None, max_length=2048, pattern=r"^https?://[^\s]+$", description=(
        "The API server URL; the agent warns when its kubeconfig points elsewhere"))
    namespace: str = Field(default="default", max_length=63, json_schema_extra={"pattern": DNS_LABEL_RE},
                           description="Namespace of the Jobs, Services and Secrets (cpn agent --namespace overrides)")
    context: str | None = Field(default=None, max_length=253,
                                description="The kubeconfig context the agent uses when not given --context")
    queue: str | None = Field(default=None, max_length=63, json_schema_extra={"pattern": DNS_LABEL_RE}, description=(
        "Kueue LocalQueue in the namespace: the Job gets the kueue.x-k8s.io/queue-name label and is created "
        "suspended, so Kueue admits all its pods at once. None: no label, not suspended"))
    image: str | None = Field(default=None, max_length=255, json_schema_extra={"pattern": IMAGE_RE}, description=(
        "Image the pods run when the job names none (spec.image); cpn agent --image overrides it"))
    priority_class_name: str | None = Field(default=None, max_length=253, json_schema_extra={"pattern": DNS_SUBDOMAIN_RE},
                                            description="The pods' PriorityClass (it must exist in the cluster)")
    node_selector: dict[str, str] = Field(default_factory=dict, max_length=64,
                                          description="Labels a node must have to run the pods")
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32, description=(
        "Taints the pods tolerate, besides nvidia.com/gpu:NoSchedule which GPU pods always tolerate"))

    @field_validator("image")
    @classmethod
    def _image(cls, v: str | None) -> str | None:
        if v is not None and not re.match(IMAGE_RE, v):
            raise ValueError(f"{v[:80]!r} is not an image reference: write [registry[:port]/]name[:tag][@sha256:digest], "
                             "e.g. ghcr.io/you/cpn:0.1-cu128")
        return v

    @field_validator("namespace", "queue")
    @classmethod
    def _dns_label(cls, v: str | None) -> str | None:
        if v is not None and not re.match(DNS_LABEL_RE, v):
            raise ValueError(f"{v[:80]!r} is not a Kubernetes name: lowercase letters, digits and '-', starting and "
                             "ending with a letter or digit, e.g. ml-team")
        return v

    @field_validator("priority_class_name")
    @classmethod
    def _dns_subdomain(cls, v: str | None) -> str | None:
        if v is not None and not re.match(DNS_SUBDOMAIN_RE, v):
            raise ValueError(f"{v[:80]!r} is not a PriorityClass name: lowercase letters, digits, '-' and '.', "
                             "e.g. high-priority")
        return v

    @field_validator("node_selector")
    @classmethod
    def _selector(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            if problem := label_key_problem(key) or label_value_problem(value):
                raise ValueError(problem)
        return v


class Interconnect(CamelModel):
    intra_node_gbps: float = Field(default=600.0, gt=0)
    inter_node_gbps: float = Field(default=100.0, gt=0)


FABRIC_GBPS_PER_GPU = {"infiniband": 400.0, "roce": 200.0, "ethernet": 25.0}  # NDR per GPU; 200G RoCE; 200G shared by 8
ROCE_GID_INDEX = "3"  # RoCE v2 over IPv4 on the usual Mellanox/NVIDIA setup
IFNAME_RE = r"^[A-Za-z0-9_.:@-]{1,15}$"


class Fabric(CamelModel):
    """How a cluster's nodes talk to each other: what the planner prices intra-site collectives at
    and what NCCL is told (:meth:`nccl_env`)."""

    kind: Literal["infiniband", "roce", "ethernet"]
    gbps_per_gpu: float | None = Field(default=None, gt=0, le=10_000,
                                       description="Inter-node bandwidth per GPU (default by kind: "
                                                   "infiniband 400, roce 200, ethernet 25)")
    gpu_direct_rdma: bool = Field(default=False, description="GPUDirect RDMA between GPU and HCA")
    hcas: list[Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]] = Field(
        default_factory=list, max_length=64, description="RDMA devices for NCCL_IB_HCA, e.g. mlx5_0")
    socket_ifname: str | None = Field(default=None, pattern=IFNAME_RE,
                                      description="Interface for NCCL/Gloo sockets, e.g. eth0 or ib0")

    @field_validator("gpu_direct_rdma", "hcas")
    @classmethod
    def _rdma_only(cls, v: Any, info: ValidationInfo) -> Any:
        if v and info.data.get("kind") == "ethernet":
            raise ValueError(f"{info.field_name} needs kind infiniband or roce (ethernet has no RDMA)")
        return v

    @property
    def gbps(self) -> float:
        return self.gbps_per_gpu or FABRIC_GBPS_PER_GPU[self.kind]

    def nccl_env(self) -> dict[str, str]:
        """The communication environment of the cluster's workers."""
        env = {"NCCL_IB_DISABLE": "1" if self.kind == "ethernet" else "0"}
        if self.hcas:
            env["NCCL_IB_HCA"] = ",".join(self.hcas)
        if self.gpu_direct_rdma:
            env["NCCL_NET_GDR_LEVEL"] = "SYS"  # GPUDirect RDMA whatever the PCIe distance
        if self.kind == "roce":
            env["NCCL_IB_GID_INDEX"] = ROCE_GID_INDEX
        if self.socket_ifname:
            env["NCCL_SOCKET_IFNAME"] = env["GLOO_SOCKET_IFNAME"] = self.socket_ifname
        return env


def fabric_of(spec: dict[str, Any]) -> Fabric | None:
    """A stored cluster spec's fabric (None for a manifest written before fabrics existed)."""
    raw = spec.get("fabric")
    return Fabric.model_validate(raw) if raw else None


def inter_node_gbps(spec: dict[str, Any]) -> float:
    """The rate between a cluster's nodes: its fabric's, else the old `interconnect.interNodeGbps`."""
    fabric = fabric_of(spec)
    if fabric is not None:
        return fabric.gbps
    return float(spec.get("interconnect", {}).get("interNodeGbps", 100))


class ClusterSpec(CamelModel):
    site: Name
    driver: Literal["local", "kubernetes"] = "local"
    kubernetes: KubernetesRef | None = None
    node_pools: list[NodePool] = Field(min_length=1)
    currency: str = Field(default="USD", pattern=r"^[A-Z]{3}$")
    interconnect: Interconnect = Field(default_factory=Interconnect)
    fabric: Fabric | None = Field(default=None, description="The nodes' network; overrides interconnect.interNodeGbps")

    @property
    def capacity(self) -> int:
        return sum(p.gpus for p in self.node_pools)


class ClusterManifest(ManifestBase):
    kind: Literal["Cluster"] = "Cluster"
    spec: ClusterSpec
    status: dict[str, Any] | None = None


class Measured(CamelModel):
    bandwidth_gbps: float = Field(gt=0)
    rtt_ms: float = Field(ge=0)
    at: datetime | None = None


class LinkSpec(CamelModel):
    a: Name
    b: Name
    bandwidth_gbps: float = Field(gt=0)
    rtt_ms: float = Field(ge=0)
    price_per_gb: Money = Field(alias="pricePerGB")
    measured: Measured | None = None


class LinkManifest(ManifestBase):
    kind: Literal["Link"] = "Link"
    spec: LinkSpec
    status: dict[str, Any] | None = None


class FabricReport(CamelModel):
    """The network an agent found at its site (heartbeat `fabric`, shown as the cluster's `status.fabric`).
    Only what it saw: a null field, or kind `unknown`, means it could not tell -- never a guess."""

    kind: Literal["infiniband", "roce", "ethernet", "unknown"] = Field(description=(
        "infiniband/roce: RDMA devices with that link layer; ethernet: the machine or the nodes' feature "
        "labels list no RDMA device; unknown: nothing to tell by"))
    hcas: list[Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]] | None = Field(
        default=None, max_length=64, description="RDMA devices seen (null: not visible from here)")
    gpu_direct_rdma: bool | None = Field(default=None, description="true: a GPUDirect RDMA module is loaded")
    nvlink: bool | None = Field(default=None, description="GPUs joined by NVLink (nvidia-smi topo -m)")
    nodes: int | None = Field(default=None, ge=0, le=100_000, description="GPU nodes looked at (Kubernetes)")
    rdma_nodes: int | None = Field(default=None, ge=0, le=100_000,
                                   description="of those, labelled or allocatable as RDMA-capable")
    source: str = Field(max_length=300, description="Where the agent looked, and what it could not see")


MAX_CLUSTER_GPUS = 10_000_000  # more than any pool can state (64 per node x 100,000 nodes); a 32-bit column


class HeartbeatRequest(CamelModel):
    capacity_gpus: int | None = Field(default=None, ge=0, le=MAX_CLUSTER_GPUS)  # before allocatableGpus: its check reads it
    allocatable_gpus: int = Field(ge=0, le=MAX_CLUSTER_GPUS, description="GPUs free now; at most capacityGpus when that is given "
                                                   "(a rule between two fields, checked by the server)")
    conditions: list[Condition] = Field(default_factory=list)
    node_pools: list[NodePool] | None = None
    fabric: FabricReport | None = Field(default=None, description="The network the agent found")

    @field_validator("allocatable_gpus")
    @classmethod
    def _bounds(cls, value: int, info: ValidationInfo) -> int:
        capacity = info.data.get("capacity_gpus")
        if capacity is not None and value > capacity:
            raise ValueError(f"allocatableGpus {value} cannot exceed capacityGpus {capacity}")
        return value


MAX_HEARTBEATS = 1000  # clusters per batched heartbeat request


class ClusterHeartbeat(HeartbeatRequest):
    cluster: Name = Field(description="The cluster this report is about")


class HeartbeatBatch(CamelModel):
    """Many clusters' reports in one request and one transaction (a site agent with many clusters, a
    provider's gateway): all are recorded or none is."""

    items: list[ClusterHeartbeat] = Field(min_length=1, max_length=MAX_HEARTBEATS)


class HeartbeatBatchResult(CamelModel):
    api_version: Literal["cpn/v1"] = "cpn/v1"
    kind: Literal["HeartbeatResult"] = "HeartbeatResult"
    accepted: int = Field(description="How many clusters' reports were recorded")
    resource_versions: dict[str, str] = Field(description="Each cluster's resourceVersion after the report")
