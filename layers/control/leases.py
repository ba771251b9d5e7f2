"""Reservations: GPUs leased to a job at each cluster, taken under row locks so that concurrent
accepts never double-book (SELECT … FOR UPDATE on PostgreSQL; serialised on SQLite)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from cpn.core import errors
from cpn.core.principal import Principal, Role
from layers.control.models import LeaseRow
from layers.resource.models import ClusterRow
from layers.resource.stores import is_ready


@dataclass(frozen=True)
class Want:
    subtask: str
    cluster: str
    gpus: int


async def reserve(session: AsyncSession, *, job: str, owner_id: str, contract_id: str | None,
                  wants: list[Want], heartbeat_timeout: timedelta, lease_ttl: timedelta,
                  now: datetime | None = None) -> list[LeaseRow]:
    """Lease every wanted GPU or none. Raises Conflict naming the cluster that ran short."""
    now = now or datetime.now(UTC)
    by_cluster: dict[str, int] = defaultdict(int)
    for want in wants:
        by_cluster[want.cluster] += want.gpus
    rows = {}
    for name in sorted(by_cluster):  # a fixed lock order avoids deadlocks between concurrent accepts
        row = (await session.execute(select(ClusterRow).where(ClusterRow.name == name).with_for_update())
               ).scalar_one_or_none()
        if row is None:
            raise errors.Conflict(f"cluster {name!r} no longer exists")
        rows[name] = row
    for name, gpus in by_cluster.items():
        row = rows[name]
        ready, reason, _ = is_ready(row, heartbeat_timeout, now)
        if not ready:
            raise errors.Conflict(f"cluster {name!r} is not Ready ({reason})")
        leased = await session.scalar(select(func.coalesce(func.sum(LeaseRow.gpus), 0))
                                      .where(LeaseRow.cluster == name, LeaseRow.state == "active"))
        free = row.allocatable_gpus - int(leased or 0)
        if gpus > free:
            raise errors.Conflict(f"cluster {name!r} has {max(free, 0)} GPUs free, {gpus} needed")
    leases = [LeaseRow(job=job, subtask=w.subtask, contract_id=contract_id, cluster_id=rows[w.cluster].id,
                       cluster=w.cluster, owner_id=owner_id, gpus=w.gpus, state="active",
                       expires_at=now + lease_ttl) for w in wants]
    session.add_all(leases)
    await session.flush()
    return leases


async def release(session: AsyncSession, job: str, reason: str, *, cluster: str | None = None,
                  now: datetime | None = None) -> int:
    """Release a job's active leases (all, or one cluster's). Returns how many were released."""
    stmt = update(LeaseRow).where(LeaseRow.job == job, LeaseRow.state == "active")
    if cluster is not None:
        stmt = stmt.where(LeaseRow.cluster == cluster)
    result = await session.execute(stmt.values(state="released", released_at=now or datetime.now(UTC),
                                               reason=reason[:200], resource_version=LeaseRow.resource_version + 1)
                                   .execution_options(synchronize_session=False))
    return int(result.rowcount or 0)


async def hold(session: AsyncSession, job: str, until: datetime) -> None:
    """A started job keeps its leases: push their expiry out."""
    await session.execute(update(LeaseRow).where(LeaseRow.job == job, LeaseRow.state == "active")
                          .values(expires_at=until, resource_version=LeaseRow.resource_version + 1)
                          .execution_options(synchronize_session=False))


async def expire(session: AsyncSession, now: datetime | None = None) -> list[str]:
    """Expire leases whose job never started in time; returns the affected jobs."""
    now = now or datetime.now(UTC)
    rows = (await session.execute(select(LeaseRow).where(LeaseRow.state == "active",
                                                         LeaseRow.expires_at < now))).scalars().all()
    for row in rows:
        row.state, row.released_at, row.reason = "expired", now, "lease expired before the job started"
    await session.flush()
    return sorted({r.job for r in rows})


async def visible(session: AsyncSession, principal: Principal, job: str | None = None,
                  namespace: str | None = None) -> list[LeaseRow]:
    """Leases the caller may see: a provider those on its clusters, a user those of its jobs (of the
    jobs in ``namespace`` only, when given)."""
    rows = await active(session, job=job)
    if namespace is not None:
        rows = [r for r in rows if r.job.startswith(f"{namespace}/")]
    if principal.role is Role.PROVIDER:
        mine = set((await session.execute(select(ClusterRow.name).where(ClusterRow.owner_id == principal.account_id)))
                   .scalars())
        return [r for r in rows if r.cluster in mine]
    if not principal.is_admin:
        return [r for r in rows if r.owner_id == principal.account_id]
    return rows


async def active(session: AsyncSession, job: str | None = None, owner_id: str | None = None) -> list[LeaseRow]:
    stmt = select(LeaseRow).order_by(LeaseRow.created_at)
    if job is not None:
        stmt = stmt.where(LeaseRow.job == job)
    if owner_id is not None:
        stmt = stmt.where(LeaseRow.owner_id == owner_id)
    return list((await session.execute(stmt)).scalars())


async def holders(session: AsyncSession, cluster_id: str) -> list[str]:
    """The jobs holding active leases on a cluster: what blocks retiring it."""
    stmt = select(LeaseRow.job).where(LeaseRow.cluster_id == cluster_id, LeaseRow.state == "active").distinct()
    return sorted((await session.execute(stmt)).scalars())
