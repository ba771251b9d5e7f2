"""OpenAPI 3.1 generated from the pydantic schemas of the registered routes."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

import cpn
from cpn.core import errors, selector
from layers.orchestration.lifecycle import agents, checkpoints, metric_series


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
    created: bool = False  # POST that creates: 201 (200 when an Idempotency-Key replays it)
    later: bool = False  # a job's output that exists only once it has run (a checkpoint, the final weights):
    # no create links to it (its 404 right after the create is right, not a created object gone missing)


PATH: dict[str, dict[str, Any]] = {"name": {"type": "string", "minLength": 1, "maxLength": 253,
                                            "pattern": "^[^\\x00/]+$"},
                                   "uid": {"type": "string", "minLength": 1, "maxLength": 64,
                                           "pattern": "^[^\\x00/]+$"},
                                   "sha256": {"type": "string", "pattern": "^(sha256:)?[0-9a-f]{64}$"},
                                   # a checkpoint file's name (the server refuses any other, 422)
                                   "step": {"type": "string", "pattern": f"^{checkpoints.STEP_PATTERN}$"},
                                   "file": {"type": "string", "pattern": f"^(?:{checkpoints.FILE_PATTERN})$"}}


ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["code", "message"], "properties": {
        "code": {"type": "string"}, "message": {"type": "string"},
        "field": {"type": ["string", "null"]},
        "details": {"description": "A validation error: every bad field as {field, message}; other errors: "
                                   "a mapping of specifics.",
                    "anyOf": [{"type": "object"},
                              {"type": "array", "items": {"type": "object", "required": ["field", "message"],
                                                          "properties": {"field": {"type": "string"},
                                                                         "message": {"type": "string"}}}}]}}}},
}

# Query parameters by name: the published schema is the check the server makes (validate_query), so the
# document and the server cannot disagree. A parameter not listed here is a free string without NUL.
NAME_PATTERN = r"^[a-z0-9]([-a-z0-9.]{0,61}[a-z0-9])?$"
_NAME = {"type": "string", "pattern": NAME_PATTERN, "maxLength": 63}
JOB_REF_PATTERN = r"^(?:[a-z0-9](?:[-a-z0-9.]{0,61}[a-z0-9])?/)?[a-z0-9]([-a-z0-9.]{0,61}[a-z0-9])?$"
_FLAG = {"type": "string", "enum": ["true", "false", "1", "0"]}
QUERY: dict[str, dict[str, Any]] = {
    "limit": {"type": "integer", "minimum": 1, "maximum": 100_000,
              "description": "At most this many items; `continue` from the response fetches the next page."},
    "continue": {"type": "string", "pattern": r"^[A-Za-z0-9_-]*={0,2}$", "maxLength": 256,
                 "description": "The `metadata.continue` of the previous page (opaque)."},
    "labelSelector": {"type": "string", "pattern": selector.SELECTOR_PATTERN, "maxLength": selector.MAX_LENGTH,
                      "description": "Kubernetes label selector: a=b, a!=b, a in (x,y), a notin (x), a, !a"},
    "dryRun": {"type": "string", "pattern": "^(?:[tT][rR][uU][eE]|[fF][aA][lL][sS][eE]|[aA][lL][lL]|1|0|)$",
               "description": "true (or All): check and price, create nothing"},
    "job": {"type": "string", "pattern": JOB_REF_PATTERN, "maxLength": 127,
            "description": "Only this job's items: NAME (yours) or NAMESPACE/NAME"},
    "namespace": {**_NAME, "description": "Only this account's jobs (admins; a user has only their own)"},
    "cluster": {**_NAME, "description": "Only this cluster's items"},
    "site": {**_NAME, "description": "Only this site's items"},
    "watch": {**_FLAG, "description": "Long-poll until the cluster's sub-tasks change (needs cluster)"},
    "active": _FLAG,
    "follow": {**_FLAG, "description": "Stream while the job runs"},
    "resourceVersion": {"type": "string", "pattern": r"^[A-Za-z0-9:._-]*$", "maxLength": 128},
    "timeoutSeconds": {"type": "integer", "minimum": 0, "maximum": 30},
    "rank": {"type": "integer", "minimum": 0, "maximum": agents.MAX_RANK},
    "attempt": {"type": "integer", "minimum": 1, "maximum": 10**9},
    "tail": {"type": "integer", "minimum": 0, "maximum": 100_000},
    "maxPoints": {"type": "integer", "minimum": metric_series.MIN_POINTS, "maximum": metric_series.MAX_POINTS,
                  "description": "Downsample the run to about this many points"},
    "sinceAttempt": {"type": "integer", "minimum": 0, "maximum": 10**9,
                     "description": "Cursor: the attempt of the last report already held"},
    "sinceStep": {"type": "integer", "minimum": -1, "maximum": 2**63 - 1,
                  "description": "Cursor: the step of the last report already held (-1: none)"},
    "maxReports": {"type": "integer", "minimum": 0, "maximum": metric_series.PAGE_ROWS,
                   "description": "At most this many raw reports after the cursor"},
}
FREE_TEXT = {"type": "string", "pattern": "^[^\\x00]*$", "maxLength": 512}
NO_NUL = "^[^\\x00]*$"
# Any JSON value without a NUL character in a key or a string: what a free-form object may hold
JSON_VALUE = {"anyOf": [{"type": "string", "pattern": NO_NUL}, {"type": ["number", "boolean", "null"]},
                        {"type": "array", "items": {"$ref": "#/components/schemas/JsonValue"}},
                        {"type": "object", "propertyNames": {"pattern": NO_NUL},
                         "additionalProperties": {"$ref": "#/components/schemas/JsonValue"}}]}
STATUS_SCHEMA = {"type": "object", "required": ["kind", "status"], "properties": {
    "kind": {"const": "Status"}, "status": {"type": "string"}, "details": {"type": "object"}}}


def _no_nul(node: Any, request_side: bool = True) -> Any:
    """Every string the server stores refuses NUL (PostgreSQL cannot hold it); say so in the schema:
    free strings get a no-NUL pattern, free-form objects no-NUL keys and values."""
    if isinstance(node, list):
        return [_no_nul(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: (_no_nul(v) if k not in ("enum", "const", "default", "examples", "required") else v)
           for k, v in node.items()}
    if out.get("type") == "string" and "pattern" not in out and "enum" not in out and "const" not in out \
            and out.get("format") != "date-time":
        out["pattern"] = NO_NUL
    if out.get("type") == "object" and "properties" not in out:
        out.setdefault("propertyNames", {"pattern": NO_NUL})
        if out.get("additionalProperties", True) is True:
            out["additionalProperties"] = {"$ref": "#/components/schemas/JsonValue"}
    if out.get("type") == "array" and out.get("items", True) in (True, {}):
        out["items"] = {"$ref": "#/components/schemas/JsonValue"}
    return out


def query_schema(name: str) -> dict[str, Any]:
    return QUERY.get(name, FREE_TEXT)


def _refuse(name: str, schema: dict[str, Any], raw: str) -> errors.InvalidInput:
    shown = raw if len(raw) <= 40 else raw[:37] + "..."
    if schema.get("type") == "integer":
        what = f"a whole number from {schema['minimum']} to {schema['maximum']}"
    elif "enum" in schema:
        what = "one of " + ", ".join(schema["enum"])
    elif schema.get("pattern") == NAME_PATTERN:
        what = "a name: 1-63 lowercase letters, digits, '-' or '.', starting and ending with a letter or digit"
    elif name == "dryRun":
        what = "true or false"
    else:
        what = f"text of at most {schema.get('maxLength')} characters matching {schema.get('pattern')}"
    return errors.InvalidInput(f"query parameter {name} must be {what}, got {shown!r}", field=name)


def validate_query(doc: RouteDoc, query: Any) -> None:
    """Refuse a declared query parameter that breaks its published schema (422 naming it)."""
    for name in doc.query:
        for raw in query.getall(name, []):
            schema = query_schema(name)
            if schema is QUERY["labelSelector"]:
                selector.parse_selector(raw)  # linear, and says what is wrong; never the backtracking pattern
                continue
            if schema.get("type") == "integer":
                ok = bool(re.fullmatch(r"-?[0-9]{1,19}", raw)) and schema["minimum"] <= int(raw) <= schema["maximum"]
            else:
                ok = (len(raw) <= schema.get("maxLength", 1 << 30)
                      and ("enum" not in schema or raw in schema["enum"])
                      and ("pattern" not in schema or re.search(schema["pattern"], raw) is not None))
            if not ok:
                raise _refuse(name, schema, raw)


def build(docs: list[RouteDoc]) -> dict[str, Any]:
    models = {m for d in docs for m in (d.request, d.response) if m is not None}
    pairs = [(m, "validation") for m in sorted(models, key=lambda m: m.__name__)]
    _, defs = models_json_schema(pairs, by_alias=True, ref_template="#/components/schemas/{model}")
    schemas = {name: _no_nul(schema) for name, schema in defs.get("$defs", {}).items()}
    schemas["Error"] = ERROR_SCHEMA
    schemas["JsonValue"] = JSON_VALUE
    schemas["Status"] = STATUS_SCHEMA
    paths: dict[str, Any] = {}
    for doc in docs:
        paths.setdefault(doc.path, {})[doc.method.lower()] = _operation(doc, _links(doc, docs))
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


def _operation_id(doc: RouteDoc) -> str:
    return f"{doc.method.lower()}_{doc.path}".replace("/", "_").replace("{", "").replace("}", "").replace("-", "_")


def _links(doc: RouteDoc, docs: list[RouteDoc]) -> dict[str, Any]:
    """From a create to every operation on the created object (read, replace, patch, delete, and the
    kind's own: quotes, accept, cancel …), so a client (and a stateful fuzzer) can chain them; not to what
    exists only later (RouteDoc.later)."""
    if not doc.created:
        return {}
    item = f"{doc.path}/{{name}}"
    return {f"{d.method.title()}{d.path[len(item):].replace('/', '_') or '_item'}": {
                "operationId": _operation_id(d), "parameters": {"name": "$response.body#/metadata/name"}}
            for d in docs if (d.path == item or d.path.startswith(item + "/")) and d.params == ("name",)
            and not d.later}


def _operation(doc: RouteDoc, links: dict[str, Any]) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": doc.summary, "tags": [doc.tag], "operationId": _operation_id(doc)}
    params = [{"name": p, "in": "path", "required": True, "schema": dict(PATH.get(p, FREE_TEXT))} for p in doc.params]
    params += [{"name": q, "in": "query", "required": False, "schema": {k: v for k, v in query_schema(q).items()
                                                                         if k != "description"},
                **({"description": query_schema(q)["description"]} if "description" in query_schema(q) else {})}
               for q in doc.query]
    if params:
        op["parameters"] = params
    if doc.request is not None:
        op["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": _ref(doc.request)},
            "application/yaml": {"schema": _ref(doc.request)}}}
    elif doc.method == "PATCH":
        patch = {"type": "object", "description": "RFC 7386 JSON merge patch of the manifest",
                 "propertyNames": {"pattern": NO_NUL}, "additionalProperties": {"$ref": "#/components/schemas/JsonValue"}}
        op["requestBody"] = {"required": True, "content": {
            "application/merge-patch+json": {"schema": patch}, "application/json": {"schema": patch}}}
    elif doc.method == "PUT":  # a PUT without a model stores the bytes it is sent (bundle, checkpoint, weights)
        op["requestBody"] = {"required": True, "content": {
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}
    ok: dict[str, Any] = {"description": "OK"}
    if doc.method == "DELETE":
        ok["content"] = {"application/json": {"schema": {"$ref": "#/components/schemas/Status"}}}
    elif doc.response is not None:
        schema: dict[str, Any] = _ref(doc.response)
        if doc.list_response:
            schema = {"type": "object", "properties": {"apiVersion": {"type": "string"},
                      "kind": {"const": "List"}, "items": {"type": "array", "items": schema}}}
        ok["content"] = {"application/json": {"schema": schema}}
    err = {"description": "Error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    op["responses"] = {"200": ok, "4XX": err}
    if doc.created:  # the links only from 201: a 200 is a replay or a dry run (?dryRun=true), which created nothing
        op["responses"]["201"] = {**ok, "description": "Created", **({"links": links} if links else {})}
        op["responses"]["200"] = {**ok, "description": "An Idempotency-Key replay, or a dry run (nothing created)"}
    if doc.auth:
        op["security"] = [{"bearer": []}]
    return op
