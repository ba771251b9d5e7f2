"""Progress and metering from the runtime's metric reports: job status (progress %, loss, ETA,
cost so far) and ledger entries for GPU-hours and WAN egress; credits for work a provider lost."""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from layers.orchestration.lifecycle.models import MetricRow, SubtaskRow
from layers.resource.models import ClusterRow, SiteRow
from layers.service import billing
from layers.service.jobs import update_status
from layers.service.models import ContractRow, JobRow, LedgerEntry


def _unit_prices(job: JobRow) -> tuple[dict[str, Decimal], dict[str, Decimal]]:
    """Unit prices agreed in the accepted quote: GPU-hour per cluster, egress per cluster."""
    gpu: dict[str, Decimal] = {}
    egress: dict[str, Decimal] = {}
    for line in job.status.get("quoteLines", []):
        target = gpu if line["item"] == "gpu-hours" else egress
        target[line["cluster"].split("/")[0]] = Decimal(line["unitPrice"])
    return gpu, egress


async def _sellers(session: AsyncSession, clusters: set[str]) -> dict[str, tuple[str, str]]:
    """Cluster → (provider name, provider account) — the provider is named on the cluster's site."""
    rows = await session.execute(select(ClusterRow.name, SiteRow.spec, ClusterRow.owner_id)
                                 .join(SiteRow, SiteRow.id == ClusterRow.site_id).where(ClusterRow.name.in_(clusters)))
    return {name: ((site_spec or {}).get("provider") or "", owner) for name, site_spec, owner in rows.all()}


async def ingest(session: AsyncSession, job: JobRow, contract: ContractRow | None, reports: list[dict[str, Any]],
                 now: datetime | None = None) -> int:
    """Store reports, advance the meter, update progress. Returns how many reports were taken."""
    now = now or datetime.now(UTC)
    attempt = int(job.status.get("attempt", 1))
    subtasks = (await session.execute(select(SubtaskRow).where(SubtaskRow.job == job.name,
                                                               SubtaskRow.attempt == attempt))).scalars().all()
    cluster_of_site = {s.site_index: s.cluster for s in subtasks}
    meter = dict(job.status.get("meter", {}))
    gpu_delta: dict[str, float] = defaultdict(float)
    wan_delta: dict[str, float] = defaultdict(float)
    since_ckpt = dict(job.status.get("sinceCheckpoint", {}))
    every = int(job.status.get("checkpointEvery", 0) or 0)
    taken = 0
    for r in reports:
        try:
            rank, site = int(r["rank"]), int(r["site"])
        except (KeyError, TypeError, ValueError):
            continue
        taken += 1
        session.add(MetricRow(job=job.name, attempt=attempt, rank=rank, site=site, step=int(r.get("step", 0)),
                              tokens=int(r.get("jobTokens") or r.get("tokens") or 0),
                              train_loss=r.get("trainLoss"), val_loss=r.get("valLoss"),
                              tokens_per_second=float(r.get("tokensPerSecond") or 0.0),
                              wall_seconds=float(r.get("wallSeconds") or 0.0),
                              wan_bytes=float(r.get("wanBytes") or 0.0), at=now))
        key = f"{attempt}:{rank}"
        prev = meter.get(key, {"gpu": 0.0, "wan": 0.0})
        gpu_now, wan_now = float(r.get("wallSeconds") or 0.0), float(r.get("wanBytes") or 0.0)
        cluster = cluster_of_site.get(site)
        if cluster is not None:
            dg, dw = max(0.0, gpu_now - prev["gpu"]), max(0.0, wan_now - prev["wan"])
            gpu_delta[cluster] += dg
            wan_delta[cluster] += dw
            crossed = every and int(r.get("step", 0)) // every > int(prev.get("step", 0)) // every
            since_ckpt[cluster] = 0.0 if crossed else since_ckpt.get(cluster, 0.0) + dg
        meter[key] = {"gpu": max(gpu_now, prev["gpu"]), "wan": max(wan_now, prev["wan"]),
                      "step": max(int(r.get("step", 0)), int(prev.get("step", 0)))}
    if contract is not None:
        await _post(session, job, contract, gpu_delta, wan_delta)
    update_status(job, meter=meter, sinceCheckpoint=since_ckpt)
    await refresh_progress(session, job, now)
    return taken


async def _post(session: AsyncSession, job: JobRow, contract: ContractRow, gpu: dict[str, float],
                wan: dict[str, float]) -> None:
    gpu_price, egress_price = _unit_prices(job)
    sellers = await _sellers(session, set(gpu) | set(wan))
    for cluster, seconds in gpu.items():
        if seconds > 0 and cluster in gpu_price and cluster in sellers:
            provider, account = sellers[cluster]
            billing.post(session, contract, provider=provider, provider_account_id=account, cluster=cluster,
                         item="gpu-hours", quantity=Decimal(repr(seconds)) / Decimal(3600),
                         unit_price=gpu_price[cluster])
    for cluster, nbytes in wan.items():
        if nbytes > 0 and cluster in egress_price and cluster in sellers:
            provider, account = sellers[cluster]
            billing.post(session, contract, provider=provider, provider_account_id=account, cluster=cluster,
                         item="egress", quantity=Decimal(repr(nbytes)) / Decimal(10**9),
                         unit_price=egress_price[cluster])


async def credit_lost_work(session: AsyncSession, job: JobRow, contract: ContractRow | None, cluster: str,
                           reason: str) -> Decimal:
    """A site lost through its provider's fault: its GPU time since the last checkpoint is not charged."""
    lost = float(job.status.get("sinceCheckpoint", {}).get(cluster, 0.0))
    gpu_price, _ = _unit_prices(job)
    if contract is None or lost <= 0 or cluster not in gpu_price:
        return Decimal(0)
    provider, account = (await _sellers(session, {cluster}))[cluster]
    entry = billing.post(session, contract, provider=provider, provider_account_id=account, cluster=cluster,
                         item="gpu-hours", quantity=-Decimal(repr(lost)) / Decimal(3600),
                         unit_price=gpu_price[cluster], kind="credit", note=reason[:200])
    since = dict(job.status.get("sinceCheckpoint", {}))
    since[cluster] = 0.0
    update_status(job, sinceCheckpoint=since)
    return -Decimal(entry.amount)


async def refresh_progress(session: AsyncSession, job: JobRow, now: datetime | None = None) -> None:
    now = now or datetime.now(UTC)
    attempt = int(job.status.get("attempt", 1))
    rows = (await session.execute(select(MetricRow).where(MetricRow.job == job.name, MetricRow.attempt == attempt)
                                  .order_by(MetricRow.at.desc(), MetricRow.step.desc()).limit(400))).scalars().all()
    total = int((job.status.get("train") or {}).get("tokens") or job.spec.get("tokens") or 1)
    tokens = max((r.tokens for r in rows if r.rank == 0), default=0) or max((r.tokens for r in rows), default=0)
    val = next((r.val_loss for r in rows if r.val_loss is not None), None)
    train = next((r.train_loss for r in rows if r.train_loss is not None), None)
    tps = sum({r.rank: r.tokens_per_second for r in reversed(rows)}.values())
    pct = min(100.0, 100.0 * tokens / total) if total else 0.0
    eta = (total - tokens) / tps if tps > 0 and tokens < total else 0.0
    entries = list((await session.execute(select(LedgerEntry).where(LedgerEntry.job == job.name))).scalars())
    # the same arithmetic as the invoice (lines rounded to the cent, then summed), so both agree
    cost = sum((Decimal(inv["status"]["total"]) for inv in billing.invoices(entries)), Decimal(0))
    update_status(job, progress={"percent": round(pct, 1), "tokens": tokens, "loss": _r(val if val is not None
                                                                                          else train),
                                 "valLoss": _r(val), "trainLoss": _r(train), "tokensPerSecond": round(tps, 1),
                                 "etaSeconds": round(eta, 1), "updatedAt": now.isoformat()},
                  cost={"total": str(cost.quantize(Decimal("0.01"))), "currency": job.spec.get("currency", "USD")})


def _r(value: float | None) -> float | None:
    return round(value, 4) if value is not None else None
