"""Migrations upgrade and downgrade cleanly (SQLite, and PostgreSQL when configured)."""

from __future__ import annotations

import asyncio

from sqlalchemy import inspect
from sqlalchemy.ext.asyncio import create_async_engine

from cpn.core import migrate
from tests.core.sql import run_sql


async def _tables(url: str) -> set[str]:
    engine = create_async_engine(url)
    async with engine.connect() as conn:
        names = await conn.run_sync(lambda c: set(inspect(c).get_table_names()))
    await engine.dispose()
    return names - {"alembic_version"}


def test_upgrade_downgrade_roundtrip(db_url: str) -> None:
    assert asyncio.run(migrate.current_revision(db_url)) == migrate.head_revision()
    tables = asyncio.run(_tables(db_url))
    assert {"accounts", "tokens", "audit_records", "sites", "clusters", "links"} <= tables
    migrate.downgrade(db_url, "base")
    assert asyncio.run(_tables(db_url)) == set()
    migrate.upgrade(db_url, "head")
    assert asyncio.run(_tables(db_url)) == tables


def test_every_table_is_tracked(db_url: str) -> None:
    async def columns() -> dict[str, set[str]]:
        engine = create_async_engine(db_url)
        async with engine.connect() as conn:
            out = await conn.run_sync(lambda c: {t: {col["name"] for col in inspect(c).get_columns(t)}
                                                 for t in inspect(c).get_table_names() if t != "alembic_version"})
        await engine.dispose()
        return out

    for table, cols in asyncio.run(columns()).items():
        assert {"created_at", "updated_at", "resource_version"} <= cols, table


def test_schema_matches_models(db_url: str) -> None:
    """Autogenerate finds nothing to do: the models and the migrations agree."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    import layers.models  # noqa: F401
    from cpn.core.db import Base

    async def diff() -> list:
        engine = create_async_engine(db_url)
        async with engine.connect() as conn:
            out = await conn.run_sync(lambda c: compare_metadata(MigrationContext.configure(c), Base.metadata))
        await engine.dispose()
        return out

    assert asyncio.run(diff()) == []


def test_existing_jobs_move_into_their_owners_namespaces(db_url: str) -> None:
    """0011: a job `lm` of alice's becomes `alice/lm`, and so do the rows that name it; down and back."""
    now = "2026-11-23 00:00:00"
    tracked = f"'{now}', '{now}', 1"

    migrate.downgrade(db_url, "0010")
    run_sql(db_url,
        f"INSERT INTO accounts (id, name, role, disabled, created_at, updated_at, resource_version) "
        f"VALUES ('a1', 'alice', 'user', false, {tracked})",
        f"INSERT INTO jobs (id, name, labels, spec, status, owner_id, phase, created_at, updated_at, resource_version) "
        f"VALUES ('j1', 'lm', '{{}}', '{{}}', '{{}}', 'a1', 'Succeeded', {tracked})",
        f"INSERT INTO events (id, at, job, type, reason, message, created_at, updated_at, resource_version) "
        f"VALUES ('e1', '{now}', 'lm', 'Normal', 'Submitted', 'x', {tracked})")
    migrate.upgrade(db_url, "head")
    assert run_sql(db_url, "SELECT name FROM jobs") == [("alice/lm",)]
    assert run_sql(db_url, "SELECT job FROM events") == [("alice/lm",)]
    migrate.downgrade(db_url, "0010")
    assert run_sql(db_url, "SELECT name FROM jobs") == [("lm",)]
    migrate.upgrade(db_url, "head")
