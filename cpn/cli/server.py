"""`cpn`: the server-side command (serve, db, token, agent, doctor, catalog, train, bench, netem, demo)."""

from __future__ import annotations

import asyncio
import os
import sys
from datetime import datetime, timedelta

import click

import cpn
from cpn.cli.lazy import LazyGroup
from cpn.core.settings import Settings, get_settings


@click.group(cls=LazyGroup, lazy={
    "agent": "cpn.cli.agent:agent_cmd",
    "train": "cpn.runtime.cli_train:train_cmd",
    "demo": "cpn.cli.demo:demo_cmd",
    "doctor": "cpn.cli.doctor:doctor_cmd",
})
@click.version_option(cpn.__version__, prog_name="cpn")
def main() -> None:
    """CPN server-side commands."""


@main.command()
@click.option("--host", default=None, help="Bind address (CPN_HOST).")
@click.option("--port", type=int, default=None, help="Port (CPN_PORT).")
@click.option("--workers", type=click.IntRange(1, 64), default=None,
              help="API processes sharing the port (CPN_WORKERS; PostgreSQL only). Default: the CPUs but "
                   "one (at least 1, at most 8) on PostgreSQL; 1 on SQLite.")
def serve(host: str | None, port: int | None, workers: int | None) -> None:
    """Run the API server; upgrades the database schema first."""
    from cpn.api.workers import prepare_metrics

    settings = get_settings()
    overrides = {k: v for k, v in {"host": host, "port": port, "workers": workers}.items() if v is not None}
    settings = settings.model_copy(update=overrides)
    try:
        count = settings.effective_workers
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    prepare_metrics(count)  # before prometheus_client is imported (by the app below)
    from cpn.api.app import serve as run

    run(settings)


@main.group()
def db() -> None:
    """Database schema migrations (Alembic)."""


@db.command()
@click.option("--revision", default="head", show_default=True)
def upgrade(revision: str) -> None:
    """Upgrade the schema."""
    from cpn.core import migrate

    migrate.upgrade(get_settings().effective_database_url, revision)
    click.echo(f"database at {revision}", err=True)


@db.command()
@click.option("--revision", default="base", show_default=True)
def downgrade(revision: str) -> None:
    """Downgrade the schema (default: remove every table)."""
    from cpn.core import migrate

    migrate.downgrade(get_settings().effective_database_url, revision)
    click.echo(f"database at {revision}", err=True)


@db.command()
def current() -> None:
    """Print the schema revision of the database."""
    from cpn.core import migrate

    click.echo(asyncio.run(migrate.current_revision(get_settings().effective_database_url)) or "empty")


@main.group()
def token() -> None:
    """Bearer tokens (server side: talks to the database directly)."""


@token.command("create")
@click.argument("name")
@click.option("--role", type=click.Choice(["admin", "provider", "user"]), required=True)
@click.option("--init", "init", is_flag=True,
              help="Create the database schema first if there is none (a fresh database for a new server).")
@click.option("--expires-in", "expires_in", default=None, metavar="DURATION",
              help="Expire the token after this long: 30d, 12h, 90m, 2w (default: never).")
def token_create(name: str, role: str, init: bool, expires_in: str | None) -> None:
    """Create account NAME (if new) with ROLE and print a new token — only the token, once.

    Writes to the database of CPN_DATABASE_URL (or CPN_DATA_DIR/cpn.db): the same settings the server
    runs with. A database without CPN's schema is refused unless --init is given."""
    from datetime import UTC, datetime

    settings = get_settings()
    expires_at = datetime.now(UTC) + parse_duration(expires_in) if expires_in is not None else None
    click.echo(asyncio.run(_create_token(settings, name, role, init=init, expires_at=expires_at)))
    note = f"; expires {expires_at.isoformat(timespec='seconds')}" if expires_at else ""
    click.echo(f"token stored in {_shown(settings.effective_database_url)}{note}", err=True)


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> timedelta:
    """`30d`, `12h`, `90m`, `45s`, `2w` → a positive timedelta (at most ten years)."""
    import re

    m = re.fullmatch(r"\s*(\d{1,6})\s*([smhdw])\s*", text or "")
    if m is None or int(m.group(1)) == 0:
        raise click.BadParameter(f"{text!r}: write a positive whole number and a unit s, m, h, d or w "
                                 "(e.g. 30d, 12h)", param_hint="--expires-in")
    seconds = int(m.group(1)) * _UNITS[m.group(2)]
    if seconds > 3650 * 86400:
        raise click.BadParameter(f"{text!r} is more than ten years; leave --expires-in out for a token that "
                                 "does not expire", param_hint="--expires-in")
    return timedelta(seconds=seconds)


@token.command("list")
@click.option("--account", default=None, help="Only this account's tokens.")
@click.option("--all", "include_workers", is_flag=True, help="Also the per-job worker tokens.")
@click.option("-o", "--output", type=click.Choice(["table", "json"]), default="table", show_default=True)
def token_list(account: str | None, include_workers: bool, output: str) -> None:
    """List tokens: id (the token's `cpn_<id>_` prefix), account, role, state, expiry. Never the secret."""
    import json

    rows = asyncio.run(_token_db(get_settings(), "list", account=account, include_workers=include_workers))
    if output == "json":
        click.echo(json.dumps([{"id": t.id, "account": t.account, "role": t.role, "job": t.job, "state": t.state,
                                "created": t.created_at.isoformat(),
                                "expires": t.expires_at.isoformat() if t.expires_at else None} for t in rows],
                              indent=2))
        return
    from cpn.cli.ctl.output import format_rows

    table = [[t.id, t.account, t.role, t.state, t.created_at.strftime("%Y-%m-%d %H:%M"),
              t.expires_at.strftime("%Y-%m-%d %H:%M") if t.expires_at else "never", t.job or ""] for t in rows]
    if not table:
        click.echo("no tokens" + (f" for account {account!r}" if account else ""), err=True)
        return
    click.echo(format_rows(["ID", "ACCOUNT", "ROLE", "STATE", "CREATED", "EXPIRES", "JOB"], table))


@token.command("revoke")
@click.argument("token_id", required=False, metavar="ID")
@click.option("--account", default=None, help="Revoke every token of this account instead.")
def token_revoke(token_id: str | None, account: str | None) -> None:
    """Revoke token ID (from `cpn token list`, or the `cpn_<id>` prefix of the token), or with --account
    every token of an account. Servers refuse it from the next request on."""
    if (token_id is None) == (account is None):
        raise click.UsageError("give a token ID or --account NAME (one of them)")
    revoked = asyncio.run(_token_db(get_settings(), "revoke", ref=token_id, account=account))
    if not revoked:
        click.echo(f"account {account!r} has no active token" if account else "already revoked", err=True)
    for lookup in revoked:
        click.echo(f"token {lookup} revoked")


async def _token_db(settings: Settings, action: str, **kw: object) -> list:
    from cpn.core import errors
    from cpn.core.db import Database
    from layers.orchestration.identity import tokens

    url = settings.effective_database_url
    await _check_schema(url)
    db = Database(url)
    try:
        async with db.session() as session:
            if action == "list":
                return await tokens.list_tokens(session, kw.get("account"),  # type: ignore[arg-type]
                                                include_workers=bool(kw.get("include_workers")))
            return await tokens.revoke(session, kw.get("ref"), account=kw.get("account"))  # type: ignore[arg-type]
    except errors.CPNError as exc:
        raise click.ClickException(exc.message) from exc
    finally:
        await db.dispose()


def _shown(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


POINT_IT = ("point it at the server's database with CPN_DATA_DIR (the server's data directory) or "
            "CPN_DATABASE_URL (its database URL)")


async def _check_schema(url: str) -> None:
    """Refuse a database that is not a CPN server's: missing, without the schema, or at another revision."""
    from cpn.core import migrate

    if url.startswith("sqlite") and ":///" in url:
        path = url.split(":///", 1)[1]
        if path and path != ":memory:" and not os.path.exists(path):
            raise click.ClickException(f"no CPN database at {_shown(url)}: {POINT_IT}, or pass --init to create "
                                       "a fresh one there")
    try:
        revision = await migrate.current_revision(url)
    except Exception as exc:  # noqa: BLE001 - the driver's own error, shown with the URL
        raise click.ClickException(f"cannot open the database {_shown(url)}: {str(exc).splitlines()[0]}; "
                                   f"{POINT_IT}") from exc
    head = migrate.head_revision()
    if revision is None:
        raise click.ClickException(f"{_shown(url)} has no CPN schema, so it is not a CPN server's database: "
                                   f"{POINT_IT}, or pass --init to create the schema there")
    if revision is not None and revision != head:
        raise click.ClickException(f"{_shown(url)} is at schema revision {revision}, this cpn expects {head}: "
                                   "start `cpn serve` (it upgrades) or run `cpn db upgrade` with the same settings")


async def _create_token(settings: Settings, name: str, role: str, *, init: bool = False,
                        expires_at: datetime | None = None) -> str:
    from cpn.core import migrate
    from cpn.core.db import Database
    from cpn.core.manifest import NAME_RE
    from cpn.core.principal import Role
    from layers.orchestration.identity.tokens import create_token

    if not NAME_RE.match(name):
        raise click.BadParameter("must be lowercase letters, digits, '-' or '.'", param_hint="NAME")
    url = settings.effective_database_url
    if init:  # explicit: create (or upgrade) the schema here
        await migrate.upgrade_async(url)
    else:
        await _check_schema(url)
    db = Database(url)
    try:
        async with db.session() as session:
            return await create_token(session, name, Role(role), expires_at=expires_at)
    finally:
        await db.dispose()


@main.group(cls=LazyGroup, lazy={
    "collectives": "cpn.runtime.cli_collectives:bench_collectives_cmd",
    "training": "cpn.runtime.cli_train:bench_training_cmd",
    "pipeline": "cpn.cli.bench_pipeline:bench_pipeline_cmd",
    "scheduler": "cpn.cli.bench:bench_scheduler_cmd",
    "memory": "cpn.cli.bench:bench_memory_cmd",
    "quotes": "cpn.cli.bench_api:bench_quotes_cmd",
    "api": "cpn.cli.bench_heartbeats:bench_api_cmd",
    "gpu": "cpn.cli.bench_gpu:bench_gpu_cmd",
})
def bench() -> None:
    """Benchmarks that print figures and write docs/benchmarks/."""


@main.group(cls=LazyGroup, lazy={"clean": "cpn.runtime.cli_collectives:netem_clean_cmd"})
def netem() -> None:
    """Emulated WAN (network namespaces, veth pairs, tbf/htb)."""


@main.group(cls=LazyGroup, lazy={"generate": "cpn.cli.catalog:catalog_generate_cmd"})
def catalog() -> None:
    """Catalogue fixtures for tests and benchmarks."""


def run() -> None:
    """Entry point: any failure becomes one line on stderr and exit code 1 (CPN_DEBUG=1 for a traceback)."""
    from pydantic import ValidationError

    from cpn.client import ApiError
    from cpn.core.errors import CPNError

    try:
        main(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("error: aborted", err=True)
        sys.exit(1)
    except click.ClickException as exc:  # usage errors too: bad input exits 1, as in cpnctl
        click.echo(f"error: {exc.format_message()}", err=True)
        sys.exit(1)
    except CPNError as exc:
        click.echo(f"error: {exc.message}", err=True)
        sys.exit(1)
    except ValidationError as exc:  # settings from CPN_* variables
        details = "; ".join(f"CPN_{str(e['loc'][0]).upper()}: {str(e['msg']).removeprefix('Value error, ')}"
                            if e["loc"] else e["msg"] for e in exc.errors(include_url=False))
        click.echo(f"error: invalid settings: {details}", err=True)
        sys.exit(1)
    except ApiError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - the CLI boundary: no traceback reaches a user
        if os.environ.get("CPN_DEBUG"):
            raise
        click.echo(f"error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    run()
