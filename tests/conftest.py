"""Shared fixtures: a migrated database per test (SQLite, or PostgreSQL when
CPN_TEST_DATABASE_URL is set), the API application, tokens, and a live `cpn serve`."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cpn.core import migrate
from cpn.core.db import Database
from cpn.core.principal import Role
from cpn.core.settings import Settings
from cpn.runtime.launcher import free_port
from tests import durations

pytest_plugins: list[str] = []
if (Path(__file__).parent / "conftest_kube.py").exists():
    pytest_plugins.append("tests.conftest_kube")

PG_DEFAULT = "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
# the accounts the `api` fixture hands out tokens for (minted once into a template, see DatabaseFactory)
API_ACCOUNTS = [("admin", "admin"), ("prov-a", "provider"), ("prov-b", "provider"), ("alice", "user"), ("bob", "user")]


def _pg_url() -> str | None:
    return os.environ.get("CPN_TEST_DATABASE_URL")


async def _pg_admin(url: str, *statements: str) -> None:
    import asyncpg

    dsn = url.replace("postgresql+asyncpg://", "postgresql://")
    conn = await asyncpg.connect(dsn, timeout=5)
    try:
        for stmt in statements:
            await conn.execute(stmt)
    finally:
        await conn.close()


def _with_db(url: str, name: str) -> str:
    base, _, _ = url.rpartition("/")
    return f"{base}/{name}"


# fixtures that start real processes (a `cpn serve`, S x W torch workers): a test using one is `slow`
SLOW_FIXTURES = {"live_server", "run_workers"}
# and a test that took this long when last recorded (tests/durations.json, written by `python -m tests.durations`)
SLOW_SECONDS = 1.5


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`db` marks every test that gets a database (its fixtures reach `db_factory`): CI's PostgreSQL pass
    runs `-m db` only. `slow` marks every test whose fixtures start processes (SLOW_FIXTURES). A
    `postgres` test runs only when CPN_TEST_DATABASE_URL is set, i.e. in that pass."""
    on_pg = bool(_pg_url())
    took = durations.load()
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if "db_factory" in fixtures:
            item.add_marker(pytest.mark.db)
        if fixtures & SLOW_FIXTURES or took.get(item.nodeid, 0.0) >= SLOW_SECONDS:
            item.add_marker(pytest.mark.slow)
        if item.path.parent.name == "runtime" and item.path.parent.parent.name == "tests":
            # the runtime's tests fork torch workers; forked from an xdist worker (a threaded process) two
            # of them hung in CI on 2026-11-28: CI runs them in a pytest of their own, without xdist
            item.add_marker(pytest.mark.forks)
        if item.get_closest_marker("postgres") and not on_pg:
            item.add_marker(pytest.mark.skip(reason="runs in CI's PostgreSQL pass (CPN_TEST_DATABASE_URL is unset)"))


class DatabaseFactory:
    """Migrates one template per session, then hands each test a fresh copy of it."""

    def __init__(self, tmp: Path, pg_url: str | None):
        self.tmp, self.pg_url = tmp, pg_url
        self.template: str | None = None
        self.with_tokens: str | None = None
        self.tokens: dict[str, str] = {}
        self.created: list[str] = []

    def _template(self) -> str:
        if self.template:
            return self.template
        if self.pg_url:
            name = f"cpn_tmpl_{uuid.uuid4().hex[:8]}"
            asyncio.run(_pg_admin(self.pg_url, f'CREATE DATABASE "{name}"'))
            self.created.append(name)
            migrate.upgrade(_with_db(self.pg_url, name))
            self.template = name
        else:
            path = self.tmp / "template.db"
            migrate.upgrade(f"sqlite+aiosqlite:///{path}")
            self.template = str(path)
        return self.template

    def _template_with_tokens(self) -> str:
        """A second template that also holds the `api` fixture's five tokens: minting them costs five
        argon2 hashes, which per test was the largest part of an API test's setup."""
        if self.with_tokens:
            return self.with_tokens
        url = self._copy(self._template())
        database = Database(url)

        async def mint() -> dict[str, str]:
            try:
                return {name: await make_token(database, name, role) for name, role in API_ACCOUNTS}
            finally:
                await database.dispose()

        self.tokens = asyncio.run(mint())
        self.with_tokens = url.rpartition("/")[2] if self.pg_url else url.removeprefix("sqlite+aiosqlite:///")
        return self.with_tokens

    def new(self, *, tokens: bool = False) -> str:
        return self._copy(self._template_with_tokens() if tokens else self._template())

    def _copy(self, template: str) -> str:
        if self.pg_url:
            name = f"cpn_t_{uuid.uuid4().hex[:10]}"
            asyncio.run(_pg_admin(self.pg_url, f'CREATE DATABASE "{name}" TEMPLATE "{template}"'))
            self.created.append(name)
            return _with_db(self.pg_url, name)
        path = self.tmp / f"{uuid.uuid4().hex[:10]}.db"
        shutil.copy(template, path)
        return f"sqlite+aiosqlite:///{path}"

    def cleanup(self) -> None:
        if self.pg_url and self.created:
            stmts = [f'DROP DATABASE IF EXISTS "{n}" WITH (FORCE)' for n in reversed(self.created)]
            try:
                asyncio.run(_pg_admin(self.pg_url, *stmts))
            except Exception:  # noqa: BLE001 - best effort
                pass


@pytest.fixture(scope="session")
def db_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DatabaseFactory]:
    pg = _pg_url()
    if pg:
        try:
            asyncio.run(_pg_admin(pg, "SELECT 1"))
        except Exception as exc:  # noqa: BLE001
            # Not a skip: a run that asked for PostgreSQL and silently tested nothing would pass green.
            pytest.fail(f"CPN_TEST_DATABASE_URL is set but PostgreSQL does not answer at {pg}: {exc}",
                        pytrace=False)
    factory = DatabaseFactory(tmp_path_factory.mktemp("db"), pg)
    yield factory
    factory.cleanup()


@pytest.fixture
def db_url(db_factory: DatabaseFactory, request: pytest.FixtureRequest) -> str:
    return db_factory.new(tokens="api" in request.fixturenames)


@pytest.fixture
def settings(db_url: str, tmp_path: Path) -> Settings:
    return Settings(database_url=db_url, data_dir=tmp_path, heartbeat_timeout_seconds=60, reconcile=False)


@pytest.fixture
async def db(settings: Settings) -> AsyncIterator[Database]:
    database = Database(settings.effective_database_url)
    yield database
    await database.dispose()


async def make_token(db: Database, name: str, role: str) -> str:
    from layers.orchestration.identity.tokens import create_token

    async with db.session() as s:
        return await create_token(s, name, Role(role))


@dataclass
class Api:
    """An aiohttp test client plus tokens for an admin, two providers and two users."""

    client: object
    tokens: dict[str, str]

    def auth(self, who: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[who]}"}


@pytest.fixture
async def api(aiohttp_client, settings: Settings, db: Database, db_factory: DatabaseFactory) -> Api:  # type: ignore[no-untyped-def]
    from cpn.api.app import create_app

    app = create_app(settings, db, migrate=False)
    client = await aiohttp_client(app)
    return Api(client=client, tokens=dict(db_factory.tokens))



@dataclass
class LiveServer:
    url: str
    env: dict[str, str]
    proc: subprocess.Popen

    def cpn(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return run_cli(["cpn", *args], self.env, check=check)

    def cpnctl(self, *args: str, input: str | None = None, check: bool = False) -> subprocess.CompletedProcess:
        return run_cli(["cpnctl", *args], self.env, input=input, check=check)

    def token(self, name: str, role: str) -> str:
        """A token minted straight into the server's database, as `cpn token create` does it (whose process
        start cost 1-2 s per token, several per world); the command itself is tested in tests/cli."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(_mint(self.env["CPN_DATABASE_URL"], name, role))
        return self.cpn("token", "create", name, "--role", role).stdout.strip()  # inside an event loop


async def _mint(url: str, name: str, role: str) -> str:
    database = Database(url)
    try:
        return await make_token(database, name, role)
    finally:
        await database.dispose()


def run_cli(argv: list[str], env: dict[str, str], input: str | None = None,
            check: bool = False) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / argv[0]
    cmd = [str(exe), *argv[1:]] if exe.exists() else argv
    proc = subprocess.run(cmd, env=env, input=input, capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"{argv} failed ({proc.returncode}): {proc.stderr}")
    return proc


def start_server(db_url: str, tmp: Path, extra_env: dict[str, str] | None = None,
                 port: int | None = None, host: str = "127.0.0.1") -> LiveServer:
    port = port or free_port()
    env = {**os.environ, "CPN_DATABASE_URL": db_url, "CPN_DATA_DIR": str(tmp), "CPN_PORT": str(port),
           "CPN_HOST": host,
           "CPN_CONFIG": str(tmp / "cpnctl.yaml"), "HOME": str(tmp), **(extra_env or {})}
    env.pop("CPN_SERVER", None)
    env.pop("CPN_TOKEN", None)
    exe = Path(sys.executable).parent / "cpn"
    log = open(tmp / f"server-{port}.log", "a")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen([str(exe), "serve", "--port", str(port)], env=env, stdout=log, stderr=log)
    url = f"http://{host}:{port}"
    try:
        wait_healthy(url, proc, tmp / f"server-{port}.log")
    except BaseException:
        proc.kill()  # a server that never answered is not left running behind the failed test
        proc.wait()
        raise
    return LiveServer(url=url, env=env, proc=proc)


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"server not healthy in {timeout}s: {log.read_text()[-2000:]}")


def stop_server(server: LiveServer) -> None:
    server.proc.terminate()
    try:
        server.proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        server.proc.kill()


@pytest.fixture
def live_server(db_url: str, tmp_path: Path) -> Iterator[LiveServer]:
    server = start_server(db_url, tmp_path)
    yield server
    stop_server(server)
