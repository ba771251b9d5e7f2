"""Raw SQL against a test database, for migration tests that write rows as an older schema had them."""

from __future__ import annotations

import asyncio

from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine


def run_sql(url: str, *statements: str) -> list[tuple]:
    """Run ``statements`` in one transaction; the rows of the last (empty when it returns none)."""

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
