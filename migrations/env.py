"""Alembic environment: runs migrations over the async engine (aiosqlite or asyncpg)."""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy.ext.asyncio import create_async_engine

import layers.models  # noqa: F401 - registers every layer's tables on Base.metadata
from cpn.core.db import Base

config = context.config
target_metadata = Base.metadata


def _do_run(connection) -> None:  # type: ignore[no-untyped-def]
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


async def _run_async(url: str) -> None:
    engine = create_async_engine(url)
    async with engine.connect() as connection:
        await connection.run_sync(_do_run)
    await engine.dispose()


def run() -> None:
    url = config.get_main_option("sqlalchemy.url")
    connection = config.attributes.get("connection")
    if connection is not None:
        _do_run(connection)
        return
    asyncio.run(_run_async(url))


if context.is_offline_mode():
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata,
                      literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    run()
