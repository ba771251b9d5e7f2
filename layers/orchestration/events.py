"""Events: every phase transition and notable happening of a job, kubectl-style."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import DateTime, String, Text, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Mapped, mapped_column

from cpn.core.db import Base, Tracked, as_utc, new_uid, utcnow
from cpn.core.store import KEY_LEN, SUBTASK_LEN


class EventRow(Tracked, Base):
    __tablename__ = "events"

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_uid)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)
    job: Mapped[str] = mapped_column(String(KEY_LEN), index=True, nullable=False)
    subtask: Mapped[str | None] = mapped_column(String(SUBTASK_LEN), nullable=True)
    type: Mapped[str] = mapped_column(String(16), nullable=False)  # Normal | Warning
    reason: Mapped[str] = mapped_column(String(63), nullable=False)
    message: Mapped[str] = mapped_column(Text, nullable=False)


async def record_event(session: AsyncSession, job: str, type_: str, reason: str, message: str,
                       subtask: str | None = None) -> None:
    session.add(EventRow(job=job, type=type_, reason=reason, message=message[:4000], subtask=subtask, at=utcnow()))


async def list_events(session: AsyncSession, jobs: list[str] | None, limit: int = 500,
                      namespace: str | None = None) -> list[dict[str, Any]]:
    """The latest ``limit`` events (of ``jobs``, or all; of the jobs in ``namespace`` only), oldest first."""
    stmt = select(EventRow).order_by(EventRow.at.desc(), EventRow.id.desc()).limit(limit)
    if jobs is not None:
        stmt = stmt.where(EventRow.job.in_(jobs))
    if namespace is not None:
        stmt = stmt.where(EventRow.job.startswith(f"{namespace}/", autoescape=True))
    rows = list((await session.execute(stmt)).scalars())[::-1]
    return [{"uid": e.id, "at": as_utc(e.at).isoformat(), "job": e.job, "subtask": e.subtask, "type": e.type,
             "reason": e.reason, "message": e.message} for e in rows]
