"""`cpnctl` entry point: global flags, error handling, command registration."""

from __future__ import annotations

import os
import sys

import click

import cpn
from cpn.cli.ctl import config as cfgmod
from cpn.cli.ctl.context import Ctx
from cpn.client import ApiError


@click.group()
@click.option("--server", envvar=None, default=None, help="API server URL (overrides CPN_SERVER and the context).")
@click.option("--token", default=None, help="Bearer token (overrides CPN_TOKEN and the context).")
@click.option("--context", "context_name", default=None, help="Use this context from ~/.cpn/config.")
@click.option("-n", "--namespace", default=None,
              help="Jobs of this account (admins; users have only their own). Same as NAMESPACE/NAME.")
@click.pass_context
def cli(ctx: click.Context, server: str | None, token: str | None, context_name: str | None,
        namespace: str | None) -> None:
    """cpnctl controls a CPN compute network (kubectl-style)."""
    ctx.obj = Ctx(server=server, token=token, context=context_name, namespace=namespace)


def main() -> None:
    from cpn.cli.ctl import commands  # noqa: F401 - registers the commands

    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("error: aborted", err=True)
        sys.exit(1)
    except click.ClickException as exc:
        click.echo(f"error: {exc.format_message()}", err=True)
        sys.exit(1)
    except (ApiError, cfgmod.ConfigError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    except (OSError, ValueError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - the CLI boundary: no traceback reaches a user
        if os.environ.get("CPN_DEBUG"):
            raise
        click.echo(f"error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} "
                   "(CPN_DEBUG=1 shows where)", err=True)
        sys.exit(1)


@cli.command()
@click.pass_obj
def version(obj: Ctx) -> None:
    """Print the client and server versions."""
    click.echo(f"Client Version: {cpn.__version__}")
    try:
        server = obj.client.get("/healthz")
        click.echo(f"Server Version: {server.get('version')}")
    except ApiError as exc:  # as kubectl: the client's version, then the server's problem, exit 1
        click.echo(f"Server Version: unavailable ({exc})")
        raise SystemExit(1) from None
