"""Generic CRUD routes for every registered kind, plus the all-or-nothing `apply` batch."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from pydantic import BaseModel, Field

from cpn.api import state
from cpn.api.bodies import json_response, read_raw
from cpn.api.middleware import principal_of
from cpn.api.openapi import RouteDoc
from cpn.api.routes import add
from cpn.core import errors
from cpn.core.kinds import Kind
from cpn.core.manifest import list_manifest


class ApplyRequest(BaseModel):
    """A batch of manifests applied in one transaction (all or nothing)."""

    items: list[dict[str, Any]] = Field(description="Manifests; each needs apiVersion, kind, metadata.name")


class ApplyResult(BaseModel):
    items: list[dict[str, Any]]


def _limit(request: web.Request) -> int | None:
    raw = request.query.get("limit")
    if raw is None:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise errors.InvalidInput("limit must be a positive integer", field="limit")
    return int(raw)


def _handlers(kind: Kind) -> dict[str, Any]:
    store = kind.store

    async def list_(request: web.Request) -> web.Response:
        db = request.app[state.DB]
        filters = {k: v for k, v in request.query.items() if k not in ("labelSelector", "limit", "continue")}
        async with db.session() as s:
            items, cont = await store.list(s, principal_of(request), selector=request.query.get("labelSelector"),
                                           limit=_limit(request), continue_token=request.query.get("continue"),
                                           filters=filters)
        return json_response(list_manifest(items, cont))

    async def create(request: web.Request) -> web.Response:
        body = await read_raw(request)
        submit = getattr(store, "submit", None)
        async with request.app[state.DB].session() as s:
            if submit is not None:  # kinds with a workflow behind creation (jobs: plan and quote)
                out, created = await submit(s, principal_of(request), body, request.headers.get("Idempotency-Key"))
                return json_response(out, status=201 if created else 200)
            out = await store.create(s, principal_of(request), body)
        return json_response(out, status=201)

    async def get(request: web.Request) -> web.Response:
        async with request.app[state.DB].session() as s:
            out = await store.get(s, principal_of(request), request.match_info["name"])
        return json_response(out)

    async def replace(request: web.Request) -> web.Response:
        body = await read_raw(request)
        async with request.app[state.DB].session() as s:
            out = await store.replace(s, principal_of(request), request.match_info["name"], body)
        return json_response(out)

    async def patch(request: web.Request) -> web.Response:
        body = await read_raw(request)
        async with request.app[state.DB].session() as s:
            out = await store.patch(s, principal_of(request), request.match_info["name"], body)
        return json_response(out)

    async def delete(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        async with request.app[state.DB].session() as s:
            await store.delete(s, principal_of(request), name)
        return json_response({"kind": "Status", "status": "Success", "details": {"kind": kind.kind, "name": name}})

    return {"list": list_, "create": create, "get": get, "update": replace, "patch": patch, "delete": delete}


def register_kind(app: web.Application, kind: Kind) -> None:
    handlers = _handlers(kind)
    coll, item = kind.path, f"{kind.path}/{{name}}"
    model = kind.manifest
    specs = {
        "list": ("GET", coll, f"List {kind.plural}", None, True, (), ("labelSelector", "limit", "continue")),
        "create": ("POST", coll, f"Create a {kind.kind}", model, False, (), ()),
        "get": ("GET", item, f"Read a {kind.kind}", None, False, ("name",), ()),
        "update": ("PUT", item, f"Replace a {kind.kind}", model, False, ("name",), ()),
        "patch": ("PATCH", item, f"Merge-patch a {kind.kind}", None, False, ("name",), ()),
        "delete": ("DELETE", item, f"Delete a {kind.kind}", None, False, ("name",), ()),
    }
    for verb in kind.verbs:
        method, path, summary, req, is_list, params, query = specs[verb]
        add(app, handlers[verb], RouteDoc(method, path, summary, kind.kind, request=req, response=model,
                                          list_response=is_list, params=params, query=query))


async def apply(request: web.Request) -> web.Response:
    """Create-or-replace many manifests in one transaction: all land or none do."""
    body = await read_raw(request)
    docs = body.get("items") if isinstance(body, dict) else None
    if not isinstance(docs, list) or not docs:
        raise errors.InvalidInput("items must be a non-empty list of manifests", field="items")
    registry = request.app[state.KINDS]
    plan: list[tuple[int, Kind, dict[str, Any]]] = []
    for i, doc in enumerate(docs):
        kind_name = doc.get("kind") if isinstance(doc, dict) else None
        kind = registry.by_kind(kind_name) if isinstance(kind_name, str) else None
        if kind is None or "create" not in kind.verbs or not kind.generic_routes:
            raise errors.InvalidInput(f"items[{i}].kind: unknown or read-only kind {kind_name!r}",
                                      field=f"items[{i}].kind")
        plan.append((i, kind, doc))
    plan.sort(key=lambda p: (p[1].order, p[0]))
    results: list[dict[str, Any]] = []
    principal = principal_of(request)
    async with request.app[state.DB].session() as s:
        for i, kind, doc in plan:
            try:
                action, out = await kind.store.apply(s, principal, doc)
            except errors.CPNError as exc:
                exc.message = f"items[{i}] ({kind.kind}) {exc.message}"
                exc.field = f"items[{i}].{exc.field}" if exc.field else f"items[{i}]"
                raise
            results.append({"index": i, "kind": kind.kind, "name": out["metadata"]["name"], "action": action})
    results.sort(key=lambda r: r["index"])
    return json_response({"items": results})


def setup(app: web.Application) -> None:
    for kind in app[state.KINDS].all():
        if kind.generic_routes:
            register_kind(app, kind)
    add(app, apply, RouteDoc("POST", "/api/v1/apply", "Apply many manifests at once (all or nothing)",
                             "apply", request=ApplyRequest, response=ApplyResult))
