"""One reconciler at a time when several `cpn serve` replicas share one PostgreSQL database.

Every replica serves the API; only the holder of a PostgreSQL session-level advisory lock runs the
reconciler's passes. The lock lives on a connection of its own: when the leader's process dies (or its
connection does), PostgreSQL releases the lock at once and the next replica to try takes it, within
`retry` seconds. Before every pass the leader checks that its connection still holds the lock, so a
leader cut off from the database stops reconciling instead of acting on stale leadership.

SQLite is the single-process default: its one process is always the leader.
"""

from __future__ import annotations

import logging
import time

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from cpn.core.db import Database

log = logging.getLogger("cpn.leader")
LOCK_KEY = 0x43504E_5245434F  # "CPN" "RECO": the reconciler's advisory lock


class Leadership:
    def __init__(self, db: Database):
        self.db = db
        self.conn: AsyncConnection | None = None
        self.since: float | None = None

    @property
    def is_leader(self) -> bool:
        return self.db.is_sqlite or self.conn is not None

    async def ensure(self) -> bool:
        """Whether this replica leads now: keeps the lock it holds, or tries to take it."""
        if self.db.is_sqlite:
            return True
        if self.conn is not None:
            if await self._still_held():
                return True
            await self.release()
        try:
            conn = await self.db.engine.connect()
        except Exception as exc:  # noqa: BLE001 - the database is down: nobody leads from here
            log.warning("cannot reach the database to contend for leadership: %s", exc)
            return False
        try:
            got = (await conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": LOCK_KEY})).scalar()
            await conn.commit()
        except Exception:  # noqa: BLE001
            await conn.close()
            return False
        if not got:
            await conn.close()
            return False
        self.conn, self.since = conn, time.monotonic()
        log.info("this replica now runs the reconciler (advisory lock %d)", LOCK_KEY)
        return True

    async def _still_held(self) -> bool:
        assert self.conn is not None
        try:
            held = (await self.conn.execute(text(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid() "
                "AND granted AND ((classid::bigint << 32) | objid::bigint) = :k"), {"k": LOCK_KEY})).scalar()
            await self.conn.commit()
        except Exception as exc:  # noqa: BLE001 - the connection is gone, and with it the lock
            log.warning("lost the reconciler's lock: %s", exc)
            return False
        return bool(held)

    async def release(self) -> None:
        conn, self.conn, self.since = self.conn, None, None
        if conn is not None:
            try:
                await conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": LOCK_KEY})
                await conn.commit()
            except Exception:  # noqa: BLE001 - closing the session releases it anyway
                pass
            finally:
                await conn.close()
