"""GET /api/v1/jobs/NAME/metrics at any length: a 100,000-step run (two ranks, written straight into
the table as the metering would) is served downsampled to `maxPoints` with the newest step exact,
totals equal to the newest cumulative values, and a cursor that pages the raw reports to the end."""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import insert, select

from cpn.cli.ctl.output import metric_lines
from cpn.core.db import new_uid
from layers.orchestration.lifecycle.metric_series import width_for
from layers.orchestration.lifecycle.models import MetricRow
from layers.service.models import JobRow
from tests.api.test_jobs import job, register_world, submit

STEPS = 100_000
RANKS = 2
TOKENS_PER_STEP = 2048  # job-wide, both ranks together


def _rows(key: str, attempt: int, steps: range, wan_per_step: float) -> list[dict]:
    start = datetime(2026, 1, 1, tzinfo=UTC)
    now = datetime.now(UTC)
    return [{"id": new_uid(), "job": key, "attempt": attempt, "rank": r, "site": r, "step": s,
             "tokens": TOKENS_PER_STEP * s, "train_loss": 6.0 - s / STEPS + 0.01 * r,
             "val_loss": 5.0 - s / STEPS if s % 1000 == 0 else None, "tokens_per_second": 1000.0 + r,
             "wall_seconds": 0.5 * s + r, "wan_bytes": wan_per_step * s * (r + 1), "extra": None,
             "at": start + timedelta(milliseconds=s), "created_at": now, "updated_at": now, "resource_version": 1}
            for s in steps for r in range(RANKS)]


async def _job_with_metrics(api, db, name: str) -> str:  # type: ignore[no-untyped-def]
    """A quoted job (the route loads it) and its reports: attempt 1 to step 400, attempt 2 from its
    checkpoint at step 300 to STEPS."""
    await register_world(api)
    resp = await submit(api, job(name, tokens=STEPS * TOKENS_PER_STEP))
    assert resp.status in (200, 201, 202), await resp.text()
    async with db.session() as s:
        key = (await s.execute(select(JobRow.name).where(JobRow.name.like(f"%/{name}")))).scalar_one()
        rows = _rows(key, 1, range(1, 401), 1000.0) + _rows(key, 2, range(300, STEPS + 1), 10.0)
        for i in range(0, len(rows), 20_000):
            await s.execute(insert(MetricRow), rows[i:i + 20_000])
    return name


async def _get(api, path: str) -> dict:  # type: ignore[no-untyped-def]
    resp = await api.client.get(path, headers=api.auth("alice"))
    assert resp.status == 200, await resp.text()
    return await resp.json()


@pytest.mark.slow
async def test_a_100k_step_run_is_served_whole_downsampled_and_paged(api, db) -> None:
    name = await _job_with_metrics(api, db, "long-run")
    started = time.monotonic()
    body = await _get(api, f"/api/v1/jobs/{name}/metrics?maxPoints=300&maxReports=0")
    elapsed = time.monotonic() - started
    points = body["series"]["points"]
    assert 150 <= len(points) <= 300, len(points)
    newest = points[-1]
    assert newest["exact"] and (newest["attempt"], newest["stepFrom"], newest["stepTo"]) == (2, STEPS, STEPS)
    assert newest["tokens"] == TOKENS_PER_STEP * STEPS
    assert newest["trainLoss"]["mean"] == pytest.approx(6.0 - 1 + 0.005)  # both ranks' mean at that step
    assert newest["tokensPerSecond"]["mean"] == pytest.approx(2 * 1000.5)
    # every step of both attempts lies in exactly one range, in order
    spans = [(p["attempt"], p["stepFrom"], p["stepTo"]) for p in points]
    assert spans == sorted(spans) and spans[0][:2] == (1, 1)
    covered = sum(b - a + 1 for _, a, b in spans)
    assert covered == 400 + (STEPS - 300 + 1)
    ranged = points[len(points) // 2]
    assert ranged["trainLoss"]["min"] < ranged["trainLoss"]["mean"] < ranged["trainLoss"]["max"]
    assert body["totals"] == {"attempt": 2, "step": STEPS, "tokens": TOKENS_PER_STEP * STEPS,
                              "wanBytes": pytest.approx(1000.0 * 400 * 3 + 10.0 * STEPS * 3),
                              "wallSeconds": pytest.approx(0.5 * STEPS + 1), "workers": RANKS}
    assert body["items"] == [] and body["metadata"]["more"] is True
    described = metric_lines(body)  # what `cpnctl describe job` prints under Metrics:
    assert described[0].split() == ["step:", str(STEPS), "(attempt", "2,", str(RANKS), "workers)"]
    assert described[1].split() == ["tokens:", str(TOKENS_PER_STEP * STEPS)]
    print(f"series of {len(points)} points over {covered} steps in {elapsed:.2f} s")

    # the raw reports page by the cursor, whole steps per page, to the newest step
    page = await _get(api, f"/api/v1/jobs/{name}/metrics?sinceAttempt=2&sinceStep={STEPS - 2600}&maxReports=5000")
    steps = [(m["attempt"], m["step"]) for m in page["items"]]
    assert steps[0] == (2, STEPS - 2599) and len(steps) == 5000 and page["metadata"]["more"] is True
    assert page["metadata"]["next"] == {"sinceAttempt": 2, "sinceStep": STEPS - 100}
    rest = await _get(api, f"/api/v1/jobs/{name}/metrics?sinceAttempt=2&sinceStep={STEPS - 100}")
    assert [m["step"] for m in rest["items"]][-2:] == [STEPS, STEPS] and rest["metadata"]["more"] is False
    assert len(rest["items"]) == 200

    # with a cursor, the series starts at the range holding it: a client splices it on (same width)
    width = body["series"]["width"]
    tail = await _get(api, f"/api/v1/jobs/{name}/metrics?maxPoints=300&maxReports=0&sinceAttempt=2"
                           f"&sinceStep={STEPS - 1}")
    assert tail["series"]["width"] == width
    first = tail["series"]["points"][0]
    assert first["stepFrom"] == ((STEPS - 1) // width) * width and tail["series"]["points"][-1]["stepTo"] == STEPS
    kept = [p for p in points if (p["attempt"], p["stepTo"]) < (first["attempt"], first["stepFrom"])]
    assert [*kept, *tail["series"]["points"]] == points


async def test_default_keeps_short_runs_whole_and_refuses_bad_parameters(api, db) -> None:
    await register_world(api)
    assert (await submit(api, job("short", tokens=40 * TOKENS_PER_STEP))).status in (200, 201, 202)
    async with db.session() as s:
        key = (await s.execute(select(JobRow.name).where(JobRow.name.like("%/short")))).scalar_one()
        await s.execute(insert(MetricRow), _rows(key, 1, range(1, 41), 100.0))
    body = await _get(api, "/api/v1/jobs/short/metrics")
    assert len(body["items"]) == 80 and {m["rank"] for m in body["items"]} == {0, 1}  # the raw reports, as before
    assert body["series"]["width"] == 1 and [p["stepTo"] for p in body["series"]["points"]] == list(range(1, 41))
    assert body["totals"]["tokens"] == 40 * TOKENS_PER_STEP and body["totals"]["wanBytes"] == 100.0 * 40 * 3
    for query, field in (("maxPoints=3", "maxPoints"), ("maxReports=9999", "maxReports"), ("sinceStep=x", "sinceStep")):
        resp = await api.client.get(f"/api/v1/jobs/short/metrics?{query}", headers=api.auth("alice"))
        assert resp.status == 422, query
        assert (await resp.json())["error"]["field"] == field
    resp = await api.client.get("/api/v1/jobs/short/metrics", headers=api.auth("bob"))
    assert resp.status == 404  # another user's job stays hidden


def test_width_keeps_points_within_the_budget() -> None:
    """A power of two, the smallest whose aligned ranges leave room for the exact newest point."""
    for spans in ([1], [10], [499], [500], [100_000], [400, 99_701], [7, 7, 7, 1_000_000]):
        for max_points in (8, 300, 500):
            w = width_for(spans, max_points)
            budget = max_points - 1 - 2 * len(spans)
            assert w & (w - 1) == 0
            if budget >= 1:
                assert sum(math.ceil(s / w) + 1 for s in spans) <= max_points - 1, (spans, max_points, w)
                assert w == 1 or sum(spans) > budget * (w // 2), (spans, max_points, w)
