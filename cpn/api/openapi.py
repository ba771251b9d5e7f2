"""OpenAPI 3.1 generated from the pydantic schemas of the registered routes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

import cpn


@dataclass(frozen=True)
class RouteDoc:
    method: str
    path: str
    summary: str
    tag: str
    request: type[BaseModel] | None = None
    response: type[BaseModel] | None = None
    list_response: bool = False
    params: tuple[str, ...] = ()
    query: tuple[str, ...] = field(default_factory=tuple)
    auth: bool = True


ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["code", "message"], "properties": {
        "code": {"type": "string"}, "message": {"type": "string"},
        "field": {"type": ["string", "null"]}, "details": {"type": "object"}}}},
}


def build(docs: list[RouteDoc]) -> dict[str, Any]:
    models = {m for d in docs for m in (d.request, d.response) if m is not None}
    pairs = [(m, "validation") for m in sorted(models, key=lambda m: m.__name__)]
    _, defs = models_json_schema(pairs, by_alias=True, ref_template="#/components/schemas/{model}")
    schemas = dict(defs.get("$defs", {}))
    schemas["Error"] = ERROR_SCHEMA
    paths: dict[str, Any] = {}
    for doc in docs:
        paths.setdefault(doc.path, {})[doc.method.lower()] = _operation(doc)
    return {
        "openapi": "3.1.0",
        "info": {"title": "CPN API", "version": cpn.__version__,
                 "description": "Cross-datacenter compute-network orchestrator"},
        "paths": paths,
        "components": {"schemas": schemas, "securitySchemes": {
            "bearer": {"type": "http", "scheme": "bearer"}}},
    }


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _operation(doc: RouteDoc) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": doc.summary, "tags": [doc.tag],
                          "operationId": f"{doc.method.lower()}_{doc.path}".replace("/", "_").replace("{", "")
                          .replace("}", "").replace("-", "_")}
    params = [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}} for p in doc.params]
    params += [{"name": q, "in": "query", "required": False, "schema": {"type": "string"}} for q in doc.query]
    if params:
        op["parameters"] = params
    if doc.request is not None:
        op["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": _ref(doc.request)},
            "application/yaml": {"schema": _ref(doc.request)}}}
    ok: dict[str, Any] = {"description": "OK"}
    if doc.response is not None:
        schema: dict[str, Any] = _ref(doc.response)
        if doc.list_response:
            schema = {"type": "object", "properties": {"apiVersion": {"type": "string"},
                      "kind": {"const": "List"}, "items": {"type": "array", "items": schema}}}
        ok["content"] = {"application/json": {"schema": schema}}
    err = {"description": "Error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    op["responses"] = {"200": ok, "4XX": err}
    if doc.auth:
        op["security"] = [{"bearer": []}]
    return op
