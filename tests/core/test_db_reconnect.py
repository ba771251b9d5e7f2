"""Without a pre-ping, a pooled connection that died with the server fails its first use as a 503
(retry), and the requests after it reconnect (PostgreSQL only: SQLite has no server to lose)."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from cpn.core import errors
from cpn.core.db import Database


async def test_a_killed_connection_is_one_503_then_the_pool_reconnects(db: Database) -> None:
    if db.is_sqlite:
        pytest.skip("PostgreSQL only")
    async with db.session() as s:
        mine = await s.scalar(text("SELECT pg_backend_pid()"))
    other = Database(db.url)
    try:
        async with other.session() as s:  # the server ends the pooled connection, as a restart would
            assert await s.scalar(text("SELECT pg_terminate_backend(:pid)"), {"pid": mine})
    finally:
        await other.dispose()
    with pytest.raises(errors.Unavailable, match="retry the request"):
        async with db.session() as s:
            await s.execute(text("SELECT 1"))
    async with db.session() as s:
        assert await s.scalar(text("SELECT 1")) == 1
