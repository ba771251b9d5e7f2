"""0015: calibrations keyed per provider too; rows learned before stay as the unscoped ('') lesson."""

from __future__ import annotations

import asyncio

from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from cpn.core import migrate

TRACKED = "'2026-11-25 00:00:00', '2026-11-25 00:00:00', 1"


def _run(url: str, *statements: str) -> list[tuple]:
    async def go() -> list[tuple]:
        engine = create_async_engine(url)
        async with engine.begin() as conn:
            rows: list[tuple] = []
            for sql in statements:
                result = await conn.execute(text(sql))
                rows = [tuple(r) for r in result] if result.returns_rows else []
        await engine.dispose()
        return rows

    return asyncio.run(go())


def test_old_lessons_become_unscoped_and_two_providers_may_teach_one_model(db_url: str) -> None:
    migrate.downgrade(db_url, "0014")
    _run(db_url, "INSERT INTO calibrations (gpu_model, strategy, workload, step_factor, startup_seconds, samples, "
                 f"last_ratio, created_at, updated_at, resource_version) VALUES ('H100', 'ddp', 'lm', 2.5, 90, 3, "
                 f"1.1, {TRACKED})")
    migrate.upgrade(db_url, "head")
    assert _run(db_url, "SELECT provider, step_factor, samples, evidence FROM calibrations") == [("", 2.5, 3, 3.0)]
    _run(db_url, "INSERT INTO calibrations (gpu_model, strategy, workload, provider, step_factor, startup_seconds, "
                 f"samples, evidence, created_at, updated_at, resource_version) VALUES ('H100', 'ddp', 'lm', "
                 f"'hobbyist', 44691, 5, 1, 0.05, {TRACKED})")  # the key admits a second provider's lesson
    migrate.downgrade(db_url, "0014")  # one lesson per key again: the better-evidenced one stays
    assert _run(db_url, "SELECT step_factor, samples FROM calibrations") == [(2.5, 3)]
    migrate.upgrade(db_url, "head")
