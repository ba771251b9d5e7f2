"""The live capacity view: what each Ready cluster can still give = reported allocatable − leased."""

from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from sqlalchemy import func, literal, select
from sqlalchemy.ext.asyncio import AsyncSession

from cpn.core.db import as_utc
from layers.control.models import LeaseRow
from layers.resource.capacity import ClusterView, LinkView, stored_catalogue
from layers.resource.schemas import inter_node_gbps
from layers.resource.stores import is_ready


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


LEASE_TAG = "lease:"  # stamp-shaped rows of active lease sums: (LEASE_TAG + cluster, GPUs, -, -)


@functools.cache  # one statement object: the catalogue's stamp query is built once with it
def _lease_sums() -> Any:
    """Active leased GPUs per cluster, in the shape of the catalogue's stamp rows, so that they come
    back in the same round trip as the catalogue check."""
    return (select((literal(LEASE_TAG) + LeaseRow.cluster).label("tag"), func.sum(LeaseRow.gpus),
                   func.max(LeaseRow.updated_at), literal(0))
            .where(LeaseRow.state == "active").group_by(LeaseRow.cluster))


@dataclass(eq=False)  # compared and hashed by identity: one object per distinct market
class OfferSet:
    """What a quote may offer at one moment: the Ready clusters' pools with their free GPUs, the
    links, the clusters. Built once per (catalogue as stored, active leases, which clusters are
    Ready) and shared by every request until one of those changes; `derived` keeps what layers
    above compute from it (planner inputs, sellers), so that they too are computed once."""

    offers: tuple[PoolOffer, ...]
    links: tuple[LinkView, ...]
    clusters: tuple[ClusterView, ...]
    extra: list[Any]  # the rows of the caller's `also` selects, from this call's round trip
    derived: dict[Any, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class _Market:
    key: tuple[Any, ...]  # (catalogue object, lease sums, heartbeat timeout)
    # readiness is the same for every `now` in [valid_from, fresh_until): before valid_from a cluster
    # that had timed out was still Ready, at fresh_until the first Ready one times out
    valid_from: datetime
    fresh_until: datetime
    offers: OfferSet


MARKETS_KEPT = 4  # offer sets kept per process (databases, heartbeat timeouts)
_markets: OrderedDict[str, _Market] = OrderedDict()  # database URL → the last offer set built from it


async def offer_set(session: AsyncSession, heartbeat_timeout: timedelta, now: datetime | None = None,
                    also: tuple[Any, ...] = (), params: dict[str, Any] | None = None) -> OfferSet:
    """The live offer set, in one round trip: the catalogue's stamp and the active lease sums (and the
    caller's `also` selects) are read together; the offers are rebuilt only when the catalogue (a
    cluster, site, link, price or heartbeat written), a lease, or the time (a Ready cluster whose
    heartbeat timed out) changed what a quote may offer. Replicas each keep their own and check it
    against the database on every call."""
    now = now or datetime.now(UTC)
    catalogue, rows = await stored_catalogue(session, (_lease_sums(), *also), params)
    leased = {r[0][len(LEASE_TAG):]: int(r[1] or 0) for r in rows if r[0].startswith(LEASE_TAG)}
    extra = [r for r in rows if not r[0].startswith(LEASE_TAG)]
    key = (catalogue, tuple(sorted(leased.items())), heartbeat_timeout)
    where = str(session.get_bind().url)
    held = _markets.get(where)
    if held is not None and held.key[0] is key[0] and held.key[1:] == key[1:] \
            and held.valid_from < now < held.fresh_until:
        return OfferSet(held.offers.offers, held.offers.links, held.offers.clusters, extra, held.offers.derived)
    clusters = []
    valid_from, fresh_until = datetime.min.replace(tzinfo=UTC), datetime.max.replace(tzinfo=UTC)
    for cluster in catalogue.clusters:
        ready, why, _ = is_ready(cluster, heartbeat_timeout, now)  # type: ignore[arg-type]
        # only the heartbeat's age moves with time; every other reason needs a write (a new stamp)
        if ready:
            fresh_until = min(fresh_until, as_utc(cluster.last_heartbeat_at) + heartbeat_timeout)  # type: ignore[operator]
        elif why == "HeartbeatTimeout":
            valid_from = max(valid_from, as_utc(cluster.last_heartbeat_at) + heartbeat_timeout)  # type: ignore[operator]
        clusters.append(ClusterView(
            name=cluster.name, site=cluster.site, region=cluster.region, provider=cluster.provider,
            owner_id=cluster.owner_id, driver=cluster.driver, ready=ready,
            allocatable_gpus=cluster.allocatable_gpus if ready else 0, capacity_gpus=cluster.capacity_gpus,
            spec=cluster.spec))
    offers = tuple(_offers(clusters, leased))
    # the same offers as before (a write that changed nothing a quote sees): keep what was derived from
    # them, so that the planner's inputs stay the very objects its memo holds
    same = held is not None and held.offers.offers == offers and held.offers.links == catalogue.links
    built = OfferSet(offers, catalogue.links, tuple(clusters), extra, held.offers.derived if same else {})  # type: ignore[union-attr]
    _markets[where] = _Market(key, valid_from, fresh_until, built)
    _markets.move_to_end(where)
    while len(_markets) > MARKETS_KEPT:
        _markets.popitem(last=False)
    return built


async def snapshot(session: AsyncSession, heartbeat_timeout: timedelta, now: datetime | None = None
                   ) -> tuple[list[PoolOffer], list[LinkView], list[ClusterView]]:
    found = await offer_set(session, heartbeat_timeout, now)
    return list(found.offers), list(found.links), list(found.clusters)


def offer_cluster(offer: str) -> str:
    """The cluster an offer's name (``cluster``, or ``cluster/pool`` for a cluster of several node pools)
    belongs to: what placement, quote and price lines name."""
    return offer.split("/")[0]


def _offers(clusters: list[ClusterView], leased: dict[str, int]) -> list[PoolOffer]:
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
                inter_node_gbps=inter_node_gbps(cluster.spec), gpus_per_node=pool["gpusPerNode"],
                driver=cluster.driver))
    return offers
