"""Prometheus metrics of the API server (one registry per application)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram

REGISTRY = web.AppKey("prom_registry", CollectorRegistry)
REQUESTS = web.AppKey("prom_requests", Counter)
LATENCY = web.AppKey("prom_latency", Histogram)


def install(app: web.Application) -> None:
    registry = CollectorRegistry()
    app[REGISTRY] = registry
    app[REQUESTS] = Counter("cpn_http_requests_total", "HTTP requests", ["method", "route", "status"],
                            registry=registry)
    app[LATENCY] = Histogram("cpn_http_request_seconds", "HTTP request latency", ["method", "route"],
                             registry=registry)


@web.middleware
async def metrics_middleware(request: web.Request,
                             handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    start = time.perf_counter()
    response = await handler(request)
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "unmatched"
    request.app[LATENCY].labels(request.method, route).observe(time.perf_counter() - start)
    request.app[REQUESTS].labels(request.method, route, str(response.status)).inc()
    return response
