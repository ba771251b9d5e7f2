"""Re-placing a job after a site failure: synchronous strategies restart from their latest
checkpoint on a new placement drawn from live capacity, never on the failed sites. A pipeline is
re-placed as a pipeline of as many stages as before: its checkpoint holds one file per stage, each
the state of that stage's cut (``cpn.runtime.strategies.pipeline``), so stage s resumes from
``site{s}.pt`` on whichever site now runs it, and a different cut could not load them. Replicas of a
pipeline (D > 1, ``spec.parallelism.dataReplicas``) are re-placed whole, D × P again (site d·P + s,
replica-major as before, resumes ``site{d·P+s}.pt``); when the live sites no longer hold D × P, the
replicas they can hold go on (D' < D, the first D'·P sites' files, every stage's copy of one step) —
with at least one whole pipeline left, a lost site costs the job its replica, not the job — or the
job fails naming why. The lines then keep ``replica`` (0 … D'−1, also for D' = 1), so a later
re-placement does not grow the job back to replicas its checkpoint holds no files for.

The new placement is priced as a quote would price it, at the list prices of that moment; the lines
for what the accepted quote did not price (a cluster new to the job) are recorded on the job, in the
same transaction, as ``status.repricedLines``: the meter bills those clusters at those prices."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta

from sqlalchemy.ext.asyncio import AsyncSession

from cpn.core import errors
from layers.control import capacity, leases
from layers.orchestration.jobs import data as job_data
from layers.orchestration.jobs.requirements import objective, planner_inputs, requirements
from layers.orchestration.jobs.workflow import data_transfers, pricing_inputs, solver_for
from layers.orchestration.planning import placement
from layers.orchestration.planning.types import JobRequirements, Plan
from layers.orchestration.quotas import usage as quotas
from layers.service import pricing
from layers.service.contracts import subtask_name
from layers.service.jobs import update_status
from layers.service.models import JobRow
from layers.service.schemas import TrainingJobSpec


async def replace_placement(s: AsyncSession, job: JobRow, failed_sites: set[str], *, heartbeat_timeout: timedelta,
                            lease_ttl: timedelta) -> list[dict]:
    """Release the job's leases, plan again without `failed_sites`, lease the new placement — all in
    the caller's transaction. Raises Infeasible (naming the binding constraint) when nothing fits."""
    spec = TrainingJobSpec.model_validate(job.spec)
    req = requirements(spec)
    if job.status.get("strategy"):
        req = dataclasses.replace(req, strategy=job.status["strategy"])
    req = dataclasses.replace(req, exclude_sites=frozenset(req.exclude_sites | failed_sites),
                              data=await job_data.need_of_job(s, job),  # residency holds on the new sites too
                              stages=stages_of(job.status["placement"]) or req.stages,
                              data_replicas=replicas_of(job.status["placement"]) or req.data_replicas)
    await leases.release(s, job.name, "re-placing after a site failure")
    await s.flush()
    room = await quotas.gpu_room(s, job)  # the owner's maxGpus quota holds for the new placement too
    if room is not None:
        if room[0] < req.gpus_min:
            raise errors.Infeasible(f"no placement without {sorted(failed_sites)} within quota {room[1]}: maxGpus leaves "
                                    f"{room[0]} GPUs, the job needs at least {req.gpus_min}", field="spec.gpus.min")
        req = dataclasses.replace(req, gpus_max=min(req.gpus_max or room[0], room[0]))
    market = await capacity.offer_set(s, heartbeat_timeout)
    offers, wan = planner_inputs(list(market.offers), list(market.links), spec.currency)
    replicated = req.strategy == "pipeline" and (req.data_replicas > 1 or replicas_of(job.status["placement"]) is not None)
    while True:
        try:
            plan = placement.plan(req, offers, wan, objective(spec), solver=solver_for(len(offers)))
            break
        except errors.Infeasible as exc:
            if not replicated or req.data_replicas <= 1:
                raise _infeasible(req, exc, failed_sites, {o.site for o in offers}) from exc
            req = dataclasses.replace(req, data_replicas=req.data_replicas - 1)  # the replicas the live sites hold
    wants = [leases.Want(subtask=subtask_name(job.name, a.cluster), cluster=capacity.offer_cluster(a.cluster), gpus=a.gpus)
             for a in plan.assignments]
    try:
        await leases.reserve(s, job=job.name, owner_id=job.owner_id, contract_id=job.status.get("contract"),
                             wants=wants, heartbeat_timeout=heartbeat_timeout, lease_ttl=lease_ttl,
                             now=datetime.now(UTC))
    except errors.Conflict as exc:
        raise errors.Infeasible(f"no placement without {sorted(failed_sites)}: {exc.message}") from exc
    _record_prices(job, plan, market)
    update_status(job, memory={"shard": plan.prediction.shard,  # the new placement's own memory plan
                               "activationCheckpointing": plan.prediction.activation_checkpointing})
    region_of = {o.name: o.region for o in offers}
    return [{"cluster": a.cluster, "site": a.site, "gpus": a.gpus, "gpuModel": a.gpu_model,
             "region": region_of[a.cluster], **({} if a.stage is None else {"stage": a.stage}),
             **({} if a.replica is None and not replicated else {"replica": a.replica or 0})}
            for a in plan.assignments]


def _record_prices(job: JobRow, plan: Plan, market: capacity.OfferSet) -> None:
    """Price the new placement at today's list prices and keep, on the job, the lines for what the
    accepted quote did not price: without them the meter had no price for a new cluster and the work
    there was never billed, nor shown to its provider."""
    _, sellers, link_prices, link_owners = pricing_inputs(market)
    pred = plan.prediction
    lines = pricing.price_lines(pred.gpu_seconds_by_cluster, pred.egress_bytes_by_link, sellers, link_prices,
                                link_owners) + pricing.data_transfer_lines(data_transfers(plan), sellers)
    quoted = {(q["item"], capacity.offer_cluster(q["cluster"])) for q in job.status.get("quoteLines", [])}
    attempt, at = int(job.status.get("attempt") or 1) + 1, datetime.now(UTC).isoformat()
    new = [{**line, "attempt": attempt, "at": at} for line in lines
           if (line["item"], capacity.offer_cluster(line["cluster"])) not in quoted]
    if new:
        update_status(job, repricedLines=[*job.status.get("repricedLines", []), *new])


def stages_of(placement_lines: list[dict]) -> int | None:
    """How many pipeline stages a placement runs (None: it is not a pipeline)."""
    stages = {int(p["stage"]) for p in placement_lines if p.get("stage") is not None}
    return len(stages) or None


def replicas_of(placement_lines: list[dict]) -> int | None:
    """How many replicas of a pipeline a placement runs (None: one, or not a pipeline)."""
    replicas = {int(p["replica"]) for p in placement_lines if p.get("replica") is not None}
    return len(replicas) or None


def _infeasible(req: JobRequirements, exc: errors.Infeasible, failed: set[str], live: set[str]) -> errors.Infeasible:
    """The planner's reason after the failure; for a pipeline left with fewer sites than the stages its
    checkpoint holds, that (the lost sites' fault, no field of the spec's)."""
    head = f"no placement without the failed site(s) {sorted(failed)}: "
    if req.stages is None or req.strategy != "pipeline":
        return errors.Infeasible(head + exc.message, field=exc.field)
    left = sorted(live - req.exclude_sites)
    d = max(1, req.data_replicas)
    held = f"{req.stages} pipeline stages" + (f" of each of {d} replicas" if d > 1 else "")
    if len(left) >= req.stages * d:
        return errors.Infeasible(f"{head}its checkpoint holds {held}: {exc.message}", field=exc.field)
    return errors.Infeasible(f"{head}its checkpoint holds {held}, each to resume on a site of its own (one stage "
                             f"per site{f', {req.stages * d} sites' if d > 1 else ''}), and only {len(left)} live site(s) remain "
                             f"({', '.join(left) or 'none'})")


def ring_of(plan_ring: list[str], placement_lines: list[dict]) -> list[str]:
    sites = [p["site"] for p in placement_lines]
    return [r for r in plan_ring if r in sites] + [s for s in sites if s not in plan_ring]
