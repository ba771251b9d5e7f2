"""Running jobs: worker metrics, cancel, logs, the loss curve, `top sites`; the reconciler task."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

from aiohttp import web
from prometheus_client import Gauge
from pydantic import BaseModel, Field
from sqlalchemy import func, select

from cpn.api import state
from cpn.api.bodies import json_response, read_model
from cpn.api.metrics import REGISTRY
from cpn.api.middleware import principal_of
from cpn.api.openapi import RouteDoc
from cpn.api.routes import add
from cpn.api.routes.system import REFRESH
from cpn.core import errors
from cpn.core.principal import Role
from layers.control.capacity import leased_gpus
from layers.orchestration.lifecycle import metering
from layers.orchestration.lifecycle.models import MetricRow, SubtaskRow
from layers.orchestration.lifecycle.reconciler import Reconciler, ReconcilerConfig
from layers.resource.capacity import inventory
from layers.resource.drivers.local import driver_for
from layers.resource.models import ClusterRow
from layers.service.contracts import contract_of
from layers.service.jobs import JobStore, load_job
from layers.service.models import JobRow

RECONCILER = web.AppKey("reconciler", Reconciler)


class MetricsBatch(BaseModel):
    reports: list[dict[str, Any]] = Field(max_length=5000)


async def post_metrics(request: web.Request) -> web.Response:
    body = await read_model(request, MetricsBatch)
    principal = principal_of(request)
    async with request.app[state.DB].session() as s:
        job = await load_job(s, principal, request.match_info["name"], lock=True)
        if job.phase not in ("Launching", "Running"):
            return json_response({"accepted": 0, "phase": job.phase})
        taken = await metering.ingest(s, job, await contract_of(s, job), body.reports)
    return json_response({"accepted": taken})


async def get_metrics(request: web.Request) -> web.Response:
    principal = principal_of(request)
    async with request.app[state.DB].session() as s:
        job = await load_job(s, principal, request.match_info["name"])
        rows = (await s.execute(select(MetricRow).where(MetricRow.job == job.name).order_by(MetricRow.at)
                                .limit(5000))).scalars().all()
    items = [{"attempt": r.attempt, "rank": r.rank, "site": r.site, "step": r.step, "tokens": r.tokens,
              "trainLoss": r.train_loss, "valLoss": r.val_loss, "tokensPerSecond": r.tokens_per_second,
              "wallSeconds": r.wall_seconds, "wanBytes": r.wan_bytes, "at": r.at.isoformat()} for r in rows]
    return json_response({"apiVersion": "cpn/v1", "kind": "List", "items": items})


async def post_cancel(request: web.Request) -> web.Response:
    principal = principal_of(request)
    db = request.app[state.DB]
    async with db.serialized(), db.session() as s:
        job = await load_job(s, principal, request.match_info["name"], lock=True)
        if job.phase in ("Succeeded", "Failed", "Cancelled"):
            raise errors.Conflict(f"job {job.name!r} is already {job.phase}")
        await request.app[RECONCILER].cancel(s, job)
        out = JobStore().to_manifest(principal, job)
    return json_response(out)


async def get_subtasks(request: web.Request) -> web.Response:
    principal = principal_of(request)
    async with request.app[state.DB].session() as s:
        job = await load_job(s, principal, request.match_info["name"])
        rows = (await s.execute(select(SubtaskRow).where(SubtaskRow.job == job.name)
                                .order_by(SubtaskRow.attempt, SubtaskRow.site_index))).scalars().all()
    items = [{"metadata": {"name": t.name}, "attempt": t.attempt, "cluster": t.cluster, "site": t.site,
              "gpus": t.gpus, "driver": t.driver, "phase": t.phase, "launches": t.launches,
              "launchKey": t.launch_key, "message": t.message, "handle": t.handle} for t in rows]
    return json_response({"apiVersion": "cpn/v1", "kind": "List", "items": items})


async def get_logs(request: web.Request) -> web.StreamResponse:
    principal = principal_of(request)
    site = request.query.get("site")
    follow = request.query.get("follow") in ("1", "true")
    async with request.app[state.DB].session() as s:
        job = await load_job(s, principal, request.match_info["name"])
        attempt = int(job.status.get("attempt", 0))
        rows = (await s.execute(select(SubtaskRow).where(SubtaskRow.job == job.name, SubtaskRow.attempt == attempt)
                                .order_by(SubtaskRow.site_index))).scalars().all()
    rows = [t for t in rows if site in (None, t.site, t.cluster, t.name) and t.launches]
    if site and not rows:
        raise errors.NotFound(f"job {job.name!r} has no launched sub-task at site {site!r}", field="site")
    response = web.StreamResponse(headers={"Content-Type": "text/plain; charset=utf-8"})
    await response.prepare(request)
    streams = [_prefixed(t, driver_for(t.driver).logs(t.handle, follow)) for t in rows]
    async for line in _merge(streams):
        await response.write((line + "\n").encode())
    await response.write_eof()
    return response


async def _prefixed(t: SubtaskRow, lines: AsyncIterator[str]) -> AsyncIterator[str]:
    async for line in lines:
        yield f"[{t.site}] {line}"


async def _merge(streams: list[AsyncIterator[str]]) -> AsyncIterator[str]:
    queue: asyncio.Queue[str | None] = asyncio.Queue()

    async def pump(stream: AsyncIterator[str]) -> None:
        try:
            async for line in stream:
                await queue.put(line)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(st)) for st in streams]
    done = 0
    try:
        while done < len(tasks):
            item = await queue.get()
            if item is None:
                done += 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


async def top_sites(request: web.Request) -> web.Response:
    settings = request.app[state.SETTINGS]
    async with request.app[state.DB].session() as s:
        clusters, _ = await inventory(s, timedelta(seconds=settings.heartbeat_timeout_seconds))
        leased = await leased_gpus(s)
        running = dict((await s.execute(select(SubtaskRow.site, func.count()).where(SubtaskRow.phase == "Running")
                                        .group_by(SubtaskRow.site))).all())
    sites: dict[str, dict[str, Any]] = {}
    for c in clusters:
        row = sites.setdefault(c.site, {"metadata": {"name": c.site}, "region": c.region, "provider": c.provider,
                                        "clusters": 0, "ready": 0, "capacity": 0, "allocatable": 0, "leased": 0,
                                        "running": running.get(c.site, 0)})
        row["clusters"] += 1
        row["ready"] += int(c.ready)
        row["capacity"] += c.capacity_gpus
        row["allocatable"] += c.allocatable_gpus
        row["leased"] += leased.get(c.name, 0)
    for row in sites.values():
        row["utilization"] = f"{100 * row['leased'] / row['capacity']:.0f}%" if row["capacity"] else "-"
    return json_response({"apiVersion": "cpn/v1", "kind": "List", "items": list(sites.values())})


async def _reconciler_ctx(app: web.Application) -> AsyncIterator[None]:
    settings = app[state.SETTINGS]
    reconciler = Reconciler(app[state.DB], ReconcilerConfig(
        run_root=settings.run_root, metrics_base_url=settings.base_url,
        heartbeat_timeout=timedelta(seconds=settings.heartbeat_timeout_seconds),
        lease_ttl=timedelta(seconds=settings.lease_ttl_seconds), wan_emulation=settings.wan_emulation,
        interval=settings.reconcile_interval_seconds))
    app[RECONCILER] = reconciler
    task = asyncio.create_task(reconciler.run_forever()) if settings.reconcile else None
    yield
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def get_all_subtasks(request: web.Request) -> web.Response:
    """Sub-tasks the caller may see: a provider those on its clusters (never the job's spec or data
    settings), a user those of its own jobs, an admin all."""
    principal = principal_of(request)
    async with request.app[state.DB].session() as s:
        stmt = select(SubtaskRow).order_by(SubtaskRow.job, SubtaskRow.attempt, SubtaskRow.site_index)
        if principal.role is Role.PROVIDER:
            mine = select(ClusterRow.name).where(ClusterRow.owner_id == principal.account_id)
            stmt = stmt.where(SubtaskRow.cluster.in_(mine))
        elif not principal.is_admin:
            own = select(JobRow.name).where(JobRow.owner_id == principal.account_id)
            stmt = stmt.where(SubtaskRow.job.in_(own))
        if request.query.get("job"):
            stmt = stmt.where(SubtaskRow.job == request.query["job"])
        rows = (await s.execute(stmt)).scalars().all()
    items = [{"apiVersion": "cpn/v1", "kind": "SubTask",
              "metadata": {"name": t.name, "creationTimestamp": t.created_at.isoformat()},
              "spec": {"job": t.job, "attempt": t.attempt, "cluster": t.cluster, "site": t.site, "gpus": t.gpus,
                       "driver": t.driver},
              "status": {"phase": t.phase, "launches": t.launches, "message": t.message}} for t in rows]
    return json_response({"apiVersion": "cpn/v1", "kind": "List", "items": items})


async def refresh_gauges(app: web.Application) -> None:
    """Set the job and site gauges from the database just before Prometheus scrapes."""
    gauges = app[GAUGES]
    settings = app[state.SETTINGS]
    async with app[state.DB].session() as s:
        phases = dict((await s.execute(select(JobRow.phase, func.count()).group_by(JobRow.phase))).all())
        clusters, _ = await inventory(s, timedelta(seconds=settings.heartbeat_timeout_seconds))
        leased = await leased_gpus(s)
    gauges["jobs"].clear()
    for phase, count in phases.items():
        gauges["jobs"].labels(phase).set(count)
    gauges["gpus"].clear()
    for c in clusters:
        gauges["gpus"].labels(c.site, c.name, "capacity").set(c.capacity_gpus)
        gauges["gpus"].labels(c.site, c.name, "allocatable").set(c.allocatable_gpus)
        gauges["gpus"].labels(c.site, c.name, "leased").set(leased.get(c.name, 0))
        gauges["ready"].labels(c.site, c.name).set(1 if c.ready else 0)


GAUGES = web.AppKey("gauges", dict)


def _install_gauges(app: web.Application) -> None:
    registry = app[REGISTRY]
    app[GAUGES] = {
        "jobs": Gauge("cpn_jobs", "Training jobs by phase", ["phase"], registry=registry),
        "gpus": Gauge("cpn_cluster_gpus", "GPUs per cluster", ["site", "cluster", "kind"], registry=registry),
        "ready": Gauge("cpn_cluster_ready", "1 when the cluster is Ready", ["site", "cluster"], registry=registry),
    }
    app[REFRESH] = refresh_gauges


def setup(app: web.Application) -> None:
    app.cleanup_ctx.append(_reconciler_ctx)
    _install_gauges(app)
    add(app, get_all_subtasks, RouteDoc("GET", "/api/v1/subtasks", "Sub-tasks (providers: on their clusters)",
                                        "SubTask", query=("job",)))
    add(app, post_metrics, RouteDoc("POST", "/api/v1/jobs/{name}/metrics", "Worker metric reports (worker token)",
                                    "TrainingJob", request=MetricsBatch, params=("name",)))
    add(app, get_metrics, RouteDoc("GET", "/api/v1/jobs/{name}/metrics", "A job's metric reports", "TrainingJob",
                                   params=("name",)))
    add(app, post_cancel, RouteDoc("POST", "/api/v1/jobs/{name}/cancel", "Cancel a job", "TrainingJob",
                                   params=("name",)))
    add(app, get_subtasks, RouteDoc("GET", "/api/v1/jobs/{name}/subtasks", "A job's sub-tasks", "TrainingJob",
                                    params=("name",)))
    add(app, get_logs, RouteDoc("GET", "/api/v1/jobs/{name}/logs", "Worker logs (text; follow=1 streams)",
                                "TrainingJob", params=("name",), query=("site", "follow")))
    add(app, top_sites, RouteDoc("GET", "/api/v1/top/sites", "Live per-site usage", "Site"))
