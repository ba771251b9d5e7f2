"""Request bodies: JSON or YAML, size-limited, converted to typed errors."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from cpn.core import errors
from cpn.core.yamlload import ManifestSyntaxError, YamlAliasError, load_yaml

M = TypeVar("M", bound=BaseModel)
MAX_DEPTH = 32  # levels of lists and objects a body may nest (a manifest uses about 6)


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
            body = load_yaml(text)
        except YamlAliasError as exc:  # well-formed, but a few bytes of aliases can name 10^8 values
            raise errors.InvalidInput(f"the body: {exc}", field="body") from exc
        except ManifestSyntaxError as exc:
            raise errors.MalformedBody(str(exc)) from exc
    else:
        try:
            body = json.loads(text)
        except json.JSONDecodeError as exc:
            raise errors.MalformedBody(f"malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from exc
        except ValueError as exc:  # an integer of more than 4300 digits (Python's limit on int(str))
            raise errors.MalformedBody(f"malformed JSON: {exc}") from exc
        except RecursionError as exc:
            raise errors.MalformedBody(f"malformed JSON: nested deeper than {MAX_DEPTH} levels") from exc
    if _deeper_than(body, MAX_DEPTH):
        raise errors.MalformedBody(f"the body is nested deeper than {MAX_DEPTH} levels; no CPN object is")
    if "\\" in text or "\x00" in text:  # JSON and YAML write a NUL as an escape (\u0000, \0, \x00 …)
        where = _nul_at(body, "")
        if where is not None:
            raise errors.InvalidInput("contains a NUL character (\\u0000), which no CPN field takes",
                                      field=where or "body")
    return body


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether lists and objects nest more than ``limit`` levels (iterative: a deep body cannot recurse here)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        for child in children:
            if isinstance(child, dict | list):
                if depth + 1 > limit:
                    return True
                stack.append((child, depth + 1))
    return False


def _nul_at(value: Any, path: str) -> str | None:
    """The user's path of the first key or string holding a NUL character (PostgreSQL refuses it)."""
    if isinstance(value, str):
        return path if "\x00" in value else None
    if isinstance(value, dict):
        for key, item in value.items():
            here = f"{path}.{key}" if path else str(key)
            if "\x00" in str(key):
                return here.replace("\x00", "\\u0000")
            found = _nul_at(item, here)
            if found is not None:
                return found
    if isinstance(value, list):
        for i, item in enumerate(value):
            found = _nul_at(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None


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
