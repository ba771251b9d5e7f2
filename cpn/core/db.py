"""The one place that opens database engines and sessions.

SQLAlchemy 2.x async ORM: aiosqlite for the embedded default, asyncpg for PostgreSQL. The
schema exists only through Alembic migrations (see :mod:`cpn.core.migrate`).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

from sqlalchemy import JSON, DateTime, Integer, MetaData, event, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, declared_attr, mapped_column
from sqlalchemy.orm.exc import StaleDataError

from cpn.core import errors

_T = TypeVar("_T")

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

JSONType = JSON().with_variant(JSONB(), "postgresql")


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_uid() -> str:
    return str(uuid.uuid4())


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class Tracked:
    """created_at / updated_at and `resource_version` for optimistic concurrency.

    SQLAlchemy's version counter makes a concurrent UPDATE of a stale row fail with
    StaleDataError, which the session scope turns into 409.
    """

    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, nullable=False)
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), default=utcnow, onupdate=utcnow, nullable=False
    )
    resource_version: Mapped[int] = mapped_column(Integer, nullable=False, default=1)

    @declared_attr.directive
    def __mapper_args__(cls) -> dict[str, Any]:  # noqa: N805 - SQLAlchemy directive
        return {"version_id_col": cls.__table__.c.resource_version}


def as_utc(value: datetime | None) -> datetime | None:
    """SQLite returns naive datetimes; everything CPN stores is UTC."""
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value


POOL_RECYCLE_SECONDS = 1800  # PostgreSQL connections older than this are replaced at checkout
PG_SESSION_SLOTS = 32  # concurrent transactions per server on PostgreSQL (more only queue inside 2 cores)


class Database:
    """Engine + session factory. Use :meth:`session` for one transaction per request."""

    def __init__(self, url: str, *, echo: bool = False, share: int = 1):
        """``share``: how many processes of one server share the database (``cpn serve``'s workers):
        each takes that fraction of the connections, so the server as a whole holds as many."""
        self.url = url
        self.is_sqlite = url.startswith("sqlite")
        kwargs: dict[str, Any] = {"echo": echo, "pool_timeout": 300}
        if self.is_sqlite:
            kwargs["connect_args"] = {"timeout": 30}
            slots = 10  # QueuePool default 5 + 5 overflow
        else:
            # No pre-ping: it cost two round trips (BEGIN, ROLLBACK) on every checkout, ~10 of a quote's ~35.
            # A connection that died with the server fails its first use instead: that request gets a 503
            # (below) and SQLAlchemy invalidates the whole pool, so the next requests reconnect.
            # The pool keeps a connection for every gate slot plus the few held outside sessions (the
            # leader's lock): a burst used to open and close the 25 overflow connections over and over
            # (a PostgreSQL backend forked, every statement prepared again, for each).
            slots = max(4, PG_SESSION_SLOTS // share)
            kwargs.update(pool_size=slots + 4, max_overflow=max(1, 10 // share), pool_recycle=POOL_RECYCLE_SECONDS)
        # Admission control: a burst of requests queues here, in order, instead of timing out in the
        # connection pool. No code path holds one session while it opens another.
        self._gate = asyncio.Semaphore(slots)
        self.engine: AsyncEngine = create_async_engine(url, **kwargs)
        if self.is_sqlite:
            event.listen(self.engine.sync_engine, "connect", _sqlite_pragmas)
        self.sessionmaker = async_sessionmaker(self.engine, expire_on_commit=False)
        self._sqlite_write_lock = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[AsyncSession]:
        """One transaction: commit on success, roll back on any error, map DB errors."""
        async with self._gate, self.sessionmaker() as session:
            try:
                yield session
                await session.commit()
            except errors.CPNError:
                await session.rollback()
                raise
            except StaleDataError as exc:
                await session.rollback()
                raise errors.StaleVersion(
                    "the object was changed by someone else; re-read it and retry",
                    field="metadata.resourceVersion",
                ) from exc
            except IntegrityError as exc:
                await session.rollback()
                raise errors.Conflict(f"conflicts with existing data: {_short(exc)}") from exc
            except DBAPIError as exc:
                if exc.connection_invalidated:
                    raise errors.Unavailable("the connection to the database was lost (did it restart?); "
                                             "retry the request") from exc
                await session.rollback()
                if _is_serialization_failure(exc):
                    raise errors.Conflict("concurrent update; retry the request") from exc
                raise

    async def transact(self, fn: Callable[[AsyncSession], Awaitable[_T]], *, attempts: int = 3) -> _T:
        """``fn`` in one transaction (:meth:`session`), run again from a fresh read when a concurrent writer
        changed a row it read in between (the optimistic version check: a user's cancel racing the
        reconciler's pass); a user's own stale ``resourceVersion`` is not retried."""
        for attempt in range(attempts):
            try:
                async with self.session() as s:
                    return await fn(s)
            except errors.StaleVersion as exc:
                if not isinstance(exc.__cause__, StaleDataError) or attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")

    async def read_row(self, stmt: Any, params: dict[str, Any] | None = None) -> Any:
        """The first row of one read-only statement, outside a transaction (autocommit: one round trip
        instead of BEGIN + statement + COMMIT), through the same admission gate as sessions. `params`:
        values of its bind parameters (a statement built once and run with new values is cheaper)."""
        return await self._autocommit(stmt, lambda result: result.first(), params)

    async def read_rows(self, stmt: Any, params: dict[str, Any] | None = None) -> list[Any]:
        """Every row of one read-only statement, outside a transaction (as :meth:`read_row`)."""
        return await self._autocommit(stmt, lambda result: result.all(), params)

    async def write_returning(self, stmt: Any, params: dict[str, Any] | None = None) -> Any:
        """The first row a one-statement write returns (None: it wrote nothing), in autocommit."""
        return await self._autocommit(stmt, lambda result: result.first(), params)

    async def write_once(self, stmt: Any, params: dict[str, Any] | None = None) -> None:
        """One statement that is a whole transaction by itself (an INSERT of one row), in autocommit."""
        await self._autocommit(stmt, lambda result: None, params)

    async def _autocommit(self, stmt: Any, take: Any, params: dict[str, Any] | None = None) -> Any:
        async with self._gate, self.engine.connect() as conn:
            conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
            try:
                return take(await conn.execute(stmt, params))
            except DBAPIError as exc:
                if exc.connection_invalidated:
                    raise errors.Unavailable("the connection to the database was lost (did it restart?); "
                                             "retry the request") from exc
                raise

    @contextlib.asynccontextmanager
    async def serialized(self) -> AsyncIterator[None]:
        """Serialise a critical section on SQLite (PostgreSQL uses row locks instead)."""
        if self.is_sqlite:
            async with self._sqlite_write_lock:
                yield
        else:
            yield

    async def ping(self) -> None:
        """A round trip to the database (health checks)."""
        async with self.session() as s:
            await s.execute(text("SELECT 1"))

    async def dispose(self) -> None:
        await self.engine.dispose()


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def _short(exc: Exception) -> str:
    text = str(getattr(exc, "orig", exc)).splitlines()[0]
    return text[:200]


def _is_serialization_failure(exc: DBAPIError) -> bool:
    text = str(exc.orig).lower()
    return "deadlock" in text or "could not serialize" in text or "database is locked" in text
