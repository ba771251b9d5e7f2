"""Progress and metering from the runtime's metric reports: job status (progress %, loss, ETA,
cost so far) and ledger entries for GPU-hours and WAN egress; credits for work a provider lost."""

from __future__ import annotations

import math
import re
from collections import defaultdict
from datetime import UTC, datetime
from decimal import ROUND_FLOOR, Decimal
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from cpn.core import errors
from cpn.core.db import as_utc
from cpn.core.phases import NEVER_STARTED, SUBTASK_FAILED, JobPhase
from layers.control.capacity import offer_cluster
from layers.orchestration.events import record_event
from layers.orchestration.lifecycle.agents import MAX_RANK
from layers.orchestration.lifecycle.models import MetricRow, SubtaskRow
from layers.resource.models import ClusterRow, SiteRow
from layers.service import billing
from layers.service.jobs import update_status
from layers.service.models import ContractRow, JobRow, LedgerEntry


def _price_lines(job: JobRow) -> list[dict[str, Any]]:
    """The lines that set the job's unit prices. What the accepted quote priced keeps its quoted price
    (the contract). A cluster the quote did not price — one a re-placement moved the job to — is billed
    at its list price when that re-placement was written (``status.repricedLines``, the newest for a
    cluster first): the user's quote never named it, and its provider is owed what it asked then."""
    quoted = list(job.status.get("quoteLines", []))
    seen = {(line["item"], _cluster(line)) for line in quoted}
    for line in reversed(job.status.get("repricedLines", [])):
        if (line["item"], _cluster(line)) not in seen:
            seen.add((line["item"], _cluster(line)))
            quoted.append(line)
    return quoted


def _cluster(line: dict[str, Any]) -> str:
    return offer_cluster(str(line["cluster"]))


def _unit_prices(job: JobRow) -> tuple[dict[str, Decimal], dict[str, Decimal]]:
    """Unit prices the job is billed at (see _price_lines): GPU-hour per cluster, egress per cluster."""
    gpu: dict[str, Decimal] = {}
    egress: dict[str, Decimal] = {}
    for line in _price_lines(job):
        target = {"gpu-hours": gpu, "egress": egress}.get(line["item"])
        if target is not None:
            target[_cluster(line)] = Decimal(line["unitPrice"])
    return gpu, egress


def _data_copies(job: JobRow) -> dict[str, tuple[Decimal, Decimal]]:
    """The dataset copies priced (see _price_lines): receiving cluster → (GB, price per GB)."""
    return {_cluster(line): (Decimal(line["quantity"]), Decimal(line["unitPrice"]))
            for line in _price_lines(job) if line["item"] == "data-transfer"}


async def _sellers(session: AsyncSession, clusters: set[str]) -> dict[str, tuple[str, str]]:
    """Cluster → (provider name, provider account) — the provider is named on the cluster's site."""
    rows = await session.execute(select(ClusterRow.name, SiteRow.spec, ClusterRow.owner_id)
                                 .join(SiteRow, SiteRow.id == ClusterRow.site_id).where(ClusterRow.name.in_(clusters)))
    return {name: ((site_spec or {}).get("provider") or "", owner) for name, site_spec, owner in rows.all()}


# what the runtime's reports carry besides the user's own metrics (cpn.train's trainer.report)
RUNTIME_KEYS = frozenset({"rank", "site", "step", "tokens", "jobTokens", "trainLoss", "valLoss", "tokensPerSecond",
                          "computeSeconds", "commSeconds", "waitSeconds", "intraBytes", "wanBytes", "gpuSeconds",
                          "wallSeconds", "final"})
USER_KEY_RE = re.compile(r"^[A-Za-z][A-Za-z0-9]{0,62}$")


def user_metrics(report: dict[str, Any], limit: int = 32) -> dict[str, float | None] | None:
    """The user's own numeric metrics of a report (camelCase names), at most `limit`; None when none."""
    out: dict[str, float | None] = {}
    for k, v in report.items():
        if k in RUNTIME_KEYS or not isinstance(k, str) or not USER_KEY_RE.match(k) or len(out) >= limit:
            continue
        if v is None or (isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)):
            out[k] = v
    return out or None


# A report's figures the server counts or bills: numbers, finite, never negative. JSON as Python parses
# it accepts NaN and Infinity; one NaN kept in the job's meter broke every later report and the job's
# cancel (issue 35, H4). A loss is no bill's figure: a diverged run's NaN loss is kept as null (refusing
# it would drop the batch's GPU time with it), and a loss may be negative in the user's own code.
COUNTS = ("rank", "site", "step", "tokens", "jobTokens")
METERED = ("gpuSeconds", "wallSeconds", "wanBytes", "intraBytes", "tokensPerSecond", "computeSeconds",
           "commSeconds", "waitSeconds")
LOSSES = ("trainLoss", "valLoss")


def check_reports(reports: list[dict[str, Any]]) -> None:
    """Refuse a batch carrying a figure no worker sends, naming it (``reports[3].gpuSeconds``)."""
    for i, report in enumerate(reports):
        for key in (*COUNTS, *METERED, *LOSSES):
            value = report.get(key)
            if value is None:
                continue
            where = f"reports[{i}].{key}"
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise errors.InvalidInput(f"{where} must be a number, got {type(value).__name__}", field=where)
            if not math.isfinite(value) and key not in LOSSES:
                raise errors.InvalidInput(f"{where} must be a finite number, got {value!r}: drop the report or "
                                          "send null for a figure you do not have", field=where)
            if value < 0 and key not in LOSSES:
                raise errors.InvalidInput(f"{where} must not be negative, got {value!r}", field=where)


def _loss(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def _finite(report: dict[str, Any]) -> bool:
    return all(not isinstance(v, float) or math.isfinite(v) for k, v in report.items() if k in (*COUNTS, *METERED))


def observed_seconds(t: SubtaskRow, now: datetime) -> float:
    """How long the server saw sub-task ``t`` hold its GPUs: from its claim (its launch) to its end as
    the server recorded it, or to ``now`` while it runs. No rank of it is billed past that, whatever its
    reports say (issue 35, C1: a forged 360,000,000 gpuSeconds billed 100,000 USD)."""
    start = t.launched_at or t.claimed_at
    if start is None:
        return 0.0
    end = as_utc(t.finished_at) if t.finished_at else now
    return max(0.0, (end - as_utc(start)).total_seconds())


def subtask_of(subtasks: list[SubtaskRow], rank: int, site: int) -> SubtaskRow | None:
    """The sub-task that holds global ``rank`` at topology site ``site`` (None: no worker of the attempt)."""
    return next((t for t in subtasks if t.site_index == site and t.first_rank <= rank < t.first_rank + t.gpus), None)


def held_seconds(report: dict[str, Any]) -> float:
    """What a rank's GPU is billed for: the wall time the rank has held it, from binding the device
    (``gpuSeconds``: start-up included, since a leased GPU is paid for while it is held, busy or not).
    The compute model predicts the same quantity (GPUs × wall time, start-up included), so bills and
    the predicted-vs-measured calibration compare like with like. Reports without it (older
    runtimes) fall back to ``wallSeconds``, the time since the training loop started."""
    held = report.get("gpuSeconds")
    return float(held if held is not None else report.get("wallSeconds") or 0.0)


async def ingest(session: AsyncSession, job: JobRow, contract: ContractRow | None, reports: list[dict[str, Any]],
                 now: datetime | None = None) -> int:
    """Store reports, advance the meter, update progress. Returns how many reports were taken."""
    now = now or datetime.now(UTC)
    attempt = int(job.status.get("attempt", 1))
    subtasks = list((await session.execute(select(SubtaskRow).where(SubtaskRow.job == job.name,
                                                                    SubtaskRow.attempt == attempt))).scalars())
    meter = dict(job.status.get("meter", {}))
    gpu_delta: dict[str, float] = defaultdict(float)
    wan_delta: dict[str, float] = defaultdict(float)
    since_ckpt = dict(job.status.get("sinceCheckpoint", {}))
    every = int(job.status.get("checkpointEvery", 0) or 0)
    taken = 0
    for r in reports:
        try:
            rank, site = int(r["rank"]), int(r["site"])
            step, tokens = int(r.get("step", 0)), int(r.get("jobTokens") or r.get("tokens") or 0)
        except (KeyError, TypeError, ValueError, OverflowError):
            continue
        if not _finite(r):
            continue  # a direct caller's NaN (the API refuses it, check_reports): never into the meter
        if not (0 <= rank <= MAX_RANK and 0 <= site <= MAX_RANK and 0 <= step < 2**63 and 0 <= tokens < 2**63):
            continue  # not a report any worker sends: skipped like a malformed one, never a database error
        taken += 1
        session.add(MetricRow(job=job.name, attempt=attempt, rank=rank, site=site, step=step, tokens=tokens,
                              train_loss=_loss(r.get("trainLoss")), val_loss=_loss(r.get("valLoss")),
                              tokens_per_second=float(r.get("tokensPerSecond") or 0.0),
                              wall_seconds=float(r.get("wallSeconds") or 0.0),
                              wan_bytes=float(r.get("wanBytes") or 0.0), extra=user_metrics(r), at=now))
        key = f"{attempt}:{rank}"
        prev = meter.get(key, {"gpu": 0.0, "wan": 0.0})
        owner = subtask_of(subtasks, rank, site)
        # billed no further than the server saw the rank's sub-task hold its GPU (one GPU a rank)
        gpu_now = min(held_seconds(r), observed_seconds(owner, now)) if owner is not None else 0.0
        wan_now = float(r.get("wanBytes") or 0.0)
        cluster = owner.cluster if owner is not None else None
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
                wan: dict[str, float]) -> list[LedgerEntry]:
    gpu_price, egress_price = _unit_prices(job)
    sellers = await _sellers(session, set(gpu) | set(wan))
    billed = dict(job.status.get("billed", {}))
    room = _Room(ceiling(job, contract) - await charged(session, job))  # what may still be charged
    posted: list[LedgerEntry] = []
    for item, usage, prices, unit in (("gpu-hours", gpu, gpu_price, Decimal(3600)),
                                      ("egress", wan, egress_price, Decimal(10**9))):
        for cluster, raw in usage.items():
            if raw > 0 and cluster in prices and cluster in sellers:
                quantity = room.cut(Decimal(repr(raw)) / unit, prices[cluster])
                entry = _charge(session, contract, billed, sellers[cluster], cluster, item, quantity, prices[cluster])
                posted.extend(room.took(entry))
    for cluster, (gb, unit) in _data_copies(job).items():  # once, when the site's workers first ran
        if gpu.get(cluster, 0) > 0 and cluster in sellers and f"data-transfer|{cluster}|{unit}" not in billed:
            entry = _charge(session, contract, billed, sellers[cluster], cluster, "data-transfer",
                            room.cut(gb, unit), unit)
            posted.extend(room.took(entry))
    if room.capped and CAPPED not in billed:
        billed[CAPPED] = str(ceiling(job, contract))  # the event once
        await record_event(session, job.name, "Warning", "ChargesCapped", (
            f"charges reached {ceiling(job, contract)} {contract.currency}, " + _ceiling_text(job, contract)
            + ": usage past it is not billed"))
    update_status(job, billed=billed)
    return posted


CAPPED = "capped"  # in status.billed: the ceiling the charges reached (see ceiling)

# How far a job's charges may go past its accepted quote without the user's consent: 25 % of it, and
# at least QUOTE_TOLERANCE_FLOOR (in the quote's currency: a short job's quote rounds to 0.00, and its
# start-up alone costs cents). Run times vary with the sites' load; the compute model's own error is
# smaller. The user consents to more by setting spec.budget: a job with a budget is charged up to it
# and never past it.
QUOTE_TOLERANCE = Decimal("0.25")
QUOTE_TOLERANCE_FLOOR = Decimal("0.50")


def ceiling(job: JobRow, contract: ContractRow) -> Decimal:
    """The most a job is ever charged: its budget when the user set one, else its accepted quote plus
    QUOTE_TOLERANCE (at least QUOTE_TOLERANCE_FLOOR)."""
    budget = (job.spec or {}).get("budget")
    if budget is not None:
        return Decimal(str(budget))
    quoted = Decimal(contract.quoted_total)
    return billing.micro(quoted + max(quoted * QUOTE_TOLERANCE, QUOTE_TOLERANCE_FLOOR))


def _ceiling_text(job: JobRow, contract: ContractRow) -> str:
    if (job.spec or {}).get("budget") is not None:
        return "the job's spec.budget"
    return (f"its accepted quote ({billing.to_cent(Decimal(contract.quoted_total))}) plus {QUOTE_TOLERANCE:.0%} "
            f"(at least {QUOTE_TOLERANCE_FLOOR})")


async def charged(session: AsyncSession, job: JobRow) -> Decimal:
    """The job's net charges so far (credits subtracted), entries not yet flushed included."""
    total = (await session.execute(select(func.sum(LedgerEntry.amount)).where(LedgerEntry.job == job.name))).scalar()
    return Decimal(total or 0)


class _Room:
    """The money a job may still be charged (see :func:`ceiling`), spent charge by charge."""

    def __init__(self, left: Decimal):
        self.left, self.capped = left, False

    def cut(self, quantity: Decimal, unit_price: Decimal) -> Decimal:
        """``quantity``, or the part of it the room pays for at ``unit_price`` (rounded down)."""
        if quantity <= 0 or unit_price <= 0 or quantity * unit_price <= self.left:
            return quantity
        self.capped = True
        return max(Decimal(0), (self.left / unit_price - billing.MICRO).quantize(billing.MICRO, rounding=ROUND_FLOOR))

    def took(self, entry: LedgerEntry | None) -> list[LedgerEntry]:
        if entry is None:
            return []
        self.left -= Decimal(entry.amount)
        return [entry]


def _charge(session: AsyncSession, contract: ContractRow, billed: dict[str, str], seller: tuple[str, str],
            cluster: str, item: str, quantity: Decimal, unit_price: Decimal, kind: str = "charge",
            note: str | None = None) -> LedgerEntry | None:
    """Post the growth of a running total (kept exact in `billed`) as the difference of its rounded
    values, so a thousand small reports sum to the total's one rounding, not to a thousand roundings.
    The amount is that of the rounded quantity (quantity as shown × unit price), so an invoice line —
    the sum of a running total's entries — is its quantity × unit price to 6 places. Credits (a
    negative `quantity`) go through the same running total, for the same reason."""
    key = f"{item}|{cluster}|{unit_price}"
    before = Decimal(billed.get(key, "0"))
    after = before + quantity
    billed[key] = str(after)
    posted_qty = billing.micro(after) - billing.micro(before)
    posted_amount = billing.micro(billing.micro(after) * unit_price) - billing.micro(billing.micro(before) * unit_price)
    if not (posted_qty or posted_amount):
        return None
    return billing.post(session, contract, provider=seller[0], provider_account_id=seller[1], cluster=cluster,
                        item=item, quantity=posted_qty, unit_price=unit_price, amount=posted_amount, kind=kind,
                        note=note)


def site_lost(job: JobRow, attempt: int) -> bool:
    """Whether a site of this attempt was lost (its workers killed, its agent silent): the providers'
    fault. Sub-tasks that failed in such an attempt are credited for their lost work; when no site was
    lost, a failure is the job's own (its code crashed) and the work done is paid for."""
    return any(f["killed"] for f in job.status.get("failedSites", []) if f["attempt"] == attempt)


def never_formed(subtasks: list[SubtaskRow]) -> bool:
    """Whether an attempt's world never met: one of its sub-tasks was never claimed or never launched,
    so its peers only waited for it (issue 36, item 4). Nothing of such an attempt is charged: not the
    waiting peers (they end Cancelled), nor the sub-task that never came."""
    return any(NEVER_STARTED & (t.exit_codes or {}).keys() for t in subtasks)


async def settle(session: AsyncSession, job: JobRow, contract: ContractRow | None, now: datetime | None = None
                 ) -> Decimal:
    """A job stopped before the end (cancelled, or failed) pays for the GPU time its workers held: the
    part of each live sub-task's run that no metric report covered yet (reports stop at the end of the
    job) is charged at the agreed price. Sub-tasks that failed in an attempt that lost a site are not:
    the providers' fault, already credited for lost work (see :func:`site_lost`); nor any sub-task of
    an attempt that never formed (see :func:`never_formed`)."""
    if contract is None or not job.status.get("attempt"):
        return Decimal(0)
    now = now or datetime.now(UTC)
    attempt = int(job.status["attempt"])
    meter = job.status.get("meter", {})
    gpu_price, _ = _unit_prices(job)
    subtasks = (await session.execute(select(SubtaskRow).where(SubtaskRow.job == job.name,
                                                               SubtaskRow.attempt == attempt))).scalars().all()
    usage: dict[str, float] = defaultdict(float)
    providers_fault = site_lost(job, attempt)
    unformed = never_formed(subtasks)
    for t in subtasks:
        if t.launched_at is None or unformed or (providers_fault and t.phase in SUBTASK_FAILED) \
                or t.cluster not in gpu_price:
            continue
        end = as_utc(t.finished_at) if t.finished_at else now
        held = max(0.0, (end - as_utc(t.launched_at)).total_seconds()) * t.gpus
        metered = sum(float(meter.get(f"{attempt}:{r}", {}).get("gpu", 0.0))
                      for r in range(t.first_rank, t.first_rank + t.gpus))
        usage[t.cluster] += max(0.0, held - metered)
    posted = await _post(session, job, contract, dict(usage), {})
    return sum((Decimal(e.amount) for e in posted), Decimal(0))


async def credit_lost_work(session: AsyncSession, job: JobRow, contract: ContractRow | None, cluster: str,
                           reason: str) -> Decimal:
    """A site lost through its provider's fault: its GPU time since the last checkpoint is not charged."""
    lost = float(job.status.get("sinceCheckpoint", {}).get(cluster, 0.0))
    gpu_price, _ = _unit_prices(job)
    if contract is None or lost <= 0 or cluster not in gpu_price:
        return Decimal(0)
    billed = dict(job.status.get("billed", {}))
    entry = _charge(session, contract, billed, (await _sellers(session, {cluster}))[cluster], cluster, "gpu-hours",
                    -Decimal(repr(lost)) / Decimal(3600), gpu_price[cluster], kind="credit", note=reason[:200])
    since = dict(job.status.get("sinceCheckpoint", {}))
    since[cluster] = 0.0
    update_status(job, sinceCheckpoint=since, billed=billed)
    return -Decimal(entry.amount) if entry is not None else Decimal(0)


async def refresh_progress(session: AsyncSession, job: JobRow, now: datetime | None = None) -> None:
    now = now or datetime.now(UTC)
    attempt = int(job.status.get("attempt", 1))
    rows = (await session.execute(select(MetricRow).where(MetricRow.job == job.name, MetricRow.attempt == attempt)
                                  .order_by(MetricRow.at.desc(), MetricRow.step.desc()).limit(400))).scalars().all()
    total = int((job.status.get("train") or {}).get("tokens") or job.spec.get("tokens") or 1)
    # every rank reports the job-wide count as it saw it; barrier-free strategies (gossip, async_ps, ssp)
    # see it at different times, so the newest is the largest, on whichever rank reported last
    tokens = min(max((r.tokens for r in rows), default=0), total)
    val = next((r.val_loss for r in rows if r.val_loss is not None), None)
    train = next((r.train_loss for r in rows if r.train_loss is not None), None)
    tps = sum({r.rank: r.tokens_per_second for r in reversed(rows)}.values())
    pct = min(100.0, 100.0 * tokens / total) if total else 0.0
    eta = (total - tokens) / tps if tps > 0 and tokens < total else 0.0
    ended = JobPhase(job.phase).terminal
    entries = list((await session.execute(select(LedgerEntry).where(LedgerEntry.job == job.name))).scalars())
    # the invoices' own totals (exact 6-place lines summed, each total rounded once to the cent), so both agree
    cost = sum((Decimal(inv["status"]["total"]) for inv in billing.invoices(entries)), Decimal(0))
    update_status(job, progress={"percent": round(pct, 1), "tokens": tokens, "loss": _r(val if val is not None
                                                                                          else train),
                                 "valLoss": _r(val), "trainLoss": _r(train), "tokensPerSecond": round(tps, 1),
                                 "etaSeconds": None if ended else round(eta, 1), "updatedAt": now.isoformat()},
                  cost={"total": str(cost.quantize(Decimal("0.01"))), "currency": job.spec.get("currency", "USD")})


def _r(value: float | None) -> float | None:
    return round(value, 4) if value is not None else None
