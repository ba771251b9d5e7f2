"""Registers Site, Cluster and Link with their printer columns."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import timedelta

from sqlalchemy.ext.asyncio import AsyncSession

from cpn.core.kinds import AGE, Column, Kind, KindRegistry
from layers.resource.schemas import ClusterManifest, LinkManifest, SiteManifest
from layers.resource.stores import ClusterStore, LinkStore, SiteStore


def register(registry: KindRegistry, heartbeat_timeout: timedelta,
             cluster_holders: Callable[[AsyncSession, str], Awaitable[list[str]]] | None = None) -> None:
    clusters = ClusterStore()
    clusters.heartbeat_timeout = heartbeat_timeout
    clusters.holders = cluster_holders
    registry.register(Kind(
        kind="Site", plural="sites", short_names=("st",), manifest=SiteManifest, store=SiteStore(), order=10,
        columns=(Column("REGION", "{spec.region}"), Column("PROVIDER", "{spec.provider}"),
                 Column("LOCATION", "{spec.location.lat},{spec.location.lon}", wide=True), AGE)))
    registry.register(Kind(
        kind="Cluster", plural="clusters", short_names=("cl",), manifest=ClusterManifest, store=clusters,
        order=20, subresources={"heartbeat": "POST"},
        columns=(Column("READY", "{status.ready}"),
                 Column("GPUS", "{status.allocatable.gpus}/{status.capacity.gpus}"),
                 Column("GPU MODEL", "{status.gpuModel}"), Column("PRICE", "{status.price}"),
                 Column("SITE", "{spec.site}"), AGE,
                 Column("INTERCONNECT", "{spec.interconnect.intraNodeGbps}/{spec.interconnect.interNodeGbps} Gbps",
                        wide=True),
                 Column("DRIVER", "{spec.driver}", wide=True))))
    registry.register(Kind(
        kind="Link", plural="links", short_names=("ln",), manifest=LinkManifest, store=LinkStore(), order=30,
        columns=(Column("A", "{spec.a}"), Column("B", "{spec.b}"), Column("GBPS", "{spec.bandwidthGbps}"),
                 Column("RTT MS", "{spec.rttMs}"), Column("PRICE/GB", "{spec.pricePerGB}"),
                 Column("STATE", "{status.state}"), AGE,
                 Column("MEASURED GBPS", "{spec.measured.bandwidthGbps}", wide=True))))
