"""Worker output as `cpnctl logs` reads it, like `kubectl logs`.

Without `follow`: one attempt's lines (default: the current attempt), every one of them, read page by
page. With `follow`: from one attempt on (default: the current one, or the first if none started yet)
through every retry, each attempt announced by a `--- attempt N ---` line, until the job has ended
and its agents have shipped their last lines.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from cpn.core import errors
from cpn.core.db import Database, as_utc
from cpn.core.phases import SUBTASK_DONE
from cpn.core.principal import Principal
from layers.orchestration.lifecycle import agents, views
from layers.orchestration.lifecycle.models import LogRow, SubtaskRow
from layers.service.jobs import TERMINAL, find_job, load_job

FOLLOW_POLL = timedelta(seconds=0.5)
# an agent ships a run's last lines up to one monitor pass (1 s) after it reports the run's end
DRAIN_GRACE = timedelta(seconds=3)
# a stopping run whose agent has not reported for this long is not waited for (its agent is gone)
DRAIN_MAX = timedelta(seconds=30)
MAX_TAIL = 100_000


@dataclass(frozen=True, kw_only=True)
class LogQuery:
    site: str | None = None
    rank: int | None = None
    attempt: int | None = None
    tail: int | None = None
    follow: bool = False


@dataclass(frozen=True)
class LogCursor:
    """What to read: the job (its key), the attempt shown (following: the first one) and the filters."""

    job: str
    attempt: int
    query: LogQuery


def attempt_header(attempt: int) -> str:
    return f"--- attempt {attempt} ---\n"


def line_text(row: LogRow) -> str:
    return f"[{row.site} rank{row.rank}] {row.line}\n"


async def open_logs(s: AsyncSession, principal: Principal, name: str, query: LogQuery) -> LogCursor:
    """Check the job and the filters before anything is streamed, so a mistake is an error, not silence."""
    job = await load_job(s, principal, name)
    current = int(job.status.get("attempt") or 0)
    sites = await views.sites_of(s, job)
    if query.site is not None and query.site not in sites and (sites or not query.follow):
        known = ", ".join(sorted(sites)) or "none yet"
        raise errors.NotFound(f"job {job.name!r} has no sub-task at site {query.site!r} (its sites and "
                              f"clusters: {known})", field="site")
    if query.attempt is not None and query.attempt > current and not query.follow:
        raise errors.NotFound(f"job {job.name!r} has no attempt {query.attempt} "
                              f"({f'it is at attempt {current}' if current else 'no attempt started yet'}); "
                              "-f waits for it", field="attempt")
    if query.rank is not None and not query.follow:
        ranks = await s.scalar(select(func.max(SubtaskRow.first_rank + SubtaskRow.gpus)).where(SubtaskRow.job == job.name))
        if not ranks or query.rank >= ranks:
            raise errors.NotFound(f"job {job.name!r} has no rank {query.rank} "
                                  f"({f'its ranks: 0-{ranks - 1}' if ranks else 'no attempt started yet'})", field="rank")
    first = query.attempt or (max(current, 1) if query.follow else current)
    return LogCursor(job.name, first, query)


async def stream(db: Database, cursor: LogCursor) -> AsyncIterator[str]:
    """The lines as text chunks, one page at a time; following, until the job is over and drained."""
    q, after, tail, shown = cursor.query, 0, cursor.query.tail, 0
    while True:
        async with db.session() as s:
            rows = await agents.read_logs(s, cursor.job, attempt=cursor.attempt, later=q.follow, site=q.site,
                                          rank=q.rank, after=after, tail=tail)
            full = len(rows) == agents.LOG_PAGE
            current, over = (0, False) if full or not q.follow else await _state(s, cursor)
        tail, chunk = None, []
        for row in rows:
            if q.follow and row.attempt != shown:
                shown = row.attempt
                chunk.append(attempt_header(shown))
            chunk.append(line_text(row))
            after = row.id
        if q.follow and current > shown and current >= cursor.attempt:  # a retry began: say so before its lines
            shown = current
            chunk.append(attempt_header(shown))
        if chunk:
            yield "".join(chunk)
        if full:
            continue
        if not q.follow or (over and not rows):
            return
        await asyncio.sleep(FOLLOW_POLL.total_seconds())


async def _state(s: AsyncSession, cursor: LogCursor) -> tuple[int, bool]:
    """(the job's current attempt, whether it is over and its agents are done shipping lines)."""
    job = await find_job(s, cursor.job)
    if job is None:  # deleted while followed
        return 0, True
    current = int(job.status.get("attempt") or 0)
    if job.phase not in TERMINAL:
        return current, False
    now = datetime.now(UTC)
    subtasks = list((await s.execute(select(SubtaskRow).where(SubtaskRow.job == cursor.job,
                                                              SubtaskRow.attempt >= cursor.attempt))).scalars())
    if any(t.phase not in SUBTASK_DONE and t.reported not in SUBTASK_DONE and t.reported_at is not None
           and now - as_utc(t.reported_at) < DRAIN_MAX for t in subtasks):
        return current, False  # an agent is still stopping its workers
    newest = (await s.execute(select(func.max(LogRow.at)).where(LogRow.job == cursor.job))).scalar()
    stamps = [as_utc(v) for v in (job.updated_at, newest, *(t.reported_at for t in subtasks)) if v is not None]
    return current, now - max(stamps) >= DRAIN_GRACE
