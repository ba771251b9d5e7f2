"""Registers TrainingJob (created through the submit workflow) and the read-only views around it:
quotes, reservations, invoices, events."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncSession

from cpn.core import errors
from cpn.core.kinds import AGE, Column, Kind, KindRegistry
from cpn.core.principal import Principal
from layers.orchestration.identity.audit import Pending
from layers.orchestration.jobs import workflow
from layers.orchestration.jobs.retire import forget
from layers.service.jobs import JobStore
from layers.service.schemas import TrainingJobManifest

CodeCheck = Callable[[str, str], bool]  # (account, "sha256:…") → whether that account holds the bundle


class OrchestratedJobStore(JobStore):
    """A job store whose creation plans and quotes the job in the same transaction."""

    def __init__(self, timeouts: workflow.Timeouts, code_exists: CodeCheck | None = None):
        self.timeouts = timeouts
        self.code_exists = code_exists

    def check_code(self, principal: Principal, body: Any) -> BaseModel:
        """A job naming a code bundle this account never uploaded is refused before it is priced.
        Returns the parsed manifest, so that the submission does not validate the body again."""
        obj = self.parse(body)
        spec = obj.spec  # type: ignore[attr-defined]
        if spec.code is not None and self.code_exists is not None \
                and not self.code_exists(principal.account_id, spec.code.digest):
            raise errors.InvalidInput(f"no code bundle {spec.code.digest} in your account: `cpnctl apply -f "
                                      "job.yaml` packs spec.code.path and uploads it (PUT /api/v1/bundles/{sha256})",
                                      field="spec.code.digest")
        return obj

    async def submit(self, session: AsyncSession, principal: Principal, body: Any,
                     idempotency_key: str | None, *, audit: Pending | None = None) -> tuple[dict[str, Any], bool]:
        obj = self.check_code(principal, body)
        return await workflow.submit(session, principal, obj, idempotency_key, self.timeouts, audit=audit)

    async def preview(self, session: AsyncSession, principal: Principal, body: Any) -> dict[str, Any]:
        self.check_code(principal, body)
        return await workflow.preview(session, principal, body, self.timeouts)

    async def create(self, session: AsyncSession, principal: Principal, body: Any) -> dict[str, Any]:
        return (await self.submit(session, principal, body, None))[0]

    async def replace(self, session: AsyncSession, principal: Principal, name: str, body: Any,
                      *, check_version: bool = True) -> dict[str, Any]:
        self.authorize_write(principal, await self.load(session, principal, name))  # before the body's checks
        self.check_code(principal, body)
        await super().replace(session, principal, name, body, check_version=check_version)
        job = await self.load(session, principal, name)
        await workflow.requote(session, job, self.timeouts)
        return self.to_manifest(principal, job)

    async def delete(self, session: AsyncSession, principal: Principal, name: str) -> None:
        """A finished (or never accepted) job goes: its run records with it, its bills and audit stay,
        and its name is free again."""
        row = await self.load(session, principal, name, lock=True)
        self.authorize_write(principal, row)
        await self.before_delete(session, principal, row)
        await forget(session, row)
        await super().delete(session, principal, name)


def register(registry: KindRegistry, timeouts: workflow.Timeouts, code_exists: CodeCheck | None = None) -> None:
    registry.register(Kind(
        kind="TrainingJob", plural="jobs", short_names=("job", "trainingjob", "trainingjobs", "tj"),
        manifest=TrainingJobManifest, store=OrchestratedJobStore(timeouts, code_exists), order=50,
        verbs=("list", "get", "create", "update", "patch", "delete"),
        columns=(Column("PHASE", "{status.phase}"), Column("PROGRESS", "{status.progress.percent}%"),
                 Column("LOSS", "{status.progress.loss}"), Column("SITES", "{status.sites}"),
                 Column("COST", "{status.cost.total} {status.cost.currency}"), AGE,
                 Column("STRATEGY", "{status.strategy}", wide=True),
                 Column("ETA", "{status.progress.etaSeconds}", wide=True, format="duration"))))
    registry.register(Kind(
        kind="Quote", plural="quotes", short_names=("quote", "qt"), manifest=None, store=None, order=60,
        verbs=("list",), custom_path="/api/v1/jobs/{parent}/quotes", generic_routes=False,
        columns=(Column("CHOSEN", "{chosen}"), Column("STRATEGY", "{strategy}"),
                 Column("PLACEMENT", "{placementSummary}"), Column("GPUS", "{gpus}"),
                 Column("TIME", "{predictedDuration}"), Column("BASIS", "{basis}"), Column("WAN GB", "{wanGB}"),
                 Column("PRICE", "{price.total} {price.currency}"), Column("STATE", "{state}"),
                 Column("NOTE", "{note}"),
                 Column("ID", "{id}", wide=True), Column("EXPIRES", "{expiresAt}", wide=True),
                 # the memory plan (perf.memory_plan): the most loaded GPU's GB, sharding, recompute
                 Column("MEM/GPU", "{model.memoryGBPerGpu} GB", wide=True), Column("SHARD", "{model.shard}", wide=True),
                 Column("RECOMPUTE", "{model.activationCheckpointing}", wide=True))))
    registry.register(Kind(
        kind="Reservation", plural="reservations", short_names=("reservation", "lease", "leases", "rsv"),
        manifest=None, store=None, order=70, verbs=("list",), generic_routes=False,
        columns=(Column("JOB", "{spec.job}"), Column("CLUSTER", "{spec.cluster}"), Column("GPUS", "{spec.gpus}"),
                 Column("STATE", "{status.state}"), Column("EXPIRES", "{status.expiresAt}"), AGE)))
    registry.register(Kind(
        kind="Invoice", plural="invoices", short_names=("invoice", "inv", "payouts"), manifest=None, store=None,
        order=80, verbs=("list",), generic_routes=False,
        columns=(Column("JOB", "{spec.job}"), Column("TOTAL", "{status.total} {spec.currency}"),
                 Column("LINES", "{status.lineCount}"), Column("CONTRACT", "{spec.contract}", wide=True))))
    registry.register(Kind(
        kind="SubTask", plural="subtasks", short_names=("subtask", "st-job"), manifest=None, store=None, order=85,
        verbs=("list",), generic_routes=False,
        columns=(Column("JOB", "{spec.job}"), Column("ATTEMPT", "{spec.attempt}"), Column("SITE", "{spec.site}"),
                 Column("CLUSTER", "{spec.cluster}"), Column("GPUS", "{spec.gpus}"), Column("PHASE", "{status.phase}"),
                 AGE, Column("DRIVER", "{spec.driver}", wide=True))))
    registry.register(Kind(
        kind="Calibration", plural="calibrations", short_names=("calibration", "cal"), manifest=None, store=None,
        order=95, verbs=("list",), generic_routes=False,
        columns=(Column("GPU MODEL", "{gpuModel}"), Column("STRATEGY", "{strategy}"), Column("WORKLOAD", "{workload}"),
                 Column("PROVIDER", "{provider}"), Column("STEP FACTOR", "{stepFactor}"), Column("STARTUP S", "{startupSeconds}"),
                 Column("RUNS", "{samples}"), Column("LAST MEASURED/PREDICTED", "{lastRatio}"))))
    registry.register(Kind(
        kind="Event", plural="events", short_names=("event", "ev"), manifest=None, store=None, order=90,
        verbs=("list",), generic_routes=False,
        columns=(Column("JOB", "{job}"), Column("TYPE", "{type}"), Column("REASON", "{reason}"),
                 Column("AGE", "{at}", format="age"), Column("MESSAGE", "{message}"))))
