"""Submissions racing for one name or one Idempotency-Key (on PostgreSQL the job, its events and its
quotes are written by one statement outside a transaction): one job is written, whole; the others
are refused or answered with it, and nothing half-written is left."""

from __future__ import annotations

import asyncio

from sqlalchemy import func, select

from layers.orchestration.events import EventRow
from layers.service.models import JobRow, QuoteRow
from tests.api.test_jobs import job, quotes, register_world, submit


async def _counts(db, name: str) -> tuple[int, int, int]:
    async with db.session() as s:
        jobs = await s.scalar(select(func.count()).select_from(JobRow).where(JobRow.name == f"alice/{name}"))
        events = await s.scalar(select(func.count()).select_from(EventRow).where(EventRow.job == f"alice/{name}"))
        quoted = await s.scalar(select(func.count()).select_from(QuoteRow).join(JobRow, QuoteRow.job_id == JobRow.id)
                                .where(JobRow.name == f"alice/{name}"))
    return jobs, events, quoted


async def test_one_of_several_submissions_of_a_name_is_written_whole(api, db) -> None:
    await register_world(api)
    answers = await asyncio.gather(*[submit(api, job("race"), key=f"k-{i}") for i in range(6)])
    statuses = sorted(a.status for a in answers)
    assert statuses.count(201) == 1 and set(statuses) <= {201, 409}, statuses
    assert await _counts(db, "race") == (1, 2, 3)  # the job, Submitted + Quoted, three quotes
    assert {q["label"] for q in await quotes(api, "race")} == {"cheapest", "fastest", "balanced"}
    got = await (await api.client.get("/api/v1/jobs/race", headers=api.auth("alice"))).json()
    assert got["status"]["phase"] == "Quoted" and got["metadata"]["creationTimestamp"]


async def test_a_retried_submission_racing_itself_makes_one_job(api, db) -> None:
    await register_world(api)
    answers = await asyncio.gather(*[submit(api, job("retry"), key="same") for _ in range(4)])
    statuses = sorted(a.status for a in answers)
    assert statuses.count(201) == 1 and set(statuses) <= {200, 201, 409}, statuses
    assert await _counts(db, "retry") == (1, 2, 3)
