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
from cpn.core.store import RETIRED, ResourceRow, ResourceStore
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


class LinkStore(ResourceStore):
    kind = "Link"
    row = LinkRow
    manifest = LinkManifest
    create_roles: ClassVar[frozenset[Role]] = PROVIDERS

    async def prepare(self, session: AsyncSession, principal: Principal, obj: Any,
                      row: ResourceRow | None) -> dict[str, Any]:
        spec = obj.spec
        if spec.a == spec.b:
            raise errors.InvalidInput("a link must join two different sites", field="spec.b")
        a, b = await site_by_name(session, spec.a), await site_by_name(session, spec.b)
        for side, site in (("a", a), ("b", b)):
            if site is None:
                raise errors.InvalidInput(f"unknown site {getattr(spec, side)!r}", field=f"spec.{side}")
        assert a is not None and b is not None
        if not (principal.owns(a.owner_id) or principal.owns(b.owner_id)):
            raise errors.Forbidden("a link may be registered only by the provider of one of its ends")
        if spec.price_per_gb > 0 and not principal.owns(a.owner_id):
            raise errors.Forbidden(
                f"spec.pricePerGB: a link's egress price is what the provider of its source site spec.a "
                f"({spec.a!r}) charges, and {spec.a!r} belongs to another provider; put your own site in spec.a "
                "to price your egress, or set pricePerGB: 0", field="spec.pricePerGB")
        key = "|".join(sorted((spec.a, spec.b)))
        clash = (await session.execute(select(LinkRow).where(LinkRow.pair_key == key))).scalar_one_or_none()
        if clash is not None and (row is None or clash.id != row.id):
            raise errors.InvalidInput(f"link {clash.name!r} already joins {spec.a} and {spec.b}", field="spec.b")
        return {"ids": (a.id, b.id, key)}

    def derive(self, row: ResourceRow, obj: Any, refs: dict[str, Any]) -> None:
        row.site_a_id, row.site_b_id, row.pair_key = refs["ids"]  # type: ignore[attr-defined]
