"""Stores of Team and Quota: admins write them; a user reads the teams it is in and the quotas that
bind it, each quota with what it counts now (status.used)."""

from __future__ import annotations

from typing import Any, ClassVar

from sqlalchemy import delete, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from cpn.core import errors
from cpn.core.principal import Principal, Role
from cpn.core.store import ResourceRow, ResourceStore
from layers.orchestration.identity.models import Account
from layers.orchestration.quotas import usage
from layers.orchestration.quotas.models import QuotaRow, TeamMemberRow, TeamRow
from layers.orchestration.quotas.schemas import RESOURCES, QuotaManifest, TeamManifest


class _AdminWritten(ResourceStore):
    """Admins create, change and delete; others read what concerns them (`mine`), and see nothing else."""

    create_roles: ClassVar[frozenset[Role]] = frozenset({Role.ADMIN})
    not_found_hides = True

    def mine(self, principal: Principal) -> Any:
        """A SQL condition on the row: it concerns `principal` (a non-admin)."""
        raise NotImplementedError

    async def decorate(self, session: AsyncSession, manifest: dict[str, Any]) -> dict[str, Any]:
        return manifest

    def filter_query(self, stmt: Any, principal: Principal, filters: dict[str, str]) -> Any:
        return stmt if principal.is_admin else stmt.where(self.mine(principal))

    async def get(self, session: AsyncSession, principal: Principal, name: str) -> dict[str, Any]:
        row = await self.load(session, principal, name)
        if not principal.is_admin and await session.scalar(
                select(self.row.id).where(self.row.id == row.id, self.mine(principal))) is None:
            raise errors.NotFound(f"{self.kind} {name!r} not found")
        return await self.decorate(session, self.to_manifest(principal, row))

    async def list(self, session: AsyncSession, principal: Principal, **kwargs: Any
                   ) -> tuple[list[dict[str, Any]], str | None]:
        items, cont = await super().list(session, principal, **kwargs)
        return [await self.decorate(session, item) for item in items], cont

    async def create(self, session: AsyncSession, principal: Principal, body: Any) -> dict[str, Any]:
        row = await self.create_row(session, principal, body)
        await self.written(session, row)
        return await self.decorate(session, self.to_manifest(principal, row))

    async def replace(self, session: AsyncSession, principal: Principal, name: str, body: Any,
                      *, check_version: bool = True) -> dict[str, Any]:
        out = await super().replace(session, principal, name, body, check_version=check_version)
        row = await self.find(session, name)
        if row is not None:
            await self.written(session, row)
        return await self.decorate(session, out)

    async def written(self, session: AsyncSession, row: ResourceRow) -> None:
        """After a create or a replace, in its transaction."""


class TeamStore(_AdminWritten):
    kind = "Team"
    row = TeamRow
    manifest = TeamManifest

    def mine(self, principal: Principal) -> Any:
        return TeamRow.id.in_(select(TeamMemberRow.team_id).where(TeamMemberRow.account == principal.name))

    async def prepare(self, session: AsyncSession, principal: Principal, obj: Any,
                      row: ResourceRow | None) -> dict[str, Any]:
        names = list(obj.spec.members)
        known = set((await session.execute(select(Account.name).where(Account.name.in_(names)))).scalars()) \
            if names else set()
        for i, name in enumerate(names):
            if name not in known:
                raise errors.InvalidInput(f"no account named {name!r}: list existing accounts (cpnctl get accounts)",
                                          field=f"spec.members[{i}]")
        return {}

    async def written(self, session: AsyncSession, row: ResourceRow) -> None:
        await session.execute(delete(TeamMemberRow).where(TeamMemberRow.team_id == row.id))
        session.add_all([TeamMemberRow(team_id=row.id, account=m) for m in (row.spec or {}).get("members", [])])
        await session.flush()

    async def before_delete(self, session: AsyncSession, principal: Principal, row: ResourceRow) -> None:
        bound = list((await session.execute(select(QuotaRow.name).where(QuotaRow.team == row.name)
                                            .order_by(QuotaRow.name))).scalars())
        if bound:
            raise errors.InUse(f"team {row.name!r} is bound by quota(s) {', '.join(bound)}; delete them first")

    async def decorate(self, session: AsyncSession, manifest: dict[str, Any]) -> dict[str, Any]:
        quotas = list((await session.execute(select(QuotaRow.name).where(QuotaRow.team == manifest["metadata"]["name"])
                                             .order_by(QuotaRow.name))).scalars())
        manifest["status"] = {"quotas": quotas}
        return manifest


class QuotaStore(_AdminWritten):
    kind = "Quota"
    row = QuotaRow
    manifest = QuotaManifest

    def mine(self, principal: Principal) -> Any:
        return or_(QuotaRow.account == principal.name, QuotaRow.team.in_(usage.teams_of_stmt(principal.name)))

    async def prepare(self, session: AsyncSession, principal: Principal, obj: Any,
                      row: ResourceRow | None) -> dict[str, Any]:
        spec = obj.spec
        if (spec.account is None) == (spec.team is None):
            raise errors.InvalidInput("bind the quota to one account (spec.account) or one team (spec.team)"
                                      + (", not both" if spec.account else ""), field="spec.account")
        if spec.account is not None and await session.scalar(
                select(Account.id).where(Account.name == spec.account)) is None:
            raise errors.InvalidInput(f"no account named {spec.account!r}", field="spec.account")
        if spec.team is not None and await session.scalar(select(TeamRow.id).where(TeamRow.name == spec.team)) is None:
            raise errors.InvalidInput(f"no team named {spec.team!r}: create it first (kind: Team)", field="spec.team")
        if all(getattr(spec, f) is None for f in ("max_gpus", "max_jobs", "gpu_hours_per_month", "spend_per_month")):
            raise errors.InvalidInput("set at least one limit: " + ", ".join(f"spec.{r}" for r in RESOURCES),
                                      field="spec.maxGpus")
        return {}

    def derive(self, row: ResourceRow, obj: Any, refs: dict[str, Any]) -> None:
        row.account, row.team = obj.spec.account, obj.spec.team  # type: ignore[attr-defined]

    async def decorate(self, session: AsyncSession, manifest: dict[str, Any]) -> dict[str, Any]:
        row = await self.find(session, manifest["metadata"]["name"])
        if row is None:
            return manifest
        used = await usage.usage(session, row)  # type: ignore[arg-type]
        wire, spec = used.wire(), manifest["spec"]
        shown = {field: f"{wire[field]}/{spec[key]}" + (f" {spec.get('currency', 'USD')}" if field == "spend" else "")
                 for key, field in (("maxGpus", "gpus"), ("maxJobs", "jobs"), ("gpuHoursPerMonth", "gpuHours"),
                                    ("spendPerMonth", "spend")) if spec.get(key) is not None}
        manifest["status"] = {"boundTo": usage.bound_to(row), "accounts": used.accounts,  # type: ignore[arg-type]
                              "month": used.month, "used": wire, "usedOfLimit": shown}
        return manifest
