"""Quotes that learn: a job that succeeded teaches the compute model its measured step-time factor
and start-up time, per GPU model, strategy and workload; later quotes of the same kind use them."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select

from layers.orchestration.lifecycle.learning import BOUND
from layers.orchestration.planning.perf import STARTUP_BY_DRIVER
from layers.service.models import JobRow, QuoteRow
from tests.layers.orchestration.test_reconciler import _accept, _job, _reconciler, _world


async def _quotes(api, name: str) -> list[dict]:  # type: ignore[no-untyped-def]
    resp = await api.client.get(f"/api/v1/jobs/{name}/quotes", headers=api.auth("alice"))
    assert resp.status == 200, await resp.text()
    return (await resp.json())["items"]


async def _finish_as_measured(db, name: str, startup: float, train: float | None) -> float:  # type: ignore[no-untyped-def]
    """End the job Succeeded through the reconciler as if it had started `startup` s after Launching
    and trained for `train` s (None: three times the model's prediction); returns that prediction."""
    reconciler = _reconciler(db, 3600)
    async with db.session() as s:
        job = (await s.execute(select(JobRow).where(JobRow.name == f"alice/{name}"))).scalar_one()
        quote = await s.get(QuoteRow, job.status["quote"])
        raw = quote.prediction["steps"] * quote.prediction["stepSeconds"] / quote.prediction["stepFactor"]
        running = datetime.now(UTC) - timedelta(seconds=3 * raw if train is None else train)
        times = {**job.status["phaseTimes"], "Launching": (running - timedelta(seconds=startup)).isoformat(),
                 "Running": running.isoformat()}
        job.status = {**job.status, "phaseTimes": times}
        await reconciler._finish(s, job, "Succeeded", "Completed", "test: the budget was trained")
    return raw


async def test_a_finished_job_corrects_the_next_quote(api, db) -> None:  # type: ignore[no-untyped-def]
    await _world(api)
    await _accept(api, "first")
    before = (await _quotes(api, "first"))[0]
    learnt = {k: before["model"][k] for k in ("stepFactor", "startupSeconds")}  # (beside the memory plan)
    assert learnt == {"stepFactor": 1.0, "startupSeconds": STARTUP_BY_DRIVER["local"]}  # nothing learnt yet:
    # the textbook start-up of the demo world's local-driver sites
    await _finish_as_measured(db, "first", startup=12.0, train=0.5)  # too short to teach anything (timer noise)
    assert (await (await api.client.get("/api/v1/calibrations", headers=api.auth("alice"))).json())["items"] == []

    await _accept(api, "second")
    raw = await _finish_as_measured(db, "second", startup=12.0, train=None)  # trains 3x what the model said
    items = (await (await api.client.get("/api/v1/calibrations", headers=api.auth("bob"))).json())["items"]
    assert len(items) == 1, items
    lesson = items[0]
    assert (lesson["gpuModel"], lesson["strategy"], lesson["workload"], lesson["samples"]) == ("CPU", "diloco", "lm", 1)
    # a run without step reports (timed by its wall clock) moves a factor by at most ×/÷ BOUND (learning.py)
    assert lesson["stepFactor"] == pytest.approx(BOUND, rel=0.05) and lesson["startupSeconds"] == pytest.approx(12, abs=1)
    assert lesson["lastRatio"] == pytest.approx((12 + 3 * raw) / (raw + STARTUP_BY_DRIVER["local"]), rel=0.05)

    assert lesson["provider"] == "prov-b"  # the job ran on nyc-1; lessons are kept per provider
    here = {"placement": {"sites": ["nyc-1"]}}
    resp = await api.client.post("/api/v1/jobs", json=_job("third", **here), headers=api.auth("alice"))
    assert resp.status == 201, await resp.text()
    cheapest = next(q for q in await _quotes(api, "third") if q["label"] == "cheapest")
    assert cheapest["model"]["stepFactor"] == pytest.approx(BOUND, rel=0.05)
    assert cheapest["predictedSeconds"] == pytest.approx(BOUND * raw + 12, rel=0.05)  # was raw + 5 s

    resp = await api.client.post("/api/v1/jobs", json=_job("other", strategy="ddp", **here), headers=api.auth("alice"))
    assert resp.status == 201, await resp.text()
    other = await _quotes(api, "other")
    assert all(q["model"]["stepFactor"] == 1.0 for q in other)  # another strategy: its steps are untaught,
    assert all(q["model"]["startupSeconds"] == pytest.approx(12, abs=1) for q in other)  # but the sites' start-up is
