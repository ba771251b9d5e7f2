"""The live capacity view: what each Ready cluster can still give = reported allocatable − leased."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from layers.control.models import LeaseRow
from layers.resource.capacity import ClusterView, LinkView, inventory


@dataclass(frozen=True)
class PoolOffer:
    """One node pool of a Ready cluster with the GPUs free for new work."""

    offer: str  # cluster, or cluster/pool when the cluster has several pools
    cluster: str
    site: str
    region: str
    provider: str
    owner_id: str
    gpu_model: str
    tflops: float
    memory_gb: float
    free_gpus: int
    price_per_gpu_hour: Decimal
    currency: str
    intra_node_gbps: float
    inter_node_gbps: float
    gpus_per_node: int
    driver: str


async def leased_gpus(session: AsyncSession) -> dict[str, int]:
    rows = await session.execute(select(LeaseRow.cluster, func.sum(LeaseRow.gpus))
                                 .where(LeaseRow.state == "active").group_by(LeaseRow.cluster))
    return {name: int(total or 0) for name, total in rows.all()}


def free_of(cluster: ClusterView, leased: dict[str, int]) -> int:
    return max(0, cluster.allocatable_gpus - leased.get(cluster.name, 0)) if cluster.ready else 0


async def snapshot(session: AsyncSession, heartbeat_timeout: timedelta, now: datetime | None = None
                   ) -> tuple[list[PoolOffer], list[LinkView], list[ClusterView]]:
    now = now or datetime.now(UTC)
    clusters, links = await inventory(session, heartbeat_timeout, now)
    leased = await leased_gpus(session)
    offers: list[PoolOffer] = []
    for cluster in clusters:
        free = free_of(cluster, leased)
        pools = cluster.spec.get("nodePools", [])
        inter = cluster.spec.get("interconnect", {})
        for pool in pools:
            gpus = pool["gpusPerNode"] * pool["nodes"]
            offers.append(PoolOffer(
                offer=cluster.name if len(pools) == 1 else f"{cluster.name}/{pool['name']}",
                cluster=cluster.name, site=cluster.site, region=cluster.region, provider=cluster.provider,
                owner_id=cluster.owner_id, gpu_model=pool["gpu"]["model"], tflops=float(pool["gpu"]["tflops"]),
                memory_gb=float(pool["gpu"]["memoryGB"]), free_gpus=min(free, gpus),
                price_per_gpu_hour=Decimal(str(pool["pricePerGpuHour"])), currency=cluster.spec.get("currency", "USD"),
                intra_node_gbps=float(inter.get("intraNodeGbps", 600)),
                inter_node_gbps=float(inter.get("interNodeGbps", 100)), gpus_per_node=pool["gpusPerNode"],
                driver=cluster.driver))
    return offers, links, clusters

