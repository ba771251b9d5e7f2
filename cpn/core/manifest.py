"""The manifest shape every CPN object speaks: apiVersion / kind / metadata / spec / status.

Keys are camelCase on the wire (aliases) and snake_case in Python. Unknown fields are errors.
"""

from __future__ import annotations

import re
from datetime import datetime
from decimal import Decimal
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PlainSerializer
from pydantic.alias_generators import to_camel

from cpn import API_VERSION

NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,61}[a-z0-9])?$")
LABEL_KEY_RE = re.compile(r"^([a-z0-9.-]{1,253}/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


class CamelModel(BaseModel):
    """Base for every wire schema: camelCase aliases, unknown fields rejected."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", validate_assignment=True
    )

    def wire(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


def _check_name(v: str) -> str:
    if not NAME_RE.match(v):
        raise ValueError(
            "must be 1-63 lowercase letters, digits, '-' or '.', starting and ending with a letter or digit"
        )
    return v


def _check_labels(v: dict[str, str]) -> dict[str, str]:
    for key, value in v.items():
        if not LABEL_KEY_RE.match(key):
            raise ValueError(f"label key {key!r} is not a valid key")
        if len(value) > 63:
            raise ValueError(f"label {key!r}: value longer than 63 characters")
    return v


Name = Annotated[str, AfterValidator(_check_name)]
Labels = Annotated[dict[str, str], AfterValidator(_check_labels)]


def _check_money(v: Decimal) -> Decimal:
    if not v.is_finite():
        raise ValueError("must be a finite decimal")
    exponent = v.as_tuple().exponent
    if isinstance(exponent, int) and exponent < -6:
        raise ValueError("at most 6 decimal places")
    if v < 0:
        raise ValueError("must not be negative")
    return v


# Money is a decimal on the wire (as a string) and in Python; never a float.
Money = Annotated[Decimal, AfterValidator(_check_money), PlainSerializer(lambda d: str(d), return_type=str)]


class ObjectMeta(CamelModel):
    name: Name
    labels: Labels = Field(default_factory=dict)
    resource_version: str | None = None
    uid: str | None = None
    creation_timestamp: datetime | None = None
    owner: str | None = Field(default=None, description="Account that owns the object (read-only).")


class Condition(CamelModel):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str | None = None
    message: str | None = None
    last_transition_time: datetime | None = None


class ManifestBase(CamelModel):
    api_version: Literal["cpn/v1"] = API_VERSION
    kind: str
    metadata: ObjectMeta


def set_condition(conditions: list[dict[str, Any]], ctype: str, status: bool, reason: str, message: str,
                  now: datetime) -> list[dict[str, Any]]:
    """Upsert a condition (wire dicts), touching lastTransitionTime only on a change of status."""
    value = "True" if status else "False"
    out = [dict(c) for c in conditions]
    for cond in out:
        if cond.get("type") == ctype:
            if cond.get("status") != value:
                cond["lastTransitionTime"] = now.isoformat()
            cond.update(status=value, reason=reason, message=message)
            return out
    out.append({"type": ctype, "status": value, "reason": reason, "message": message,
                "lastTransitionTime": now.isoformat()})
    return out


def list_manifest(items: list[dict[str, Any]], continue_token: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"apiVersion": API_VERSION, "kind": "List", "items": items}
    if continue_token:
        body["metadata"] = {"continue": continue_token}
    return body
