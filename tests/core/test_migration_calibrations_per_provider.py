"""0015: calibrations keyed per provider too; rows learned before stay as the unscoped ('') lesson."""

from __future__ import annotations

from cpn.core import migrate
from tests.core.sql import run_sql

TRACKED = "'2026-11-25 00:00:00', '2026-11-25 00:00:00', 1"


def test_old_lessons_become_unscoped_and_two_providers_may_teach_one_model(db_url: str) -> None:
    migrate.downgrade(db_url, "0014")
    run_sql(db_url, "INSERT INTO calibrations (gpu_model, strategy, workload, step_factor, startup_seconds, samples, "
                 f"last_ratio, created_at, updated_at, resource_version) VALUES ('H100', 'ddp', 'lm', 2.5, 90, 3, "
                 f"1.1, {TRACKED})")
    migrate.upgrade(db_url, "head")
    assert run_sql(db_url, "SELECT provider, step_factor, samples, evidence FROM calibrations") == [("", 2.5, 3, 3.0)]
    run_sql(db_url, "INSERT INTO calibrations (gpu_model, strategy, workload, provider, step_factor, startup_seconds, "
                 f"samples, evidence, created_at, updated_at, resource_version) VALUES ('H100', 'ddp', 'lm', "
                 f"'hobbyist', 44691, 5, 1, 0.05, {TRACKED})")  # the key admits a second provider's lesson
    migrate.downgrade(db_url, "0014")  # one lesson per key again: the better-evidenced one stays
    assert run_sql(db_url, "SELECT step_factor, samples FROM calibrations") == [(2.5, 3)]
    migrate.upgrade(db_url, "head")
