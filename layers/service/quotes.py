"""Quotes: priced offers for a job, labelled cheapest / fastest / balanced, valid until they expire."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession

from cpn.core import errors
from cpn.core.db import as_utc
from layers.service.models import JobRow, QuoteRow

LABELS = ("cheapest", "fastest", "balanced")


async def supersede_open(session: AsyncSession, job: JobRow) -> None:
    await session.execute(update(QuoteRow).where(QuoteRow.job_id == job.id, QuoteRow.state == "open")
                          .values(state="superseded", resource_version=QuoteRow.resource_version + 1)
                          .execution_options(synchronize_session=False))


def new_quote(job: JobRow, label: str, *, placement: list[dict[str, Any]], strategy: str, ring: list[str],
              prediction: dict[str, Any], predicted_seconds: float, wan_gb: float, lines: list[dict[str, Any]],
              total: Decimal, currency: str, ttl: timedelta, now: datetime | None = None) -> QuoteRow:
    now = now or datetime.now(UTC)
    return QuoteRow(job_id=job.id, label=label, strategy=strategy, placement=placement, ring=ring,
                    prediction=prediction, predicted_seconds=predicted_seconds, wan_gb=wan_gb, total=total,
                    currency=currency, lines=lines, expires_at=now + ttl, state="open")


async def open_quotes(session: AsyncSession, job: JobRow) -> list[QuoteRow]:
    rows = (await session.execute(select(QuoteRow).where(QuoteRow.job_id == job.id, QuoteRow.state == "open")
                                  )).scalars().all()
    return sorted(rows, key=lambda q: LABELS.index(q.label) if q.label in LABELS else 99)


async def find_quote(session: AsyncSession, job: JobRow, ref: str) -> QuoteRow:
    """A quote by id or label among the job's quotes (open ones first for labels)."""
    stmt = select(QuoteRow).where(QuoteRow.job_id == job.id)
    rows = (await session.execute(stmt)).scalars().all()
    by_id = [q for q in rows if q.id == ref]
    if by_id:
        return by_id[0]
    by_label = [q for q in rows if q.label == ref and q.state == "open"]
    if by_label:
        return by_label[0]
    raise errors.NotFound(f"no quote {ref!r} for job {job.name!r}; see `cpnctl get quotes {job.name}`",
                          field="quote")


def expired(quote: QuoteRow, now: datetime | None = None) -> bool:
    return as_utc(quote.expires_at) <= (now or datetime.now(UTC))


def public(quote: QuoteRow) -> dict[str, Any]:
    return {
        "id": quote.id, "label": quote.label, "placement": quote.placement, "strategy": quote.strategy,
        "predictedSeconds": round(quote.predicted_seconds, 3), "wanGB": round(quote.wan_gb, 6),
        "price": {"total": str(Decimal(quote.total).quantize(Decimal("0.01"))), "currency": quote.currency,
                  "lines": quote.lines},
        "expiresAt": as_utc(quote.expires_at).isoformat(), "state": quote.state,
        "ring": quote.ring,
    }
