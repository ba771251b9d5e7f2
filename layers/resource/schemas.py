"""Wire schemas of the inventory kinds: Site, Cluster, Link (and the heartbeat body)."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, WithJsonSchema, field_validator

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


class KubernetesRef(CamelModel):
    kubeconfig_secret: str | None = Field(default=None, description="Write-only reference to a kubeconfig")
    server: str | None = None
    namespace: str = "default"
    context: str | None = None
    queue: str | None = Field(default=None, description="Kueue LocalQueue for gang admission (default cpn)")
    image: str | None = Field(default=None, description="Worker image (default cpn:latest)")


class Interconnect(CamelModel):
    intra_node_gbps: float = Field(default=600.0, gt=0)
    inter_node_gbps: float = Field(default=100.0, gt=0)


class ClusterSpec(CamelModel):
    site: Name
    driver: Literal["local", "kubernetes"] = "local"
    kubernetes: KubernetesRef | None = None
    node_pools: list[NodePool] = Field(min_length=1)
    currency: str = Field(default="USD", pattern=r"^[A-Z]{3}$")
    interconnect: Interconnect = Field(default_factory=Interconnect)

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


MAX_CLUSTER_GPUS = 10_000_000  # more than any pool can state (64 per node x 100,000 nodes); a 32-bit column


class HeartbeatRequest(CamelModel):
    capacity_gpus: int | None = Field(default=None, ge=0, le=MAX_CLUSTER_GPUS)  # before allocatableGpus: its check reads it
    allocatable_gpus: int = Field(ge=0, le=MAX_CLUSTER_GPUS, description="GPUs free now; at most capacityGpus when that is given "
                                                   "(a rule between two fields, checked by the server)")
    conditions: list[Condition] = Field(default_factory=list)
    node_pools: list[NodePool] | None = None

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
