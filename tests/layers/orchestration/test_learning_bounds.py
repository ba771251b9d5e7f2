"""One odd run cannot poison quotes (learning.py): a lesson learns a step from the reports' step
times, weighs a run by the steps it timed, moves by at most ×/÷ BOUND per run, and is kept per provider."""

from __future__ import annotations

import math

import pytest
from sqlalchemy import select

from layers.orchestration.lifecycle.learning import (
    BOUND,
    FULL_STEPS,
    CalibrationRow,
    Observation,
    fold,
    observe,
    step_rate,
)
from layers.orchestration.lifecycle.models import MetricRow
from layers.orchestration.planning.types import Learned, Lesson
from layers.service.models import JobRow, QuoteRow
from tests.layers.orchestration.test_learning import _finish_as_measured, _quotes
from tests.layers.orchestration.test_reconciler import _accept, _job, _world


def _row(factor: float = 1.0, evidence: float = 0.0, samples: int = 0) -> CalibrationRow:
    return CalibrationRow(gpu_model="H100", strategy="ddp", workload="lm", provider="p", step_factor=factor,
                          startup_seconds=60.0, samples=samples, evidence=evidence)


def test_a_one_step_run_after_normal_runs_moves_the_factor_little_and_within_the_bound() -> None:
    # the tester's numbers: 44,691 learnt, then a one-step run whose wall time says 687,902 (×15.4)
    row = _row(44_691.0, evidence=3.0, samples=3)
    seen = observe(raw_step=0.01, steps=1, startup=5.0, train=0.01 * 687_902, rate=None)
    assert seen.evidence == pytest.approx(1 / FULL_STEPS)
    fold(row, seen)
    assert 44_691.0 < row.step_factor <= 44_691.0 * BOUND
    assert row.step_factor < 44_691.0 * 1.05  # weighed by what one step can tell: ~3 % of a ×15 miss
    assert row.last_observed == pytest.approx(687_902.0)  # the run's own figure stays visible
    known = observe(raw_step=0.01, steps=1, startup=5.0, train=0.01 * 687_902, rate=None, known=44_691.0)
    assert known.startup == pytest.approx(5.0 + 0.01 * (687_902 - 44_691))  # the rest is a fixed cost


def test_no_single_run_moves_a_factor_past_the_bound_either_way() -> None:
    for observed in (1e-6, 1e6):
        row = _row(3.0, evidence=1.0, samples=1)
        fold(row, Observation(observed, 10.0, 1.0, True))  # a full run, the lesson's second
        assert row.step_factor == pytest.approx(3.0 * BOUND ** (1 if observed > 1 else -1))


def test_a_new_lessons_first_full_step_timed_run_replaces_the_textbook_guess() -> None:
    row = _row()
    fold(row, Observation(44_691.0, 5.0, 1.0, True))  # CPU slots declared as H100
    assert row.step_factor == pytest.approx(44_691.0) and row.evidence == 1.0
    for seen in (Observation(44_691.0, 5.0, 1.0, False), Observation(44_691.0, 5.0, 0.5, True)):
        row = _row()
        fold(row, seen)  # wall-timed, or too short to time a step: weighed and bounded as ever
        assert row.step_factor <= BOUND


def test_consistent_runs_converge_to_the_true_factor() -> None:
    row = _row()
    path = []
    for _ in range(12):
        fold(row, Observation(3.0, 30.0, 1.0, True))
        path.append(row.step_factor)
    assert all(f == pytest.approx(3.0) for f in path)  # the first full run replaces the guess; the rest agree
    assert row.step_factor == pytest.approx(3.0, rel=0.02) and row.samples == 12 and row.evidence == 12
    assert row.startup_seconds == pytest.approx(30.0)


def test_the_step_time_comes_from_the_reports_not_the_fixed_costs() -> None:
    # rank 0: data loaded before its first report (wall 10 s), 0.5 s a step, 40 s of final validation
    # and upload after the first report of its last step; rank 1 a little faster: the slowest counts
    reports = [(0, k, 10.0 + 0.5 * k) for k in range(1, 41)] + [(1, k, 9.0 + 0.4 * k) for k in range(1, 41)]
    rate = step_rate(reports)
    assert rate == pytest.approx((0.5, 39, 40))
    train = 10.0 + 0.5 * 40 + 40.0
    seen = observe(raw_step=0.25, steps=40, startup=7.0, train=train, rate=rate)
    assert seen.factor == pytest.approx(2.0) and seen.steps_timed and seen.evidence == 1.0
    assert seen.startup == pytest.approx(7.0 + train - 0.5 * 40)  # the fixed costs priced as fixed
    wall = observe(raw_step=0.25, steps=40, startup=7.0, train=train, rate=None)
    assert wall.factor == pytest.approx(train / 10.0)  # what the old rule learnt: 7x, not 2x
    assert step_rate([(0, 1, 3.0), (0, 1, 9.0)]) is None  # one distinct step: no rate


def test_lessons_are_read_per_provider_with_the_unscoped_one_as_fallback() -> None:
    cpu_slot = Lesson("H100", "ddp", "lm", 44_691.0, 5.0, 3, provider="hobbyist")
    legacy = Lesson("H100", "ddp", "lm", 2.0, 90.0, 5)
    learned = Learned((cpu_slot, legacy))
    assert learned.lookup("H100", "ddp", "lm", "hobbyist") is cpu_slot
    assert learned.lookup("H100", "ddp", "lm", "cloud") is legacy
    assert Learned((cpu_slot,)).lookup("H100", "ddp", "lm", "cloud") is None
    assert Learned((cpu_slot,)).startup("H100", "cloud") is None


async def _report_steps(db, name: str, raw_step: float, factor: float, steps: int) -> None:  # type: ignore[no-untyped-def]
    """Rank 0 of the job's first attempt reports each step as if a step took `factor` x the model's."""
    async with db.session() as s:
        for k in range(1, steps + 1):
            s.add(MetricRow(job=f"alice/{name}", attempt=1, rank=0, site=0, step=k, tokens=k * 3072,
                            wall_seconds=4.0 + factor * raw_step * k))


async def _raw_step(db, name: str) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    async with db.session() as s:
        job = (await s.execute(select(JobRow).where(JobRow.name == f"alice/{name}"))).scalar_one()
        pred = (await s.get(QuoteRow, job.status["quote"])).prediction
        return pred["stepSeconds"] / pred["stepFactor"], pred["steps"]


async def _lessons(api) -> list[dict]:  # type: ignore[no-untyped-def]
    return (await (await api.client.get("/api/v1/calibrations", headers=api.auth("bob"))).json())["items"]


async def test_a_one_step_job_does_not_poison_quotes_and_stays_with_its_provider(api, db) -> None:  # type: ignore[no-untyped-def]
    await _world(api)
    nyc, fra = {"placement": {"sites": ["nyc-1"]}}, {"placement": {"sites": ["fra-1"]}}
    await _accept(api, "normal", strategy="ddp", **nyc)
    raw_step, steps = await _raw_step(db, "normal")
    await _report_steps(db, "normal", raw_step, 1.5, steps)
    # 30 s of fixed costs besides 1.5x the steps: the old rule learnt the wall time's ratio instead
    await _finish_as_measured(db, "normal", startup=6.0, train=4.0 + 1.5 * raw_step * steps + 30.0)
    [before] = await _lessons(api)
    assert (before["provider"], before["stepFactor"]) == ("prov-b", pytest.approx(1.5, rel=0.02))
    assert before["startupSeconds"] == pytest.approx(6.0 + 4.0 + 30.0, rel=0.02)  # fixed costs priced as fixed

    await _accept(api, "one-step", strategy="ddp", tokens=3072, globalBatchTokens=3072, **nyc)
    one_raw, one_steps = await _raw_step(db, "one-step")
    assert one_steps == 1
    await _report_steps(db, "one-step", one_raw, 1.5, 1)
    await _finish_as_measured(db, "one-step", startup=6.0, train=400 * one_raw)  # its fixed costs dwarf its step
    [after] = await _lessons(api)
    assert after["samples"] == 2 and after["lastObserved"] == pytest.approx(400, rel=0.02)
    moved = after["stepFactor"] / before["stepFactor"]
    assert 1.0 < moved <= BOUND and math.log(moved) < 0.05 * math.log(400 / 1.5)

    resp = await api.client.post("/api/v1/jobs", json=_job("elsewhere", strategy="ddp", **fra), headers=api.auth("alice"))
    assert resp.status == 201, await resp.text()
    # fra-1 is prov-a's: prov-b's runs move neither its step factor nor its start-up
    # (a quote's model block also states its memory plan beside what was learnt)
    assert all({k: q["model"][k] for k in ("stepFactor", "startupSeconds")} == {"stepFactor": 1.0, "startupSeconds": 5.0}
               for q in await _quotes(api, "elsewhere"))
    resp = await api.client.post("/api/v1/jobs", json=_job("here", strategy="ddp", **nyc), headers=api.auth("alice"))
    assert resp.status == 201, await resp.text()
    assert all(q["model"]["stepFactor"] == pytest.approx(after["stepFactor"], rel=1e-3)
               for q in await _quotes(api, "here"))


def test_the_step_rate_skips_step_0_and_refuses_a_flat_slope() -> None:
    # rank 0 validates at step 0 (5 s), then the first step's warm-up (30 s), then 0.5 s a step
    reports = [(0, 0, 5.0), (0, 1, 35.0)] + [(0, k, 35.0 + 0.5 * (k - 1)) for k in range(2, 21)]
    assert step_rate(reports) == pytest.approx((0.5, 19, 20))  # from step 1, not from the validation
    assert step_rate([(0, 1, 7.0), (0, 20, 7.0)]) is None  # no time passed: nothing to learn


def test_a_short_first_run_does_not_stop_the_first_full_run_from_replacing_the_guess() -> None:
    row = _row()
    fold(row, Observation(44_691.0, 5.0, 0.2, True))  # a 4-step smoke job: weighed, bounded
    assert row.step_factor <= BOUND
    fold(row, Observation(44_691.0, 5.0, 1.0, True))  # then a full one
    assert row.step_factor == pytest.approx(44_691.0)
    fold(row, Observation(1.0, 5.0, 1.0, True))  # once it holds a full run, later ones are bounded
    assert row.step_factor == pytest.approx(44_691.0 / BOUND)


async def test_a_providers_first_lesson_starts_from_the_unscoped_one(api, db) -> None:  # type: ignore[no-untyped-def]
    await _world(api)
    nyc = {"placement": {"sites": ["nyc-1"]}}
    await _accept(api, "smoke", strategy="ddp", tokens=4 * 3072, globalBatchTokens=3072, **nyc)
    raw_step, steps = await _raw_step(db, "smoke")
    assert steps == 4
    async with db.session() as s:  # a lesson learnt before lessons were kept per provider
        s.add(CalibrationRow(gpu_model="CPU", strategy="ddp", workload="lm", provider="", step_factor=40.0,
                             startup_seconds=6.0, samples=3, evidence=3.0))
    await _report_steps(db, "smoke", raw_step, 40.0, steps)  # a short run: 3 steps timed
    await _finish_as_measured(db, "smoke", startup=6.0, train=4.0 + 40.0 * raw_step * steps)
    mine = next(x for x in await _lessons(api) if x["provider"] == "prov-b")
    assert mine["stepFactor"] == pytest.approx(40.0, rel=0.05)  # not dragged from the textbook's 1 toward 40
