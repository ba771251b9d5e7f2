"""The registry of resource kinds: names, REST paths, printer columns and their stores.

Layers register their kinds here; the API builds generic CRUD routes from the registry and
publishes it at `/api/v1/kinds` so that `cpnctl` resolves `cluster`, `clusters`, `cl` without
importing any layer (the way kubectl uses API discovery).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pydantic import BaseModel

    from cpn.core.store import ResourceStore


@dataclass(frozen=True)
class Column:
    """A printer column. `template` fills `{dotted.path}` placeholders from the manifest;
    `format="age"` renders a timestamp as an age, `format="duration"` seconds as `3 min 20 s`."""

    name: str
    template: str
    wide: bool = False
    format: str | None = None

    def wire(self) -> dict[str, Any]:
        return {"name": self.name, "template": self.template, "wide": self.wide, "format": self.format}


@dataclass
class Kind:
    kind: str
    plural: str
    short_names: tuple[str, ...]
    manifest: type[BaseModel] | None
    store: ResourceStore | None
    columns: tuple[Column, ...] = ()
    order: int = 100  # apply order inside one batch (Sites before Clusters before Links)
    verbs: tuple[str, ...] = ("list", "get", "create", "update", "patch", "delete")
    subresources: dict[str, str] = field(default_factory=dict)
    custom_path: str | None = None  # e.g. /api/v1/jobs/{parent}/quotes for objects under a parent
    generic_routes: bool = True  # False: the layer's own routes serve this kind


    @property
    def singular(self) -> str:
        return self.kind.lower()

    @property
    def path(self) -> str:
        return self.custom_path or f"/api/v1/{self.plural}"

    def names(self) -> set[str]:
        return {self.kind.lower(), self.plural, *self.short_names}

    def wire(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "singular": self.singular,
            "plural": self.plural,
            "shortNames": list(self.short_names),
            "path": self.path,
            "verbs": list(self.verbs),
            "columns": [c.wire() for c in self.columns],
        }


class KindRegistry:
    def __init__(self) -> None:
        self._kinds: dict[str, Kind] = {}

    def register(self, kind: Kind) -> Kind:
        for existing in self._kinds.values():
            clash = existing.names() & kind.names()
            if clash and existing.kind != kind.kind:
                raise ValueError(f"kind {kind.kind} reuses names {sorted(clash)} of {existing.kind}")
        self._kinds[kind.kind] = kind
        return kind

    def resolve(self, name: str) -> Kind | None:
        lowered = name.lower()
        for kind in self._kinds.values():
            if lowered in kind.names():
                return kind
        return None

    def by_kind(self, kind: str) -> Kind | None:
        return self._kinds.get(kind)

    def all(self) -> list[Kind]:
        return sorted(self._kinds.values(), key=lambda k: (k.order, k.kind))


AGE = Column("AGE", "{metadata.creationTimestamp}", format="age")
