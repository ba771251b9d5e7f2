"""Per-invocation state: where to connect, the client, and the kind discovery."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import click

from cpn.cli.ctl import config
from cpn.client import ApiError, Client


@dataclass
class Ctx:
    server: str | None
    token: str | None
    context: str | None
    namespace: str | None = None
    _client: Client | None = None
    _kinds: list[dict[str, Any]] | None = field(default=None)

    @property
    def client(self) -> Client:
        if self._client is None:
            target = config.resolve(self.server, self.token, self.context)
            self._client = Client(target.server or "", target.token)
        return self._client

    def new_client(self) -> Client:
        """A second client to the same server, for a thread of its own (`run --follow` polls progress while
        the main thread streams logs); the caller closes it."""
        target = config.resolve(self.server, self.token, self.context)
        return Client(target.server or "", target.token)

    def qualified(self, name: str | None) -> str | None:
        """A job's name as the server reads it: NAMESPACE/NAME under -n, else as given."""
        if not name or not self.namespace or "/" in name:
            return name
        return f"{self.namespace}/{name}"

    def ref(self, name: str) -> str:
        """`name` as one URL path segment ("alice/lm" → "alice%2Flm")."""
        return quote(self.qualified(name) or "", safe="")

    def kinds(self) -> list[dict[str, Any]]:
        if self._kinds is None:
            self._kinds = self.client.get("/api/v1/kinds")["items"]
        return self._kinds

    def kind(self, name: str) -> dict[str, Any]:
        lowered = name.lower()
        for kind in self.kinds():
            if lowered in {kind["kind"].lower(), kind["singular"], kind["plural"], *kind["shortNames"]}:
                return kind
        known = ", ".join(sorted(k["plural"] for k in self.kinds()))
        raise ApiError(0, "unknown_kind", f'the server doesn\'t have a resource type "{name}" (known: {known})')


pass_ctx = click.make_pass_decorator(Ctx)
