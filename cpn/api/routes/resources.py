"""Generic CRUD routes for every registered kind, plus the all-or-nothing `apply` batch."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from pydantic import BaseModel, Field

from cpn.api import state
from cpn.api.bodies import json_response, read_raw
from cpn.api.middleware import AUDIT, principal_of
from cpn.api.openapi import RouteDoc
from cpn.api.routes import add
from cpn.core import errors
from cpn.core.kinds import Kind
from cpn.core.manifest import list_manifest
from cpn.core.store import WRITE_ATTEMPTS


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


def _dry_run(request: web.Request) -> bool:
    """`?dryRun=true` (or kubectl's `All`): check and price, create nothing."""
    raw = request.query.get("dryRun")
    if raw is None or raw.lower() in ("false", "0", ""):
        return False
    if raw.lower() in ("true", "1", "all"):
        return True
    raise errors.InvalidInput("dryRun must be true or false", field="dryRun")


def _same_kind(kind: Kind, body: Any) -> Any:
    """`kind: trainingjob` (or the plural or a short name) on the kind's own path means that kind."""
    if isinstance(body, dict) and isinstance(body.get("kind"), str) and body["kind"].lower() in kind.names():
        return {**body, "kind": kind.kind}
    return body


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
        body = _same_kind(kind, await read_raw(request))
        submit = getattr(store, "submit", None)
        async with request.app[state.DB].session() as s:
            if _dry_run(request):
                return json_response(await _preview(store, s, principal_of(request), body))
            if submit is not None:  # kinds with a workflow behind creation (jobs: plan and quote)
                out, created = await submit(s, principal_of(request), body, request.headers.get("Idempotency-Key"),
                                            audit=request.get(AUDIT))
                return json_response(out, status=201 if created else 200)
            out = await store.create(s, principal_of(request), body)
        return json_response(out, status=201)

    async def get(request: web.Request) -> web.Response:
        async with request.app[state.DB].session() as s:
            out = await store.get(s, principal_of(request), request.match_info["name"])
        return json_response(out)

    async def replace(request: web.Request) -> web.Response:
        body = _same_kind(kind, await read_raw(request))
        async with request.app[state.DB].session() as s:
            out = await store.replace(s, principal_of(request), request.match_info["name"], body)
        return json_response(out)

    async def patch(request: web.Request) -> web.Response:
        body = await read_raw(request)

        async def merge(s: Any) -> dict[str, Any]:
            return await store.patch(s, principal_of(request), request.match_info["name"], body)

        # a patch naming no resourceVersion is merged again onto a concurrent writer's result, not answered 409
        return json_response(await request.app[state.DB].transact(merge, attempts=WRITE_ATTEMPTS))

    async def delete(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        async with request.app[state.DB].session() as s:
            await store.delete(s, principal_of(request), name)
        return json_response({"kind": "Status", "status": "Success", "details": {"kind": kind.kind, "name": name}})

    return {"list": list_, "create": create, "get": get, "update": replace, "patch": patch, "delete": delete}


async def _preview(store: Any, session: Any, principal: Any, body: Any) -> dict[str, Any]:
    preview = getattr(store, "preview", None)
    if preview is None:
        raise errors.InvalidInput(f"dryRun is offered for TrainingJob only, not {store.kind}", field="dryRun")
    return await preview(session, principal, body)


def register_kind(app: web.Application, kind: Kind) -> None:
    handlers = _handlers(kind)
    coll, item = kind.path, f"{kind.path}/{{name}}"
    model = kind.manifest
    specs = {
        "list": ("GET", coll, f"List {kind.plural}", None, True, (),
                 ("labelSelector", "limit", "continue", *(("namespace",) if getattr(kind.store, "namespaced", False) else ()))),
        "create": ("POST", coll, f"Create a {kind.kind}", model, False, (),
                   ("dryRun",) if hasattr(kind.store, "preview") else ()),
        "get": ("GET", item, f"Read a {kind.kind}", None, False, ("name",), ()),
        "update": ("PUT", item, f"Replace a {kind.kind}", model, False, ("name",), ()),
        "patch": ("PATCH", item, f"Merge-patch a {kind.kind}", None, False, ("name",), ()),
        "delete": ("DELETE", item, f"Delete a {kind.kind}", None, False, ("name",), ()),
    }
    for verb in kind.verbs:
        method, path, summary, req, is_list, params, query = specs[verb]
        add(app, handlers[verb], RouteDoc(method, path, summary, kind.kind, request=req, response=model,
                                          list_response=is_list, params=params, query=query,
                                          created=verb == "create"))


async def apply(request: web.Request) -> web.Response:
    """Create-or-replace many manifests in one transaction: all land or none do."""
    body = await read_raw(request)
    docs = body.get("items") if isinstance(body, dict) else None
    if not isinstance(docs, list) or not docs:
        raise errors.InvalidInput("items must be a non-empty list of manifests", field="items")
    registry = request.app[state.KINDS]
    plan: list[tuple[int, Kind, dict[str, Any]]] = []
    for i, doc in enumerate(docs):
        kind = _manifest_kind(registry, doc, f"items[{i}]")
        plan.append((i, kind, {**doc, "kind": kind.kind}))
    plan.sort(key=lambda p: (p[1].order, p[0]))
    results: list[dict[str, Any]] = []
    principal = principal_of(request)
    dry = _dry_run(request)
    async with request.app[state.DB].session() as s:
        for i, kind, doc in plan:
            try:
                action, out = await _apply_one(kind.store, s, principal, doc, dry)
            except errors.CPNError as exc:
                exc.message = f"items[{i}] ({kind.kind}): {exc.message}"
                exc.field = f"items[{i}].{exc.field}" if exc.field else f"items[{i}]"
                raise
            results.append({"index": i, "kind": kind.kind, "name": out["metadata"]["name"], "action": action,
                            **({"dryRun": True, "quotes": out["status"].get("quotes")} if dry else {})})
        if dry:
            await s.rollback()
    results.sort(key=lambda r: r["index"])
    return json_response({"items": results})


async def _apply_one(store: Any, session: Any, principal: Any, doc: dict[str, Any], dry: bool
                     ) -> tuple[str, dict[str, Any]]:
    """One manifest of a batch; in a dry run kinds that price (jobs) preview instead of storing, the
    others are applied and rolled back with the batch."""
    if dry and hasattr(store, "preview"):
        out = await store.preview(session, principal, doc)
        return ("configured" if out["status"].get("draft") else "created"), out
    action, out = await store.apply(session, principal, doc)
    return action, {**out, "status": out.get("status") or {}}


def _manifest_kind(registry: Any, doc: Any, where: str) -> Kind:
    """A manifest's kind as the CLI takes it: any case, singular, plural or short (`trainingjob`,
    `trainingjobs`, `tj`); an unknown or read-only kind is refused with the valid ones listed."""
    if not isinstance(doc, dict):
        raise errors.InvalidInput(f"{where}: a manifest must be a mapping with apiVersion, kind, metadata, spec",
                                  field=where)
    name = doc.get("kind")
    kind = registry.resolve(name) if isinstance(name, str) else None
    if kind is None or "create" not in kind.verbs or not kind.generic_routes:
        writable = [k for k in registry.all() if "create" in k.verbs and k.generic_routes]
        valid = ", ".join(sorted(k.kind for k in writable))
        why = "missing" if name is None else f"{name!r} is not a kind you can apply"
        raise errors.InvalidInput(f"{where}.kind: {why}; valid kinds: {valid} (any case, singular, plural or "
                                  "short names such as cluster, clusters, cl)", field=f"{where}.kind")
    return kind


def setup(app: web.Application) -> None:
    for kind in app[state.KINDS].all():
        if kind.generic_routes:
            register_kind(app, kind)
    add(app, apply, RouteDoc("POST", "/api/v1/apply", "Apply many manifests at once (all or nothing)",
                             "apply", request=ApplyRequest, response=ApplyResult, query=("dryRun",)))
