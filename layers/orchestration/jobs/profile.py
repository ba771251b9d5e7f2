"""spec.profile: time a few of the job's own steps at one candidate site before quoting it.

A job submitted with ``spec.profile: true`` is not quoted at once. It becomes ``Profiling``: the
cheapest feasible placement's largest site lends one cluster's GPUs of that placement (leased, so
nothing else is booked on them) to a short run of the job itself — attempt
:data:`~cpn.core.phases.PROFILE_ATTEMPT` (0), one sub-task, the site agent runs it through the same
job runner with the user's bundle and contract, data parallel on one site (no WAN), for
:data:`PROFILE_STEPS` steps and at most :data:`PROFILE_MAX_SECONDS` from its claim. The runner relays
each step's metrics as for any run; from rank 0's reports the server takes the seconds per step
after the first (start-up and the first step's warm-up excluded); that prices the job's compute
(:func:`layers.orchestration.planning.perf.profile_factor`), the rest of the run from the agent's
claim to its end (fetching the code, starting, loading data, the first step, the last evaluation)
is a floor for the quotes' start-up, and the quotes say ``basis: profiled``.

The profile is free: it runs before any contract exists, so no invoice carries it; its cost to the
provider is bounded by the step and time caps here. The server never runs the user's code: the
site's agent does, as for the job itself. A profile that fails (the code crashed, no agent claimed
it, fewer than two steps in the time cap) fails the job with the reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from cpn.core import errors
from cpn.core.db import as_utc
from cpn.core.phases import PROFILE_ATTEMPT, SUBTASK_DONE, JobPhase, SubtaskPhase
from layers.control import leases
from layers.control.capacity import offer_cluster, snapshot
from layers.orchestration.events import record_event
from layers.orchestration.lifecycle.models import MetricRow, SubtaskRow
from layers.orchestration.lifecycle.plan import attempt_plan
from layers.orchestration.planning.perf import intra_gbps_by_site
from layers.orchestration.planning.types import Assignment, ClusterOffer, Profiled
from layers.orchestration.quotas import usage as quotas
from layers.resource.models import ClusterRow
from layers.service.contracts import subtask_name
from layers.service.jobs import set_phase, update_status
from layers.service.models import JobRow, QuoteRow
from layers.service.schemas import TrainingJobSpec
from layers.service.status import ProfileStatus, status_of

PROFILE_STEPS = 8  # the first is warm-up; the other 7 are timed
PROFILE_MAX_SECONDS = 120.0  # from the agent's claim: start-up, the bundle's fetch and the steps
PROFILE_STRATEGY = "ddp"  # one site: its all-reduce is what perf.site_comm models inside any site
MIN_TIMED_STEPS = 2  # fewer timed steps than this: no measurement


class ProfileFailed(errors.CPNError):
    """The profile run gave no step time; the job fails with this reason."""

    code = "profile_failed"


@dataclass(frozen=True)
class Verdict:
    """What the reconciler does with a Profiling job this pass."""

    done: bool = False  # the profile is over (ended, or stopped at the cap): measure it
    failure: str | None = None  # the profile failed: the job fails with this reason
    capped: bool = False  # the run was stopped at PROFILE_MAX_SECONDS


def profile_site(rows: list[QuoteRow]) -> dict[str, Any]:
    """The placement line to profile on: the cheapest quote's (or the first's) largest site, and
    there its cluster with the most GPUs of the placement."""
    row = next((q for q in rows if q.label == "cheapest"), rows[0])
    per_site: dict[str, int] = {}
    for line in row.placement:
        per_site[line["site"]] = per_site.get(line["site"], 0) + int(line["gpus"])
    site = max(sorted(per_site), key=per_site.__getitem__)
    return max((p for p in row.placement if p["site"] == site), key=lambda p: int(p["gpus"]))


def profile_train(spec: TrainingJobSpec, train: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """The runtime's TrainConfig for the profile: the job's own step on this site, PROFILE_STEPS of
    them, no checkpoints, no validation inside the timed steps. Returns it and its step count."""
    units = int(train["global_batch_tokens"])
    steps = min(PROFILE_STEPS, math.ceil(spec.tokens / units))
    if steps < MIN_TIMED_STEPS + 1:
        raise errors.InvalidInput(f"the job is {steps} step(s) of {units:,} units long; a profile times at least "
                                  f"{MIN_TIMED_STEPS} steps after a warm-up one, so it would be the whole run: "
                                  "drop spec.profile", field="spec.profile")
    return {**train, "tokens": steps * units, "checkpoint_every": 0, "val_every": steps + 1}, steps


async def start(session: AsyncSession, job: JobRow, spec: TrainingJobSpec, rows: list[QuoteRow], *,
                heartbeat_timeout: timedelta, lease_ttl: timedelta, now: datetime | None = None) -> None:
    """Lease the profile's GPUs and write its sub-task for the site's agent; the job becomes Profiling."""
    now = now or datetime.now(UTC)
    if not rows:
        raise errors.Infeasible("no placement can run the job, so there is nowhere to profile it", field="spec")
    line = profile_site(rows)
    cluster = offer_cluster(line["cluster"])
    pool_offers, links, _ = await snapshot(session, heartbeat_timeout, now)
    offer = next(o for o in pool_offers if o.offer == line["cluster"])
    try:
        topo, train = attempt_plan(spec, PROFILE_STRATEGY, [line], [line["site"]], links)
    except ValueError as exc:
        raise errors.InvalidInput(f"the profile cannot run at {line['site']}: {str(exc).splitlines()[0]}",
                                  field="spec.profile") from exc
    train, steps = profile_train(spec, train)
    name = subtask_name(job.name, cluster)
    await quotas.admit_gpus(session, job, int(line["gpus"]), now)  # a profile run's GPUs count against maxGpus
    try:
        await leases.reserve(session, job=job.name, owner_id=job.owner_id, contract_id=None,
                             wants=[leases.Want(subtask=name, cluster=cluster, gpus=int(line["gpus"]))],
                             heartbeat_timeout=heartbeat_timeout, lease_ttl=lease_ttl, now=now)
    except errors.Conflict as exc:
        raise errors.Conflict(f"the profile's GPUs are gone: {exc.message}; submit again", field="spec.profile") from exc
    await leases.hold(session, job.name, now + lease_ttl + timedelta(seconds=PROFILE_MAX_SECONDS))
    driver = (await session.execute(select(ClusterRow.driver).where(ClusterRow.name == cluster))).scalar()
    session.add(SubtaskRow(job=job.name, name=name, attempt=PROFILE_ATTEMPT,
                           launch_key=f"{job.name}/{name}/{PROFILE_ATTEMPT}", cluster=cluster, site=line["site"],
                           site_index=0, gpus=int(line["gpus"]), first_rank=0, desired="Run", exit_codes={},
                           driver=driver or "local", phase="Pending"))
    intra = intra_gbps_by_site([Assignment(line["cluster"], line["site"], int(line["gpus"]), offer.gpu_model)],
                               {line["cluster"]: _cluster_offer(offer)})[line["site"]]
    profile = ProfileStatus(site=line["site"], cluster=cluster, gpus=int(line["gpus"]), gpu_model=offer.gpu_model,
                            digest=spec.code.digest if spec.code is not None else None,
                            tflops=offer.tflops, intra_gbps=intra, units_per_step=int(train["global_batch_tokens"]),
                            steps=steps, max_seconds=PROFILE_MAX_SECONDS)
    update_status(job, attempt=PROFILE_ATTEMPT, topology=topo, train=train, sites="0/1",
                  profile=profile.model_dump(mode="json", by_alias=True))
    message = (f"timing {steps} steps of {profile.units_per_step:,} units on {profile.gpus}×{profile.gpu_model} "
               f"at {profile.site} ({cluster}) before quoting")
    set_phase(job, JobPhase.PROFILING, "Profiling", message, now)
    await record_event(session, job.name, "Normal", "Profiling", message)


def _cluster_offer(o: Any) -> ClusterOffer:
    return ClusterOffer(name=o.offer, site=o.site, region=o.region, provider=o.provider, gpu_model=o.gpu_model,
                        tflops=o.tflops, memory_gb=o.memory_gb, free_gpus=o.free_gpus,
                        price_per_gpu_hour=o.price_per_gpu_hour, currency=o.currency,
                        intra_node_gbps=o.intra_node_gbps, inter_node_gbps=o.inter_node_gbps,
                        gpus_per_node=o.gpus_per_node, driver=o.driver)


def verdict(subtasks: list[SubtaskRow], now: datetime | None = None) -> Verdict:
    """Over, failed, or still running (the sub-tasks' phases as the reconciler last applied them)."""
    now = now or datetime.now(UTC)
    if not subtasks:
        return Verdict(failure="the profile's sub-task is missing")
    t = subtasks[0]
    if t.phase == SubtaskPhase.SUCCEEDED:
        return Verdict(done=True)
    if t.phase in SUBTASK_DONE:
        return Verdict(failure=f"the profile at {t.site} ({t.cluster}) ended {t.phase}: {t.message or 'no reason given'}")
    if t.claimed_at is not None and (now - as_utc(t.claimed_at)).total_seconds() > PROFILE_MAX_SECONDS:
        return Verdict(done=True, capped=True)
    return Verdict()


def step_time(rows: list[MetricRow]) -> tuple[float, int] | None:
    """(seconds per step, steps timed) from rank 0's step reports: from the first reported step's end
    to the last's, so start-up and the first step's warm-up are left out; None under MIN_TIMED_STEPS."""
    walls: dict[int, float] = {}
    for r in rows:
        if r.rank == 0 and r.train_loss is not None and r.step > 0:
            walls[r.step] = r.wall_seconds
    if len(walls) < 2:
        return None
    first, last = min(walls), max(walls)
    timed = last - first
    seconds = walls[last] - walls[first]
    if timed < MIN_TIMED_STEPS or seconds <= 0:
        return None
    return seconds / timed, timed


async def record(session: AsyncSession, job: JobRow, subtasks: list[SubtaskRow], *, capped: bool = False
                 ) -> ProfileStatus:
    """Measure the finished profile from its metric reports and keep the figure on the job; its
    leases go back. Raises ProfileFailed when the reports hold too few timed steps."""
    rows = list((await session.execute(select(MetricRow).where(MetricRow.job == job.name,
                                                               MetricRow.attempt == PROFILE_ATTEMPT))).scalars())
    profile = status_of(job).profile
    if profile is None:
        raise ProfileFailed("the job has no profile run")
    measured = step_time(rows)
    if measured is None:
        why = f"it was stopped after {int(profile.max_seconds)} s" if capped else "the run ended"
        raise ProfileFailed(f"the profile at {profile.site} timed fewer than {MIN_TIMED_STEPS} steps after the "
                            f"first ({why}); a step of this job may be longer than the profile allows: drop "
                            "spec.profile to be quoted from the compute model")
    seconds, timed = measured
    note = (f"stopped at the {int(profile.max_seconds)} s cap after {timed + 1} steps" if capped
            else f"{timed} steps timed after a warm-up step")
    done = profile.model_copy(update={"measured_step_seconds": round(seconds, 6), "measured_steps": timed,
                                      "units_per_second": round(profile.units_per_step / seconds, 3), "note": note,
                                      "startup_seconds": None if capped else _startup(subtasks, timed, seconds)})
    await leases.release(session, job.name, "profile finished")
    update_status(job, profile=done.model_dump(mode="json", by_alias=True), progress=None, sites=None)
    await record_event(session, job.name, "Normal", "Profiled",
                       f"{seconds:.4f} s per step of {profile.units_per_step:,} units on {profile.gpus}×"
                       f"{profile.gpu_model} at {profile.site} ({note}); quoting from it")
    return done


def _startup(subtasks: list[SubtaskRow], timed: int, seconds: float) -> float | None:
    """The profile run's time besides its timed steps: from the agent's claim to its report of the end."""
    t = subtasks[0] if subtasks else None
    if t is None or t.claimed_at is None or t.reported_at is None:
        return None
    whole = (as_utc(t.reported_at) - as_utc(t.claimed_at)).total_seconds()
    return round(max(0.0, whole - timed * seconds), 2)


def current(job: JobRow, spec: TrainingJobSpec | None = None) -> ProfileStatus | None:
    """The job's profile if it still describes the job: spec.profile is on and the code is the code
    that was timed (a changed spec is quoted as modelled; it is not profiled again). `spec`: job.spec
    already validated by the caller."""
    spec = spec or TrainingJobSpec.model_validate(job.spec)
    if not spec.profile:
        return None
    found = status_of(job).profile
    if found is None:
        return None
    return found if found.digest == (spec.code.digest if spec.code is not None else None) else None


def profiled(profile: ProfileStatus | None) -> Profiled | None:
    """The compute model's view of a measured profile (None before it is measured)."""
    if profile is None or profile.measured_step_seconds is None:
        return None
    return Profiled(gpu_model=profile.gpu_model, tflops=profile.tflops, gpus=profile.gpus,
                    intra_gbps=profile.intra_gbps, units_per_step=profile.units_per_step,
                    step_seconds=profile.measured_step_seconds, startup_seconds=profile.startup_seconds)


def figure(profile: ProfileStatus, steps: int, step_seconds: float) -> dict[str, Any]:
    """The quote's `profile` block (schemas.ProfileFigure): the measurement and what it predicts here."""
    return {"site": profile.site, "cluster": profile.cluster, "gpus": profile.gpus, "gpuModel": profile.gpu_model,
            "measuredStepSeconds": profile.measured_step_seconds, "unitsPerStep": profile.units_per_step,
            "unitsPerSecond": profile.units_per_second, "startupSeconds": profile.startup_seconds,
            "steps": steps, "stepSeconds": step_seconds}
