"""Deleting a TrainingJob: what goes with it and what stays.

Goes: its sub-tasks, worker logs, metrics and events (the run's own records, keyed by the job's name,
which a new job may take). Stays: contracts and ledger entries (so its invoices), audit records and
released leases; a job with a contract is retired (renamed to `~<uid>`, see `cpn.core.store.RETIRED`)
rather than deleted, so those keep a row to point at. Checkpoints are keyed by the job's uid and
agents' run folders by name and uid, so a new job of the same name never resumes or adopts them.
"""

from __future__ import annotations

from sqlalchemy import delete, update
from sqlalchemy.ext.asyncio import AsyncSession

from cpn.core.store import RETIRED
from layers.control.models import LeaseRow
from layers.orchestration.events import EventRow
from layers.orchestration.lifecycle.models import LogRow, MetricBatchRow, MetricRow, SubtaskRow
from layers.service.models import JobRow


async def forget(session: AsyncSession, job: JobRow) -> None:
    for model in (SubtaskRow, LogRow, MetricRow, MetricBatchRow, EventRow):
        await session.execute(delete(model).where(model.job == job.name))
    await session.execute(update(LeaseRow).where(LeaseRow.job == job.name).values(job=f"{RETIRED}{job.id}"))
