"""`cpn`: the server-side command (serve, db, token, agent, catalog, train, bench, netem, demo)."""

from __future__ import annotations

import asyncio
import os
import sys

import click

import cpn
from cpn.cli.lazy import LazyGroup
from cpn.core.settings import Settings, get_settings


@click.group(cls=LazyGroup, lazy={
    "agent": "cpn.cli.agent:agent_cmd",
    "train": "cpn.runtime.cli_train:train_cmd",
    "demo": "cpn.cli.demo:demo_cmd",
})
@click.version_option(cpn.__version__, prog_name="cpn")
def main() -> None:
    """CPN server-side commands."""


@main.command()
@click.option("--host", default=None, help="Bind address (CPN_HOST).")
@click.option("--port", type=int, default=None, help="Port (CPN_PORT).")
def serve(host: str | None, port: int | None) -> None:
    """Run the API server; upgrades the database schema first."""
    from cpn.api.app import serve as run

    settings = get_settings()
    overrides = {k: v for k, v in {"host": host, "port": port}.items() if v is not None}
    run(settings.model_copy(update=overrides))


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
def token_create(name: str, role: str) -> None:
    """Create account NAME (if new) with ROLE and print a new token — only the token, once."""
    click.echo(asyncio.run(_create_token(get_settings(), name, role)))


async def _create_token(settings: Settings, name: str, role: str) -> str:
    from cpn.core import migrate
    from cpn.core.db import Database
    from cpn.core.manifest import NAME_RE
    from cpn.core.principal import Role
    from layers.orchestration.identity.tokens import create_token

    if not NAME_RE.match(name):
        raise click.BadParameter("must be lowercase letters, digits, '-' or '.'", param_hint="NAME")
    await migrate.upgrade_async(settings.effective_database_url)
    db = Database(settings.effective_database_url)
    try:
        async with db.session() as session:
            return await create_token(session, name, Role(role))
    finally:
        await db.dispose()


@main.group(cls=LazyGroup, lazy={
    "collectives": "cpn.runtime.cli_collectives:bench_collectives_cmd",
    "training": "cpn.runtime.cli_train:bench_training_cmd",
    "scheduler": "cpn.cli.bench:bench_scheduler_cmd",
    "quotes": "cpn.cli.bench_api:bench_quotes_cmd",
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
    from cpn.client import ApiError
    from cpn.core.errors import CPNError

    try:
        main(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("error: aborted", err=True)
        sys.exit(1)
    except click.ClickException as exc:
        click.echo(f"error: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code or 1)
    except CPNError as exc:
        click.echo(f"error: {exc.message}", err=True)
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
