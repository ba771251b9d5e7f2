"""Registers Team and Quota with their printer columns."""

from __future__ import annotations

from cpn.core.kinds import AGE, Column, Kind, KindRegistry
from layers.orchestration.quotas.schemas import QuotaManifest, TeamManifest
from layers.orchestration.quotas.stores import QuotaStore, TeamStore


def register(registry: KindRegistry) -> None:
    registry.register(Kind(
        kind="Team", plural="teams", short_names=("team",), manifest=TeamManifest, store=TeamStore(), order=40,
        columns=(Column("MEMBERS", "{spec.members}"), Column("QUOTAS", "{status.quotas}"), AGE)))
    registry.register(Kind(
        kind="Quota", plural="quotas", short_names=("quota", "quo"), manifest=QuotaManifest, store=QuotaStore(),
        order=45,
        columns=(Column("BOUND TO", "{status.boundTo}"),
                 Column("GPUS", "{status.usedOfLimit.gpus}"),
                 Column("JOBS", "{status.usedOfLimit.jobs}"),
                 Column("GPU-HOURS", "{status.usedOfLimit.gpuHours}"),
                 Column("SPEND", "{status.usedOfLimit.spend}"),
                 Column("MONTH", "{status.month}", wide=True), Column("ACCOUNTS", "{status.accounts}", wide=True),
                 AGE)))
