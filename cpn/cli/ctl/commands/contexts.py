"""`cpnctl config …`: contexts in ~/.cpn/config."""

from __future__ import annotations

import click

from cpn.cli.ctl import config as cfgmod
from cpn.cli.ctl.main import cli
from cpn.cli.ctl.output import format_rows


@cli.group("config")
def config_group() -> None:
    """Manage contexts (server + token) in ~/.cpn/config."""


@config_group.command("set-context")
@click.argument("name")
@click.option("--server", required=True, help="API server URL, e.g. http://127.0.0.1:8080")
@click.option("--token", default=None, help="Bearer token from `cpn token create`.")
@click.option("--use", is_flag=True, help="Also make it the current context (as `cpnctl config use-context`).")
def set_context(name: str, server: str, token: str | None, use: bool) -> None:
    """Create or update context NAME. The current context changes only with --use (or when there is
    none yet); `cpnctl config use-context NAME` switches later."""
    if not server.startswith(("http://", "https://")):
        raise click.BadParameter("must start with http:// or https://", param_hint="--server")
    cfg = cfgmod.load()
    entry = cfg.find(name)
    if entry is None:
        cfg.contexts.append(cfgmod.ContextEntry(name=name, server=server, token=token))
    else:
        entry.server = server
        entry.token = token if token is not None else entry.token
    previous = cfg.current_context
    if use or previous is None:
        cfg.current_context = name
    cfgmod.save(cfg)
    click.echo(f'Context "{name}" {"created" if entry is None else "modified"} ({server}).')
    if cfg.current_context != previous:
        click.echo(f'Switched to context "{name}"' + (" (there was no current context)." if previous is None
                                                       and not use else "."))
    elif previous != name:
        click.echo(f'Current context is still "{previous}"; switch with: cpnctl config use-context {name}')


@config_group.command("use-context")
@click.argument("name")
def use_context(name: str) -> None:
    """Switch the current context."""
    cfg = cfgmod.load()
    if cfg.find(name) is None:
        raise click.ClickException(f"no context named {name!r}")
    cfg.current_context = name
    cfgmod.save(cfg)
    click.echo(f'Switched to context "{name}".')


@config_group.command("get-contexts")
def get_contexts() -> None:
    """List contexts; the current one is marked with *."""
    cfg = cfgmod.load()
    rows = [["*" if c.name == cfg.current_context else "", c.name, c.server] for c in cfg.contexts]
    click.echo(format_rows(["CURRENT", "NAME", "SERVER"], rows))


@config_group.command("current-context")
def current_context() -> None:
    """Print the current context's name."""
    cfg = cfgmod.load()
    if not cfg.current_context:
        raise click.ClickException("current-context is not set")
    click.echo(cfg.current_context)


@config_group.command("delete-context")
@click.argument("name")
def delete_context(name: str) -> None:
    """Remove a context."""
    cfg = cfgmod.load()
    if cfg.find(name) is None:
        raise click.ClickException(f"no context named {name!r}")
    cfg.contexts = [c for c in cfg.contexts if c.name != name]
    if cfg.current_context == name:
        cfg.current_context = None
    cfgmod.save(cfg)
    click.echo(f'Deleted context "{name}".')
