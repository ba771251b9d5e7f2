"""A leased GPU is billed for the wall time its rank held it (gpuSeconds, start-up included), not only
the training loop's wallSeconds."""

from __future__ import annotations

from decimal import Decimal

from sqlalchemy import select

from layers.orchestration.lifecycle import metering
from layers.service.contracts import contract_of
from layers.service.models import JobRow, LedgerEntry
from tests.api.test_money import _running
from tests.layers.orchestration.test_reconciler import _world


def test_held_seconds_prefer_gpu_seconds_and_fall_back_to_wall_seconds() -> None:
    assert metering.held_seconds({"gpuSeconds": 12.5, "wallSeconds": 10.0}) == 12.5
    assert metering.held_seconds({"wallSeconds": 10.0}) == 10.0
    assert metering.held_seconds({}) == 0.0


async def test_gpu_hours_are_the_seconds_the_rank_held_its_gpu(api, db) -> None:  # type: ignore[no-untyped-def]
    await _world(api)
    t = await _running(api, db, "held", launched_ago=60)  # the server saw it hold its GPU for 60 s
    async with db.session() as s:
        job = (await s.execute(select(JobRow).where(JobRow.name == "alice/held").with_for_update())).scalar_one()
        await metering.ingest(s, job, await contract_of(s, job), [
            {"rank": t.first_rank, "site": t.site_index, "step": 1, "wallSeconds": 30.0, "gpuSeconds": 36.0}])
    async with db.session() as s:
        rows = list((await s.execute(select(LedgerEntry).where(LedgerEntry.job == "alice/held"))).scalars())
    hours = sum(Decimal(r.quantity) for r in rows if r.item == "gpu-hours")
    assert hours == Decimal(36) / Decimal(3600), hours  # 36 s held (6 s of it start-up), not the loop's 30 s


async def test_a_large_jobs_token_count_is_stored_and_absurd_reports_are_skipped(api, db) -> None:  # type: ignore[no-untyped-def]
    """Past 2**31 cumulative tokens (a 2.1e9-token budget) the report is stored (PostgreSQL refused it in
    a 32-bit column: a 500 that stopped progress and billing); a rank no worker can have is skipped."""
    from layers.orchestration.lifecycle.models import MetricRow

    await _world(api)
    t = await _running(api, db, "big")
    async with db.session() as s:
        job = (await s.execute(select(JobRow).where(JobRow.name == "alice/big").with_for_update())).scalar_one()
        taken = await metering.ingest(s, job, await contract_of(s, job), [
            {"rank": t.first_rank, "site": t.site_index, "step": 3_000_000_000, "tokens": 5_000_000_000,
             "wallSeconds": 1.0},
            {"rank": 10**17, "site": t.site_index, "step": 1, "tokens": 1},
            {"rank": t.first_rank, "site": t.site_index, "step": 1, "tokens": -5}])
    assert taken == 1
    async with db.session() as s:
        rows = list((await s.execute(select(MetricRow).where(MetricRow.job == "alice/big"))).scalars())
    assert [(r.step, r.tokens) for r in rows] == [(3_000_000_000, 5_000_000_000)]
