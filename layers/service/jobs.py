"""The TrainingJob kind: storage, tenancy (users see only their own jobs) and phases."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, ClassVar

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from cpn.core import errors
from cpn.core.manifest import set_condition
from cpn.core.principal import Principal, Role
from cpn.core.store import ResourceRow, ResourceStore
from layers.service.models import JobRow
from layers.service.schemas import TrainingJobManifest

PHASES = ("Pending", "Quoted", "Accepted", "Reserved", "Launching", "Running", "Succeeded", "Failed",
          "Cancelled")
TERMINAL = frozenset({"Succeeded", "Failed", "Cancelled"})


class JobStore(ResourceStore):
    kind = "TrainingJob"
    row = JobRow
    manifest = TrainingJobManifest
    create_roles: ClassVar[frozenset[Role]] = frozenset({Role.USER, Role.ADMIN})
    not_found_hides = True

    def visible(self, principal: Principal, row: ResourceRow) -> bool:
        return principal.owns(row.owner_id) or (principal.role is Role.WORKER and principal.job == row.name)

    def status_view(self, row: ResourceRow, now: datetime | None = None) -> dict[str, Any]:
        status = dict(row.status or {})
        status["phase"] = row.phase  # type: ignore[attr-defined]
        return status

    def initial_status(self, obj: Any) -> dict[str, Any]:
        return {"conditions": []}

    async def replace(self, session: AsyncSession, principal: Principal, name: str, body: Any,
                      *, check_version: bool = True) -> dict[str, Any]:
        row = await self.load(session, principal, name)
        if row.phase != "Pending" and row.phase != "Quoted":  # type: ignore[attr-defined]
            raise errors.Conflict(f"job {name!r} is {row.phase}; its spec can no longer change")  # type: ignore[attr-defined]
        return await super().replace(session, principal, name, body, check_version=check_version)

    async def before_delete(self, session: AsyncSession, principal: Principal, row: ResourceRow) -> None:
        if row.phase not in TERMINAL and row.phase not in ("Pending", "Quoted"):  # type: ignore[attr-defined]
            raise errors.InUse(f"job {row.name!r} is {row.phase}; cancel it first")  # type: ignore[attr-defined]

    def filter_query(self, stmt: Any, principal: Principal, filters: dict[str, str]) -> Any:
        if not principal.is_admin:
            stmt = stmt.where(JobRow.owner_id == principal.account_id)
        if "phase" in filters:
            stmt = stmt.where(JobRow.phase == filters["phase"])
        return stmt


async def find_job(session: AsyncSession, name: str, *, lock: bool = False) -> JobRow | None:
    stmt = select(JobRow).where(JobRow.name == name)
    if lock:
        stmt = stmt.with_for_update()
    return (await session.execute(stmt)).scalar_one_or_none()


async def load_job(session: AsyncSession, principal: Principal, name: str, *, lock: bool = False) -> JobRow:
    row = await find_job(session, name, lock=lock)
    if row is None or not JobStore().visible(principal, row):
        raise errors.NotFound(f"TrainingJob {name!r} not found")
    return row


def set_phase(row: JobRow, phase: str, reason: str, message: str, now: datetime | None = None) -> str:
    """Move a job to `phase`, keep a condition per phase transition, return the previous phase."""
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase}")
    now = now or datetime.now(UTC)
    previous = row.phase
    status = dict(row.status or {})
    status["conditions"] = set_condition(status.get("conditions", []), phase, True, reason, message, now)
    status.setdefault("phaseTimes", {})[phase] = now.isoformat()
    status["message"] = message
    row.status = status
    row.phase = phase
    return previous


def update_status(row: JobRow, **fields: Any) -> None:
    status = dict(row.status or {})
    status.update({k: v for k, v in fields.items()})
    row.status = status
