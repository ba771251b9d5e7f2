"""Health, Prometheus metrics, OpenAPI, kind discovery, identity and audit."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

import cpn
from cpn.api import state
from cpn.api.bodies import json_response
from cpn.api.metrics import REGISTRY
from cpn.api.middleware import principal_of
from cpn.api.openapi import RouteDoc, build
from cpn.api.routes import add
from layers.orchestration.identity import audit

REFRESH = web.AppKey("metrics_refresh", object)


class WhoAmI(BaseModel):
    name: str
    role: str
    accountId: str


async def healthz(request: web.Request) -> web.Response:
    await request.app[state.DB].ping()
    return json_response({"status": "ok", "version": cpn.__version__, "reconciler": _reconciler_role(request.app)})


def _reconciler_role(app: web.Application) -> str:
    """leader (runs the reconciler), standby (another replica does) or off (`CPN_RECONCILE=false`)."""
    from cpn.api.routes.lifecycle import RECONCILER

    reconciler = app.get(RECONCILER)
    if reconciler is None or not app[state.SETTINGS].reconcile:
        return "off"
    return "leader" if reconciler.leadership.is_leader else "standby"


async def metrics(request: web.Request) -> web.Response:
    hook = request.app.get(REFRESH)
    if hook is not None:
        await hook(request.app)
    body = generate_latest(request.app[REGISTRY])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def openapi(request: web.Request) -> web.Response:
    return json_response(build(request.app[state.DOCS]))


async def kinds(request: web.Request) -> web.Response:
    return json_response({"apiVersion": "cpn/v1", "kind": "KindList",
                          "items": [k.wire() for k in request.app[state.KINDS].all()]})


async def whoami(request: web.Request) -> web.Response:
    p = principal_of(request)
    return json_response({"name": p.name, "role": p.role.value, "accountId": p.account_id})


async def audit_log(request: web.Request) -> web.Response:
    async with request.app[state.DB].session() as s:
        rows = await audit.recent(s, principal_of(request), limit=min(int(request.query.get("limit", "100")), 1000))
    items = [{"at": r.at.isoformat(), "account": r.account_name, "method": r.method, "path": r.path,
              "status": r.status, "result": r.result, "requestId": r.request_id} for r in rows]
    return json_response({"apiVersion": "cpn/v1", "kind": "List", "items": items})




def setup(app: web.Application) -> None:
    add(app, healthz, RouteDoc("GET", "/healthz", "Liveness and database reachability", "system", auth=False))
    add(app, metrics, RouteDoc("GET", "/metrics", "Prometheus metrics", "system", auth=False))
    add(app, openapi, RouteDoc("GET", "/api/v1/openapi.json", "This OpenAPI document", "system", auth=False))
    add(app, kinds, RouteDoc("GET", "/api/v1/kinds", "Kind discovery for clients", "system", auth=False))
    add(app, whoami, RouteDoc("GET", "/api/v1/whoami", "The calling account", "system", response=WhoAmI))
    add(app, audit_log, RouteDoc("GET", "/api/v1/audit", "Audit records (own; admin: all)", "system",
                                 query=("limit",)))
