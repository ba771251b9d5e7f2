"""Route modules: each adds its handlers and their OpenAPI docs to the application."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from cpn.api import state
from cpn.api.openapi import RouteDoc, validate_query

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def add(app: web.Application, handler: Handler, doc: RouteDoc) -> None:
    """Register a handler and document it in the OpenAPI spec in one step."""
    aio_path = doc.path
    if doc.query:  # the published query schema is enforced before the handler runs
        handler = _checked(handler, doc)
    app.router.add_route(doc.method, aio_path, handler)
    app[state.DOCS].append(doc)


def _checked(handler: Handler, doc: RouteDoc) -> Handler:
    async def checked(request: web.Request) -> web.StreamResponse:
        validate_query(doc, request.query)
        return await handler(request)

    checked.__name__ = checked.__qualname__ = getattr(handler, "__name__", "handler")
    return checked
