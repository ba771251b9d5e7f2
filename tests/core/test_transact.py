"""Database.transact runs a request's transaction again when a concurrent writer changed a row it read
(the optimistic version check) — a new user's `cpnctl cancel` of a running job failed once with "the
object was changed by someone else" while the reconciler wrote the job; a user's own stale
resourceVersion is not retried."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from cpn.core import errors
from cpn.core.db import Database
from layers.resource.models import SiteRow
from tests.conftest import make_token


async def _site(db: Database) -> str:
    await make_token(db, "prov", "provider")
    from layers.orchestration.identity.models import Account

    async with db.session() as s:
        owner = (await s.execute(select(Account))).scalars().first()
        s.add(SiteRow(name="s1", region="eu", owner_id=owner.id, labels={}, spec={}, status={}))
    return "s1"


async def test_a_concurrent_write_is_retried_from_a_fresh_read(db: Database) -> None:
    await _site(db)
    calls = []

    async def relabel(s) -> int:
        row = (await s.execute(select(SiteRow).where(SiteRow.name == "s1"))).scalar_one()
        if not calls:  # another writer commits between this read and this commit
            async with db.session() as other:
                theirs = (await other.execute(select(SiteRow).where(SiteRow.name == "s1"))).scalar_one()
                theirs.region = "us"
        calls.append(row.resource_version)
        row.labels = {"k": "v"}
        return len(calls)

    assert await db.transact(relabel) == 2
    async with db.session() as s:
        row = (await s.execute(select(SiteRow).where(SiteRow.name == "s1"))).scalar_one()
        assert row.labels == {"k": "v"} and row.region == "us"  # both writes kept


async def test_a_users_stale_version_is_not_retried(db: Database) -> None:
    calls = []

    async def stale(s) -> None:
        calls.append(1)
        raise errors.StaleVersion("site 's1' is at resourceVersion 3, not 2", field="metadata.resourceVersion")

    with pytest.raises(errors.StaleVersion):
        await db.transact(stale)
    assert calls == [1]
