"""Accepting a quote: a contract plus GPU leases at every chosen cluster, in one transaction."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from cpn.core import errors
from cpn.core.principal import Principal
from layers.control import leases
from layers.control.capacity import offer_cluster
from layers.control.models import LeaseRow
from layers.service import billing
from layers.service import quotes as quotes_mod
from layers.service.jobs import load_job, set_phase, update_status
from layers.service.models import ContractRow, JobRow, QuoteRow


class QuoteUnavailable(errors.Conflict):
    """The quote expired or its capacity is gone; the caller re-quotes and offers fresh ones."""

    code = "quote_unavailable"


@dataclass
class Accepted:
    job: JobRow
    contract: ContractRow
    quote: QuoteRow
    leases: list[LeaseRow]


# A check of the orchestration layer's (quotas) made in the accept's transaction before any lease is
# taken; it raises to refuse. (job, quote, now)
Admit = Callable[[AsyncSession, JobRow, QuoteRow, datetime], Awaitable[None]]


def subtask_name(job: str, cluster: str) -> str:
    return f"{job}-{cluster.replace('/', '-')}"


async def accept(session: AsyncSession, principal: Principal, job_name: str, ref: str, *,
                 heartbeat_timeout: timedelta, lease_ttl: timedelta, now: datetime | None = None,
                 admit: Admit | None = None) -> Accepted:
    now = now or datetime.now(UTC)
    job = await load_job(session, principal, job_name, lock=True)
    if job.phase != "Quoted":
        raise errors.Conflict(f"job {job_name!r} is {job.phase}; only a Quoted job can accept a quote")
    quote = await quotes_mod.find_quote(session, job, ref)
    if quote.state != "open":
        raise QuoteUnavailable(f"quote {quote.label} ({quote.id}) is {quote.state}", field="quote")
    if quotes_mod.expired(quote, now):
        raise QuoteUnavailable(f"quote {quote.label} expired at {quote.expires_at.isoformat()}", field="quote")
    if admit is not None:
        await admit(session, job, quote, now)
    contract = ContractRow(job_id=job.id, job=job.name, quote_id=quote.id, account_id=job.owner_id,
                           quoted_total=quote.total, currency=quote.currency, state="active")
    session.add(contract)
    await session.flush()
    wants = [leases.Want(subtask=subtask_name(job.name, p["cluster"]), cluster=offer_cluster(p["cluster"]),
                         gpus=int(p["gpus"])) for p in quote.placement]
    try:
        taken = await leases.reserve(session, job=job.name, owner_id=job.owner_id, contract_id=contract.id,
                                     wants=wants, heartbeat_timeout=heartbeat_timeout, lease_ttl=lease_ttl, now=now)
    except errors.Conflict as exc:
        raise QuoteUnavailable(f"capacity for quote {quote.label} is gone: {exc.message}", field="quote") from exc
    for other in await quotes_mod.open_quotes(session, job):
        other.state = "accepted" if other.id == quote.id else "superseded"
    set_phase(job, "Accepted", "QuoteAccepted", f"accepted {quote.label} quote {quote.id}", now)
    set_phase(job, "Reserved", "GpusLeased", f"{sum(w.gpus for w in wants)} GPUs leased at "
              f"{len({w.cluster for w in wants})} cluster(s)", now)
    memory = {k: quote.prediction[k] for k in ("shard", "activationCheckpointing") if k in (quote.prediction or {})}
    update_status(job, contract=contract.id, quote=quote.id, strategy=quote.strategy, placement=quote.placement,
                  ring=quote.ring, **({"memory": memory} if memory else {}),  # the quote's memory plan: the runtime's
                  predictedSeconds=quote.predicted_seconds, quoteLines=quote.lines,
                  price={"total": str(billing.to_cent(Decimal(quote.total))), "currency": quote.currency})
    return Accepted(job=job, contract=contract, quote=quote, leases=taken)


async def contract_of(session: AsyncSession, job: JobRow) -> ContractRow | None:
    stmt = select(ContractRow).where(ContractRow.job_id == job.id).order_by(ContractRow.created_at.desc())
    return (await session.execute(stmt)).scalars().first()
