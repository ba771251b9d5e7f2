"""A job's metrics at any length, for `GET /api/v1/jobs/NAME/metrics`.

Three parts, each bounded whatever the job's length:

- ``series``: the whole run folded into step ranges (per attempt), each range carrying the min, mean
  and max of every series (train and validation loss, the job's tokens/s) and its last cumulative
  values (tokens, training time); at most ``maxPoints`` points, the last of which is the newest
  step exactly. Range widths are powers of two and ranges are aligned to multiples of the width,
  so a client that asked with a cursor can splice the answer onto what it has (same ``width``) or
  ask again from scratch (the width grew);
- ``totals``: the latest cumulative values (tokens, WAN bytes over every rank of every attempt,
  training time), read from every report, never from a window of them;
- ``items``: the raw reports after a cursor (``sinceAttempt``/``sinceStep``), oldest first, cut at a
  step boundary after ``limit`` rows; ``next`` is the cursor for the next page.

A rank that reports a step below the cursor after the cursor was handed out (barrier-free
strategies) is missed by ``items``; the series catches it when it falls in the range the cursor
re-reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from layers.orchestration.lifecycle.models import MetricRow

DEFAULT_MAX_POINTS = 500
MAX_POINTS = 5000
MIN_POINTS = 8
PAGE_ROWS = 5000
# the report's own columns; the user's metrics (cpn.train) come from `extra` and never shadow these
BUILTIN = frozenset({"attempt", "rank", "site", "step", "tokens", "trainLoss", "valLoss", "tokensPerSecond",
                     "wallSeconds", "wanBytes", "at"})


@dataclass(frozen=True, kw_only=True)
class SeriesQuery:
    """What to read: `since_*` is the cursor (rows strictly after (attempt, step)); `limit` raw rows."""

    max_points: int = DEFAULT_MAX_POINTS
    since_attempt: int = 0
    since_step: int = -1
    limit: int = PAGE_ROWS

    def __post_init__(self) -> None:
        if not MIN_POINTS <= self.max_points <= MAX_POINTS:
            raise ValueError(f"maxPoints must be between {MIN_POINTS} and {MAX_POINTS}")
        if not 0 <= self.limit <= PAGE_ROWS:
            raise ValueError(f"maxReports must be between 0 and {PAGE_ROWS}")


@dataclass(frozen=True)
class _Attempt:
    attempt: int
    first_step: int
    last_step: int
    ranks: int
    tokens: int
    wall: float


async def read(s: AsyncSession, job: str, q: SeriesQuery) -> dict[str, Any]:
    """The response body: series, totals, the raw page and its cursor."""
    attempts, wan = await _attempts(s, job)
    items, more = await _page(s, job, q)
    last = items[-1] if items else None
    nxt = {"sinceAttempt": last["attempt"], "sinceStep": last["step"]} if last else {
        "sinceAttempt": q.since_attempt, "sinceStep": q.since_step}
    return {"apiVersion": "cpn/v1", "kind": "List",
            "metadata": {"more": more, "next": nxt},
            "series": await _series(s, job, attempts, q) if attempts else {"width": 1, "points": []},
            "totals": _totals(attempts, wan), "items": items}


async def _attempts(s: AsyncSession, job: str) -> tuple[list[_Attempt], float]:
    """Per attempt its step span, rank count and newest cumulative values; WAN bytes summed over every
    (attempt, rank)'s newest cumulative count (what the meter bills)."""
    per_rank = (select(MetricRow.attempt, MetricRow.rank, func.min(MetricRow.step).label("lo"),
                       func.max(MetricRow.step).label("hi"), func.max(MetricRow.tokens).label("tokens"),
                       func.max(MetricRow.wan_bytes).label("wan"), func.max(MetricRow.wall_seconds).label("wall"))
                .where(MetricRow.job == job).group_by(MetricRow.attempt, MetricRow.rank).subquery())
    rows = (await s.execute(select(per_rank.c.attempt, func.min(per_rank.c.lo), func.max(per_rank.c.hi),
                                   func.count(), func.max(per_rank.c.tokens), func.max(per_rank.c.wall),
                                   func.sum(per_rank.c.wan))
                            .group_by(per_rank.c.attempt).order_by(per_rank.c.attempt))).all()
    attempts = [_Attempt(int(a), int(lo), int(hi), int(n), int(tok or 0), float(wall or 0.0))
                for a, lo, hi, n, tok, wall, _ in rows]
    return attempts, float(sum(float(r[6] or 0.0) for r in rows))


def _totals(attempts: list[_Attempt], wan: float) -> dict[str, Any]:
    if not attempts:
        return {"attempt": None, "step": None, "tokens": 0, "wanBytes": 0.0, "wallSeconds": 0.0, "workers": 0}
    a = attempts[-1]
    return {"attempt": a.attempt, "step": a.last_step, "tokens": a.tokens, "wanBytes": wan, "wallSeconds": a.wall,
            "workers": a.ranks}


def width_for(spans: list[int], max_points: int) -> int:
    """The smallest power of two whose ranges, aligned to its multiples, give at most `max_points` - 1
    points over these per-attempt step spans (one more point: the newest step, exact)."""
    budget = max(1, max_points - 1 - 2 * len(spans))  # each attempt may cut a range at either end
    needed = max(1, math.ceil(sum(spans) / budget))
    return 1 << (needed - 1).bit_length()


async def _series(s: AsyncSession, job: str, attempts: list[_Attempt], q: SeriesQuery) -> dict[str, Any]:
    width = width_for([a.last_step - a.first_step + 1 for a in attempts], q.max_points)
    last = attempts[-1]
    ranks = {a.attempt: a.ranks for a in attempts}
    per_step = (select(MetricRow.attempt, MetricRow.step, func.max(MetricRow.tokens).label("tokens"),
                       func.avg(MetricRow.train_loss).label("train"), func.avg(MetricRow.val_loss).label("val"),
                       func.avg(MetricRow.tokens_per_second).label("tps"),
                       func.max(MetricRow.wall_seconds).label("wall"))
                .where(MetricRow.job == job, _after(MetricRow.attempt, MetricRow.step, q.since_attempt,
                                                    (q.since_step // width) * width - 1 if q.since_step >= 0
                                                    else q.since_step))
                .group_by(MetricRow.attempt, MetricRow.step).subquery())
    c = per_step.c
    bucket = (c.step // width).label("bucket")
    stats = [f(col) for col in (c.train, c.val, c.tps) for f in (func.min, func.avg, func.max)]
    body = (select(c.attempt, bucket, func.min(c.step), func.max(c.step), func.max(c.tokens), func.max(c.wall),
                   *stats)
            .where(~and_(c.attempt == last.attempt, c.step == last.last_step))
            .group_by(c.attempt, bucket).order_by(c.attempt, bucket))
    points = [_point(r[0], r[2], r[3], r[4], r[5], r[6:], ranks[r[0]]) for r in (await s.execute(body)).all()]
    newest = (await s.execute(select(c.attempt, c.step, c.tokens, c.wall, c.train, c.train, c.train, c.val, c.val,
                                     c.val, c.tps, c.tps, c.tps)
                              .where(c.attempt == last.attempt, c.step == last.last_step))).first()
    if newest is not None:
        points.append({**_point(newest[0], newest[1], newest[1], newest[2], newest[3], newest[4:], ranks[newest[0]]),
                       "exact": True})
    return {"width": width, "points": points}


def _after(attempt: Any, step: Any, since_attempt: int, since_step: int) -> Any:
    """(attempt, step) strictly after the cursor."""
    return or_(attempt > since_attempt, and_(attempt == since_attempt, step > since_step))


def _stat(lo: Any, mean: Any, hi: Any, scale: int = 1) -> dict[str, float] | None:
    if mean is None:
        return None
    return {"min": float(lo) * scale, "mean": float(mean) * scale, "max": float(hi) * scale}


def _point(attempt: int, first: int, last: int, tokens: int, wall: float, stats: Any, ranks: int) -> dict[str, Any]:
    """One range; tokens/s is the job's (mean per rank × the attempt's ranks, as every rank trains alike)."""
    return {"attempt": int(attempt), "stepFrom": int(first), "stepTo": int(last), "tokens": int(tokens or 0),
            "wallSeconds": float(wall or 0.0), "trainLoss": _stat(*stats[0:3]), "valLoss": _stat(*stats[3:6]),
            "tokensPerSecond": _stat(*stats[6:9], scale=ranks)}


async def _page(s: AsyncSession, job: str, q: SeriesQuery) -> tuple[list[dict[str, Any]], bool]:
    """Raw reports after the cursor, oldest first; a page ends with a whole step unless one step alone
    has more reports than `limit`. True when more follow."""
    if q.limit == 0:
        return [], bool((await s.execute(select(MetricRow.id).where(
            MetricRow.job == job, _after(MetricRow.attempt, MetricRow.step, q.since_attempt, q.since_step))
            .limit(1))).first())
    rows = list((await s.execute(
        select(MetricRow).where(MetricRow.job == job,
                                _after(MetricRow.attempt, MetricRow.step, q.since_attempt, q.since_step))
        .order_by(MetricRow.attempt, MetricRow.step, MetricRow.rank, MetricRow.at).limit(q.limit + 1))).scalars())
    more = len(rows) > q.limit
    if more:
        spill = (rows[-1].attempt, rows[-1].step)  # the first report past the page: its step is cut whole
        rows = [r for r in rows[:q.limit] if (r.attempt, r.step) != spill] or rows[:q.limit]
    return [report(r) for r in rows], more


def report(r: MetricRow) -> dict[str, Any]:
    return {"attempt": r.attempt, "rank": r.rank, "site": r.site, "step": r.step, "tokens": r.tokens,
            "trainLoss": r.train_loss, "valLoss": r.val_loss, "tokensPerSecond": r.tokens_per_second,
            "wallSeconds": r.wall_seconds, "wanBytes": r.wan_bytes, "at": r.at.isoformat(),
            **{k: v for k, v in (r.extra or {}).items() if k not in BUILTIN}}


__all__ = ["DEFAULT_MAX_POINTS", "MAX_POINTS", "PAGE_ROWS", "SeriesQuery", "read", "report", "width_for"]
