"""The audit trail: one row per mutating request — who, what, when, result."""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass
class Pending:
    """A mutating request's audit row before it is written. The audit middleware writes it after the
    handler, in a round trip of its own, unless a handler whose write is one atomic statement carried
    it in that statement (`ride_along`, workflow.submit): then the row is durable exactly when the
    request's own write is, and the request costs one round trip less. `written`: the status the
    carried row says; the middleware still writes its own row if the answer ended otherwise."""

    principal: Principal
    method: str
    path: str
    request_id: str | None
    written: int | None = None

    def ride_along(self, session: AsyncSession, status: int) -> AuditRecord:
        """Add this request's row, with `status` and result "ok", to the session's pending rows; the
        caller sets `written` once the statement that writes them succeeded."""
        row = AuditRecord(account_id=self.principal.account_id, account_name=self.principal.name,
                          method=self.method, path=self.path[:512], status=status, result="ok",
                          request_id=self.request_id)
        session.add(row)
        return row


async def recent(session: AsyncSession, principal: Principal, limit: int = 100) -> list[AuditRecord]:
    stmt = select(AuditRecord).order_by(AuditRecord.at.desc()).limit(limit)
    if not principal.is_admin:
        stmt = stmt.where(AuditRecord.account_id == principal.account_id)
    return list((await session.execute(stmt)).scalars())
