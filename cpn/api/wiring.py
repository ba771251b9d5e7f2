"""Which kinds and routes the server offers: the one place that joins the layers to the face."""

from __future__ import annotations

from aiohttp import web

from cpn.core.kinds import KindRegistry
from layers.orchestration.identity import kinds as identity_kinds


def build_registry() -> KindRegistry:
    registry = KindRegistry()
    registry.register(identity_kinds.kind())
    return registry


def setup_layer_routes(app: web.Application) -> None:
    """Routes beyond generic CRUD (heartbeats, quotes, accept, metrics …)."""
