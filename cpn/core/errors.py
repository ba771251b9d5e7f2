"""Errors CPN raises on purpose, modelled once and mapped to HTTP in one place.

    CPNError                      500 internal
     ├── InvalidInput             422 invalid        (names the field)
     │    ├── MalformedBody       400 malformed
     │    └── Infeasible          422 infeasible     (no placement satisfies the constraints)
     ├── PayloadTooLarge          413 too_large
     ├── Unauthenticated          401 unauthenticated
     ├── Forbidden                403 forbidden
     ├── NotFound                 404 not_found
     ├── Conflict                 409 conflict
     │    ├── AlreadyExists       409 already_exists
     │    ├── StaleVersion        409 stale
     │    ├── InUse               409 in_use
     │    └── QuotaExceeded       409 quota_exceeded (names the quota, its limit, what is used)
     ├── RateLimited              429 rate_limited
     └── Unavailable              503 unavailable    (with Retry-After; also what `unavailable()` makes
                                                      of a database or disk error the code did not expect)

The API serialises any of them as ``{"error": {"code", "message", "field", "details"}}`` and the
client library turns that body back into :class:`cpn.client.ApiError`. A validation error reports
every bad field: ``message`` lists them all, ``field`` names the first, ``details`` is the list
``[{"field", "message"}, ...]`` in the user's field paths (``spec.model``, ``spec.gpus.min``).
"""

from __future__ import annotations

import errno
import re
from typing import Any


class CPNError(Exception):
    status = 500
    code = "internal"

    def __init__(self, message: str, *, field: str | None = None,
                 details: dict[str, Any] | list[dict[str, Any]] | None = None):
        if field and field not in message and isinstance(self, InvalidInput):
            message = f"{field}: {message}"
        super().__init__(message)
        self.message = message
        self.field = field
        self.details = details or {}

    def to_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"code": self.code, "message": self.message, "field": self.field}
        if self.details:
            body["details"] = self.details
        return {"error": body}


class InvalidInput(CPNError):
    status, code = 422, "invalid"


class MalformedBody(InvalidInput):
    status, code = 400, "malformed"


class Infeasible(InvalidInput):
    status, code = 422, "infeasible"


class PayloadTooLarge(CPNError):
    status, code = 413, "too_large"


class Unauthenticated(CPNError):
    status, code = 401, "unauthenticated"


class Forbidden(CPNError):
    status, code = 403, "forbidden"


class NotFound(CPNError):
    status, code = 404, "not_found"


class Conflict(CPNError):
    status, code = 409, "conflict"


class AlreadyExists(Conflict):
    code = "already_exists"


class StaleVersion(Conflict):
    code = "stale"


class InUse(Conflict):
    code = "in_use"


class QuotaExceeded(Conflict):
    """An accept that would take an account or a team past one of its quotas. ``details``: quota, boundTo,
    resource (maxGpus | maxJobs | gpuHoursPerMonth | spendPerMonth), unit, limit, used, requested."""

    code = "quota_exceeded"


class RateLimited(CPNError):
    status, code = 429, "rate_limited"


class Unavailable(CPNError):
    status, code = 503, "unavailable"
    retry_after = 5  # seconds: the ``Retry-After`` the API sends with it


_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO})


def unavailable(exc: BaseException) -> Unavailable | None:
    """The :class:`Unavailable` an unexpected error stands for, if it says the database or the disk is
    down (issue 36, item 5: these answered 500 "internal error", and load balancers took the server for
    broken): SQLAlchemy's OperationalError / InterfaceError / DisconnectionError / pool timeout (the
    database refused, dropped or could not open the connection, or is full), a refused or reset
    connection, PostgreSQL's "cannot serve" states, a full or read-only disk. Anything else (a bug) stays a 500. The cause chain is walked:
    the drivers' errors arrive wrapped."""
    from sqlalchemy import exc as sa  # the server's error path only: cpnctl imports this module too

    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, sa.OperationalError | sa.InterfaceError | sa.DisconnectionError | sa.TimeoutError):
            return Unavailable(f"the database is unavailable ({_first_line(cause)}); retry the request",
                               details={"database": "down"})
        if isinstance(cause, OSError) and cause.errno in _DISK_ERRNOS:
            return Unavailable(f"the server's disk is unavailable ({cause.strerror or cause}); retry the request",
                               details={"disk": "unavailable"})
        if isinstance(cause, ConnectionError) or _down_state(cause):  # refused, reset; or PostgreSQL says so
            return Unavailable(f"the database is unavailable ({cause}); retry the request",
                               details={"database": "down"})
        cause = cause.__cause__ or cause.__context__
    return None


# PostgreSQL's SQLSTATEs for a database that cannot serve: connection exceptions (08), insufficient resources
# (53: disk full, out of memory, too many connections), shutting down or starting up (57P), gone (3D000)
_DOWN_STATES = ("08", "53", "57P", "3D000")


def _down_state(exc: BaseException) -> bool:
    state = getattr(exc, "sqlstate", None)
    if not isinstance(state, str):
        return False
    return state.startswith(_DOWN_STATES) or (state == "55000" and "accepting connections" in str(exc))


def _first_line(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None)  # the driver's own message, not SQLAlchemy's statement dump
    text = str(orig if orig is not None else exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:200]


def field_path(loc: tuple[Any, ...] | list[Any]) -> str:
    """Render a pydantic error location as `spec.nodePools[1].gpusPerNode`, leaving out pydantic's
    own steps (union members such as `function-after[_complete(), ModelSpec]`, `str`, `int`)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _is_internal(part):
            continue
        else:
            out += f".{part}" if out else str(part)
    return out


_INTERNAL_RE = re.compile(r"[\[\](), ]|^(str|int|float|bool|dict|list|none|decimal|function-\w+)$")


def _is_internal(part: Any) -> bool:
    """A location step pydantic adds for a union member or a validator, never a key the user wrote."""
    return isinstance(part, str) and bool(_INTERNAL_RE.search(part))


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if value is None or isinstance(value, bool):  # as the user wrote it (JSON/YAML), not Python's True
        return {None: "null", True: "true", False: "false"}[value]
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _message(err: dict[str, Any]) -> str:
    """Pydantic's message in the user's words."""
    kind, msg, ctx = err["type"], err["msg"], err.get("ctx") or {}
    if kind == "extra_forbidden":
        return "unknown field"
    if kind == "missing":
        return "required field is missing"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"expected a mapping of fields (key: value), got {_describe(err.get('input'))}"
    if kind in ("literal_error", "enum"):
        expected = ctx.get("expected", "")
        return (f"must be one of: {expected.replace(' or ', ', ')}; got {_describe(err.get('input'))}"
                + closest(err.get("input"), re.findall(r"'([^']*)'", expected)))
    if kind in ("int_parsing", "int_from_float", "int_type"):
        return f"must be a whole number, got {_describe(err.get('input'))}"
    if kind in ("float_parsing", "float_type", "decimal_parsing", "decimal_type"):
        return f"must be a number, got {_describe(err.get('input'))}"
    if kind.startswith(("greater_than", "less_than")):
        return f"{msg.replace('Input should be', 'must be')}, got {_describe(err.get('input'))}"
    if kind in ("value_error", "assertion_error"):
        return re.sub(r"^(Value|Assertion) error, ", "", msg)
    if kind == "string_pattern_mismatch":
        pattern = ctx.get("pattern", "")
        return f"must be {PATTERN_HINTS.get(pattern, f'text matching {pattern}')}, got {_describe(err.get('input'))}"
    if kind in ("too_short", "too_long", "string_too_short", "string_too_long"):
        short = kind.endswith("too_short")
        bound = ctx.get("min_length") if short else ctx.get("max_length")
        unit = "character" if kind.startswith("string") else "item"
        actual = ctx.get("actual_length")  # None for a mapping or a set
        actual = len(err.get("input") or ()) if actual is None else actual
        return f"must have at {'least' if short else 'most'} {bound} {unit}{'' if bound == 1 else 's'}, got {actual}"
    return msg.replace("Input should be", "must be")


def closest(value: Any, choices: list[str]) -> str:
    """" (did you mean `diloco`?)" when `value` is text close to one of `choices` (any case), else ""."""
    import difflib

    if not isinstance(value, str) or not value or not choices:
        return ""
    lowered = {c.lower(): c for c in choices}
    close = difflib.get_close_matches(value.lower(), list(lowered), n=1, cutoff=0.6)
    return f" (did you mean `{lowered[close[0]]}`?)" if close else ""


# A schema's regular expression in words, for the errors that quote it (the schemas register theirs)
PATTERN_HINTS: dict[str, str] = {}


def validation_details(exc: Any, prefix: str = "") -> list[dict[str, str]]:
    """Every error of a pydantic ValidationError as {field, message}, in the user's field paths."""
    out: list[dict[str, str]] = []
    seen: set[tuple[str, str]] = set()
    for err in exc.errors(include_url=False):
        path = field_path(err["loc"])
        if prefix:
            path = f"{prefix}.{path}" if path and not path.startswith("[") else f"{prefix}{path}"
        entry = (path, _message(err) + (_did_you_mean(exc, err["loc"]) if err["type"] == "extra_forbidden" else ""))
        if entry not in seen:
            seen.add(entry)
            out.append({"field": path, "message": entry[1]})
    return _drop_union_noise(out)


def _did_you_mean(exc: Any, loc: tuple[Any, ...]) -> str:
    """" (did you mean `strategy`?)" when an unknown key is close to a field of the model it was written
    in (found by walking the error's location down from the validated model's fields)."""
    import difflib

    model = _model_named(getattr(exc, "title", ""))
    for part in loc[:-1]:
        if model is None:
            return ""
        if isinstance(part, str):  # a list index or a dict key of a model's value stays in the same model
            fields = {f.alias or n: f for n, f in model.model_fields.items()} | dict(model.model_fields)
            field = fields.get(part)
            model = _model_in(field.annotation) if field is not None else _model_named(part)
    if model is None or not isinstance(loc[-1], str):
        return ""
    names = sorted({f.alias or n for n, f in model.model_fields.items()})
    close = difflib.get_close_matches(loc[-1], names, n=1, cutoff=0.6)
    return f" (did you mean `{close[0]}`?)" if close else ""


def _model_named(name: str) -> Any:
    from pydantic import BaseModel

    todo = list(BaseModel.__subclasses__())
    while todo:
        cls = todo.pop()
        if cls.__name__ == name:
            return cls
        todo.extend(cls.__subclasses__())
    return None


def _model_in(annotation: Any) -> Any:
    """The pydantic model inside an annotation (`X`, `X | None`, `list[X]`, `dict[str, X]`), or None."""
    import typing

    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _drop_union_noise(details: list[dict[str, str]]) -> list[dict[str, str]]:
    """A union (`ModelSpec | str`) reports one complaint per member at the same path; keep the most
    specific one (a rule broken inside the value beats "expected a mapping" / "must be a string")."""
    generic = ("expected a mapping", "must be a valid string")
    specific = {d["field"] for d in details if not d["message"].startswith(generic)}

    def explained(path: str) -> bool:  # a specific complaint at this path or inside it
        return any(f == path or f.startswith((f"{path}.", f"{path}[")) for f in specific)

    kept = [d for d in details if not (d["message"].startswith(generic) and explained(d["field"]))]
    return kept or details


def from_validation_error(exc: Any, prefix: str = "") -> InvalidInput:
    """Convert a pydantic ValidationError into one InvalidInput that reports every bad field:
    `message` lists them all, `field` names the first, `details` holds [{field, message}, ...]."""
    details = validation_details(exc, prefix)
    if not details:
        return InvalidInput(str(exc).splitlines()[0])
    message = "; ".join(f"{d['field']}: {d['message']}" if d["field"] else d["message"] for d in details)
    return InvalidInput(message, field=details[0]["field"] or None, details=details)
