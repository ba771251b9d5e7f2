"""The TrainingJob kind: storage, tenancy (users see only their own jobs) and phases."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, ClassVar

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from cpn.core import errors
from cpn.core.manifest import set_condition
from cpn.core.phases import JOB_DRAFT, JOB_TERMINAL, JobPhase
from cpn.core.principal import Principal, Role
from cpn.core.store import ResourceRow, ResourceStore, is_retired, qualify, split_key
from layers.service.models import ContractRow, JobRow
from layers.service.schemas import TrainingJobManifest
from layers.service.status import validated

TERMINAL = JOB_TERMINAL
DRAFT_PHASES = JOB_DRAFT


class JobStore(ResourceStore):
    kind = "TrainingJob"
    row = JobRow
    manifest = TrainingJobManifest
    create_roles: ClassVar[frozenset[Role]] = frozenset({Role.USER, Role.ADMIN})
    not_found_hides = True
    namespaced = True  # stored as "<account>/<name>": each user has their own job names

    def visible(self, principal: Principal, row: ResourceRow) -> bool:
        return principal.owns(row.owner_id) or (principal.role is Role.WORKER and principal.job == row.name)

    def status_view(self, row: ResourceRow, now: datetime | None = None) -> dict[str, Any]:
        status = dict(row.status or {})
        status["phase"] = row.phase  # type: ignore[attr-defined]
        return status

    def initial_status(self, obj: Any) -> dict[str, Any]:
        return {"conditions": []}

    async def apply(self, session: AsyncSession, principal: Principal, body: Any) -> tuple[str, dict[str, Any]]:
        """kubectl apply: the manifest of a job past its draft, re-applied as it is, is "unchanged"."""
        obj = self.parse(body)
        row = await self.find(session, self.key(principal, obj.metadata.name, self.own_namespace(principal, obj)))
        if row is not None and row.phase not in DRAFT_PHASES and self.visible(principal, row) \
                and self._same(row, obj):  # type: ignore[attr-defined]
            return "unchanged", self.to_manifest(principal, row)
        return await super().apply(session, principal, body)

    @staticmethod
    def _same(row: ResourceRow, obj: Any) -> bool:
        wire = obj.model_dump(mode="json", by_alias=True, exclude_none=True)
        return wire.get("spec", {}) == (row.spec or {}) and wire["metadata"].get("labels", {}) == (row.labels or {})

    async def replace(self, session: AsyncSession, principal: Principal, name: str, body: Any,
                      *, check_version: bool = True) -> dict[str, Any]:
        row = await self.load(session, principal, name)
        if row.phase not in DRAFT_PHASES:  # type: ignore[attr-defined]
            raise errors.Conflict(f"job {name!r} is {row.phase}; its spec can no longer change: "  # type: ignore[attr-defined]
                                  "submit it under a new name (or delete it first)")
        return await super().replace(session, principal, name, body, check_version=check_version)

    async def before_delete(self, session: AsyncSession, principal: Principal, row: ResourceRow) -> None:
        if row.phase not in TERMINAL and row.phase not in DRAFT_PHASES:  # type: ignore[attr-defined]
            raise errors.InUse(f"job {row.name!r} is {row.phase}; cancel it first")  # type: ignore[attr-defined]

    async def has_history(self, session: AsyncSession, row: ResourceRow) -> bool:
        """A job that held a contract is retired, not deleted: its contract and ledger keep pointing at it."""
        return bool(await session.scalar(select(func.count()).select_from(ContractRow)
                                         .where(ContractRow.job_id == row.id)))

    def filter_query(self, stmt: Any, principal: Principal, filters: dict[str, str]) -> Any:
        if not principal.is_admin:
            stmt = stmt.where(JobRow.owner_id == principal.account_id)
        if "phase" in filters:
            stmt = stmt.where(JobRow.phase == filters["phase"])
        if filters.get("namespace"):
            stmt = stmt.where(JobRow.name.startswith(qualify(filters["namespace"], ""), autoescape=True))
        return stmt


async def find_job(session: AsyncSession, name: str, *, lock: bool = False) -> JobRow | None:
    if is_retired(name):
        return None
    stmt = select(JobRow).where(JobRow.name == name)
    if lock:
        stmt = stmt.with_for_update()
    return (await session.execute(stmt)).scalar_one_or_none()


async def load_job(session: AsyncSession, principal: Principal, name: str, *, lock: bool = False) -> JobRow:
    """The job `name` (bare: the caller's own; "ns/name": another namespace's, if the caller may see it)."""
    row = await JobStore().resolve(session, principal, name, lock=lock)
    if row is None or not JobStore().visible(principal, row):
        raise errors.NotFound(f"TrainingJob {name!r} not found")
    return row  # type: ignore[return-value]


async def job_key(session: AsyncSession, principal: Principal, name: str | None) -> str | None:
    """The stored name a `?job=` filter means (a job the caller cannot see filters to nothing)."""
    if not name:
        return name
    row = await JobStore().resolve(session, principal, name)
    return row.name if row is not None else JobStore().key(principal, name)


async def owned_keys(session: AsyncSession, principal: Principal) -> list[str]:
    """The stored names of the caller's own jobs."""
    stmt = select(JobRow.name).where(JobRow.owner_id == principal.account_id, JobRow.name.not_like("~%"))
    return list((await session.execute(stmt)).scalars())


def display_name(key: str) -> str:
    """A job's name as its owner knows it ("alice/lm" → "lm")."""
    return split_key(key)[1]


def set_phase(row: JobRow, phase: JobPhase | str, reason: str, message: str, now: datetime | None = None) -> str:
    """Move a job to `phase`, keep a condition per phase transition, return the previous phase."""
    phase = JobPhase(phase)  # an unknown phase raises here, where it is written
    now = now or datetime.now(UTC)
    previous = row.phase
    status = dict(row.status or {})
    conditions = set_condition(status.get("conditions", []), phase.value, True, reason, message, now)
    for cond in list(conditions):  # one phase at a time: the others' conditions are history (False), as kubectl reads
        if cond["type"] != phase.value and cond.get("status") == "True":
            conditions = set_condition(conditions, cond["type"], False, cond.get("reason", ""), cond.get("message", ""), now)
    times = {**status.get("phaseTimes", {}), phase.value: now.isoformat()}
    row.status = validated(status, {"conditions": conditions, "phaseTimes": times, "message": message})
    row.phase = phase.value
    return previous


def reword_phase(row: JobRow, reason: str, message: str, now: datetime | None = None) -> None:
    """Say something new about the job's current phase (its condition and message) without a transition:
    the phase's time stays (metering and learning read it). Writes only when the words changed."""
    status = dict(row.status or {})
    current = next((c for c in status.get("conditions", []) if c.get("type") == row.phase), None)
    if current is not None and current.get("reason") == reason and current.get("message") == message:
        return
    conditions = set_condition(status.get("conditions", []), row.phase, True, reason, message, now or datetime.now(UTC))
    row.status = validated(status, {"conditions": conditions, "message": message})


def update_status(row: JobRow, **fields: Any) -> None:
    """Change the job's status; every key and type is checked against `JobStatus`."""
    row.status = validated(dict(row.status or {}), fields)
