"""Middlewares: request ids, errors → HTTP (the one place), authentication, rate limits, audit."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable

from aiohttp import web

from cpn.api import state
from cpn.api.bodies import json_response
from cpn.core import errors
from cpn.core.principal import Principal, Role
from layers.orchestration.identity import audit, tokens
from layers.orchestration.identity.ratelimit import RateLimiter

log = logging.getLogger("cpn.api")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
PUBLIC_PREFIXES = ("/healthz", "/metrics", "/api/v1/openapi.json", "/api/v1/kinds", "/ui", "/favicon")
MUTATING = {"POST", "PUT", "PATCH", "DELETE"}
PRINCIPAL = "principal"
AUDIT = "audit"  # the request's audit.Pending (mutating requests of a principal)


def principal_of(request: web.Request) -> Principal:
    return request[PRINCIPAL]


def _public(request: web.Request) -> bool:
    return request.path == "/" or request.path.startswith(PUBLIC_PREFIXES)


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    request["request_id"] = request.headers.get("X-Request-Id") or str(uuid.uuid4())
    try:
        _refuse_nul(request)
        response = await handler(request)
    except errors.CPNError as exc:
        response = _error_response(exc)
    except web.HTTPRequestEntityTooLarge:
        exc2 = errors.PayloadTooLarge(f"request body is larger than {request.app._client_max_size} bytes")
        response = json_response(exc2.to_body(), status=413)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status, "http_error")
        message = exc.reason
        if exc.status == 404 and isinstance(exc, web.HTTPNotFound) and exc.reason == "Not Found":  # no route
            message = (f"no such path {request.path}: the API is under /api/v1 (a client's server address is the "
                       "server's root, e.g. http://HOST:8080)")
        response = json_response({"error": {"code": code, "message": message, "field": None}}, exc.status)
        if "Allow" in exc.headers:  # RFC 9110: a 405 says which methods the path takes
            response.headers["Allow"] = exc.headers["Allow"]
    except Exception as exc:  # noqa: BLE001 - the boundary: nothing unexpected reaches a user as a traceback
        down = errors.unavailable(exc)
        if down is not None:  # the database or the disk is down: 503 and when to retry, not "internal error"
            log.warning("%s %s: %s", request.method, request.path, down.message)
            response = _error_response(down)
        else:
            log.exception("unhandled error on %s %s", request.method, request.path)
            response = json_response({"error": {"code": "internal", "field": None,
                                                "message": f"internal error (request id {request['request_id']})"}},
                                     status=500)
    response.headers["X-Request-Id"] = request["request_id"]
    return response


def _error_response(exc: errors.CPNError) -> web.Response:
    response = json_response(exc.to_body(), status=exc.status)
    if isinstance(exc, errors.Unavailable):
        response.headers["Retry-After"] = str(exc.retry_after)
    return response


def _refuse_nul(request: web.Request) -> None:
    """A NUL byte is never part of a name or a value CPN keeps (and PostgreSQL refuses it in text):
    refuse it in the path or the query here, as bad input, before it reaches a handler or the database."""
    if "\x00" in request.path:
        raise errors.InvalidInput("the request path contains a NUL byte (%00)", field="path")
    for key, value in request.query.items():
        if "\x00" in key or "\x00" in value:
            name = key.replace("\x00", "")
            raise errors.InvalidInput(f"query parameter {name!r} contains a NUL byte (%00)", field=name or "query")


RATE = web.AppKey("rate", RateLimiter)  # ratelimit.limiter_for: shared on PostgreSQL


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    if _public(request):
        return await handler(request)
    header = request.headers.get("Authorization")
    # a token seen before: its check and its rate limit in one statement (PostgreSQL)
    principal, allowed = await tokens.authenticate_charged(request.app[state.DB], header, request.app[RATE])
    if principal.role is Role.WORKER and not _worker_may(request, principal.job or ""):
        raise errors.Forbidden("a worker token may only report metrics and checkpoints for its own job")
    if allowed is None:  # worker tokens too (issue 35, M2): one bucket per token, like every other
        allowed = await request.app[RATE].allow(principal.token_id or principal.account_id)
    if not allowed:
        raise errors.RateLimited("too many requests for this token; slow down and retry")
    request[PRINCIPAL] = principal
    return await handler(request)


def _worker_may(request: web.Request, job: str) -> bool:
    """Workers report metrics and read/write checkpoints of their own job; nothing else."""
    own = f"/api/v1/jobs/{job}/"
    return (request.path == f"{own}metrics" or request.path.startswith(f"{own}checkpoints/")
            or (request.path == f"{own}final" and request.method == "PUT")
            or (request.path.startswith("/api/v1/bundles/") and request.method == "GET"))  # its job's, checked there


@web.middleware
async def audit_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Record every mutating request with its outcome, in its own transaction — or in the handler's
    own one-statement write when it carried the row (audit.Pending)."""
    if request.method not in MUTATING or _public(request):
        return await handler(request)
    principal = request.get(PRINCIPAL)
    pending = request[AUDIT] = None if principal is None else audit.Pending(
        principal, request.method, request.path_qs, request.get("request_id"))
    status, result = 500, "internal"
    try:
        response = await handler(request)
        status, result = response.status, "ok"
        return response
    except errors.CPNError as exc:
        status, result = exc.status, exc.code
        raise
    finally:
        if pending is not None and pending.written != status:
            try:
                await audit.write(request.app[state.DB], principal, request.method, request.path_qs, status, result,
                                  request.get("request_id"))
            except Exception:  # noqa: BLE001 - auditing must not turn a success into a failure
                log.exception("could not write the audit record")
