"""The read-only `Account` kind: admins list every account, others see only their own."""

from __future__ import annotations

from typing import Any, Literal

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from cpn.core import errors
from cpn.core.db import as_utc
from cpn.core.kinds import AGE, Column, Kind
from cpn.core.manifest import CamelModel, ManifestBase
from cpn.core.principal import Principal
from layers.orchestration.identity.models import Account


class AccountSpec(CamelModel):
    role: Literal["admin", "provider", "user"]


class AccountManifest(ManifestBase):
    kind: Literal["Account"] = "Account"
    spec: AccountSpec
    status: dict[str, Any] | None = None


class AccountStore:
    kind = "Account"

    def _wire(self, row: Account) -> dict[str, Any]:
        return {"apiVersion": "cpn/v1", "kind": "Account",
                "metadata": {"name": row.name, "uid": row.id, "resourceVersion": str(row.resource_version),
                             "creationTimestamp": as_utc(row.created_at).isoformat()},
                "spec": {"role": row.role}, "status": {"disabled": row.disabled}}

    async def list(self, session: AsyncSession, principal: Principal, **_: Any) -> tuple[list[dict], None]:
        stmt = select(Account).order_by(Account.name)
        if not principal.is_admin:
            stmt = stmt.where(Account.id == principal.account_id)
        return [self._wire(r) for r in (await session.execute(stmt)).scalars()], None

    async def get(self, session: AsyncSession, principal: Principal, name: str) -> dict[str, Any]:
        row = (await session.execute(select(Account).where(Account.name == name))).scalar_one_or_none()
        if row is None or not principal.owns(row.id):
            raise errors.NotFound(f"Account {name!r} not found")
        return self._wire(row)


def kind() -> Kind:
    return Kind(kind="Account", plural="accounts", short_names=("acct",), manifest=AccountManifest,
                store=AccountStore(),  # type: ignore[arg-type]
                columns=(Column("ROLE", "{spec.role}"), AGE), order=0, verbs=("list", "get"))
