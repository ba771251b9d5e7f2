"""Request bodies: JSON or YAML, size-limited, converted to typed errors."""

from __future__ import annotations

import json
from typing import Any, TypeVar

import yaml
from aiohttp import web
from pydantic import BaseModel, ValidationError

from cpn.core import errors

M = TypeVar("M", bound=BaseModel)


async def read_raw(request: web.Request) -> Any:
    try:
        text = await request.text()
    except web.HTTPRequestEntityTooLarge as exc:
        raise errors.PayloadTooLarge(f"request body is larger than {request.app._client_max_size} bytes") from exc
    except UnicodeDecodeError as exc:
        raise errors.MalformedBody("request body is not UTF-8 text") from exc
    if not text.strip():
        raise errors.MalformedBody("request body is empty; send a JSON object")
    if "yaml" in (request.content_type or ""):
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise errors.MalformedBody(f"malformed YAML: {str(exc).splitlines()[0]}") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise errors.MalformedBody(f"malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from exc


async def read_model(request: web.Request, model: type[M]) -> M:
    raw = await read_raw(request)
    if not isinstance(raw, dict):
        raise errors.InvalidInput("the body must be a JSON object")
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise errors.from_validation_error(exc) from exc


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.json_response(body, status=status, dumps=_dumps)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, default=str)
