"""The server's side of the site-agent protocol. Agents dial out with their provider's token; each
sees and claims only the sub-tasks placed on clusters its provider owns (others: 404), receives the
attempt contract on claim, and reports phase, exit codes and worker output back.

Desired state (`SubtaskRow.desired`) is written by the reconciler only; reported state
(`reported`, exit codes, message) by the agent only. The reconciler reads both.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from cpn.core import errors
from cpn.core.db import as_utc
from cpn.core.phases import SUBTASK_DONE, SubtaskPhase
from cpn.core.principal import Principal, Role
from cpn.runtime.contract import AttemptSpec, CodeRef, DataRef, Endpoint, Integer
from layers.orchestration.identity.models import Account
from layers.orchestration.identity.tokens import issue_token, revoke_subtask_tokens, subtask_has_token
from layers.orchestration.jobs.data import data_ref
from layers.orchestration.lifecycle.models import LogRow, SubtaskRow
from layers.orchestration.lifecycle.plan import elastic
from layers.resource.models import ClusterRow
from layers.resource.schemas import fabric_of
from layers.service.jobs import display_name, find_job
from layers.service.models import JobRow

REPORTABLE = tuple(p.value for p in SubtaskPhase if p is not SubtaskPhase.PENDING)  # Pending is the server's
DONE = SUBTASK_DONE
MAX_LOG_LINE = 4000
MAX_RANK = 10**9  # a worker's global rank, as the logs store it (a 32-bit column; GET …/logs?rank= takes as many)
LOG_PAGE = 5000  # lines per read: longer logs are read page by page
# a sub-task's log stays open this long after it ended (its runner ships the last lines after the end);
# later lines are refused, so nobody writes into a finished job's log (issue 35, L2)
LOG_GRACE = timedelta(minutes=2)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ClaimRequest(_Body):
    rendezvous: Endpoint | None = Field(default=None, description="Only from the agent of the sub-task holding "
                                        "global rank 0: where its workers serve the job's rendezvous")


class SubtaskReport(_Body):
    phase: Literal["Launching", "Running", "Succeeded", "Failed", "Cancelled", "Lost"]
    message: str = Field(default="", max_length=2000)
    exit_codes: dict[str, Integer | None] = Field(default_factory=dict, alias="exitCodes", max_length=4096)
    devices: list[str] | None = Field(default=None, max_length=4096, description="the device indices the "
                                      "site's agent gave the sub-task's workers (CUDA_VISIBLE_DEVICES)")


class LogLineIn(_Body):
    rank: Integer = Field(ge=0, le=MAX_RANK)
    line: str = Field(max_length=MAX_LOG_LINE)


class LogBatch(_Body):
    lines: list[LogLineIn] = Field(max_length=5000)


def view(t: SubtaskRow) -> dict[str, Any]:
    """The SubTask manifest (never the contract: that comes only with a claim)."""
    return {"apiVersion": "cpn/v1", "kind": "SubTask",
            "metadata": {"name": t.name, "uid": t.id, "creationTimestamp": t.created_at.isoformat()},
            "spec": {"job": t.job, "attempt": t.attempt, "cluster": t.cluster, "site": t.site, "gpus": t.gpus,
                     "driver": t.driver, "desired": t.desired, "firstRank": t.first_rank},
            "status": {"phase": t.phase, "launches": t.launches, "message": t.message,
                       "exitCodes": t.exit_codes or {}, "devices": (t.handle or {}).get("devices"),
                       "claimedAt": t.claimed_at.isoformat() if t.claimed_at else None,
                       "reportedAt": t.reported_at.isoformat() if t.reported_at else None}}


async def _owned_clusters(s: AsyncSession, principal: Principal) -> Any:
    return select(ClusterRow.name).where(ClusterRow.owner_id == principal.account_id)


async def visible(s: AsyncSession, principal: Principal, *, cluster: str | None = None, job: str | None = None,
                  active: bool = False) -> list[SubtaskRow]:
    """Sub-tasks the caller may see: a provider those on its clusters, a user those of its own jobs."""
    stmt = select(SubtaskRow).order_by(SubtaskRow.job, SubtaskRow.attempt, SubtaskRow.site_index)
    if principal.role is Role.PROVIDER:
        stmt = stmt.where(SubtaskRow.cluster.in_(await _owned_clusters(s, principal)))
    elif not principal.is_admin:
        stmt = stmt.where(SubtaskRow.job.in_(select(JobRow.name).where(JobRow.owner_id == principal.account_id)))
    if cluster is not None:
        await _check_cluster(s, principal, cluster)
        stmt = stmt.where(SubtaskRow.cluster == cluster)
    if job is not None:
        stmt = stmt.where(SubtaskRow.job == job)
    if active:
        stmt = stmt.where(SubtaskRow.phase.not_in(DONE))
    return list((await s.execute(stmt)).scalars())


async def version(s: AsyncSession, cluster: str) -> str:
    """Changes whenever a sub-task of the cluster changes: what a watch waits on."""
    row = (await s.execute(select(func.count(), func.max(SubtaskRow.updated_at), func.sum(SubtaskRow.resource_version))
                           .where(SubtaskRow.cluster == cluster))).one()
    stamp = int(row[1].timestamp() * 1e6) if row[1] else 0  # digits only: opaque and URL-safe on any database
    return f"{row[0]}.{stamp}.{row[2] or 0}"


async def _check_cluster(s: AsyncSession, principal: Principal, cluster: str) -> ClusterRow:
    row = (await s.execute(select(ClusterRow).where(ClusterRow.name == cluster))).scalar_one_or_none()
    if row is None or not principal.owns(row.owner_id):
        raise errors.NotFound(f"Cluster {cluster!r} not found", field="cluster")
    return row


async def _load(s: AsyncSession, principal: Principal, uid: str, *, lock: bool = False) -> SubtaskRow:
    stmt = select(SubtaskRow).where(SubtaskRow.id == uid)
    if lock:
        stmt = stmt.with_for_update()
    row = (await s.execute(stmt)).scalar_one_or_none()
    if row is None or principal.role not in (Role.PROVIDER, Role.ADMIN):
        raise errors.NotFound(f"SubTask {uid!r} not found")
    await _check_cluster(s, principal, row.cluster)
    return row


async def get(s: AsyncSession, principal: Principal, uid: str) -> SubtaskRow:
    return await _load(s, principal, uid)


async def _rendezvous(s: AsyncSession, t: SubtaskRow) -> dict[str, Any] | None:
    lead = (await s.execute(select(SubtaskRow).where(SubtaskRow.job == t.job, SubtaskRow.attempt == t.attempt,
                                                     SubtaskRow.first_rank == 0))).scalar_one_or_none()
    return lead.rendezvous if lead is not None else None


async def claim(s: AsyncSession, principal: Principal, uid: str, body: ClaimRequest) -> AttemptSpec:
    """The first claim moves the sub-task to Launching and mints its workers' one token (valid for this
    sub-task's attempt, site and ranks only). A claim once that token exists is refused (409): the
    server keeps only the token's hash, so it cannot hand it out again, and a fresh token on every
    claim let any holder of the provider's token collect tokens (issue 35, C1/M1). A restarted agent
    re-adopts the runs it launched; one that died between claim and launch leaves the sub-task to the
    claim timeout, which fails it as the site's fault (credited) and re-places the attempt."""
    t = await _load(s, principal, uid, lock=True)
    if t.desired != "Run" or t.phase in DONE:
        raise errors.Conflict(f"sub-task {t.name} (attempt {t.attempt}) is {t.phase}, desired {t.desired}: "
                              "nothing to run", field="desired")
    if t.claimed_at is not None and await subtask_has_token(s, t.id):
        raise errors.Conflict(f"sub-task {t.name} (attempt {t.attempt}) was claimed at {t.claimed_at.isoformat()}; "
                              "a sub-task is claimed once (its worker token is minted once): an agent that lost "
                              "its run lets the claim timeout re-place it", field="claimedAt")
    job = await find_job(s, t.job)
    if job is None:
        raise errors.NotFound(f"TrainingJob {t.job!r} not found")
    if t.first_rank == 0 and t.rendezvous is None:
        if body.rendezvous is None:
            raise errors.InvalidInput("this sub-task holds global rank 0: its agent must advertise the "
                                      "rendezvous endpoint", field="rendezvous")
        t.rendezvous = body.rendezvous.model_dump()
    rendezvous = await _rendezvous(s, t)
    if rendezvous is None:
        raise errors.Conflict(f"sub-task {t.name} waits for the rendezvous of the job's first site; retry",
                              field="rendezvous")
    if t.phase == "Pending":
        t.phase, t.launches, t.claimed_at = "Launching", t.launches + 1, datetime.now(UTC)
        t.launched_at = t.claimed_at
    owner = (await s.execute(select(Account).where(Account.id == job.owner_id))).scalar_one()
    token = await issue_token(s, owner, f"worker-{display_name(job.name)}-{t.attempt}"[:63], job=job.name,
                              subtask=t.id)
    cluster = (await s.execute(select(ClusterRow).where(ClusterRow.name == t.cluster))).scalar_one_or_none()
    fabric = fabric_of(cluster.spec or {}) if cluster is not None else None
    return contract(job, t, rendezvous, token, data=await data_ref(s, job, t.site),
                    env=fabric.nccl_env() if fabric is not None else None)


async def check_worker(s: AsyncSession, principal: Principal, job: JobRow, reports: list[dict[str, Any]]) -> None:
    """A worker token speaks for its own sub-task only: the job's current attempt, while the sub-task
    runs, and its own site and ranks (issue 35, M1: a token of attempt 1 posted usage into attempt 2;
    issue 36, item 2: a Lost sub-task's workers went on billing). Tokens minted before sub-task
    binding (no `subtask`) keep their job-wide scope until the job ends."""
    if principal.role is not Role.WORKER or principal.subtask is None:
        return
    t = (await s.execute(select(SubtaskRow).where(SubtaskRow.id == principal.subtask))).scalar_one_or_none()
    attempt = int(job.status.get("attempt", 1))
    if t is None or t.job != job.name or t.attempt != attempt:
        raise errors.Forbidden(f"this worker token belongs to attempt {t.attempt if t else '?'} of the job, "
                               f"not to its current attempt {attempt}")
    if t.phase in DONE:
        raise errors.Forbidden(f"sub-task {t.name} is {t.phase}: its workers' reports are no longer taken")
    ranks = range(t.first_rank, t.first_rank + t.gpus)
    for i, report in enumerate(reports):
        if report.get("site") != t.site_index:
            raise errors.Forbidden(f"reports[{i}].site is {report.get('site')!r}: this worker token reports for "
                                   f"site {t.site_index} ({t.site}) only", field=f"reports[{i}].site")
        if report.get("rank") not in ranks:
            raise errors.Forbidden(f"reports[{i}].rank is {report.get('rank')!r}: this worker token reports for "
                                   f"ranks {t.first_rank}..{ranks[-1]} only", field=f"reports[{i}].rank")


def contract(job: JobRow, t: SubtaskRow, rendezvous: dict[str, Any] | None, token: str | None,
             data: DataRef | None = None, env: dict[str, str] | None = None) -> AttemptSpec:
    """The sub-task's attempt contract; `data` is where its site reads the job's Dataset (data_ref), `env`
    its cluster's communication environment (its fabric's NCCL settings)."""
    code = (job.spec or {}).get("code")  # the user's bundle: the agent fetches it by digest
    return AttemptSpec(code=CodeRef(digest=code["digest"], entrypoint=code["entrypoint"], args=code.get("args") or {})
                       if code and code.get("digest") else None,
                       job=job.name, job_uid=job.id, attempt=t.attempt, subtask=t.name, cluster=t.cluster, site_index=t.site_index,
                       first_rank=t.first_rank, workers=t.gpus, topology=job.status["topology"],
                       train=job.status["train"], elastic=elastic(job.status),
                       rendezvous=Endpoint(**rendezvous) if rendezvous else None, worker_token=token, data=data,
                       image=(job.spec or {}).get("image"), env=env or {})


async def report(s: AsyncSession, principal: Principal, uid: str, body: SubtaskReport) -> SubtaskRow:
    """Store what the agent saw. A terminal report is final: later ones do not move it back."""
    t = await _load(s, principal, uid, lock=True)
    if t.reported in DONE and body.phase != t.reported:
        return t
    t.reported = body.phase
    t.exit_codes = dict(body.exit_codes)
    t.handle = {**(t.handle or {}), "message": body.message,
                **({"devices": [d[:32] for d in body.devices]} if body.devices else {})}
    t.reported_at = datetime.now(UTC)
    if t.desired == "Stop" and body.phase in DONE and t.phase not in DONE:  # a confirmed stop needs no reconciling
        t.phase, t.finished_at = body.phase, t.reported_at
        await revoke_subtask_tokens(s, t.id)
    return t


async def append_logs(s: AsyncSession, principal: Principal, uid: str, batch: LogBatch) -> int:
    t = await _load(s, principal, uid)
    now = datetime.now(UTC)
    if t.finished_at is not None and now - as_utc(t.finished_at) > LOG_GRACE:
        return 0  # the log closed LOG_GRACE after the sub-task ended
    s.add_all([LogRow(job=t.job, attempt=t.attempt, subtask=t.name, site=t.site, rank=line.rank,
                      line=line.line.replace("\x00", ""), at=now) for line in batch.lines])
    return len(batch.lines)


async def read_logs(s: AsyncSession, job: str, *, attempt: int, later: bool = False, site: str | None = None,
                    rank: int | None = None, after: int = 0, limit: int = LOG_PAGE,
                    tail: int | None = None) -> list[LogRow]:
    """Up to `limit` lines of `attempt` (`later`: and of every later attempt) stored after row id `after`,
    oldest first. `tail` starts at the last N lines instead; page on with `after` = the last id returned."""
    where = [LogRow.job == job, LogRow.attempt >= attempt if later else LogRow.attempt == attempt]
    if site is not None:
        of_cluster = select(SubtaskRow.name).where(SubtaskRow.job == job, SubtaskRow.cluster == site)
        where.append((LogRow.site == site) | (LogRow.subtask == site) | LogRow.subtask.in_(of_cluster))
    if rank is not None:
        where.append(LogRow.rank == rank)
    if tail is not None:  # the id just before the last `tail` lines
        before = (await s.execute(select(LogRow.id).where(*where, LogRow.id > after).order_by(LogRow.id.desc())
                                  .offset(tail).limit(1))).scalar()
        after = max(after, before or 0)
    stmt = select(LogRow).where(*where, LogRow.id > after).order_by(LogRow.id).limit(limit)
    return list((await s.execute(stmt)).scalars())
