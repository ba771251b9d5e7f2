"""Running jobs: the site agents' protocol (watch, claim, report, logs), worker metrics and
checkpoints, cancel, logs, the loss curve, `top sites`; the reconciler task."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

from aiohttp import web
from prometheus_client.core import GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field

from cpn.api import state
from cpn.api.bodies import json_response, read_model
from cpn.api.longpolls import LONG_POLLS
from cpn.api.middleware import principal_of
from cpn.api.openapi import RouteDoc
from cpn.api.routes import add
from cpn.api.routes.system import REFRESH
from cpn.core import errors
from cpn.core.principal import Role
from cpn.runtime.contract import AttemptSpec
from layers.orchestration.lifecycle import agents, checkpoints, learning, logs, metering, metric_series, views
from layers.orchestration.lifecycle.metric_batches import BATCH_ID_PATTERN, record_batch, stored_batch
from layers.orchestration.lifecycle.reconciler import Reconciler, ReconcilerConfig
from layers.orchestration.lifecycle.retention import prune as prune_checkpoints
from layers.resource.bundles import final_key
from layers.service.contracts import contract_of
from layers.service.jobs import TERMINAL, JobStore, job_key, load_job

RECONCILER = web.AppKey("reconciler", Reconciler)
BLOBS = state.BLOBS
WATCH_MAX_SECONDS = 30.0


class MetricsBatch(BaseModel):
    # no other keys: the schema said any were welcome while a NUL in one got a 422 (the fuzz, 2026-11-28)
    model_config = ConfigDict(extra="forbid")

    reports: list[dict[str, object]] = Field(max_length=5000)
    # the sender's name for this batch, the same on every retry: a batch already stored is not stored again
    batchId: str | None = Field(None, pattern=BATCH_ID_PATTERN)  # noqa: N815 - wire name


def _heartbeat_timeout(request: web.Request) -> timedelta:
    return timedelta(seconds=request.app[state.SETTINGS].heartbeat_timeout_seconds)


def _int(request: web.Request, name: str, default: int | None = None, *, low: int = 0,
         high: int = 10**9) -> int | None:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise errors.InvalidInput(f"{name} must be an integer, got {raw[:20]!r}", field=name) from None
    if not low <= value <= high:
        raise errors.InvalidInput(f"{name} must be between {low} and {high}", field=name)
    return value


def _text(request: web.Request, name: str) -> str | None:
    raw = request.query.get(name)
    if raw is not None and ("\x00" in raw or len(raw) > 253):
        raise errors.InvalidInput(f"{name} is not a valid name", field=name)
    return raw or None


# ---------------------------------------------------------------- agents
async def list_subtasks(request: web.Request) -> web.Response:
    """Sub-tasks the caller may see. With `cluster` and `watch=true`: a long poll that answers when
    the cluster's sub-tasks change after `resourceVersion`, or after `timeoutSeconds`."""
    principal = principal_of(request)
    cluster, job = _text(request, "cluster"), _text(request, "job")
    watch = request.query.get("watch") in ("1", "true")
    if watch and cluster is None:
        raise errors.InvalidInput("watch needs cluster=NAME", field="cluster")
    since = request.query.get("resourceVersion")
    deadline = time.monotonic() + (_int(request, "timeoutSeconds", 20, high=int(WATCH_MAX_SECONDS)) or 0)
    db = request.app[state.DB]
    with request.app[LONG_POLLS].hold(principal, f"cluster {cluster}") if watch else contextlib.nullcontext():
        while True:
            async with db.session() as s:
                rows = await agents.visible(s, principal, cluster=cluster, job=await job_key(s, principal, job),
                                            active=request.query.get("active") in ("1", "true") or watch)
                version = await agents.version(s, cluster) if cluster else ""
            if not watch or version != since or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.5)
    return json_response({"apiVersion": "cpn/v1", "kind": "List", "metadata": {"resourceVersion": version},
                          "items": [agents.view(t) for t in rows]})


async def get_subtask(request: web.Request) -> web.Response:
    async with request.app[state.DB].session() as s:
        row = await agents.get(s, principal_of(request), request.match_info["uid"])
        return json_response(agents.view(row))


async def post_claim(request: web.Request) -> web.Response:
    body = await read_model(request, agents.ClaimRequest)
    db = request.app[state.DB]
    async with db.serialized(), db.session() as s:
        spec = await agents.claim(s, principal_of(request), request.match_info["uid"], body)
    return json_response(spec.model_dump(mode="json"))


async def post_report(request: web.Request) -> web.Response:
    body = await read_model(request, agents.SubtaskReport)
    async with request.app[state.DB].session() as s:
        row = await agents.report(s, principal_of(request), request.match_info["uid"], body)
        return json_response(agents.view(row))


async def post_subtask_logs(request: web.Request) -> web.Response:
    body = await read_model(request, agents.LogBatch)
    async with request.app[state.DB].session() as s:
        taken = await agents.append_logs(s, principal_of(request), request.match_info["uid"], body)
    return json_response({"accepted": taken})


# ---------------------------------------------------------------- workers
async def post_metrics(request: web.Request) -> web.Response:
    body = await read_model(request, MetricsBatch)
    metering.check_reports(body.reports)  # NaN, Infinity, negative: 422 naming the field
    principal = principal_of(request)
    async with request.app[state.DB].session() as s:
        job = await load_job(s, principal, request.match_info["name"], lock=True)
        if body.batchId is not None and (seen := await stored_batch(s, job.name, body.batchId)) is not None:
            return json_response({"accepted": seen, "duplicate": True})
        if job.phase not in ("Launching", "Running", "Profiling"):
            return json_response({"accepted": 0, "phase": job.phase})
        await agents.check_worker(s, principal, job, body.reports)
        taken = await metering.ingest(s, job, await contract_of(s, job), body.reports)
        if body.batchId is not None:
            record_batch(s, job.name, body.batchId, taken)
    return json_response({"accepted": taken})


async def put_checkpoint(request: web.Request) -> web.Response:
    principal = principal_of(request)
    name = request.match_info["name"]
    if principal.role is not Role.WORKER or principal.job != name:
        raise errors.Forbidden("only the job's workers write its checkpoints")
    async with request.app[state.DB].session() as s:
        job = await load_job(s, principal, name)
    key = checkpoints.key(job.id, f"{request.match_info['step']}/{request.match_info['file']}")
    size = await request.app[BLOBS].put(key, request.content.iter_chunked(1 << 20))
    if request.match_info["file"] == "latest.json":  # a step committed: older ones beyond the kept go
        keep = request.app[state.SETTINGS].checkpoint_keep
        await asyncio.to_thread(prune_checkpoints, request.app[BLOBS], job.id, keep)
    return json_response({"name": key, "size": size}, status=201)


async def get_checkpoint_latest(request: web.Request) -> web.Response:
    async with request.app[state.DB].session() as s:
        job = await load_job(s, principal_of(request), request.match_info["name"])
    latest = checkpoints.latest(request.app[BLOBS], job.id)
    if latest is None:
        raise errors.NotFound(f"job {job.name!r} has no complete checkpoint")
    return json_response(latest)


async def get_checkpoint(request: web.Request) -> web.StreamResponse:
    async with request.app[state.DB].session() as s:
        job = await load_job(s, principal_of(request), request.match_info["name"])
    key = checkpoints.key(job.id, f"{request.match_info['step']}/{request.match_info['file']}")
    chunks = await request.app[BLOBS].open(key)
    if chunks is None:
        raise errors.NotFound(f"checkpoint file {request.match_info['step']}/{request.match_info['file']} not found")
    response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    await response.prepare(request)
    async for chunk in chunks:
        await response.write(chunk)
    await response.write_eof()
    return response


# ---------------------------------------------------------------- users
async def get_metrics(request: web.Request) -> web.Response:
    """The run downsampled (`maxPoints`), its totals, and the raw reports after the cursor
    (`sinceAttempt`, `sinceStep`; at most `maxReports`): see :mod:`metric_series`."""
    try:
        query = metric_series.SeriesQuery(
            max_points=_int(request, "maxPoints", metric_series.DEFAULT_MAX_POINTS, high=metric_series.MAX_POINTS) or 0,
            since_attempt=_int(request, "sinceAttempt", 0) or 0,
            since_step=_int(request, "sinceStep", -1, low=-1, high=2**63 - 1) or 0,
            limit=_int(request, "maxReports", metric_series.PAGE_ROWS, high=metric_series.PAGE_ROWS) or 0)
    except ValueError as exc:
        raise errors.InvalidInput(str(exc), field=str(exc).split()[0]) from None
    async with request.app[state.DB].session() as s:
        job = await load_job(s, principal_of(request), request.match_info["name"])
        return json_response(await metric_series.read(s, job.name, query))


async def post_cancel(request: web.Request) -> web.Response:
    principal = principal_of(request)
    db = request.app[state.DB]

    async def cancel(s: Any) -> dict[str, Any]:
        job = await load_job(s, principal, request.match_info["name"], lock=True)
        if job.phase in TERMINAL:
            raise errors.Conflict(f"job {job.name!r} is already {job.phase}")
        await request.app[RECONCILER].cancel(s, job)
        return JobStore().to_manifest(principal, job)

    async with db.serialized():  # again from a fresh read if the reconciler wrote the job meanwhile
        out = await db.transact(cancel)
    return json_response(out)


async def get_subtasks(request: web.Request) -> web.Response:
    async with request.app[state.DB].session() as s:
        job = await load_job(s, principal_of(request), request.match_info["name"])
        items = await views.job_subtasks(s, job.name)
    return json_response({"apiVersion": "cpn/v1", "kind": "List", "items": items})


async def get_logs(request: web.Request) -> web.StreamResponse:
    """Every rank's output as the agents shipped it, all of it: `site`, `rank`, `attempt`, `tail`;
    `follow` streams every attempt from `attempt` on and ends when the job has ended."""
    query = logs.LogQuery(site=_text(request, "site"), rank=_int(request, "rank"),
                          attempt=_int(request, "attempt", low=1), tail=_int(request, "tail", high=logs.MAX_TAIL),
                          follow=request.query.get("follow") in ("1", "true"))
    db, principal = request.app[state.DB], principal_of(request)
    async with db.session() as s:
        cursor = await logs.open_logs(s, principal, request.match_info["name"], query)
    with request.app[LONG_POLLS].hold(principal, f"job {cursor.job}") if query.follow else contextlib.nullcontext():
        response = web.StreamResponse(headers={"Content-Type": "text/plain; charset=utf-8"})
        await response.prepare(request)
        try:
            async for chunk in logs.stream(db, cursor):
                await response.write(chunk.encode())
            await response.write_eof()
        except ConnectionResetError:  # the reader left (Ctrl-C on `cpnctl logs -f`): nothing to answer
            pass
    return response


async def top_sites(request: web.Request) -> web.Response:
    async with request.app[state.DB].session() as s:
        items = await views.top_sites(s, _heartbeat_timeout(request))
    return json_response({"apiVersion": "cpn/v1", "kind": "List", "items": items})


async def get_calibrations(request: web.Request) -> web.Response:
    principal = principal_of(request)
    async with request.app[state.DB].session() as s:
        items = await learning.listing(s, None if principal.role is Role.ADMIN else principal.account_id)
    return json_response({"apiVersion": "cpn/v1", "kind": "List", "items": items})


async def top_links(request: web.Request) -> web.Response:
    async with request.app[state.DB].session() as s:
        items = await views.top_links(s, _heartbeat_timeout(request))
    return json_response({"apiVersion": "cpn/v1", "kind": "List", "items": items})


# ---------------------------------------------------------------- app wiring
async def _reconciler_ctx(app: web.Application) -> AsyncIterator[None]:
    settings = app[state.SETTINGS]
    reconciler = Reconciler(app[state.DB], ReconcilerConfig(
        heartbeat_timeout=timedelta(seconds=settings.heartbeat_timeout_seconds),
        lease_ttl=timedelta(seconds=settings.lease_ttl_seconds),
        claim_timeout=timedelta(seconds=settings.claim_timeout_seconds),
        quote_ttl=timedelta(seconds=settings.quote_ttl_seconds),
        interval=settings.reconcile_interval_seconds,
        final_weights=lambda uid: app[state.BLOBS].exists(final_key(uid))))
    app[RECONCILER] = reconciler
    task = asyncio.create_task(reconciler.run_forever()) if settings.reconcile else None
    yield
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def gauge_families(app: web.Application) -> list[GaugeMetricFamily]:
    """The job and site gauges, read from the database when Prometheus scrapes (fresh every scrape, so
    every API worker reports the same, and a deleted cluster's labels go with it)."""
    async with app[state.DB].session() as s:
        phases, clusters, leased = await views.gauges(
            s, timedelta(seconds=app[state.SETTINGS].heartbeat_timeout_seconds))
    jobs = GaugeMetricFamily("cpn_jobs", "Training jobs by phase", labels=["phase"])
    gpus = GaugeMetricFamily("cpn_cluster_gpus", "GPUs per cluster", labels=["site", "cluster", "kind"])
    ready = GaugeMetricFamily("cpn_cluster_ready", "1 when the cluster is Ready", labels=["site", "cluster"])
    for phase, count in phases.items():
        jobs.add_metric([phase], count)
    for c in clusters:
        gpus.add_metric([c.site, c.name, "capacity"], c.capacity_gpus)
        gpus.add_metric([c.site, c.name, "allocatable"], c.allocatable_gpus)
        gpus.add_metric([c.site, c.name, "leased"], leased.get(c.name, 0))
        ready.add_metric([c.site, c.name], 1 if c.ready else 0)
    return [jobs, gpus, ready]


def _install_gauges(app: web.Application) -> None:
    app[REFRESH] = gauge_families


def setup(app: web.Application) -> None:
    app.cleanup_ctx.append(_reconciler_ctx)
    _install_gauges(app)
    ckpt = "/api/v1/jobs/{name}/checkpoints/{step}/{file}"
    for handler, doc in [
        (list_subtasks, RouteDoc("GET", "/api/v1/subtasks", "Sub-tasks (providers: on their clusters); "
                                 "watch=true&cluster=NAME long-polls for the agent", "SubTask",
                                 query=("job", "cluster", "watch", "active", "resourceVersion", "timeoutSeconds"))),
        (get_subtask, RouteDoc("GET", "/api/v1/subtasks/{uid}", "One sub-task (its cluster's provider)", "SubTask",
                               params=("uid",))),
        (post_claim, RouteDoc("POST", "/api/v1/subtasks/{uid}/claim", "Claim a sub-task: the attempt contract",
                              "SubTask", request=agents.ClaimRequest, response=AttemptSpec, params=("uid",))),
        (post_report, RouteDoc("POST", "/api/v1/subtasks/{uid}/status", "An agent reports a sub-task's state",
                               "SubTask", request=agents.SubtaskReport, params=("uid",))),
        (post_subtask_logs, RouteDoc("POST", "/api/v1/subtasks/{uid}/logs", "An agent ships worker output",
                                     "SubTask", request=agents.LogBatch, params=("uid",))),
        (post_metrics, RouteDoc("POST", "/api/v1/jobs/{name}/metrics", "Worker metric reports (worker token)",
                                "TrainingJob", request=MetricsBatch, params=("name",))),
        (get_metrics, RouteDoc("GET", "/api/v1/jobs/{name}/metrics", "A job's metrics: the run downsampled "
                               "(min/mean/max per step range, the newest step exact), totals, and the raw "
                               "reports after a cursor", "TrainingJob", params=("name",),
                               query=("maxPoints", "sinceAttempt", "sinceStep", "maxReports"))),
        (get_checkpoint_latest, RouteDoc("GET", "/api/v1/jobs/{name}/checkpoints/latest",
                                         "The newest complete checkpoint", "TrainingJob", params=("name",),
                                         later=True)),
        (put_checkpoint, RouteDoc("PUT", ckpt, "Store a checkpoint file (worker token)", "TrainingJob",
                                  params=("name", "step", "file"))),
        (get_checkpoint, RouteDoc("GET", ckpt, "Fetch a checkpoint file", "TrainingJob",
                                  params=("name", "step", "file"))),
        (post_cancel, RouteDoc("POST", "/api/v1/jobs/{name}/cancel", "Cancel a job", "TrainingJob",
                               params=("name",))),
        (get_subtasks, RouteDoc("GET", "/api/v1/jobs/{name}/subtasks", "A job's sub-tasks", "TrainingJob",
                                params=("name",))),
        (get_logs, RouteDoc("GET", "/api/v1/jobs/{name}/logs", "Worker logs (text): one attempt, whole; "
                            "follow=1 streams every attempt until the job ends",
                            "TrainingJob", params=("name",), query=("site", "rank", "attempt", "tail", "follow"))),
        (top_sites, RouteDoc("GET", "/api/v1/top/sites", "Live per-site usage", "Site")),
        (get_calibrations, RouteDoc("GET", "/api/v1/calibrations", "What finished runs taught the compute model: "
                                    "per GPU model, strategy and workload, measured/predicted step time and "
                                    "start-up seconds, used by later quotes", "Calibration")),
        (top_links, RouteDoc("GET", "/api/v1/top/links", "Live per-link use: running jobs spanning both ends",
                             "Link")),
    ]:
        add(app, handler, doc)
