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
     │    └── InUse               409 in_use
     ├── RateLimited              429 rate_limited
     └── Unavailable              503 unavailable

The API serialises any of them as ``{"error": {"code", "message", "field"}}`` and the client
library turns that body back into :class:`cpn.client.ApiError`.
"""

from __future__ import annotations

from typing import Any


class CPNError(Exception):
    status = 500
    code = "internal"

    def __init__(self, message: str, *, field: str | None = None, details: dict[str, Any] | None = None):
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


class RateLimited(CPNError):
    status, code = 429, "rate_limited"


class Unavailable(CPNError):
    status, code = 503, "unavailable"


def field_path(loc: tuple[Any, ...] | list[Any]) -> str:
    """Render a pydantic error location as `spec.nodePools[1].gpusPerNode`."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def from_validation_error(exc: Any, prefix: str = "") -> InvalidInput:
    """Convert a pydantic ValidationError into one InvalidInput naming the first bad field."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    loc = [p for p in first["loc"] if p not in ("function-after", "function-before")]
    path = field_path(loc)
    if prefix:
        path = f"{prefix}.{path}" if path and not path.startswith("[") else f"{prefix}{path}"
    msg = first["msg"]
    if first["type"] == "extra_forbidden":
        msg = "unknown field"
    message = f"{path}: {msg}" if path else msg
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more)"
    others = [{"field": field_path(e["loc"]), "message": e["msg"]} for e in errors[1:10]]
    return InvalidInput(message, field=path or None, details={"errors": others} if others else None)
