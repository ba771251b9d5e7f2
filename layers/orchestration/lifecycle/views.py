"""Read models for running jobs: metrics, sub-tasks, per-site usage, gauges (logs: logs.py). The API's
handlers call these; they never query rows themselves."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from layers.control.capacity import leased_gpus
from layers.orchestration.lifecycle import agents
from layers.orchestration.lifecycle.models import MetricRow, SubtaskRow
from layers.resource.capacity import inventory
from layers.service.models import JobRow

BUILTIN_METRICS = frozenset({"attempt", "rank", "site", "step", "tokens", "trainLoss", "valLoss", "tokensPerSecond",
                             "wallSeconds", "wanBytes", "at"})


async def metrics(s: AsyncSession, job: str) -> list[dict[str, Any]]:
    rows = (await s.execute(select(MetricRow).where(MetricRow.job == job).order_by(MetricRow.at)
                            .limit(5000))).scalars().all()
    return [{"attempt": r.attempt, "rank": r.rank, "site": r.site, "step": r.step, "tokens": r.tokens,
             "trainLoss": r.train_loss, "valLoss": r.val_loss, "tokensPerSecond": r.tokens_per_second,
             "wallSeconds": r.wall_seconds, "wanBytes": r.wan_bytes, "at": r.at.isoformat(),
             **{k: v for k, v in (r.extra or {}).items() if k not in BUILTIN_METRICS}} for r in rows]


async def job_subtasks(s: AsyncSession, job: str) -> list[dict[str, Any]]:
    rows = (await s.execute(select(SubtaskRow).where(SubtaskRow.job == job)
                            .order_by(SubtaskRow.attempt, SubtaskRow.site_index))).scalars().all()
    return [agents.view(t) for t in rows]


async def sites_of(s: AsyncSession, job: JobRow) -> set[str]:
    rows = (await s.execute(select(SubtaskRow.site, SubtaskRow.cluster, SubtaskRow.name)
                            .where(SubtaskRow.job == job.name))).all()
    return {v for row in rows for v in row}


async def top_sites(s: AsyncSession, heartbeat_timeout: timedelta) -> list[dict[str, Any]]:
    clusters, _ = await inventory(s, heartbeat_timeout)
    leased = await leased_gpus(s)
    running = dict((await s.execute(select(SubtaskRow.site, func.count()).where(SubtaskRow.phase == "Running")
                                    .group_by(SubtaskRow.site))).all())
    sites: dict[str, dict[str, Any]] = {}
    for c in clusters:
        row = sites.setdefault(c.site, {"metadata": {"name": c.site}, "region": c.region, "provider": c.provider,
                                        "clusters": 0, "ready": 0, "capacity": 0, "allocatable": 0, "leased": 0,
                                        "running": running.get(c.site, 0), "byCluster": []})
        row["clusters"] += 1
        row["ready"] += int(c.ready)
        row["capacity"] += c.capacity_gpus
        row["allocatable"] += c.allocatable_gpus
        row["leased"] += leased.get(c.name, 0)
        # free = capacity less what is leased: the same count the site's utilisation is drawn from
        row["byCluster"].append({"name": c.name, "capacity": c.capacity_gpus, "leased": leased.get(c.name, 0),
                                 "free": max(0, c.capacity_gpus - leased.get(c.name, 0)) if c.ready else 0})
    for row in sites.values():
        row["utilization"] = f"{100 * row['leased'] / row['capacity']:.0f}%" if row["capacity"] else "-"
    return list(sites.values())


async def top_links(s: AsyncSession, heartbeat_timeout: timedelta) -> list[dict[str, Any]]:
    """Every link with how many running jobs have sub-tasks running at both of its ends (the jobs
    whose traffic it may carry); counts only, never whose jobs they are."""
    _, links = await inventory(s, heartbeat_timeout)
    spans: dict[str, set[str]] = {}
    for job, site in (await s.execute(select(SubtaskRow.job, SubtaskRow.site)
                                      .where(SubtaskRow.phase == "Running"))).all():
        spans.setdefault(job, set()).add(site)
    return [{"metadata": {"name": ln.name}, "a": ln.a, "b": ln.b, "bandwidthGbps": ln.bandwidth_gbps,
             "rttMs": ln.rtt_ms, "jobs": sum(1 for sites in spans.values() if {ln.a, ln.b} <= sites)}
            for ln in links]


async def gauges(s: AsyncSession, heartbeat_timeout: timedelta) -> tuple[dict[str, int], list[Any], dict[str, int]]:
    phases = dict((await s.execute(select(JobRow.phase, func.count()).group_by(JobRow.phase))).all())
    clusters, _ = await inventory(s, heartbeat_timeout)
    return phases, clusters, await leased_gpus(s)
