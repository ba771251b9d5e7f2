"""Submit, quote and accept: the orchestration of the service and control layers for one job."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from cpn.core import errors
from cpn.core.db import Database
from cpn.core.principal import Principal
from cpn.core.settings import Settings
from layers.control import capacity
from layers.orchestration.events import record_event
from layers.orchestration.jobs.requirements import objective, planner_inputs, prediction_dict, requirements
from layers.orchestration.planning import placement
from layers.service import pricing
from layers.service import quotes as quotes_mod
from layers.service.contracts import Accepted, QuoteUnavailable, accept
from layers.service.jobs import JobStore, load_job, set_phase
from layers.service.models import JobRow
from layers.service.schemas import TrainingJobSpec


@dataclass(frozen=True)
class Timeouts:
    heartbeat: timedelta
    quote_ttl: timedelta
    lease_ttl: timedelta

    @classmethod
    def of(cls, settings: Settings) -> Timeouts:
        return cls(heartbeat=timedelta(seconds=settings.heartbeat_timeout_seconds),
                   quote_ttl=timedelta(seconds=settings.quote_ttl_seconds),
                   lease_ttl=timedelta(seconds=settings.lease_ttl_seconds))


EXACT_MAX_OFFERS = 12  # beyond this the MILP takes seconds; the heuristic stays within a few % (bench scheduler)


def solver_for(offers: int) -> str:
    """The exact MILP for small catalogues, the heuristic where a request must answer quickly."""
    return "exact" if offers <= EXACT_MAX_OFFERS else "heuristic"


async def submit(session: AsyncSession, principal: Principal, body: Any, idempotency_key: str | None,
                 t: Timeouts) -> tuple[dict[str, Any], bool]:
    """Create a job and quote it. A retried submission with the same Idempotency-Key returns the
    same job (and False: not created)."""
    store = JobStore()
    if idempotency_key:
        found = (await session.execute(select(JobRow).where(JobRow.owner_id == principal.account_id,
                                                            JobRow.idempotency_key == idempotency_key))
                 ).scalar_one_or_none()
        if found is not None:
            return store.to_manifest(principal, found), False
    manifest = await store.create(session, principal, body)
    job = await store.load(session, principal, manifest["metadata"]["name"])
    job.idempotency_key = idempotency_key
    await record_event(session, job.name, "Normal", "Submitted", f"submitted by {principal.name}")
    await requote(session, job, t)
    await session.flush()
    return store.to_manifest(principal, job), True


async def requote(session: AsyncSession, job: JobRow, t: Timeouts, now: datetime | None = None
                  ) -> list[dict[str, Any]]:
    """Plan the job against live capacity and store fresh quotes; the job becomes Quoted."""
    now = now or datetime.now(UTC)
    spec = TrainingJobSpec.model_validate(job.spec)
    req = requirements(spec, now)
    pool_offers, links, _ = await capacity.snapshot(session, t.heartbeat, now)
    offers, wan = planner_inputs(pool_offers, links, spec.currency)
    plans = placement.quote_options(req, offers, wan, objective(spec), solver=solver_for(len(offers)))
    sellers = {o.offer: pricing.Seller(provider=o.provider, provider_account_id=o.owner_id, site=o.site,
                                       price_per_gpu_hour=o.price_per_gpu_hour, currency=o.currency)
               for o in pool_offers}
    link_prices = {frozenset((ln.a, ln.b)): Decimal(ln.price_per_gb) for ln in links}
    await quotes_mod.supersede_open(session, job)
    saved = []
    for label, plan in plans.items():
        pred = plan.prediction
        lines = pricing.price_lines(pred.gpu_seconds_by_cluster, pred.egress_bytes_by_link, sellers, link_prices)
        placement_lines = [{"cluster": a.cluster, "site": a.site, "gpus": a.gpus, "gpuModel": a.gpu_model}
                           for a in plan.assignments]
        row = quotes_mod.new_quote(job, label, placement=placement_lines, strategy=plan.strategy, ring=plan.ring,
                                   prediction=prediction_dict(pred), predicted_seconds=pred.total_seconds,
                                   wan_gb=pred.wan_bytes / 1e9, lines=lines, total=pricing.total(lines),
                                   currency=spec.currency, ttl=t.quote_ttl, now=now)
        session.add(row)
        saved.append(row)
    await session.flush()
    if job.phase != "Quoted":
        previous = set_phase(job, "Quoted", "Quoted", f"{len(saved)} quote(s) offered", now)
        await record_event(session, job.name, "Normal", "Quoted",
                           f"{previous} → Quoted: " + ", ".join(f"{q.label} {q.total:.2f} {q.currency}" for q in saved))
    return [quotes_mod.public(q) for q in saved]


async def accept_quote(db: Database, principal: Principal, job_name: str, ref: str, t: Timeouts) -> Accepted:
    """Accept in one serialised transaction; if the quote is stale, re-quote in a second one and
    raise 409 carrying the fresh quotes."""
    try:
        async with db.serialized(), db.session() as session:
            result = await accept(session, principal, job_name, ref, heartbeat_timeout=t.heartbeat,
                                  lease_ttl=t.lease_ttl)
            await record_event(session, job_name, "Normal", "Reserved",
                               f"Quoted → Accepted → Reserved with quote {result.quote.label}: "
                               + ", ".join(f"{lease.gpus}×{lease.cluster}" for lease in result.leases))
            return result
    except QuoteUnavailable as exc:
        fresh: list[dict[str, Any]] = []
        try:
            async with db.serialized(), db.session() as session:
                job = await load_job(session, principal, job_name, lock=True)
                fresh = await requote(session, job, t)
        except errors.Infeasible as inner:
            exc.details = {"freshQuotes": [], "reason": inner.message}
            raise exc from inner
        exc.details = {"freshQuotes": fresh}
        exc.message += "; fresh quotes are offered (cpnctl get quotes " + job_name + ")"
        raise
