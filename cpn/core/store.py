"""Generic storage of manifests: list/get/create/replace/patch/delete/apply over one table.

Each kind's table has the columns of :class:`ResourceRow`; a layer subclasses
:class:`ResourceStore` and overrides the hooks (`prepare`, `before_delete`, `redact`,
`visible`) for its own rules. Every method runs inside the caller's session, so one API request
is one transaction.
"""

from __future__ import annotations

import base64
import copy
import functools
from datetime import datetime
from typing import Any, ClassVar

from pydantic import BaseModel, ValidationError
from sqlalchemy import ForeignKey, String, bindparam, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Mapped, declared_attr, mapped_column

from cpn.core import errors
from cpn.core.db import JSONType, Tracked, as_utc, new_uid
from cpn.core.principal import Principal, Role
from cpn.core.selector import matches, parse_selector


class ResourceRow(Tracked):
    """Columns shared by every manifest table."""

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_uid)
    name: Mapped[str] = mapped_column(String(63), unique=True, nullable=False)
    labels: Mapped[dict[str, str]] = mapped_column(JSONType, default=dict, nullable=False)
    spec: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict, nullable=False)
    status: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict, nullable=False)

    @declared_attr
    def owner_id(cls) -> Mapped[str]:  # noqa: N805 - SQLAlchemy declared_attr
        return mapped_column(String(36), ForeignKey("accounts.id", ondelete="RESTRICT"), index=True)




WRITE_ATTEMPTS = 8  # a write naming no resourceVersion (a merge PATCH, a heartbeat) is run again from a fresh
# read this many times in all when a concurrent writer moved the row (Database.transact) instead of answering 409
RETIRED = "~"  # a retired object's name is RETIRED + its uid: never a valid name, so it frees the old one
READ_ONLY_META = ("uid", "creationTimestamp", "owner")  # set by the server; ignored on input


def is_retired(name: str) -> bool:
    return name.startswith(RETIRED)


NS_SEP = "/"  # a namespaced object is stored under "<namespace>/<name>"; no name holds a '/'
KEY_LEN = 127  # "<namespace>/<name>": two names of at most 63 characters
SUBTASK_LEN = 200  # "<job key>-<cluster>"
LAUNCH_KEY_LEN = 400  # "<job key>/<sub-task>/<attempt>"


def qualify(namespace: str, name: str) -> str:
    return f"{namespace}{NS_SEP}{name}"


def split_key(key: str) -> tuple[str | None, str]:
    """"alice/lm" → ("alice", "lm"); a cluster-wide name → (None, name)."""
    namespace, sep, name = key.rpartition(NS_SEP)
    return (namespace, name) if sep else (None, key)


def _check_read_only(body: dict[str, Any]) -> None:
    """Read-only parts (status, metadata.uid/creationTimestamp/owner) are ignored on input, but only
    when they have the shape the server returns them in: anything else is a client's mistake."""
    if body.get("status") is not None and not isinstance(body["status"], dict):
        raise errors.InvalidInput(f"status is read-only: leave it out or give the object the server returned, "
                                  f"not {type(body['status']).__name__}", field="status")
    meta = body.get("metadata")
    if not isinstance(meta, dict):
        return
    for k in READ_ONLY_META:
        value = meta.get(k)
        if value is None:
            continue
        ok = isinstance(value, str)
        if ok and k == "creationTimestamp":
            try:
                datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                ok = False
        if not ok:
            raise errors.InvalidInput(f"{k} is read-only: leave it out or give the value the server returned, "
                                      f"not {value!r:.40}", field=f"metadata.{k}")


def encode_continue(name: str) -> str:
    return base64.urlsafe_b64encode(name.encode()).decode()


def decode_continue(token: str | None) -> str | None:
    """A position in name order. Any URL-safe base64 text is one (the API publishes that pattern), so a
    token this server did not make lists from wherever it points instead of failing."""
    if not token:
        return None
    body = token.rstrip("=")
    body = body[: len(body) - (len(body) % 4 == 1)]
    try:
        raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
    except ValueError as exc:
        raise errors.InvalidInput("not a continue token from this server", field="continue") from exc
    return raw.decode("utf-8", "replace").replace("\x00", "") or None


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def validate(model: type[BaseModel], body: Any) -> BaseModel:
    if not isinstance(body, dict):
        raise errors.InvalidInput("a manifest must be a JSON object", field=None)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise errors.from_validation_error(exc) from exc



_UNCHECKED = object()  # create_row: the caller did not look for an existing row


@functools.cache  # one statement per (row class, lock), run with each name: cheaper than building it per call
def _by_name(row: Any, lock: bool) -> Any:
    stmt = select(row).where(row.name == bindparam("row_name"))
    return stmt.with_for_update() if lock else stmt


class ResourceStore:
    """CRUD over one manifest table. Subclasses set `row`, `manifest`, `kind` and hooks."""

    kind: ClassVar[str]
    row: ClassVar[type[ResourceRow]]
    manifest: ClassVar[type[BaseModel]]
    create_roles: ClassVar[frozenset[Role]] = frozenset({Role.ADMIN})
    not_found_hides: ClassVar[bool] = False  # 404 instead of 403 for invisible objects
    namespaced: ClassVar[bool] = False  # names are per owner (the owning account's name is the namespace)

    # ---- names -------------------------------------------------------------------------
    def key(self, principal: Principal, name: str, namespace: str | None = None) -> str:
        """The stored name of what a caller calls `name`: a namespaced kind's bare name lives in the
        caller's namespace (or `namespace`); "ns/name" names one in another namespace."""
        if not self.namespaced or NS_SEP in name:
            return name
        return qualify(namespace or principal.name, name)

    # ---- hooks -------------------------------------------------------------------------
    async def prepare(self, session: AsyncSession, principal: Principal, obj: BaseModel,
                      row: ResourceRow | None) -> dict[str, Any]:
        """Check references and rules before a create (row None) or replace; raise to refuse.
        Returns what `derive` needs (resolved ids …)."""
        return {}

    async def before_delete(self, session: AsyncSession, principal: Principal, row: ResourceRow) -> None:
        """Raise InUse if something still depends on the object."""

    def visible(self, principal: Principal, row: ResourceRow) -> bool:
        return True

    def redact(self, principal: Principal, row: ResourceRow, spec: dict[str, Any]) -> dict[str, Any]:
        return spec

    def derive(self, row: ResourceRow, obj: BaseModel, refs: dict[str, Any]) -> None:
        """Fill kind-specific columns from the validated manifest."""

    def initial_status(self, obj: BaseModel) -> dict[str, Any]:
        return {}

    def status_view(self, row: ResourceRow, now: datetime | None = None) -> dict[str, Any]:
        return dict(row.status or {})

    # ---- reads -------------------------------------------------------------------------
    def to_manifest(self, principal: Principal, row: ResourceRow) -> dict[str, Any]:
        spec = self.redact(principal, row, copy.deepcopy(row.spec or {}))
        namespace, name = split_key(row.name) if self.namespaced else (None, row.name)
        meta = {"name": name, **({"namespace": namespace} if namespace else {}), "labels": row.labels or {},
                "resourceVersion": str(row.resource_version), "uid": row.id,
                "creationTimestamp": as_utc(row.created_at).isoformat(), "owner": row.owner_id}
        return {"apiVersion": "cpn/v1", "kind": self.kind, "metadata": meta, "spec": spec,
                "status": self.status_view(row)}

    async def find(self, session: AsyncSession, name: str, *, lock: bool = False) -> ResourceRow | None:
        if is_retired(name):
            return None
        return (await session.execute(_by_name(self.row, lock), {"row_name": name})).scalar_one_or_none()

    async def resolve(self, session: AsyncSession, principal: Principal, name: str,
                      *, lock: bool = False) -> ResourceRow | None:
        """The object a caller means by `name`. An admin's bare name that is not in the admin's own
        namespace finds the one object of that name in any namespace (several: say which)."""
        row = await self.find(session, self.key(principal, name), lock=lock)
        if row is not None or not (self.namespaced and principal.is_admin) or NS_SEP in name or is_retired(name):
            return row
        keys = list((await session.execute(select(self.row.name).where(
            self.row.name.endswith(f"{NS_SEP}{name}", autoescape=True)))).scalars())
        if len(keys) > 1:
            raise errors.InvalidInput(
                f"{len(keys)} {self.kind} objects are named {name!r} ({', '.join(sorted(keys))}): "
                "say which as NAMESPACE/NAME (cpnctl -n NAMESPACE)", field="metadata.name")
        return await self.find(session, keys[0], lock=lock) if keys else None

    async def load(self, session: AsyncSession, principal: Principal, name: str,
                   *, lock: bool = False) -> ResourceRow:
        row = await self.resolve(session, principal, name, lock=lock)
        if row is None or (self.not_found_hides and not self.visible(principal, row)):
            raise errors.NotFound(f"{self.kind} {name!r} not found")
        if not self.visible(principal, row):
            raise errors.Forbidden(f"{self.kind} {name!r} is not yours")
        return row

    async def get(self, session: AsyncSession, principal: Principal, name: str) -> dict[str, Any]:
        return self.to_manifest(principal, await self.load(session, principal, name))

    async def list(self, session: AsyncSession, principal: Principal, *, selector: str | None = None,
                   limit: int | None = None, continue_token: str | None = None,
                   filters: dict[str, str] | None = None) -> tuple[list[dict[str, Any]], str | None]:
        terms = parse_selector(selector)
        after = decode_continue(continue_token)
        stmt = select(self.row).where(self.row.name.not_like(f"{RETIRED}%")).order_by(self.row.name)
        if after:
            stmt = stmt.where(self.row.name > after)
        stmt = self.filter_query(stmt, principal, filters or {})
        items: list[dict[str, Any]] = []
        last: str | None = None
        for row in (await session.execute(stmt)).scalars():
            if not self.visible(principal, row) or not matches(row.labels or {}, terms):
                continue
            if limit is not None and len(items) >= limit:
                return items, encode_continue(last or "")
            items.append(self.to_manifest(principal, row))
            last = row.name
        return items, None

    def filter_query(self, stmt: Any, principal: Principal, filters: dict[str, str]) -> Any:
        return stmt

    # ---- writes ------------------------------------------------------------------------
    def authorize_write(self, principal: Principal, row: ResourceRow | None) -> None:
        if principal.role not in self.create_roles and not principal.is_admin:
            raise errors.Forbidden(f"role {principal.role.value!r} may not change {self.kind} objects")
        if row is not None and not principal.owns(row.owner_id):
            raise errors.Forbidden(f"{self.kind} {row.name!r} belongs to another account")

    async def create(self, session: AsyncSession, principal: Principal, body: Any) -> dict[str, Any]:
        return self.to_manifest(principal, await self.create_row(session, principal, body))

    def new_key(self, principal: Principal, obj: BaseModel) -> str:
        """The key a new object `obj` of `principal`'s gets."""
        return self.key(principal, obj.metadata.name, self.own_namespace(principal, obj))  # type: ignore[attr-defined]

    async def create_row(self, session: AsyncSession, principal: Principal, body: Any, *,
                         flush: bool = True, existing: Any = _UNCHECKED) -> ResourceRow:
        """`create`, returning the row; with flush=False it is only added to the session (written with
        the transaction's next flush, together with what else the caller adds). `body` may be parsed
        already (a manifest); `existing`: the row the caller found under the new object's key (None:
        none), when it looked in a read of its own."""
        obj = body if isinstance(body, self.manifest) else self.parse(body)
        self.authorize_write(principal, None)
        key = self.new_key(principal, obj)
        if (await self.find(session, key) if existing is _UNCHECKED else existing) is not None:
            raise errors.AlreadyExists(f"{self.kind} {key!r} already exists", field="metadata.name")
        refs = await self.prepare(session, principal, obj, None)
        row = self.row(name=key, owner_id=principal.account_id)
        self._fill(row, obj, refs)
        row.status = self.initial_status(obj)
        session.add(row)
        if flush:
            await session.flush()
        return row

    async def replace(self, session: AsyncSession, principal: Principal, name: str, body: Any,
                      *, check_version: bool = True) -> dict[str, Any]:
        row = await self.load(session, principal, name, lock=True)
        self.authorize_write(principal, row)  # before the body: another account learns nothing from its checks
        obj = self.parse(body)
        if obj.metadata.name != split_key(name)[1]:
            raise errors.InvalidInput(f"name {obj.metadata.name!r} does not match the URL's {name!r}",
                                      field="metadata.name")
        if self.namespaced and obj.metadata.namespace not in (None, split_key(row.name)[0]):
            raise errors.InvalidInput(f"namespace {obj.metadata.namespace!r} does not match the object's "
                                      f"{split_key(row.name)[0]!r}", field="metadata.namespace")
        wanted = obj.metadata.resource_version
        if check_version and wanted is not None and wanted != str(row.resource_version):
            raise errors.StaleVersion(
                f"{self.kind} {name!r} is at resourceVersion {row.resource_version}, not {wanted}; "
                "re-read it and retry", field="metadata.resourceVersion")
        refs = await self.prepare(session, principal, obj, row)
        self._fill(row, obj, refs)
        await session.flush()
        return self.to_manifest(principal, row)

    async def patch(self, session: AsyncSession, principal: Principal, name: str, patch: Any) -> dict[str, Any]:
        if not isinstance(patch, dict):
            raise errors.InvalidInput("a merge patch must be a JSON object")
        # locked from the read the patch is merged onto: a concurrent writer waits for this one and then
        # merges onto its result (PostgreSQL; on SQLite the caller's retry, WRITE_ATTEMPTS, does it)
        row = await self.load(session, principal, name, lock=True)
        self.authorize_write(principal, row)
        current = {"apiVersion": "cpn/v1", "kind": self.kind,
                   "metadata": {"name": split_key(row.name)[1], "labels": row.labels or {}},
                   "spec": copy.deepcopy(row.spec)}
        merged = merge_patch(current, {k: v for k, v in patch.items() if k != "status"})
        version = (patch.get("metadata") or {}).get("resourceVersion")
        merged["metadata"].pop("resourceVersion", None)
        if version is not None:
            merged["metadata"]["resourceVersion"] = version
        return await self.replace(session, principal, name, merged)

    async def delete(self, session: AsyncSession, principal: Principal, name: str) -> None:
        row = await self.load(session, principal, name, lock=True)
        self.authorize_write(principal, row)
        await self.before_delete(session, principal, row)
        if await self.has_history(session, row):
            self.retire(row)
        else:
            await session.delete(row)
        await session.flush()

    async def has_history(self, session: AsyncSession, row: ResourceRow) -> bool:
        """Whether records that must outlive the object (ledger, leases) point at it: it is then retired
        instead of deleted: gone from every list and lookup, its name free, its history kept."""
        return False

    @staticmethod
    def retire(row: ResourceRow) -> None:
        row.labels = {**(row.labels or {}), "cpn.io/retired-name": split_key(row.name)[1]}
        row.name = f"{RETIRED}{row.id}"

    async def apply(self, session: AsyncSession, principal: Principal, body: Any) -> tuple[str, dict[str, Any]]:
        """Create or replace (kubectl apply); returns ("created"|"configured", manifest)."""
        obj = self.parse(body)
        key = self.key(principal, obj.metadata.name, self.own_namespace(principal, obj))
        if await self.find(session, key) is None:
            return "created", await self.create(session, principal, body)
        return "configured", await self.replace(session, principal, key, body)

    def own_namespace(self, principal: Principal, obj: BaseModel) -> str | None:
        """Objects are created in the caller's own namespace; naming another one is refused."""
        namespace = getattr(obj.metadata, "namespace", None)
        if self.namespaced and namespace not in (None, principal.name):
            raise errors.Forbidden(f"{self.kind} objects are created in your own namespace {principal.name!r}, "
                                   f"not {namespace!r}: leave metadata.namespace out", field="metadata.namespace")
        return namespace

    def parse(self, body: Any) -> BaseModel:
        if isinstance(body, dict):
            _check_read_only(body)
            body = {k: v for k, v in body.items() if k != "status"}
            meta = body.get("metadata")
            if isinstance(meta, dict):
                body["metadata"] = {k: v for k, v in meta.items() if k not in READ_ONLY_META}
            if body.get("kind") not in (None, self.kind):
                raise errors.InvalidInput(f"kind must be {self.kind!r}", field="kind")
            body.setdefault("kind", self.kind)
        return validate(self.manifest, body)

    def _fill(self, row: ResourceRow, obj: BaseModel, refs: dict[str, Any]) -> None:
        wire = obj.model_dump(mode="json", by_alias=True, exclude_none=True)
        row.labels = wire["metadata"].get("labels", {})
        row.spec = wire.get("spec", {})
        self.derive(row, obj, refs or {})
