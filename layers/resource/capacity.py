"""Live capacity: heartbeats from agents and the Ready view the scheduler reads."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import bindparam, func, literal, select, union_all, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm.attributes import set_committed_value

from cpn.core import errors
from cpn.core.db import as_utc
from cpn.core.principal import Principal, Role
from cpn.core.store import RETIRED
from layers.resource.models import ClusterRow, LinkRow, SiteRow
from layers.resource.schemas import HeartbeatBatch, HeartbeatRequest
from layers.resource.stores import FIRST_HEARTBEAT, READY_CHANGED, is_ready, link_active


async def heartbeat(session: AsyncSession, principal: Principal, name: str, body: HeartbeatRequest,
                    timeout: timedelta, now: datetime | None = None) -> ClusterRow:
    """Record an agent's report; only the cluster's provider (or an admin) may send it. ``timeout``: the
    heartbeat timeout, to tell when the report changes the cluster's readiness (its transition time)."""
    # the row lock the batch path takes: a concurrent write to the row (a PATCH of its labels) queues
    # behind this one instead of making it fail the version check (issue 36, item 3)
    stmt = select(ClusterRow).where(ClusterRow.name == name).with_for_update()
    row = (await session.execute(stmt)).scalar_one_or_none()
    _record(principal, name, row, body, now or datetime.now(UTC), timeout)
    await session.flush()
    return row  # type: ignore[return-value]


async def heartbeats(session: AsyncSession, principal: Principal, batch: HeartbeatBatch, timeout: timedelta,
                     now: datetime | None = None) -> list[ClusterRow]:
    """Record many clusters' reports with one read and one write; any bad item refuses the batch.

    The read locks the rows (in name order, so two overlapping batches queue instead of deadlocking),
    so the write is one pipelined executemany at version + 1 rather than a version-checked UPDATE
    round trip per cluster, which is where a batch's time went (docs/benchmarks/api.md)."""
    names = [item.cluster for item in batch.items]
    stmt = select(ClusterRow).where(ClusterRow.name.in_(names)).order_by(ClusterRow.name).with_for_update()
    rows = {r.name: r for r in (await session.execute(stmt)).scalars()}
    at = now or datetime.now(UTC)
    with session.no_autoflush:  # the rows are written below in one statement, not flushed one by one
        for i, item in enumerate(batch.items):
            try:
                _record(principal, item.cluster, rows.get(item.cluster), item, at, timeout)
            except errors.CPNError as exc:
                exc.field = f"items[{i}].{exc.field or 'cluster'}"
                exc.message = f"items[{i}]: {exc.message}"
                raise
        touched = [rows[n] for n in dict.fromkeys(names)]
        await _write_locked(session, touched, at)
    return touched


_HEARTBEAT_COLUMNS = ("status", "capacity_gpus", "allocatable_gpus", "last_heartbeat_at")


async def _write_locked(session: AsyncSession, rows: list[ClusterRow], at: datetime) -> None:
    """Write the heartbeat columns of rows this transaction holds locked (so nobody else moved their
    version) in one statement, and tell the ORM they are stored (so its flush writes nothing more)."""
    table = ClusterRow.__table__
    stmt = (update(table).where(table.c.id == bindparam("row_id"))
            .values({**{c: bindparam(f"new_{c}") for c in _HEARTBEAT_COLUMNS},
                     "resource_version": bindparam("new_version"), "updated_at": at}))
    await session.execute(stmt, [{"row_id": r.id, "new_version": r.resource_version + 1,
                                  **{f"new_{c}": getattr(r, c) for c in _HEARTBEAT_COLUMNS}} for r in rows])
    for r in rows:
        for column in _HEARTBEAT_COLUMNS:
            set_committed_value(r, column, getattr(r, column))
        set_committed_value(r, "resource_version", r.resource_version + 1)
        set_committed_value(r, "updated_at", at)


def _record(principal: Principal, name: str, row: ClusterRow | None, body: HeartbeatRequest, now: datetime,
            timeout: timedelta) -> None:
    if row is None:
        raise errors.NotFound(f"Cluster {name!r} not found")
    if not principal.owns(row.owner_id):
        if principal.role not in (Role.PROVIDER, Role.ADMIN):
            raise errors.Forbidden(f"heartbeats come from the cluster's provider; this token is a {principal.role.value}'s "
                                   "(create a provider token: cpn token create NAME --role provider)")
        raise errors.Forbidden(f"cluster {name!r} belongs to another provider")
    before = is_ready(row, timeout, now)[:2]
    capacity = body.capacity_gpus if body.capacity_gpus is not None else row.capacity_gpus
    if body.allocatable_gpus > capacity:
        raise errors.InvalidInput(f"allocatableGpus {body.allocatable_gpus} exceeds capacity {capacity}",
                                  field="allocatableGpus")
    status = dict(row.status or {})
    status["reportedConditions"] = [c.wire() for c in body.conditions]
    if body.node_pools is not None:
        status["discoveredPools"] = [p.wire() for p in body.node_pools]
    if body.fabric is not None:
        status["discoveredFabric"] = body.fabric.model_dump(mode="json", by_alias=True)  # nulls: unknown
    row.status = status
    row.capacity_gpus = capacity
    row.allocatable_gpus = body.allocatable_gpus
    row.last_heartbeat_at = now
    status = dict(status)
    if is_ready(row, timeout, now)[:2] != before or READY_CHANGED not in status:
        status[READY_CHANGED] = now.isoformat()  # the Ready condition's lastTransitionTime (stores.cluster_status)
    status.setdefault(FIRST_HEARTBEAT, now.isoformat())
    row.status = status


@dataclass(frozen=True)
class ClusterView:
    """What the control layer needs of one cluster to place work on it."""

    name: str
    site: str
    region: str
    provider: str
    owner_id: str
    driver: str
    ready: bool
    allocatable_gpus: int
    capacity_gpus: int
    spec: dict[str, Any]


@dataclass(frozen=True)
class LinkView:
    name: str
    a: str
    b: str
    bandwidth_gbps: float
    rtt_ms: float
    price_per_gb: str
    owner_id: str


async def inventory(session: AsyncSession, heartbeat_timeout: timedelta,
                    now: datetime | None = None) -> tuple[list[ClusterView], list[LinkView]]:
    """Every cluster with its live state, and every link.

    The catalogue as stored is loaded once per change, not once per call: one aggregate query
    (count, latest `updated_at`, sum of versions of clusters, sites and links — every write moves
    one of them) says whether the copy this process holds is still the database's; readiness is then
    computed for `now` from the stored heartbeat times. Replicas each keep their own copy and each
    check it against the database on every call."""
    now = now or datetime.now(UTC)
    stored = await _stored_catalogue(session)
    clusters = []
    for cluster in stored.clusters:
        ready = is_ready(cluster, heartbeat_timeout, now)[0]  # type: ignore[arg-type]
        clusters.append(ClusterView(
            name=cluster.name, site=cluster.site, region=cluster.region, provider=cluster.provider,
            owner_id=cluster.owner_id, driver=cluster.driver, ready=ready,
            allocatable_gpus=cluster.allocatable_gpus if ready else 0, capacity_gpus=cluster.capacity_gpus,
            spec=cluster.spec))
    return clusters, list(stored.links)


@dataclass(frozen=True)
class _StoredCluster:
    """A cluster row as stored (what `is_ready` and ClusterView read), detached from any session."""

    name: str
    site: str
    region: str
    provider: str
    owner_id: str
    driver: str
    allocatable_gpus: int
    capacity_gpus: int
    spec: dict[str, Any]
    status: dict[str, Any]
    last_heartbeat_at: datetime | None


@dataclass(frozen=True)
class _Catalogue:
    stamp: tuple[Any, ...]
    clusters: tuple[_StoredCluster, ...]
    links: tuple[LinkView, ...]


_catalogues: dict[str, _Catalogue] = {}  # database URL → the catalogue last loaded from it


def _stamp_of(row: Any, tag: str) -> Any:
    return select(literal(tag).label("tag"), func.count(row.id), func.max(row.updated_at),
                  func.coalesce(func.sum(row.resource_version), 0))


async def _stored_catalogue(session: AsyncSession) -> _Catalogue:
    return (await stored_catalogue(session))[0]


CATALOGUE_TAGS = ("c", "s", "l")  # the stamp rows of clusters, sites and links
_stamp_queries: dict[tuple[Any, ...], Any] = {}


async def stored_catalogue(session: AsyncSession, also: tuple[Any, ...] = (),
                           params: dict[str, Any] | None = None) -> tuple[_Catalogue, list[Any]]:
    """The catalogue as stored (the same object while nothing changed), and the rows of `also`: more
    selects of the stamp's shape (tag, count, timestamp, number; tags other than c/s/l) that callers
    above this layer send in the same round trip (lease sums, their own stamps), `params` the values
    of their bind parameters."""
    stmt = _stamp_queries.get(also)
    if stmt is None:  # built once per distinct `also` (callers pass the same statement objects)
        stmt = _stamp_queries[also] = union_all(_stamp_of(ClusterRow, "c"), _stamp_of(SiteRow, "s"),
                                                _stamp_of(LinkRow, "l"), *also)
    stamps = (await session.execute(stmt, params)).all()
    stamp = tuple(sorted((r[0], r[1], as_utc(r[2]), int(r[3])) for r in stamps if r[0] in CATALOGUE_TAGS))
    extra = [r for r in stamps if r[0] not in CATALOGUE_TAGS]
    where = str(session.get_bind().url)
    held = _catalogues.get(where)
    if held is not None and held.stamp == stamp:
        return held, extra
    return await _load_once(session, where, stamp), extra


_loading: dict[str, tuple[tuple[Any, ...], asyncio.Future[_Catalogue | None]]] = {}  # URL → (stamp, load)


async def _load_once(session: AsyncSession, where: str, stamp: tuple[Any, ...]) -> _Catalogue:
    """The catalogue at `stamp`, loaded by one request of this process while the others that read the
    same stamp wait for it: at a burst's start (or after a write) every request in flight used to miss
    the copy together and each load and decode the whole catalogue (a tenth of a cold 1,000-quote
    burst's CPU, docs/benchmarks/api.md). A waiter whose loader failed loads by itself."""
    loop = asyncio.get_running_loop()
    pending = _loading.get(where)
    if pending is not None and pending[0] == stamp and pending[1].get_loop() is loop:
        shared = await asyncio.shield(pending[1])
        if shared is not None:
            return shared
    future: asyncio.Future[_Catalogue | None] = loop.create_future()
    _loading[where] = (stamp, future)
    loaded = None
    try:
        loaded = await _load(session, stamp)
        _catalogues[where] = loaded
        return loaded
    finally:
        future.set_result(loaded)
        if _loading.get(where, (None, None))[1] is future:
            del _loading[where]


async def _load(session: AsyncSession, stamp: tuple[Any, ...]) -> _Catalogue:
    """The catalogue's rows, read after `stamp` was (so they are at least as new as it says)."""
    rows = (await session.execute(select(ClusterRow, SiteRow).join(SiteRow, SiteRow.id == ClusterRow.site_id)
                                  .where(ClusterRow.name.not_like(f"{RETIRED}%"))  # retired: no new work
                                  .order_by(ClusterRow.name))).all()
    clusters = tuple(_StoredCluster(
        name=c.name, site=s.name, region=s.region, provider=s.spec.get("provider") or "", owner_id=c.owner_id,
        driver=c.driver, allocatable_gpus=c.allocatable_gpus, capacity_gpus=c.capacity_gpus, spec=c.spec,
        status=c.status or {}, last_heartbeat_at=c.last_heartbeat_at) for c, s in rows)
    links = tuple(LinkView(name=r.name, a=r.spec["a"], b=r.spec["b"], bandwidth_gbps=float(r.spec["bandwidthGbps"]),
                           rtt_ms=float(r.spec["rttMs"]), price_per_gb=str(r.spec["pricePerGB"]), owner_id=r.owner_id)
                  for r in (await session.execute(select(LinkRow).order_by(LinkRow.name))).scalars()
                  if link_active(r.status))  # a pending link between two providers' sites is not offered
    return _Catalogue(stamp, clusters, links)
