"""Resource-layer routes beyond CRUD: cluster heartbeats."""

from __future__ import annotations

from aiohttp import web
from sqlalchemy.ext.asyncio import AsyncSession

from cpn.api import state
from cpn.api.bodies import json_response, read_model
from cpn.api.middleware import principal_of
from cpn.api.openapi import RouteDoc
from cpn.api.routes import add
from cpn.core.store import WRITE_ATTEMPTS
from layers.resource import capacity
from layers.resource.schemas import ClusterManifest, HeartbeatBatch, HeartbeatBatchResult, HeartbeatRequest


async def heartbeat(request: web.Request) -> web.Response:
    body = await read_model(request, HeartbeatRequest)
    kind = request.app[state.KINDS].by_kind("Cluster")
    assert kind is not None
    principal = principal_of(request)

    async def record(s: AsyncSession) -> dict:
        row = await capacity.heartbeat(s, principal, request.match_info["name"], body, kind.store.heartbeat_timeout)
        return kind.store.to_manifest(principal, row)

    # a heartbeat names no resourceVersion: a concurrent writer's version bump is retried here, not a 409
    return json_response(await request.app[state.DB].transact(record, attempts=WRITE_ATTEMPTS))


async def heartbeats(request: web.Request) -> web.Response:
    body = await read_model(request, HeartbeatBatch)
    kind = request.app[state.KINDS].by_kind("Cluster")
    assert kind is not None
    async with request.app[state.DB].session() as s:
        rows = await capacity.heartbeats(s, principal_of(request), body, kind.store.heartbeat_timeout)
        out = HeartbeatBatchResult(accepted=len(body.items),
                                   resource_versions={r.name: str(r.resource_version) for r in rows})
    return json_response(out.wire())


def setup(app: web.Application) -> None:
    add(app, heartbeat, RouteDoc("POST", "/api/v1/clusters/{name}/heartbeat", "Report live capacity", "Cluster",
                                 request=HeartbeatRequest, response=ClusterManifest, params=("name",)))
    add(app, heartbeats, RouteDoc("POST", "/api/v1/heartbeats", "Report many clusters' live capacity at once",
                                  "Cluster", request=HeartbeatBatch, response=HeartbeatBatchResult))
