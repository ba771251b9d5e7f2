"""Health, Prometheus metrics, OpenAPI, kind discovery, identity and audit."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest, multiprocess
from pydantic import BaseModel

import cpn
from cpn.api import state
from cpn.api.bodies import json_response
from cpn.api.metrics import REGISTRY
from cpn.api.middleware import principal_of
from cpn.api.openapi import RouteDoc, build
from cpn.api.routes import add
from cpn.api.workers import shared_metrics
from cpn.core import errors
from cpn.core.principal import Role
from layers.orchestration.identity import audit, tokens

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
    """The request counters (every worker's, when ``cpn serve`` runs several) and the gauges read from
    the database for this scrape."""
    if not request.app[state.SETTINGS].metrics_public:  # issue 35, L1: it names clusters and counts jobs
        who = await tokens.authenticate_request(request.app[state.DB], request.headers.get("Authorization"))
        if who.role is not Role.ADMIN:
            raise errors.Forbidden("/metrics needs an admin token (Prometheus: authorization credentials), or "
                                   "CPN_METRICS_PUBLIC=true on the server")
    hook = request.app.get(REFRESH)
    families = await hook(request.app) if hook is not None else []
    counters: Any = multiprocess.MultiProcessCollector(None) if shared_metrics() else request.app[REGISTRY]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Scrape(counters, families))
    return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


class _Scrape:
    """One scrape's metrics: a source's (a registry or the multiprocess files) plus fixed families."""

    def __init__(self, source: Any, families: list[Any]):
        self.source, self.families = source, families

    def collect(self) -> Iterator[Any]:
        yield from self.source.collect()
        yield from self.families


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
    add(app, metrics, RouteDoc("GET", "/metrics", "Prometheus metrics (an admin token unless CPN_METRICS_PUBLIC)", "system"))
    add(app, openapi, RouteDoc("GET", "/api/v1/openapi.json", "This OpenAPI document", "system", auth=False))
    add(app, kinds, RouteDoc("GET", "/api/v1/kinds", "Kind discovery for clients", "system", auth=False))
    add(app, whoami, RouteDoc("GET", "/api/v1/whoami", "The calling account", "system", response=WhoAmI))
    add(app, audit_log, RouteDoc("GET", "/api/v1/audit", "Audit records (own; admin: all)", "system",
                                 query=("limit",)))
