"""Rate limits hold across replicas on PostgreSQL: two servers on one database share each token's
budget (one GCRA row per token), and a refused request spends nothing."""

from __future__ import annotations

import pytest

from cpn.core.db import Database
from layers.orchestration.identity.ratelimit import MemoryRateLimiter, SharedRateLimiter, limiter_for


async def test_two_replicas_share_one_budget(aiohttp_client, settings, db) -> None:
    if db.is_sqlite:
        assert isinstance(limiter_for(db, 3), MemoryRateLimiter)  # one process: the bucket stays in memory
        pytest.skip("replicas share a PostgreSQL database")
    from cpn.api.app import create_app
    from tests.conftest import make_token

    limited = settings.model_copy(update={"rate_limit_per_minute": 4})
    other_db = Database(settings.effective_database_url)
    try:
        replicas = [await aiohttp_client(create_app(limited, d, migrate=False)) for d in (db, other_db)]
        token = await make_token(db, "eve", "user")
        headers = {"Authorization": f"Bearer {token}"}
        codes = [(await replicas[i % 2].get("/api/v1/sites", headers=headers)).status for i in range(6)]
        assert codes == [200, 200, 200, 200, 429, 429]  # 4 a minute in all, not 4 per replica
        fresh = await make_token(db, "mallory", "user")  # another token has its own budget
        assert (await replicas[1].get("/api/v1/sites", headers={"Authorization": f"Bearer {fresh}"})).status == 200
    finally:
        await other_db.dispose()


async def test_a_refusal_spends_nothing(db) -> None:
    if db.is_sqlite:
        pytest.skip("PostgreSQL only")
    from sqlalchemy import func, select

    from layers.orchestration.identity.models import RateBucket

    limiter = SharedRateLimiter(db, per_minute=2)  # T = 30 s, a burst of 2
    assert [await limiter.allow("k") for _ in range(4)] == [True, True, False, False]
    async with db.session() as s:
        ahead = await s.scalar(select(RateBucket.tat - func.extract("epoch", func.now())).where(RateBucket.key == "k"))
    assert 55 < ahead <= 60  # two requests' worth (2 T) ahead of now: the two refusals moved nothing
