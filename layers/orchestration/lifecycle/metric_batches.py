"""Idempotent metric batches: a runner names each batch once and re-sends the same id until it
hears an answer; a batch already stored is answered with what was stored, never stored again."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from layers.orchestration.lifecycle.models import MetricBatchRow

BATCH_ID_PATTERN = r"^[A-Za-z0-9_\-]{8,64}$"


async def stored_batch(session: AsyncSession, job: str, batch: str) -> int | None:
    """How many reports of batch `batch` job `job` took, or None if it has not seen the batch."""
    return (await session.execute(select(MetricBatchRow.accepted).where(
        MetricBatchRow.job == job, MetricBatchRow.id == batch))).scalar_one_or_none()


def record_batch(session: AsyncSession, job: str, batch: str, accepted: int) -> None:
    """Remember the batch in the session that stores its reports: both commit or neither."""
    session.add(MetricBatchRow(job=job, id=batch, accepted=accepted))
