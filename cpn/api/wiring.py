"""Which kinds and routes the server offers: the one place that joins the layers to the face."""

from __future__ import annotations

from datetime import timedelta

from aiohttp import web

from cpn.core.kinds import KindRegistry
from cpn.core.settings import Settings
from layers.control import leases
from layers.orchestration.identity import kinds as identity_kinds
from layers.orchestration.jobs import data as job_data
from layers.orchestration.jobs import kinds as job_kinds
from layers.orchestration.jobs.workflow import Timeouts
from layers.orchestration.quotas import kinds as quota_kinds
from layers.resource import bundles, datasets
from layers.resource import kinds as resource_kinds
from layers.resource.blobs import BlobStore


def build_registry(settings: Settings, blobs: BlobStore) -> KindRegistry:
    registry = KindRegistry()
    registry.register(identity_kinds.kind())
    resource_kinds.register(registry, timedelta(seconds=settings.heartbeat_timeout_seconds), leases.holders)
    datasets.register(registry, job_data.readers)
    quota_kinds.register(registry)
    job_kinds.register(registry, Timeouts.of(settings), lambda owner, digest: bundles.exists(blobs, owner, digest))
    return registry


def setup_layer_routes(app: web.Application) -> None:
    """Routes beyond generic CRUD (heartbeats, quotes, accept, metrics …)."""
    from cpn.api.routes import bundles, jobs, lifecycle, resource

    resource.setup(app)
    jobs.setup(app)
    lifecycle.setup(app)
    bundles.setup(app)
