"""The audit trail: one row per mutating request — who, what, when, result."""

from __future__ import annotations

from sqlalchemy import insert, select
from sqlalchemy.ext.asyncio import AsyncSession

from cpn.core.db import Database
from cpn.core.principal import Principal
from layers.orchestration.identity.models import AuditRecord


async def record(session: AsyncSession, principal: Principal | None, method: str, path: str, status: int,
                 result: str, request_id: str | None) -> None:
    session.add(AuditRecord(
        account_id=principal.account_id if principal else None,
        account_name=principal.name if principal else None,
        method=method, path=path[:512], status=status, result=result, request_id=request_id,
    ))


async def write(db: Database, principal: Principal | None, method: str, path: str, status: int, result: str,
                request_id: str | None) -> None:
    """`record` as a transaction of its own: one INSERT in autocommit, one round trip (one statement
    object, run with each request's values)."""
    await db.write_once(_INSERT, dict(
        account_id=principal.account_id if principal else None,
        account_name=principal.name if principal else None,
        method=method, path=path[:512], status=status, result=result, request_id=request_id))


_INSERT = insert(AuditRecord)


async def recent(session: AsyncSession, principal: Principal, limit: int = 100) -> list[AuditRecord]:
    stmt = select(AuditRecord).order_by(AuditRecord.at.desc()).limit(limit)
    if not principal.is_admin:
        stmt = stmt.where(AuditRecord.account_id == principal.account_id)
    return list((await session.execute(stmt)).scalars())
