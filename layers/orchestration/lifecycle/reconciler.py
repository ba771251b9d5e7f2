"""The reconciler: drives every job from Reserved to a terminal phase. It writes desired state
(the sub-tasks of each attempt and whether they should run) and reads the state that the site
agents report; it never starts a worker or calls a site. Level-triggered and restart-safe: all
state lives in the database, and agents claim each sub-task idempotently, so a killed and
restarted API server picks up where it was and nothing is launched twice."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from cpn.core import errors
from cpn.core.db import Database, as_utc
from cpn.core.phases import JOB_ACTIVE, NEVER_CLAIMED, NEVER_STARTED, NOT_LAUNCHED, SUBTASK_DONE, JobPhase
from cpn.core.settings import Settings
from layers.control import leases
from layers.control.capacity import offer_cluster
from layers.orchestration.events import record_event
from layers.orchestration.identity.tokens import revoke_job_tokens, revoke_subtask_tokens
from layers.orchestration.jobs import profile, workflow
from layers.orchestration.lifecycle import learning, metering
from layers.orchestration.lifecycle.leader import Leadership
from layers.orchestration.lifecycle.models import MetricRow, SubtaskRow
from layers.orchestration.lifecycle.plan import (
    attempt_plan,
    budget_note,
    elastic,
    rank_offsets,
    survives_site_loss,
)
from layers.orchestration.lifecycle.replan import replace_placement, replicas_of, ring_of
from layers.resource.capacity import inventory
from layers.resource.drivers.base import SubtaskState
from layers.resource.models import ClusterRow
from layers.resource.stores import is_ready
from layers.service.contracts import contract_of
from layers.service.jobs import reword_phase, set_phase, update_status
from layers.service.models import JobRow
from layers.service.schemas import TrainingJobSpec

log = logging.getLogger("cpn.reconciler")
ACTIVE = JOB_ACTIVE
DRIVEN = (*JOB_ACTIVE, JobPhase.PROFILING)  # the phases a pass looks at: the active ones and spec.profile's run
DONE = SUBTASK_DONE
MAX_ATTEMPTS = 3
MAX_STRIKES = 3  # a job whose pass raises this many times in a row fails alone


@dataclass
class ReconcilerConfig:
    heartbeat_timeout: timedelta
    lease_ttl: timedelta
    claim_timeout: timedelta = timedelta(seconds=120)
    interval: float = 1.0
    # how long the quotes a finished profile run brings stay open (spec.profile)
    quote_ttl: timedelta = timedelta(seconds=Settings.model_fields["quote_ttl_seconds"].default)
    # whether the job (by uid) has its final weights in the blob store; None: not checked (no store)
    final_weights: Callable[[str], bool] | None = None

    def timeouts(self) -> workflow.Timeouts:
        return workflow.Timeouts(heartbeat=self.heartbeat_timeout, quote_ttl=self.quote_ttl, lease_ttl=self.lease_ttl)


class Reconciler:
    def __init__(self, db: Database, cfg: ReconcilerConfig):
        self.db, self.cfg = db, cfg
        self.strikes: dict[str, int] = {}  # job → consecutive passes that raised
        self.leadership = Leadership(db)
        # since when this replica has led and its API could hear the agents (None: not leading, or
        # driven pass by pass from outside): silence older than that is the server's, not the sites'
        self.listening_since: datetime | None = None

    def _heard_since(self, moment: datetime) -> datetime:
        """``moment``, or when this reconciler started listening if later: a server that was down (or
        a replica that just took the lead) does not blame agents for reports it could not receive."""
        moment = as_utc(moment)
        return max(moment, self.listening_since) if self.listening_since is not None else moment

    async def run_forever(self) -> None:
        """Passes while this replica leads (always, on SQLite); the others only try to take the lead."""
        try:
            while True:
                try:
                    if await self.leadership.ensure():
                        self.listening_since = self.listening_since or datetime.now(UTC)
                        await self.reconcile_once()
                    else:
                        self.listening_since = None
                except Exception:  # noqa: BLE001 - one bad pass must not stop the loop
                    log.exception("reconcile pass failed")
                await asyncio.sleep(self.cfg.interval)
        finally:
            await self.leadership.release()

    async def reconcile_once(self) -> None:
        async with self.db.session() as s:
            for job in await leases.expire(s):
                row = (await s.execute(select(JobRow).where(JobRow.name == job))).scalar_one_or_none()
                if row is not None and row.phase == "Reserved":
                    await self._finish(s, row, "Failed", "LeaseExpired", "the job did not start before its leases expired")
            names = list((await s.execute(select(JobRow.name).where(JobRow.phase.in_(DRIVEN)))).scalars())
        for name in names:
            await self.reconcile_job(name)

    async def reconcile_job(self, name: str) -> None:
        """One job, one transaction. A job whose pass raises is failed alone, with the cause in its
        conditions and events, in a transaction of its own; no other job waits on it."""
        try:
            async with self.db.serialized(), self.db.session() as s:
                job = (await s.execute(select(JobRow).where(JobRow.name == name).with_for_update())).scalar_one()
                if job.phase in DRIVEN:
                    await self.step(s, job)
        except (errors.StaleVersion, errors.Unavailable) as exc:  # a concurrent writer won: next pass
            log.info("reconciling job %s deferred: %s", name, exc.message)
        except Exception as exc:  # noqa: BLE001 - isolate the job; the pass goes on for the others
            self.strikes[name] = self.strikes.get(name, 0) + 1
            log.exception("reconciling job %s failed (%d of %d)", name, self.strikes[name], MAX_STRIKES)
            if self.strikes[name] >= MAX_STRIKES:
                await self._fail_alone(name, exc)
        else:
            self.strikes.pop(name, None)

    async def _fail_alone(self, name: str, exc: Exception) -> None:
        cause = exc.message if isinstance(exc, errors.CPNError) else f"{type(exc).__name__}: {exc}"
        try:
            async with self.db.serialized(), self.db.session() as s:
                job = (await s.execute(select(JobRow).where(JobRow.name == name).with_for_update())).scalar_one()
                if job.phase in DRIVEN:
                    await self._finish(s, job, "Failed", "ReconcileError", f"the job could not be run: {cause}")
        except Exception:  # noqa: BLE001 - never let one job stop the loop
            log.exception("could not fail job %s", name)

    async def step(self, s: AsyncSession, job: JobRow) -> None:
        if job.phase == JobPhase.PROFILING:
            await self._profile(s, job)
            return
        if job.phase == "Reserved":
            await self._prepare_attempt(s, job)
            if job.phase not in ACTIVE:  # the attempt could not be prepared: the job has failed
                return
        subtasks = await self._subtasks(s, job)
        await self._apply_states(s, job, subtasks, await self._observe(s, job, subtasks))

    # ---------------------------------------------------------------- spec.profile
    async def _profile(self, s: AsyncSession, job: JobRow) -> None:
        """The profile run (attempt 0, one sub-task): watch it like any attempt; when it is over, measure
        it and quote the job from the measurement; when it failed, the job fails with the reason."""
        subtasks = await self._subtasks(s, job)
        states = await self._observe(s, job, subtasks)
        for t in subtasks:
            state = states.get(t.name)
            if state is not None and state.phase != t.phase:
                t.exit_codes = {**(t.exit_codes or {}), **state.exit_codes}
                await self._move(s, job, t, state, " (profile)")
        verdict = profile.verdict(subtasks)
        if verdict.failure is not None:
            await self._finish(s, job, "Failed", "ProfileFailed", verdict.failure)
            return
        if not verdict.done:
            return
        await self._stop_subtasks(s, job)  # a run stopped at the cap: its agent is told to stop it
        try:
            await profile.record(s, job, subtasks, capped=verdict.capped)
            await revoke_job_tokens(s, job.name)
            await workflow.requote(s, job, self.cfg.timeouts())
        except profile.ProfileFailed as exc:
            await self._finish(s, job, "Failed", "ProfileFailed", exc.message)
        except errors.CPNError as exc:
            await self._finish(s, job, "Failed", "NoFeasiblePlacement", f"profiled, but no quote: {exc.message}")

    # ---------------------------------------------------------------- attempts
    async def _prepare_attempt(self, s: AsyncSession, job: JobRow) -> None:
        """Write the attempt's desired state: one sub-task per placed cluster, to be claimed by the
        cluster's agent. A retry resumes from the job's checkpoints in the server's blob store."""
        attempt = int(job.status.get("attempt", 0)) + 1
        spec = TrainingJobSpec.model_validate(job.spec)
        placement, ring = job.status["placement"], job.status.get("ring") or []
        _, links = await inventory(s, self.cfg.heartbeat_timeout)
        try:  # the runtime's own validation and preflight, here, before any agent claims anything
            topo, train = attempt_plan(spec, job.status["strategy"], placement, ring, links,
                                       "server" if attempt > 1 else None, memory=job.status.get("memory"))
        except ValueError as exc:
            await self._finish(s, job, "Failed", "NotRunnable", str(exc))
            return
        index = {site["name"]: i for i, site in enumerate(topo["sites"])}
        clusters = {c.name: c for c in (await s.execute(select(ClusterRow))).scalars()}
        offsets = rank_offsets(topo, placement)
        for p in placement:
            cluster = offer_cluster(p["cluster"])
            name = f"{job.name}-{cluster}"
            s.add(SubtaskRow(job=job.name, name=name, attempt=attempt, launch_key=f"{job.name}/{name}/{attempt}",
                             cluster=cluster, site=p["site"], site_index=index[p["site"]], gpus=int(p["gpus"]),
                             first_rank=offsets[p["cluster"]], desired="Run", exit_codes={},
                             driver=clusters[cluster].driver if cluster in clusters else "local", phase="Pending"))
        note = budget_note(spec, train)
        if note and attempt == 1:
            await record_event(s, job.name, "Normal", "BudgetRounded", note)
        update_status(job, attempt=attempt, topology=topo, train=train, elastic=survives_site_loss(topo, train),
                      checkpointEvery=train["checkpoint_every"], sites=f"0/{len(placement)}")
        await leases.hold(s, job.name, datetime.now(UTC) + timedelta(days=30))
        set_phase(job, "Launching", "Launching", _waiting(attempt, sorted({offer_cluster(p["cluster"]) for p in placement})))
        await record_event(s, job.name, "Normal", "Launching", f"Reserved → Launching (attempt {attempt})")
        await s.flush()

    async def _subtasks(self, s: AsyncSession, job: JobRow) -> list[SubtaskRow]:
        attempt = int(job.status.get("attempt", 1))
        stmt = select(SubtaskRow).where(SubtaskRow.job == job.name, SubtaskRow.attempt == attempt)
        return list((await s.execute(stmt.order_by(SubtaskRow.site_index, SubtaskRow.first_rank))).scalars())

    async def _observe(self, s: AsyncSession, job: JobRow, subtasks: list[SubtaskRow]) -> dict[str, SubtaskState]:
        """What the agents reported, and what their silence means: an agent past the heartbeat
        timeout has lost its site; a sub-task nobody claims in time cannot run."""
        clusters = {c.name: c for c in (await s.execute(select(ClusterRow))).scalars()}
        now = datetime.now(UTC)
        states: dict[str, SubtaskState] = {}
        for t in subtasks:
            if t.phase in DONE:
                continue
            cluster = clusters.get(t.cluster)
            if t.phase == "Pending":
                waited = now - self._heard_since(t.created_at)
                if waited > self.cfg.claim_timeout:
                    states[t.name] = SubtaskState("Failed", f"no agent of cluster {t.cluster} claimed the sub-task "
                                                  f"within {int(self.cfg.claim_timeout.total_seconds())} s",
                                                  {NEVER_CLAIMED: -9})
                elif cluster is not None and not (ready := is_ready(cluster, self.cfg.heartbeat_timeout))[0]:
                    left = int((self.cfg.claim_timeout - waited).total_seconds())
                    states[t.name] = SubtaskState("Pending", f"{t.cluster} is not Ready ({ready[2]}): re-placed "
                                                  f"elsewhere if it has not claimed its sub-task in {left} s")
                continue
            if t.phase == "Launching" and t.reported is None and t.claimed_at is not None \
                    and now - self._heard_since(t.claimed_at) > self.cfg.claim_timeout:  # claimed, then never a word
                states[t.name] = SubtaskState("Failed", f"the agent of cluster {t.cluster} claimed the sub-task but "
                                              f"reported nothing within {int(self.cfg.claim_timeout.total_seconds())} s",
                                              {NOT_LAUNCHED: -9})
                continue
            deaf = self.listening_since is not None and now - self.listening_since < self.cfg.heartbeat_timeout
            if cluster is not None and not deaf and not is_ready(cluster, self.cfg.heartbeat_timeout)[0]:
                states[t.name] = SubtaskState("Lost", f"the agent of cluster {t.cluster} stopped heartbeating",
                                              {"heartbeat": -9})
            elif t.reported and t.reported != t.phase:
                states[t.name] = SubtaskState(t.reported, (t.handle or {}).get("message", ""), dict(t.exit_codes or {}))
        return states

    # ---------------------------------------------------------------- state
    async def _apply_states(self, s: AsyncSession, job: JobRow, subtasks: list[SubtaskRow],
                            states: dict[str, SubtaskState]) -> None:
        # a site lost first, then the peers its loss broke: their lost work is the providers' fault too
        for t in sorted(subtasks, key=lambda t: t.name not in states or not _killed(states[t.name])):
            state = states.get(t.name)
            if state is not None and state.phase != t.phase:
                await self._transition(s, job, t, state)
        live = [t for t in subtasks if t.phase not in DONE]
        running = [t for t in subtasks if t.phase == "Running"]
        working = [t for t in subtasks if t.phase in ("Running", "Succeeded")]  # a finished site did its part
        update_status(job, sites=f"{len(working)}/{len(subtasks)}")
        if job.phase == "Launching" and running:
            set_phase(job, "Running", "WorkersRunning", _running(running, subtasks))
            await record_event(s, job.name, "Normal", "Running", "Launching → Running")
        elif job.phase == "Running":
            reword_phase(job, "WorkersRunning", _running(running, subtasks))
        elif job.phase == "Launching":  # say why it still waits when a site it waits for has gone silent
            silent = [states[t.name].message for t in subtasks if t.name in states and states[t.name].phase == "Pending"]
            pending = sorted({t.cluster for t in subtasks if t.phase == "Pending"})
            reword_phase(job, "Launching", "; ".join([_waiting(int(job.status.get("attempt", 1)), pending), *silent]))
        if not live:
            await self._attempt_over(s, job, subtasks)

    async def _move(self, s: AsyncSession, job: JobRow, t: SubtaskRow, state: SubtaskState, what: str = "") -> bool:
        """Put sub-task ``t`` in its observed phase with its event; True when it failed or was lost."""
        old, t.phase, t.message = t.phase, state.phase, state.message or t.message
        failed = state.phase in ("Failed", "Lost")
        await record_event(s, job.name, "Warning" if failed else "Normal", f"Subtask{state.phase}",
                           f"{t.name}{what}: {old} → {state.phase} {state.message}".strip(), subtask=t.name)
        if state.phase in DONE:
            t.finished_at = datetime.now(UTC)
            await revoke_subtask_tokens(s, t.id)  # nothing it reports after its end (or loss) is taken
        return failed

    async def _transition(self, s: AsyncSession, job: JobRow, t: SubtaskRow, state: SubtaskState) -> None:
        failed = await self._move(s, job, t, state)
        if not failed and state.phase == "Succeeded" and elastic(job.status):
            # a site that is done while the others go on (a pipeline replica that broke) frees its GPUs now
            await leases.release(s, job.name, f"sub-task {t.name} finished", cluster=t.cluster)
        if failed:
            t.exit_codes = {**(t.exit_codes or {}), **state.exit_codes}
            update_status(job, failedSites=[*job.status.get("failedSites", []),
                                            {"attempt": t.attempt, "site": t.site, "killed": _killed(state)}])
            credit = Decimal(0)
            if metering.site_lost(job, t.attempt):  # the providers' fault: the work since the checkpoint is free
                credit = await metering.credit_lost_work(s, job, await contract_of(s, job), t.cluster,
                                                         f"{t.cluster} failed: lost work since the last checkpoint")
            await leases.release(s, job.name, f"sub-task {t.name} failed", cluster=t.cluster)
            never_formed = bool(NEVER_STARTED & state.exit_codes.keys())  # the world never met: nobody can go on
            await record_event(s, job.name, "Warning", "SiteFailed",
                               f"site {t.site} ({t.cluster}) failed; {credit:.2f} credited for lost work; "
                               + _next_step(job, t, never_formed), subtask=t.name)
            t.desired = "Stop"
            # a synchronous attempt ends here, and any attempt whose rank 0 (the job's store) is gone
            if never_formed or not elastic(job.status) or t.first_rank == 0:
                await self._stop_subtasks(s, job)

    async def _attempt_over(self, s: AsyncSession, job: JobRow, subtasks: list[SubtaskRow]) -> None:
        ok = [t for t in subtasks if t.phase == "Succeeded"]
        # elastic: the live sites finish the budget, and rank 0's site (the job's store, its final
        # weights) among them — a pipeline replica that broke leaves early but cleanly
        rank0 = any(t.first_rank == 0 for t in ok)
        if ok and (len(ok) == len(subtasks) or (elastic(job.status) and rank0)):
            if (nothing := await _trained_nothing(s, job)) is not None:
                await self._finish(s, job, "Failed", "NothingTrained", nothing)
                return
            if (missing := await self._outputs_missing(job)) is not None:
                await self._finish(s, job, "Failed", "OutputsNotStored", missing)
                return
            await self._finish(s, job, "Succeeded", "Completed",
                               f"{len(ok)} of {len(subtasks)} site(s) finished the token budget")
            return
        if any(t.phase == "Cancelled" for t in subtasks) and job.status.get("cancelRequested"):
            await self._finish(s, job, "Cancelled", "Cancelled", "cancelled by the user")
            return
        await self._retry_or_fail(s, job, subtasks)

    async def _outputs_missing(self, job: JobRow) -> str | None:
        """Why a job whose sites all finished is not Succeeded: its final weights are not stored (issue
        36, item 1: the blob store or the API was down as training ended, and the job said Succeeded
        with no model). The sites' runners retry for their outage window before they report an end, so
        a missing model here is lost for the server; the site keeps its copy on disk."""
        check = self.cfg.final_weights
        if check is None or await asyncio.to_thread(check, job.id):
            return None
        return ("the workers finished, but the job's final weights never reached the server's blob store "
                "(it or the API was unavailable for longer than the sites' outage window); the sites keep "
                "their copy on disk")

    async def _retry_or_fail(self, s: AsyncSession, job: JobRow, subtasks: list[SubtaskRow]) -> None:
        """A synchronous job lost a site: restart from the latest checkpoint on a new placement from
        live capacity (never on the failed sites); fail only when no feasible placement remains."""
        attempt = int(job.status.get("attempt", 1))
        failed_sites = _culprits(job, attempt, {t.site for t in subtasks if t.phase in ("Failed", "Lost")})
        cause = "; ".join(f"{t.site}: {t.message}" for t in subtasks if t.phase in ("Failed", "Lost") and t.message)
        if not metering.site_lost(job, attempt):
            await self._finish(s, job, "Failed", "WorkersFailed",
                               f"the workers failed on their own (no site was lost), so a retry would fail too: {cause}")
            return
        if attempt >= MAX_ATTEMPTS:
            await self._finish(s, job, "Failed", "TooManyAttempts",
                               f"attempt {attempt} failed on {sorted(failed_sites)}; giving up after {attempt}: {cause}")
            return
        try:  # reserve() checks every cluster before it writes a lease, so a refusal leaves nothing behind
            lines = await replace_placement(s, job, failed_sites, heartbeat_timeout=self.cfg.heartbeat_timeout,
                                            lease_ttl=self.cfg.lease_ttl)
        except errors.CPNError as exc:
            await self._finish(s, job, "Failed", "NoFeasiblePlacement", exc.message)
            return
        if (dearer := _above_price_cap(job, attempt + 1)) is not None:
            await self._finish(s, job, "Failed", "PriceCapExceeded", f"attempt {attempt} failed ({cause}); {dearer}")
            return
        before, after = replicas_of(job.status.get("placement") or []), replicas_of(lines)
        fewer = f"; {after} of its {before} pipeline replicas go on (the live sites hold no more)" if (
            before and after and after < before) else ""
        update_status(job, placement=lines, ring=ring_of(job.status.get("ring", []), lines))
        set_phase(job, "Reserved", "Restarting", f"restarting from the latest checkpoint without {sorted(failed_sites)}")
        await record_event(s, job.name, "Warning", "Restarting",
                           f"attempt {attempt} lost {sorted(failed_sites)}; attempt {attempt + 1} resumes from the "
                           "latest checkpoint on " + ", ".join(f"{p['gpus']}×{p['cluster']}" for p in lines) + fewer)

    async def _finish(self, s: AsyncSession, job: JobRow, phase: str, reason: str, message: str) -> None:
        previous = set_phase(job, phase, reason, message)
        released = await leases.release(s, job.name, f"job {phase.lower()}")
        await self._stop_subtasks(s, job)
        await revoke_job_tokens(s, job.name)
        contract = await contract_of(s, job)
        if contract is not None:
            contract.state = {"Succeeded": "completed", "Failed": "failed"}.get(phase, "cancelled")
        if phase != "Succeeded":  # the work done until now is paid for; reports stop here
            await metering.settle(s, job, contract)
        await metering.refresh_progress(s, job)
        _record_accuracy(job)
        try:
            lesson = await learning.learn(s, job)
        except Exception:  # noqa: BLE001 - a calibration problem must not undo the job's end
            log.exception("learning from job %s failed", job.name)
        else:
            if lesson is not None:
                log.info("job %s taught %s/%s/%s: step factor %.3f, start-up %.1f s (%d run(s))", job.name,
                         lesson.gpu_model, lesson.strategy, lesson.workload, lesson.step_factor,
                         lesson.startup_seconds, lesson.samples)
        await record_event(s, job.name, "Normal" if phase == "Succeeded" else "Warning", phase,
                           f"{previous} → {phase}: {message} ({released} lease(s) released)")

    async def cancel(self, s: AsyncSession, job: JobRow) -> None:
        """Stop a job now: its agents are told to stop the workers; leases are released at once."""
        update_status(job, cancelRequested=True)
        await self._finish(s, job, "Cancelled", "Cancelled", "cancelled by the user")

    async def _stop_subtasks(self, s: AsyncSession, job: JobRow) -> None:
        """Desired state Stop for every live sub-task; those no agent claimed yet end here."""
        if job.status.get("attempt") is None:  # no attempt yet (0: the profile run)
            return
        for t in await self._subtasks(s, job):
            if t.phase in DONE:
                continue
            t.desired = "Stop"
            if t.phase == "Pending":
                t.phase, t.finished_at = "Cancelled", datetime.now(UTC)


def _culprits(job: JobRow, attempt: int, failed: set[str]) -> set[str]:
    """Of the sites that failed together, the ones whose workers were killed or lost are to blame;
    peers that crashed because a collective lost its partner are not (Gloo raises on them)."""
    killed = {f["site"] for f in job.status.get("failedSites", []) if f["attempt"] == attempt and f["killed"]}
    return (killed & failed) or failed


def _killed(state: SubtaskState) -> bool:
    """The site, not the job's code, ended these workers: signalled (negative codes, 137 and 143 —
    SIGKILL/SIGTERM through a shell), never claimed or launched, or their agent fell silent."""
    return state.phase == "Lost" or any(isinstance(c, int) and (c < 0 or c in (137, 143))
                                        for c in state.exit_codes.values())


def _record_accuracy(job: JobRow) -> None:
    """Keep predicted vs measured run time on the job: the compute model's report card."""
    times = job.status.get("phaseTimes", {})
    start, end = times.get("Launching"), times.get(job.phase)
    predicted = job.status.get("predictedSeconds")
    if not (start and end and predicted):
        return
    wall = (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds()
    update_status(job, measured={"wallSeconds": round(wall, 1), "predictedSeconds": round(float(predicted), 1),
                                 "ratio": round(wall / float(predicted), 3) if predicted else None})


def _next_step(job: JobRow, t: SubtaskRow, never_formed: bool) -> str:
    """What a site's failure does to the job, in the event that reports it (issue 36, item 4: it said
    "the job continues on the other sites" just before the job failed)."""
    if never_formed:
        return ("the attempt never formed (its workers never met), so its other sites are stopped and none "
                "of it is charged; a new placement is tried if one remains")
    if elastic(job.status) and t.first_rank != 0:
        return "the job continues on the other sites"
    return "the attempt restarts from its latest checkpoint if a placement remains"


async def _trained_nothing(s: AsyncSession, job: JobRow) -> str | None:
    """Why a job whose sub-tasks all exited 0 has not succeeded: it never reported a trained token
    (issue 35, H3: such a job ended Succeeded at 0 % with a 0.00 invoice). None: it trained."""
    trained = await s.execute(select(MetricRow.id).where(MetricRow.job == job.name, MetricRow.tokens > 0).limit(1))
    if trained.first() is not None:
        return None
    return ("the workers exited 0 but never reported a trained token (no metric report with tokens > 0): "
            "nothing was trained, so the job has not succeeded; the GPU time it held is charged")


def _above_price_cap(job: JobRow, attempt: int) -> str | None:
    """Why a re-placement may not run: a cluster it priced at more per GPU-hour than the user agreed to
    (spec.maxPricePerGpuHour, else the accepted quote's dearest GPU-hour). None: within the cap."""
    cap_text = (job.spec or {}).get("maxPricePerGpuHour")
    quoted = [Decimal(q["unitPrice"]) for q in job.status.get("quoteLines", []) if q["item"] == "gpu-hours"]
    if cap_text is None and not quoted:
        return None
    cap = Decimal(str(cap_text)) if cap_text is not None else max(quoted)
    dearer = [q for q in job.status.get("repricedLines", []) if q["item"] == "gpu-hours"
              and int(q.get("attempt", 0)) == attempt and Decimal(q["unitPrice"]) > cap]
    if not dearer:
        return None
    where = ", ".join(f"{q['cluster']} at {q['unitPrice']}/GPU-h" for q in dearer)
    source = "spec.maxPricePerGpuHour" if cap_text is not None else "the accepted quote's price"
    return (f"the only placement left without the failed site(s) costs more per GPU-hour ({where}) than "
            f"{source} ({cap}): not billed without your consent; set spec.maxPricePerGpuHour to allow it")


def _waiting(attempt: int, clusters: list[str]) -> str:
    if not clusters:  # every sub-task is claimed: the workers are starting
        return f"attempt {attempt}: sub-tasks claimed, workers starting"
    return f"attempt {attempt}: waiting for the agents of {', '.join(clusters)} to claim their sub-tasks"


def _running(running: list[SubtaskRow], subtasks: list[SubtaskRow]) -> str:
    finished = sum(t.phase == "Succeeded" for t in subtasks)
    return f"{len(running)} of {len(subtasks)} sub-tasks running" + (f", {finished} finished" if finished else "")
