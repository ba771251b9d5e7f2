"""Route modules: each adds its handlers and their OpenAPI docs to the application."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from cpn.api import state
from cpn.api.openapi import RouteDoc

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def add(app: web.Application, handler: Handler, doc: RouteDoc) -> None:
    """Register a handler and document it in the OpenAPI spec in one step."""
    aio_path = doc.path
    app.router.add_route(doc.method, aio_path, handler)
    app[state.DOCS].append(doc)
