"""The manifest shape every CPN object speaks: apiVersion / kind / metadata / spec / status.

Keys are camelCase on the wire (aliases) and snake_case in Python. Unknown fields are errors.
"""

from __future__ import annotations

import re
from datetime import datetime
from decimal import Decimal
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
)
from pydantic.alias_generators import to_camel

from cpn import API_VERSION
from cpn.core.yamlload import (  # noqa: F401 - re-exported: the loader lived here
    ALIAS_REFUSED,
    ManifestLoader,
    ManifestSyntaxError,
    YamlAliasError,
    load_yaml,
    load_yaml_all,
    yaml_error_message,
)

NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,61}[a-z0-9])?$")
LABEL_KEY_RE = re.compile(r"^([a-z0-9.-]{1,253}/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


class CamelModel(BaseModel):
    """Base for every wire schema: camelCase aliases, unknown fields rejected."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", validate_assignment=True
    )

    def wire(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_number(cls, v: Any, info: ValidationInfo) -> Any:
        """`true` is not a number: pydantic's lax mode would read it as 1 (the schema says integer)."""
        if isinstance(v, bool) and info.field_name is not None:
            annotation = cls.model_fields[info.field_name].annotation
            if annotation in _NUMBERS:
                raise ValueError(f"must be a number, got {str(v).lower()}")
        return v


_NUMBERS = {int, float, int | None, float | None, Decimal, Decimal | None}


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


# WithJsonSchema: the published OpenAPI states the same rule the validator enforces.
Name = Annotated[str, AfterValidator(_check_name), WithJsonSchema(
    {"type": "string", "minLength": 1, "maxLength": 63, "pattern": NAME_RE.pattern})]
Labels = Annotated[dict[str, str], AfterValidator(_check_labels), WithJsonSchema(
    {"type": "object", "propertyNames": {"pattern": LABEL_KEY_RE.pattern},
     "additionalProperties": {"type": "string", "maxLength": 63}})]


MONEY_PATTERN = r"^[0-9]+(\.[0-9]{1,6})?$"
MONEY_MAX = Decimal(10) ** 12  # beyond any price or budget; bounds the digits every sum and format handles


def _money_text(v: Any) -> Any:
    """A string amount must read as the published pattern says: digits, an optional point and at most
    6 decimals -- not ``1e999999999`` (a billion digits once formatted), ``1_000``, `` 1 `` or ``-0``."""
    if isinstance(v, str) and not re.fullmatch(MONEY_PATTERN, v):
        raise ValueError('must be a decimal amount such as "12.50": digits, an optional point and at most 6 '
                         "decimal places (no sign, exponent, spaces or separators)")
    return v


def _check_money(v: Decimal) -> Decimal:
    if not v.is_finite():
        raise ValueError("must be a finite decimal")
    if abs(v) > MONEY_MAX:
        raise ValueError(f"must be at most {MONEY_MAX:f}")
    exponent = v.as_tuple().exponent
    if isinstance(exponent, int) and exponent < -6:
        raise ValueError("at most 6 decimal places")
    if v < 0:
        raise ValueError("must not be negative")
    return v


# Money is a decimal on the wire (as a string) and in Python; never a float.
Money = Annotated[Decimal, BeforeValidator(_money_text), AfterValidator(_check_money), PlainSerializer(lambda d: format(d, "f"), return_type=str),
                  WithJsonSchema({"anyOf": [{"type": "string", "pattern": MONEY_PATTERN},
                                            {"type": "integer", "minimum": 0}],
                                  "description": "A decimal amount, at most 6 decimal places (a string, or a "
                                                 "whole number)"})]


class ObjectMeta(CamelModel):
    name: Name
    namespace: Name | None = Field(default=None, description=(
        "Namespaced kinds (TrainingJob): the owning account's name, so two users can each have a job "
        "`lm`; defaults to the caller's. Cluster-wide kinds (sites, clusters, links) ignore it."))
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


def duration_text(seconds: float, decimals: int = 0) -> str:
    """A duration in the units a person reads: `45 s`, `2 min 4 s`, `3 h 05 min`, `2 d 4 h`; `decimals`
    adds precision to the seconds when two values would otherwise read the same."""
    if seconds < 0 or seconds != seconds:
        return "-"
    if seconds >= 86400 and decimals == 0:
        return f"{int(seconds // 86400)} d {int(seconds % 86400 // 3600)} h"
    if seconds >= 3600 and decimals == 0:
        return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"
    minutes, rest = divmod(seconds, 60)
    secs = f"{rest:.{decimals}f}" if decimals else f"{int(rest)}"
    if minutes >= 60:
        return f"{int(minutes // 60)} h {int(minutes % 60):02d} min {secs} s"
    return f"{int(minutes)} min {secs} s" if minutes else f"{secs} s"


def distinct_durations(values: list[float]) -> list[str]:
    """`duration_text` for several options at once, with just enough precision that options whose
    times differ never read the same (a quote list's TIME column)."""
    for decimals in range(4):
        texts = [duration_text(v, decimals) for v in values]
        if all(texts[i] != texts[j] or abs(values[i] - values[j]) < 0.001
               for i in range(len(values)) for j in range(i)):
            return texts
    return texts
