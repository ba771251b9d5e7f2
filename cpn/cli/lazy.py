"""A click group whose subcommands are imported only when used (keeps `cpn --help` fast
and lets torch-heavy commands live in the runtime)."""

from __future__ import annotations

import importlib

import click


class LazyGroup(click.Group):
    def __init__(self, *args, lazy: dict[str, str] | None = None, **kwargs):  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self.lazy))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy:
            module, _, attr = self.lazy[cmd_name].partition(":")
            try:
                return getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError) as exc:
                raise click.ClickException(f"command {cmd_name!r} is unavailable: {exc}") from exc
        return super().get_command(ctx, cmd_name)
