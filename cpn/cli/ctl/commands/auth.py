"""`cpnctl auth whoami`: who the server takes the caller for."""

from __future__ import annotations

import json

import click

from cpn.cli.ctl.context import Ctx
from cpn.cli.ctl.main import cli


@cli.group("auth")
def auth_group() -> None:
    """Inspect the credentials cpnctl uses."""


@auth_group.command("whoami")
@click.option("-o", "--output", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.pass_obj
def whoami(obj: Ctx, output: str) -> None:
    """Print the account, role and server of the current token (as the server sees it)."""
    me = obj.client.get("/api/v1/whoami")
    server = obj.client.server
    if output == "json":
        click.echo(json.dumps({**me, "server": server}, indent=2))
        return
    click.echo(f"Name:     {me['name']}")
    click.echo(f"Role:     {me['role']}")
    click.echo(f"Account:  {me['accountId']}")
    click.echo(f"Server:   {server}")
