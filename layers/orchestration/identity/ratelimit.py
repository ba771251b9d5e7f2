"""Per-token rate limits: `per_minute` requests a minute, bursts up to `per_minute`.

- `MemoryRateLimiter`: a token bucket in this process (SQLite: CPN runs as one process there).
- `SharedRateLimiter`: the same limit for all replicas on one PostgreSQL, as GCRA (the generic cell
  rate algorithm: a bucket is one number, its theoretical arrival time `tat`). A request is allowed
  when `max(tat, now) + T - now <= burst · T` (T = 60 / per_minute s) and then moves `tat` to
  `max(tat, now) + T`; a refused request changes nothing. That is one conditional upsert, atomic
  under the row's lock, on the database's clock (replicas' clocks never enter it): one round trip,
  outside any transaction.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from sqlalchemy import bindparam, func, select
from sqlalchemy.dialects.postgresql import insert

from cpn.core.db import Database
from layers.orchestration.identity.models import RateBucket


class RateLimiter(Protocol):
    async def allow(self, key: str) -> bool: ...


class MemoryRateLimiter:
    """A token bucket per key in this process's memory."""

    def __init__(self, per_minute: int):
        self.rate = per_minute / 60.0
        self.capacity = float(per_minute)
        self.buckets: dict[str, tuple[float, float]] = {}

    async def allow(self, key: str) -> bool:
        now = time.monotonic()
        level, at = self.buckets.get(key, (self.capacity, now))
        level = min(self.capacity, level + (now - at) * self.rate)
        if level < 1.0:
            self.buckets[key] = (level, now)
            return False
        self.buckets[key] = (level - 1.0, now)
        return True


class SharedRateLimiter:
    """GCRA on a `rate_buckets` row per key, shared by every replica using the database."""

    def __init__(self, db: Database, per_minute: int):
        self.db = db
        self.interval = 60.0 / per_minute  # T: seconds one request uses up
        self.burst = float(per_minute) * self.interval  # how far ahead of now `tat` may run
        # built once, run with each key (building it per request cost more than running it)
        now = func.extract("epoch", func.now())  # in autocommit: this statement's start, one value throughout
        start = func.greatest(RateBucket.__table__.c.tat, now)
        stmt = insert(RateBucket).values(key=bindparam("bucket_key"), tat=now + self.interval)
        self.stmt = stmt.on_conflict_do_update(
            index_elements=[RateBucket.key],
            set_={"tat": start + self.interval, "updated_at": func.now(),
                  "resource_version": RateBucket.__table__.c.resource_version + 1},
            where=start + self.interval - now <= self.burst,
        ).returning(RateBucket.tat)
        self._charging: dict[Any, Any] = {}

    async def allow(self, key: str) -> bool:
        return await self.db.write_returning(self.stmt, {"bucket_key": key[:64]}) is not None

    def charging(self, read: Any) -> Any:
        """`read` (a select of one row) that also charges the bucket `bucket_key` in the same statement
        (a data-modifying WITH runs once, whatever the select returns): its column `allowed` is 1 when
        the request is within the limit. One round trip for a request's token check and rate limit."""
        stmt = self._charging.get(read)
        if stmt is None:
            bucket = self.stmt.cte("bucket")
            stmt = self._charging[read] = read.add_columns(
                select(func.count()).select_from(bucket).scalar_subquery().label("allowed"))
        return stmt


def limiter_for(db: Database, per_minute: int) -> RateLimiter:
    """The shared limiter on PostgreSQL (replicas), the in-memory one on SQLite (one process)."""
    return MemoryRateLimiter(per_minute) if db.is_sqlite else SharedRateLimiter(db, per_minute)
