"""Stores of the inventory kinds: who may change what, references, and derived columns."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar

from sqlalchemy import func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from cpn.core import errors
from cpn.core.db import as_utc
from cpn.core.manifest import set_condition
from cpn.core.principal import Principal, Role
from cpn.core.store import _UNCHECKED, RETIRED, ResourceRow, ResourceStore
from layers.resource.models import ClusterRow, LinkRow, SiteRow
from layers.resource.schemas import ClusterManifest, LinkManifest, SiteManifest

PROVIDERS = frozenset({Role.PROVIDER, Role.ADMIN})


class SiteStore(ResourceStore):
    kind = "Site"
    row = SiteRow
    manifest = SiteManifest
    create_roles: ClassVar[frozenset[Role]] = PROVIDERS

    async def prepare(self, session: AsyncSession, principal: Principal, obj: Any,
                      row: ResourceRow | None) -> dict[str, Any]:
        # spec.provider comes from the token, never from the body
        obj.spec.provider = row.spec.get("provider") if row is not None else principal.name
        return {}

    def derive(self, row: ResourceRow, obj: Any, refs: dict[str, Any]) -> None:
        row.region = obj.spec.region  # type: ignore[attr-defined]

    async def before_delete(self, session: AsyncSession, principal: Principal, row: ResourceRow) -> None:
        clusters = list((await session.execute(select(ClusterRow.name).where(
            ClusterRow.site_id == row.id, ClusterRow.name.not_like(f"{RETIRED}%")).order_by(ClusterRow.name)))
            .scalars())
        links = list((await session.execute(select(LinkRow.name).where(
            or_(LinkRow.site_a_id == row.id, LinkRow.site_b_id == row.id)).order_by(LinkRow.name))).scalars())
        if clusters or links:
            what = [f"cluster(s) {', '.join(clusters)}" if clusters else "", f"link(s) {', '.join(links)}" if links else ""]
            raise errors.InUse(f"site {row.name!r} still has {' and '.join(w for w in what if w)}; "
                               "delete them first (clusters with history are retired, not lost)")

    async def has_history(self, session: AsyncSession, row: ResourceRow) -> bool:
        """Retired clusters (and so their leases and bills) still point at the site."""
        return bool(await session.scalar(select(func.count()).select_from(ClusterRow)
                                         .where(ClusterRow.site_id == row.id)))


async def site_by_name(session: AsyncSession, name: str) -> SiteRow | None:
    return (await session.execute(select(SiteRow).where(SiteRow.name == name))).scalar_one_or_none()


class ClusterStore(ResourceStore):
    kind = "Cluster"
    row = ClusterRow
    manifest = ClusterManifest
    create_roles: ClassVar[frozenset[Role]] = PROVIDERS
    heartbeat_timeout = timedelta(seconds=60)
    # the jobs holding a cluster (control layer, passed in by the wiring: this layer cannot look up)
    holders: Callable[[AsyncSession, str], Awaitable[list[str]]] | None = None

    async def before_delete(self, session: AsyncSession, principal: Principal, row: ResourceRow) -> None:
        jobs = await self.holders(session, row.id) if self.holders else []
        if jobs:
            raise errors.InUse(f"cluster {row.name!r} is leased by job(s) {', '.join(jobs)}; it can be deleted "
                               "when they finish or are cancelled")

    async def has_history(self, session: AsyncSession, row: ResourceRow) -> bool:
        """A cluster is always retired: leases and bills name it, and no new work is placed on it."""
        return True

    async def prepare(self, session: AsyncSession, principal: Principal, obj: Any,
                      row: ResourceRow | None) -> dict[str, Any]:
        spec = obj.spec
        site = await site_by_name(session, spec.site)
        if site is None:
            raise errors.InvalidInput(f"unknown site {spec.site!r}", field="spec.site")
        if not principal.owns(site.owner_id):
            raise errors.Forbidden(f"site {spec.site!r} belongs to another provider", field="spec.site")
        if spec.driver == "kubernetes" and spec.kubernetes is None:
            raise errors.InvalidInput("driver kubernetes needs {kubeconfigSecret | server, namespace}",
                                      field="spec.kubernetes")
        if spec.driver == "local" and spec.kubernetes is not None:  # it would be stored and never honoured
            raise errors.InvalidInput("spec.kubernetes configures the pods of driver kubernetes; this cluster's "
                                      "driver is local (processes on the agent's machine): set driver: kubernetes "
                                      "or drop spec.kubernetes", field="spec.kubernetes")
        seen: set[str] = set()
        for i, pool in enumerate(spec.node_pools):
            if pool.name in seen:
                raise errors.InvalidInput(f"duplicate node pool name {pool.name!r}", field=f"spec.nodePools[{i}].name")
            seen.add(pool.name)
        if row is not None and spec.kubernetes is not None and spec.kubernetes.kubeconfig_secret is None:
            # write-only: a client that re-sends what it read keeps the stored reference
            spec.kubernetes.kubeconfig_secret = (row.spec.get("kubernetes") or {}).get("kubeconfigSecret")
        return {"site_id": site.id}

    def derive(self, row: ResourceRow, obj: Any, refs: dict[str, Any]) -> None:
        row.site_id = refs["site_id"]  # type: ignore[attr-defined]
        row.driver = obj.spec.driver  # type: ignore[attr-defined]
        row.capacity_gpus = obj.spec.capacity  # type: ignore[attr-defined]
        row.allocatable_gpus = min(row.allocatable_gpus or 0, obj.spec.capacity)  # type: ignore[attr-defined]

    def redact(self, principal: Principal, row: ResourceRow, spec: dict[str, Any]) -> dict[str, Any]:
        kube = spec.get("kubernetes")
        if isinstance(kube, dict):
            kube.pop("kubeconfigSecret", None)
        return spec

    def status_view(self, row: ResourceRow, now: datetime | None = None) -> dict[str, Any]:
        return cluster_status(row, self.heartbeat_timeout, now)  # type: ignore[arg-type]

    def filter_query(self, stmt: Any, principal: Principal, filters: dict[str, str]) -> Any:
        if "site" in filters:
            stmt = stmt.join(SiteRow, SiteRow.id == ClusterRow.site_id).where(SiteRow.name == filters["site"])
        return stmt


def is_ready(row: ClusterRow, timeout: timedelta, now: datetime | None = None) -> tuple[bool, str, str]:
    """A cluster is Ready when it heartbeated within `timeout` and reported itself Ready."""
    now = now or datetime.now(UTC)
    seen = as_utc(row.last_heartbeat_at)
    if seen is None:
        return False, "NoHeartbeat", "no heartbeat received yet"
    if now - seen > timeout:
        return False, "HeartbeatTimeout", f"last heartbeat {int((now - seen).total_seconds())}s ago"
    reported = next((c for c in (row.status or {}).get("reportedConditions", []) if c.get("type") == "Ready"), None)
    if reported and reported.get("status") != "True":
        return False, reported.get("reason") or "NotReady", reported.get("message") or "agent reports not ready"
    return True, "HeartbeatFresh", "agent heartbeating"


READY_CHANGED = "readyChangedAt"  # status key: the heartbeat that last changed the Ready condition
FIRST_HEARTBEAT = "firstHeartbeatAt"  # status key: the cluster's first heartbeat


def cluster_status(row: ClusterRow, timeout: timedelta, now: datetime | None = None) -> dict[str, Any]:
    """The cluster's status as of ``now``. Its conditions' lastTransitionTime is when the condition took its
    current value -- the heartbeat that changed it, the moment its last heartbeat went stale, or the
    cluster's creation -- so reading it twice gives the same time."""
    now = now or datetime.now(UTC)
    ready, reason, message = is_ready(row, timeout, now)
    stored = dict(row.status or {})
    seen = as_utc(row.last_heartbeat_at)
    created = as_utc(row.created_at) or now
    ready_at = {"HeartbeatTimeout": seen + timeout if seen else created, "NoHeartbeat": created}.get(
        reason, _stamp(stored.get(READY_CHANGED)) or seen or created)
    heard_at = (_stamp(stored.get(FIRST_HEARTBEAT)) or seen) if seen else created
    conditions = set_condition(stored.get("conditions", []), "Ready", ready, reason, message, ready_at)
    conditions = set_condition(conditions, "Heartbeat", seen is not None, "Received" if seen else "Missing",
                               seen.isoformat() if seen else "never", heard_at)
    pools = row.spec.get("nodePools", [])
    prices = sorted({p["pricePerGpuHour"] for p in pools}, key=float)
    return {
        "capacity": {"gpus": row.capacity_gpus},
        "allocatable": {"gpus": row.allocatable_gpus if ready else 0},
        "reportedAllocatable": {"gpus": row.allocatable_gpus},
        "ready": "True" if ready else "False",
        "conditions": conditions,
        "lastHeartbeatTime": seen.isoformat() if seen else None,
        "gpuModel": ",".join(sorted({p["gpu"]["model"] for p in pools})),
        "price": f"{prices[0]} {row.spec.get('currency', 'USD')}/GPU-h" if prices else None,
        **({"fabric": stored["discoveredFabric"]} if stored.get("discoveredFabric") else {}),  # as the agent found it
    }


def _stamp(text: str | None) -> datetime | None:
    return datetime.fromisoformat(text) if text else None


LINK_FIGURES = ("a", "b", "bandwidthGbps", "rttMs", "pricePerGB")  # what both providers of a link must state alike


def link_active(status: dict[str, Any] | None) -> bool:
    """Whether planning and pricing may use a link: every provider of its two sites applied it (or an admin
    did). A link stored before consent existed (no `accepted` in its status) counts as active."""
    return (status or {}).get("accepted", True) is not False


def _same_figures(stored: dict[str, Any], wire: dict[str, Any]) -> bool:
    from decimal import Decimal
    for k in LINK_FIGURES:
        x, y = stored.get(k), wire.get(k)
        if k in ("a", "b"):
            if x != y:
                return False
        elif x is None or y is None or Decimal(str(x)) != Decimal(str(y)):
            return False
    return True


class LinkStore(ResourceStore):
    """A link between two sites of one provider is that provider's. A link between two providers' sites is
    an agreement: the first provider's apply makes it *pending* (status `accepted: false`, condition
    `Accepted=False AwaitingOtherProvider`) and no plan or price uses it until the other site's provider
    applies a link between the same two sites with the same figures (a, b, bandwidthGbps, rttMs,
    pricePerGB); then it is active and both providers may change or delete it (a change by one makes it
    pending again for the other; a delete by either removes it). An apply with other figures replaces a
    pending link that awaits the caller (a counter-proposal, now awaiting the first provider). An admin's
    link is active at once. See docs/security.md (M4)."""

    kind = "Link"
    row = LinkRow
    manifest = LinkManifest
    create_roles: ClassVar[frozenset[Role]] = PROVIDERS

    def authorize_write(self, principal: Principal, row: ResourceRow | None) -> None:
        if principal.role not in self.create_roles and not principal.is_admin:
            raise errors.Forbidden(f"role {principal.role.value!r} may not change {self.kind} objects")
        if row is None or principal.owns(row.owner_id):
            return
        if principal.account_id not in {p.get("account") for p in (row.status or {}).get("parties", [])}:
            raise errors.Forbidden(f"Link {row.name!r} joins two sites of other providers: only they (or an admin) "
                                   "may change or delete it")

    async def _sides(self, session: AsyncSession, principal: Principal, obj: Any) -> tuple[SiteRow, SiteRow]:
        spec = obj.spec
        if spec.a == spec.b:
            raise errors.InvalidInput("a link must join two different sites", field="spec.b")
        a, b = await site_by_name(session, spec.a), await site_by_name(session, spec.b)
        for side, site in (("a", a), ("b", b)):
            if site is None:
                raise errors.InvalidInput(f"unknown site {getattr(spec, side)!r}: register the Site first",
                                          field=f"spec.{side}")
        assert a is not None and b is not None
        if not (principal.owns(a.owner_id) or principal.owns(b.owner_id)):
            raise errors.Forbidden(f"spec.a: a link may be registered only by the provider of one of its ends "
                                   f"({spec.a!r} or {spec.b!r}) or an admin", field="spec.a")
        return a, b

    @staticmethod
    def _status(principal: Principal, a: SiteRow, b: SiteRow, wire: dict[str, Any],
                accepted: set[str]) -> dict[str, Any]:
        parties = {a.owner_id: a.spec.get("provider") or a.owner_id, b.owner_id: b.spec.get("provider") or b.owner_id}
        if principal.is_admin or len(parties) == 1:
            accepted = set(parties)
        accepted &= set(parties)
        now = datetime.now(UTC)
        if accepted == set(parties):
            how = "Admin" if principal.is_admin and len(parties) > 1 and principal.account_id not in parties else (
                "BothProviders" if len(parties) > 1 else "OneProvider")
            cond = set_condition([], "Accepted", True, how, "in use: every provider of its two sites applied it"
                                 if how != "Admin" else "in use: created by an admin", now)
        else:
            waiting = [(acc, name) for acc, name in parties.items() if acc not in accepted]
            acc, name = waiting[0]
            site = a if a.owner_id == acc else b
            figures = ", ".join(f"{k}: {wire.get(k)}" for k in LINK_FIGURES)
            cond = set_condition([], "Accepted", False, "AwaitingOtherProvider",
                                 f"pending: not used by any plan until provider {name!r} (owner of site "
                                 f"{site.name!r}) applies a Link between {a.name} and {b.name} with the same "
                                 f"figures ({figures}), or deletes this one", now)
        return {"accepted": accepted == set(parties), "conditions": cond,
                "parties": [{"provider": name, "account": acc, "accepted": acc in accepted}
                            for acc, name in sorted(parties.items(), key=lambda kv: kv[1])]}

    @staticmethod
    def _accepted(row: ResourceRow) -> set[str]:
        return {p["account"] for p in (row.status or {}).get("parties", []) if p.get("accepted")}

    def status_view(self, row: ResourceRow, now: datetime | None = None) -> dict[str, Any]:
        """The stored status with `state`: Active (planning uses it) or Pending (awaiting the other provider)."""
        status = dict(row.status or {})
        status["state"] = "Active" if link_active(status) else "Pending"
        return status

    async def _pair(self, session: AsyncSession, a: SiteRow, b: SiteRow) -> LinkRow | None:
        key = "|".join(sorted((a.name, b.name)))
        return (await session.execute(select(LinkRow).where(LinkRow.pair_key == key))).scalar_one_or_none()

    async def prepare(self, session: AsyncSession, principal: Principal, obj: Any,
                      row: ResourceRow | None) -> dict[str, Any]:
        """A replace (a create goes through `create_row`): the figures unchanged keep who accepted them and add
        the caller; changed, only the caller has accepted them."""
        a, b = await self._sides(session, principal, obj)
        clash = await self._pair(session, a, b)
        if clash is not None and (row is None or clash.id != row.id):
            raise errors.InvalidInput(f"spec.b: link {clash.name!r} already joins {a.name} and {b.name}; "
                                      f"change that one (cpnctl edit link {clash.name}) or delete it first",
                                      field="spec.b")
        wire = obj.spec.model_dump(mode="json", by_alias=True, exclude_none=True)
        accepted = {principal.account_id}
        if row is not None and _same_figures(row.spec or {}, wire):
            accepted |= self._accepted(row)
        return {"ids": (a.id, b.id, "|".join(sorted((a.name, b.name)))),
                "status": self._status(principal, a, b, wire, accepted)}

    async def create_row(self, session: AsyncSession, principal: Principal, body: Any, *,
                         flush: bool = True, existing: Any = _UNCHECKED) -> ResourceRow:
        obj = body if isinstance(body, self.manifest) else self.parse(body)
        self.authorize_write(principal, None)
        key = self.new_key(principal, obj)
        if (await self.find(session, key) if existing is _UNCHECKED else existing) is not None:
            raise errors.AlreadyExists(f"{self.kind} {key!r} already exists", field="metadata.name")
        a, b = await self._sides(session, principal, obj)
        wire = obj.spec.model_dump(mode="json", by_alias=True, exclude_none=True)
        clash = await self._pair(session, a, b)
        if clash is not None:
            mine = self._accepted(clash)
            parties = {p.get("account") for p in (clash.status or {}).get("parties", [])}
            awaits_me = principal.account_id in parties and principal.account_id not in mine and not principal.is_admin
            if awaits_me and _same_figures(clash.spec or {}, wire):  # consent: the other provider's link, accepted
                clash.status = self._status(principal, a, b, wire, mine | {principal.account_id})
                if flush:
                    await session.flush()
                return clash
            if not awaits_me:
                raise errors.InvalidInput(
                    f"spec.b: link {clash.name!r} already joins {a.name} and {b.name}; change that one "
                    f"(cpnctl edit link {clash.name}) or delete it first", field="spec.b")
            await session.delete(clash)  # a pending proposal awaiting the caller: its own figures replace it
            await session.flush()
        row = self.row(name=key, owner_id=principal.account_id)
        self._fill(row, obj, {"ids": (a.id, b.id, "|".join(sorted((a.name, b.name)))),
                              "status": self._status(principal, a, b, wire, {principal.account_id})})
        session.add(row)
        if flush:
            await session.flush()
        return row

    async def apply(self, session: AsyncSession, principal: Principal, body: Any) -> tuple[str, dict[str, Any]]:
        verb, out = await super().apply(session, principal, body)
        named = (body.get("metadata") or {}).get("name") if isinstance(body, dict) else None
        return ("configured" if verb == "created" and named and out["metadata"]["name"] != named else verb), out

    def derive(self, row: ResourceRow, obj: Any, refs: dict[str, Any]) -> None:
        row.site_a_id, row.site_b_id, row.pair_key = refs["ids"]  # type: ignore[attr-defined]
        row.status = refs["status"]
