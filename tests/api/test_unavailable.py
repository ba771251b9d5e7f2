"""503 with Retry-After while the database or the disk is unavailable, never 500 (issue 36, item 5)."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from aiohttp import web
from sqlalchemy.engine import make_url

from cpn.api.middleware import errors_middleware
from cpn.core import errors
from cpn.core.db import Database
from cpn.core.settings import Settings
from tests.conftest import _pg_admin, make_token


def _own_copy(db_url: str, folder: Path) -> str:
    """A SQLite database the test may take away (the fixture's sits beside the session's template)."""
    url = make_url(db_url)
    if not url.drivername.startswith("sqlite"):
        return db_url
    folder.mkdir()
    shutil.copy(url.database, folder / "cpn.db")
    return f"sqlite+aiosqlite:///{folder / 'cpn.db'}"


async def _take_away(db: Database, folder: Path) -> None:
    """The database goes away: its connections drop and new ones are refused (PostgreSQL: the database no
    longer accepts connections; SQLite: its folder is gone, so the file cannot be opened)."""
    url = make_url(db.url)
    if url.drivername.startswith("sqlite"):
        shutil.rmtree(folder)
    else:
        admin = db.url.replace(f"/{url.database}", "/postgres")
        await _pg_admin(admin, f'ALTER DATABASE "{url.database}" ALLOW_CONNECTIONS false',
                        f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{url.database}'")
    await db.engine.dispose()  # what a database restart does to the pool's connections


async def _assert_unavailable(resp) -> dict:  # type: ignore[no-untyped-def]
    assert resp.status == 503, await resp.text()
    assert int(resp.headers["Retry-After"]) > 0
    body = await resp.json()
    assert body["error"]["code"] == "unavailable" and "retry" in body["error"]["message"]
    return body


async def test_a_server_whose_database_went_away_answers_503_with_retry_after(aiohttp_client, db_url: str,  # type: ignore[no-untyped-def]
                                                                             tmp_path: Path) -> None:
    from cpn.api.app import create_app

    folder = tmp_path / "database"
    url = _own_copy(db_url, folder)
    settings = Settings(database_url=url, data_dir=tmp_path, heartbeat_timeout_seconds=60, reconcile=False)
    db = Database(settings.effective_database_url)
    try:
        client = await aiohttp_client(create_app(settings, db, migrate=False))
        token = await make_token(db, "prov-a", "provider")
        auth = {"Authorization": f"Bearer {token}"}
        assert (await client.get("/healthz")).status == 200
        assert (await client.get("/api/v1/clusters", headers=auth)).status == 200

        await _take_away(db, folder)

        body = await _assert_unavailable(await client.get("/healthz"))
        assert body["error"]["details"] == {"database": "down"}
        await _assert_unavailable(await client.get("/api/v1/clusters", headers=auth))
        site = {"apiVersion": "cpn/v1", "kind": "Site", "metadata": {"name": "fra-1"}, "spec": {"region": "eu-central"}}
        await _assert_unavailable(await client.post("/api/v1/sites", json=site, headers=auth))
    finally:
        await db.dispose()


def _app(error: BaseException) -> web.Application:
    async def handler(request: web.Request) -> web.Response:
        raise error

    app = web.Application(middlewares=[errors_middleware])
    app.router.add_get("/x", handler)
    return app


async def test_a_full_disk_is_503_and_a_bug_stays_500(aiohttp_client) -> None:  # type: ignore[no-untyped-def]
    """The one mapping in the errors middleware: ENOSPC (a blob or a log that cannot be written) is 503 with
    Retry-After; an error that says nothing about the database or the disk is still a 500."""
    full = await (await aiohttp_client(_app(OSError(errno.ENOSPC, "No space left on device")))).get("/x")
    body = await _assert_unavailable(full)
    assert body["error"]["details"] == {"disk": "unavailable"} and "No space left" in body["error"]["message"]
    bug = await (await aiohttp_client(_app(ValueError("a bug")))).get("/x")
    assert bug.status == 500 and "Retry-After" not in bug.headers
    assert (await bug.json())["error"]["code"] == "internal"
    lost = await (await aiohttp_client(_app(errors.Unavailable("the connection to the database was lost; retry the request")))).get("/x")
    await _assert_unavailable(lost)  # the 503 the database layer raised itself now says when to retry
