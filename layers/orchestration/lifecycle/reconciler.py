"""The reconciler: drives every job from Reserved to a terminal phase. Restart-safe — all state
lives in the database and in the drivers' idempotent launches (keyed job/sub-task/attempt), so a
killed and restarted API server picks up where it was and launches nothing twice."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from cpn.core import errors
from cpn.core.db import Database
from cpn.runtime.launcher import free_port
from layers.control import leases
from layers.orchestration.events import record_event
from layers.orchestration.identity.models import Account
from layers.orchestration.identity.tokens import issue_token, revoke_job_tokens
from layers.orchestration.lifecycle import metering
from layers.orchestration.lifecycle.models import SubtaskRow
from layers.orchestration.lifecycle.plan import ELASTIC, topology_for, train_config
from layers.orchestration.lifecycle.replan import replace_placement, ring_of
from layers.resource.capacity import inventory
from layers.resource.drivers.base import JobLaunch, SubtaskLaunch, SubtaskState
from layers.resource.drivers.local import driver_for
from layers.resource.models import ClusterRow
from layers.resource.stores import is_ready
from layers.service.contracts import contract_of
from layers.service.jobs import TERMINAL, set_phase, update_status
from layers.service.models import JobRow
from layers.service.schemas import TrainingJobSpec

log = logging.getLogger("cpn.reconciler")
ACTIVE = ("Reserved", "Launching", "Running")
DONE = ("Succeeded", "Failed", "Cancelled", "Lost")
MAX_ATTEMPTS = 3


@dataclass
class ReconcilerConfig:
    run_root: Path
    metrics_base_url: str
    heartbeat_timeout: timedelta
    lease_ttl: timedelta
    wan_emulation: bool = False
    interval: float = 1.0


class Reconciler:
    def __init__(self, db: Database, cfg: ReconcilerConfig):
        self.db, self.cfg = db, cfg
        self.tokens: dict[str, str] = {}  # job → worker token (in memory only; re-issued after a restart)

    async def run_forever(self) -> None:
        while True:
            try:
                await self.reconcile_once()
            except Exception:  # noqa: BLE001 - one bad pass must not stop the loop
                log.exception("reconcile pass failed")
            await asyncio.sleep(self.cfg.interval)

    async def reconcile_once(self) -> None:
        async with self.db.session() as s:
            for job in await leases.expire(s):
                row = (await s.execute(select(JobRow).where(JobRow.name == job))).scalar_one_or_none()
                if row is not None and row.phase == "Reserved":
                    await self._finish(s, row, "Failed", "LeaseExpired", "the job did not start before its leases expired")
            names = list((await s.execute(select(JobRow.name).where(JobRow.phase.in_(ACTIVE)))).scalars())
        for name in names:
            async with self.db.serialized(), self.db.session() as s:
                job = (await s.execute(select(JobRow).where(JobRow.name == name).with_for_update())).scalar_one()
                if job.phase in ACTIVE:
                    await self.step(s, job)

    async def step(self, s: AsyncSession, job: JobRow) -> None:
        if job.phase == "Reserved":
            await self._prepare_attempt(s, job)
        subtasks = await self._subtasks(s, job)
        launch = self._launch_spec(job)
        pending = [t for t in subtasks if t.launches == 0]
        if pending:
            await self._launch(s, job, launch, pending)
        states = await self._poll(job, launch, subtasks)
        await self._apply_states(s, job, subtasks, states)

    # ---------------------------------------------------------------- attempts
    async def _prepare_attempt(self, s: AsyncSession, job: JobRow) -> None:
        attempt = int(job.status.get("attempt", 0)) + 1
        spec = TrainingJobSpec.model_validate(job.spec)
        placement, ring = job.status["placement"], job.status.get("ring") or []
        _, links = await inventory(s, self.cfg.heartbeat_timeout)
        topo = topology_for(placement, ring, links)
        workers = sum(site["ranks"] for site in topo["sites"])
        resume = str(self.cfg.run_root / job.name / "checkpoints") if attempt > 1 else None
        try:
            train = train_config(spec, job.status["strategy"], workers, resume)
        except ValueError as exc:
            await self._finish(s, job, "Failed", "NotRunnable", str(exc))
            return
        index = {site["name"]: i for i, site in enumerate(topo["sites"])}
        clusters = {c.name: c for c in (await s.execute(select(ClusterRow))).scalars()}
        for p in placement:
            cluster = p["cluster"].split("/")[0]
            name = f"{job.name}-{cluster}"
            s.add(SubtaskRow(job=job.name, name=name, attempt=attempt, launch_key=f"{job.name}/{name}/{attempt}",
                             cluster=cluster, site=p["site"], site_index=index[p["site"]], gpus=int(p["gpus"]),
                             driver=clusters[cluster].driver if cluster in clusters else "local", phase="Pending"))
        update_status(job, attempt=attempt, topology=topo, train=train, masterPort=free_port(),
                      checkpointEvery=train["checkpoint_every"], sites=f"0/{len(placement)}")
        await leases.hold(s, job.name, datetime.now(UTC) + timedelta(days=30))
        set_phase(job, "Launching", "Launching", f"attempt {attempt}: launching {len(placement)} sub-task(s)")
        await record_event(s, job.name, "Normal", "Launching", f"Reserved → Launching (attempt {attempt})")
        await s.flush()

    async def _subtasks(self, s: AsyncSession, job: JobRow) -> list[SubtaskRow]:
        attempt = int(job.status.get("attempt", 1))
        stmt = select(SubtaskRow).where(SubtaskRow.job == job.name, SubtaskRow.attempt == attempt)
        return list((await s.execute(stmt.order_by(SubtaskRow.site_index))).scalars())

    def _launch_spec(self, job: JobRow) -> JobLaunch:
        return JobLaunch(job=job.name, attempt=int(job.status.get("attempt", 1)), topology=job.status["topology"],
                         train=job.status["train"], master_port=int(job.status["masterPort"]),
                         metrics_url=f"{self.cfg.metrics_base_url}/api/v1/jobs/{job.name}/metrics",
                         metrics_token=self.tokens.get(job.name), run_root=self.cfg.run_root,
                         elastic=job.status.get("strategy") in ELASTIC, wan_emulation=self.cfg.wan_emulation)

    async def _launch(self, s: AsyncSession, job: JobRow, launch: JobLaunch, pending: list[SubtaskRow]) -> None:
        if job.name not in self.tokens:
            owner = (await s.execute(select(Account).where(Account.id == job.owner_id))).scalar_one()
            self.tokens[job.name] = await issue_token(s, owner, f"worker-{job.name}", job=job.name)
            launch = JobLaunch(**{**launch.__dict__, "metrics_token": self.tokens[job.name]})
        by_driver: dict[str, list[SubtaskRow]] = {}
        for t in pending:
            by_driver.setdefault(t.driver, []).append(t)
        specs_of = {c.name: c.spec for c in (await s.execute(
            select(ClusterRow).where(ClusterRow.name.in_({t.cluster for t in pending})))).scalars()}
        for name, rows in by_driver.items():
            specs = [SubtaskLaunch(subtask=t.name, cluster=t.cluster, site_index=t.site_index, ranks=t.gpus,
                                   key=t.launch_key, cluster_spec=specs_of.get(t.cluster, {})) for t in rows]
            handles = await driver_for(name).launch(launch, specs)
            now = datetime.now(UTC)
            for t in rows:
                t.handle, t.launches, t.launched_at, t.phase = handles[t.name], t.launches + 1, now, "Launching"
                await record_event(s, job.name, "Normal", "SubtaskLaunched",
                                   f"{t.name} on {t.cluster} ({t.gpus} workers, key {t.launch_key})", subtask=t.name)

    async def _poll(self, job: JobRow, launch: JobLaunch, subtasks: list[SubtaskRow]) -> dict[str, SubtaskState]:
        states: dict[str, SubtaskState] = {}
        by_driver: dict[str, dict[str, dict[str, Any]]] = {}
        for t in subtasks:
            if t.launches and t.phase not in DONE:
                by_driver.setdefault(t.driver, {})[t.name] = t.handle
        for name, handles in by_driver.items():
            states.update(await driver_for(name).poll(launch, handles))
        return states

    # ---------------------------------------------------------------- state
    async def _apply_states(self, s: AsyncSession, job: JobRow, subtasks: list[SubtaskRow],
                            states: dict[str, SubtaskState]) -> None:
        clusters = {c.name: c for c in (await s.execute(select(ClusterRow))).scalars()}
        for t in subtasks:
            state = states.get(t.name)
            if state is None:
                continue
            cluster = clusters.get(t.cluster)
            if state.phase in ("Running", "Launching") and cluster is not None \
                    and not is_ready(cluster, self.cfg.heartbeat_timeout)[0]:
                await self._kill_site(job, t, state)
                state = SubtaskState(phase="Failed", message=f"cluster {t.cluster} stopped heartbeating",
                                     exit_codes={"heartbeat": -9})
            if state.phase != t.phase:
                await self._transition(s, job, t, state)
        live = [t for t in subtasks if t.phase not in DONE]
        running = [t for t in subtasks if t.phase == "Running"]
        update_status(job, sites=f"{len(running)}/{len(subtasks)}")
        if job.phase == "Launching" and running:
            set_phase(job, "Running", "WorkersRunning", f"{len(running)} of {len(subtasks)} sub-tasks running")
            await record_event(s, job.name, "Normal", "Running", "Launching → Running")
        if not live:
            await self._attempt_over(s, job, subtasks)

    async def _transition(self, s: AsyncSession, job: JobRow, t: SubtaskRow, state: SubtaskState) -> None:
        old, t.phase, t.message = t.phase, state.phase, state.message or t.message
        failed = state.phase in ("Failed", "Lost")
        await record_event(s, job.name, "Warning" if failed else "Normal", f"Subtask{state.phase}",
                           f"{t.name}: {old} → {state.phase} {state.message}".strip(), subtask=t.name)
        if state.phase in DONE:
            t.finished_at = datetime.now(UTC)
        if failed:
            killed = any(isinstance(c, int) and (c < 0 or c in (137, 143)) for c in state.exit_codes.values())
            update_status(job, failedSites=[*job.status.get("failedSites", []),
                                            {"attempt": t.attempt, "site": t.site, "killed": killed}])
            contract = await contract_of(s, job)
            credit = await metering.credit_lost_work(s, job, contract, t.cluster,
                                                     f"{t.cluster} failed: lost work since the last checkpoint")
            await leases.release(s, job.name, f"sub-task {t.name} failed", cluster=t.cluster)
            await record_event(s, job.name, "Warning", "SiteFailed",
                               f"site {t.site} ({t.cluster}) failed; {credit:.2f} credited for lost work; "
                               + ("the job continues on the other sites" if job.status.get("strategy") in ELASTIC
                                  else "the attempt restarts from its latest checkpoint"), subtask=t.name)
            if job.status.get("strategy") not in ELASTIC:
                await driver_for(t.driver).cancel(self._launch_spec(job), {t.name: t.handle})

    async def _kill_site(self, job: JobRow, t: SubtaskRow, state: SubtaskState) -> None:
        import os
        import signal

        for pid in state.pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)

    async def _attempt_over(self, s: AsyncSession, job: JobRow, subtasks: list[SubtaskRow]) -> None:
        ok = [t for t in subtasks if t.phase == "Succeeded"]
        elastic = job.status.get("strategy") in ELASTIC
        if ok and (elastic or len(ok) == len(subtasks)):
            await self._finish(s, job, "Succeeded", "Completed",
                               f"{len(ok)} of {len(subtasks)} site(s) finished the token budget")
            return
        if any(t.phase == "Cancelled" for t in subtasks) and job.status.get("cancelRequested"):
            await self._finish(s, job, "Cancelled", "Cancelled", "cancelled by the user")
            return
        await self._retry_or_fail(s, job, subtasks)

    async def _retry_or_fail(self, s: AsyncSession, job: JobRow, subtasks: list[SubtaskRow]) -> None:
        """A synchronous job lost a site: restart from the latest checkpoint on a new placement from
        live capacity (never on the failed sites); fail only when no feasible placement remains."""
        attempt = int(job.status.get("attempt", 1))
        failed_sites = _culprits(job, attempt, {t.site for t in subtasks if t.phase in ("Failed", "Lost")})
        if attempt >= MAX_ATTEMPTS:
            await self._finish(s, job, "Failed", "TooManyAttempts",
                               f"attempt {attempt} failed on {sorted(failed_sites)}; giving up after {attempt}")
            return
        try:  # reserve() checks every cluster before it writes a lease, so a refusal leaves nothing behind
            lines = await replace_placement(s, job, failed_sites, heartbeat_timeout=self.cfg.heartbeat_timeout,
                                            lease_ttl=self.cfg.lease_ttl)
        except errors.CPNError as exc:
            await self._finish(s, job, "Failed", "NoFeasiblePlacement", exc.message)
            return
        update_status(job, placement=lines, ring=ring_of(job.status.get("ring", []), lines))
        set_phase(job, "Reserved", "Restarting", f"restarting from the latest checkpoint without {sorted(failed_sites)}")
        await record_event(s, job.name, "Warning", "Restarting",
                           f"attempt {attempt} lost {sorted(failed_sites)}; attempt {attempt + 1} resumes from the "
                           "latest checkpoint on " + ", ".join(f"{p['gpus']}×{p['cluster']}" for p in lines))

    async def _finish(self, s: AsyncSession, job: JobRow, phase: str, reason: str, message: str) -> None:
        previous = set_phase(job, phase, reason, message)
        released = await leases.release(s, job.name, f"job {phase.lower()}")
        await revoke_job_tokens(s, job.name)
        self.tokens.pop(job.name, None)
        contract = await contract_of(s, job)
        if contract is not None:
            contract.state = {"Succeeded": "completed", "Failed": "failed"}.get(phase, "cancelled")
        await metering.refresh_progress(s, job)
        _record_accuracy(job)
        await record_event(s, job.name, "Normal" if phase == "Succeeded" else "Warning", phase,
                           f"{previous} → {phase}: {message} ({released} lease(s) released)")

    async def cancel(self, s: AsyncSession, job: JobRow) -> None:
        """Stop a job now: signal its drivers, release everything, phase Cancelled."""
        update_status(job, cancelRequested=True)
        if job.phase in ("Launching", "Running") and job.status.get("attempt"):
            launch = self._launch_spec(job)
            subtasks = await self._subtasks(s, job)
            by_driver: dict[str, dict[str, dict[str, Any]]] = {}
            for t in subtasks:
                if t.phase not in DONE:
                    by_driver.setdefault(t.driver, {})[t.name] = t.handle
                    t.phase, t.finished_at = "Cancelled", datetime.now(UTC)
            for name, handles in by_driver.items():
                await driver_for(name).cancel(launch, handles)
        await self._finish(s, job, "Cancelled", "Cancelled", "cancelled by the user")


def _culprits(job: JobRow, attempt: int, failed: set[str]) -> set[str]:
    """Of the sites that failed together, the ones whose workers were killed or lost are to blame;
    peers that crashed because a collective lost its partner are not (Gloo raises on them)."""
    killed = {f["site"] for f in job.status.get("failedSites", []) if f["attempt"] == attempt and f["killed"]}
    return (killed & failed) or failed


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


def is_terminal(job: JobRow) -> bool:
    return job.phase in TERMINAL
