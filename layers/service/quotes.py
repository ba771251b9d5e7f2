"""Quotes: priced offers for a job, labelled cheapest / fastest / balanced, valid until they expire."""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from sqlalchemy import and_, bindparam, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from cpn.core import errors
from cpn.core.db import Database, as_utc
from cpn.core.manifest import distinct_durations
from cpn.core.principal import Principal
from cpn.core.store import is_retired
from layers.service.jobs import JobStore, load_job
from layers.service.models import JobRow, QuoteRow

LABELS = ("cheapest", "fastest", "balanced")
RECOMMENDED = "balanced"  # the objective's own choice; the other two are its extremes
CONFIRM_ABOVE_CHEAPEST = 10  # accepting a quote this many times the cheapest asks the user to confirm


async def supersede_open(session: AsyncSession, job: JobRow) -> None:
    await session.execute(update(QuoteRow).where(QuoteRow.job_id == job.id, QuoteRow.state == "open")
                          .values(state="superseded", resource_version=QuoteRow.resource_version + 1)
                          .execution_options(synchronize_session=False))


def new_quote(job_id: str | None, label: str, *, placement: list[dict[str, Any]], strategy: str, ring: list[str],
              prediction: dict[str, Any], predicted_seconds: float, wan_gb: float, lines: list[dict[str, Any]],
              total: Decimal, currency: str, ttl: timedelta, now: datetime | None = None) -> QuoteRow:
    now = now or datetime.now(UTC)
    return QuoteRow(job_id=job_id, label=label, strategy=strategy, placement=placement, ring=ring,
                    prediction=prediction, predicted_seconds=predicted_seconds, wan_gb=wan_gb, total=total,
                    currency=currency, lines=lines, expires_at=now + ttl, state="open")


def true_labels(rows: list[QuoteRow]) -> list[QuoteRow]:
    """The offers labelled as they are, priced: "cheapest" is the lowest total (the faster of equals),
    "fastest" the shortest predicted time (the cheaper of equals), and "balanced" (the user's weights)
    is never slower and dearer than another offer: one that is dominated gives way to the offer that
    dominates it, which scores better under any weights. The planner labels its plans by what its
    solvers found; a heuristic's "fastest" can lose to its "balanced" (issue 32: 7 min 9 s at 0.29
    USD against 6 min 38 s at 0.10 USD). A label missing from `rows` (refused) stays missing."""
    if not rows:
        return rows
    cost_first = min(rows, key=lambda q: (q.total, _exact(q), q.predicted_seconds))  # totals equal to the cent:
    time_first = min(rows, key=lambda q: (q.predicted_seconds, q.total, _exact(q)))  # the lines' own amounts
    best = {"cheapest": cost_first, "fastest": time_first}
    out = []
    for q in rows:
        pick = best.get(q.label, q)
        if q.label not in best:
            pick = next((o for o in (cost_first, time_first) if _dominates(o, q)), q)
        out.append(q if pick is q else _relabelled(pick, q.label))
    return out


def _exact(q: QuoteRow) -> Decimal:
    """The quote's lines summed unrounded (a sub-cent job's totals all read 0.00)."""
    return sum((Decimal(str(line.get("amount", 0))) for line in q.lines or []), Decimal(0))


def _dominates(a: QuoteRow, b: QuoteRow) -> bool:
    return (a.total <= b.total and a.predicted_seconds <= b.predicted_seconds
            and (a.total < b.total or a.predicted_seconds < b.predicted_seconds))


def _relabelled(q: QuoteRow, label: str) -> QuoteRow:
    row = new_quote(q.job_id, label, placement=copy.deepcopy(q.placement), strategy=q.strategy,
                    ring=list(q.ring or []), prediction=copy.deepcopy(q.prediction),
                    predicted_seconds=q.predicted_seconds, wan_gb=q.wan_gb, lines=copy.deepcopy(q.lines),
                    total=q.total, currency=q.currency, ttl=timedelta(0))
    row.expires_at = q.expires_at
    return row


async def open_quotes(session: AsyncSession, job: JobRow) -> list[QuoteRow]:
    rows = (await session.execute(select(QuoteRow).where(QuoteRow.job_id == job.id, QuoteRow.state == "open")
                                  )).scalars().all()
    return _by_label(rows)


def _by_label(rows: Any) -> list[Any]:
    """Quotes in LABELS order (cheapest, fastest, balanced), any other label last."""
    return sorted(rows, key=lambda q: LABELS.index(q.label) if q.label in LABELS else 99)


def _shown(rows: list[Any], spec: dict[str, Any], status: dict[str, Any]) -> list[dict[str, Any]]:
    """`views` of a job's quote rows, given its stored spec and status."""
    return views([public(q) for q in rows], status.get("quote"))  # `recommended` says which is advised


async def find_quote(session: AsyncSession, job: JobRow, ref: str) -> QuoteRow:
    """A quote by id or label among the job's quotes (open ones first for labels)."""
    stmt = select(QuoteRow).where(QuoteRow.job_id == job.id)
    rows = (await session.execute(stmt)).scalars().all()
    by_id = [q for q in rows if q.id == ref]
    if by_id:
        return by_id[0]
    by_label = [q for q in rows if q.label == ref and q.state == "open"]
    if by_label:
        return by_label[0]
    raise errors.NotFound(f"no quote {ref!r} for job {job.name!r}; see `cpnctl get quotes {job.name}`",
                          field="quote")


async def job_quotes(session: AsyncSession, principal: Principal, name: str) -> list[dict[str, Any]]:
    """A job's open quotes (or, once accepted, the accepted one) as `views` shows them."""
    job = await load_job(session, principal, name)
    rows = await open_quotes(session, job)
    if not rows and job.status.get("quote"):
        rows = [await find_quote(session, job, job.status["quote"])]
    return _shown(rows, job.spec, job.status)


_PUBLIC_COLUMNS = ("id", "label", "placement", "strategy", "predicted_seconds", "wan_gb", "total", "currency", "lines",
                   "expires_at", "state", "ring", "prediction")  # what `public` reads of a quote
# GET …/quotes in one autocommit read: the job (by its stored name) and its open quotes, joined
_JOB_AND_OPEN_QUOTES = (  # built once
    select(JobRow.name.label("job_name"), JobRow.owner_id.label("job_owner"), JobRow.status.label("job_status"),
           JobRow.spec.label("job_spec"), *(QuoteRow.__table__.c[c] for c in _PUBLIC_COLUMNS))
    .select_from(JobRow)
    .outerjoin(QuoteRow, and_(QuoteRow.job_id == JobRow.id, QuoteRow.state == "open"))
    .where(JobRow.name == bindparam("key")))


async def job_quotes_read_once(db: Database, principal: Principal, name: str) -> list[dict[str, Any]] | None:
    """`job_quotes` in one round trip (no transaction) for the common case: the caller's own job, or
    one named "ns/name", that has open quotes. None: anything else (not found, not visible, an admin's
    bare name in another namespace, an accepted job), which `job_quotes` answers as it always has."""
    found = await job_quotes_and(db, principal, name)
    return None if found is None else found[0]


async def job_quotes_and(db: Database, principal: Principal, name: str, also: Any = None,
                         params: dict[str, Any] | None = None) -> tuple[list[dict[str, Any]], Any] | None:
    """`job_quotes_read_once`, and in the same statement the value of a caller's column `also` (a layer
    above asks something of its own on the way, e.g. whether a quota binds the owner; `params`: its
    bind parameters), returned beside the quotes."""
    key = JobStore().key(principal, name)
    if is_retired(key):
        return None
    stmt = _JOB_AND_OPEN_QUOTES if also is None else _JOB_AND_OPEN_QUOTES.add_columns(also.label("also"))
    rows = await db.read_rows(stmt, {"key": key, **(params or {})})
    if not rows or rows[0].id is None:
        return None
    first = rows[0]
    if not JobStore().visible(principal, _Owned(first.job_owner, first.job_name)):
        return None
    return _shown(_by_label(rows), first.job_spec, first.job_status or {}), (first.also if also is not None else None)


class _Owned:
    """What `JobStore.visible` reads of a job row."""

    __slots__ = ("name", "owner_id")

    def __init__(self, owner_id: str, name: str):
        self.owner_id, self.name = owner_id, name


def expired(quote: QuoteRow, now: datetime | None = None) -> bool:
    return as_utc(quote.expires_at) <= (now or datetime.now(UTC))


def public(quote: QuoteRow) -> dict[str, Any]:
    return {
        "id": quote.id, "label": quote.label, "placement": quote.placement, "strategy": quote.strategy,
        "predictedSeconds": round(quote.predicted_seconds, 3), "wanGB": round(quote.wan_gb, 6),
        "price": {"total": str(Decimal(quote.total).quantize(Decimal("0.01"))), "currency": quote.currency,
                  "lines": quote.lines},
        "expiresAt": as_utc(quote.expires_at).isoformat(), "state": quote.state,
        "ring": quote.ring,
        # modelled: the compute model's estimate; profiled: from the job's own timed steps (spec.profile)
        "basis": (quote.prediction or {}).get("basis", "modelled"),
        **({"profile": quote.prediction["profile"]} if "profile" in (quote.prediction or {}) else {}),
        **({"trains": quote.prediction["trains"]} if "trains" in (quote.prediction or {}) else {}),
        # what finished runs taught the compute model (GET /api/v1/calibrations); factor 1: nothing yet
        **({"model": {"stepFactor": round(quote.prediction["stepFactor"], 4),
                      "startupSeconds": round(quote.prediction.get("startupSeconds", 0.0), 2),
                      **_memory(quote.prediction)}}
           if "stepFactor" in (quote.prediction or {}) else {}),
    }


def _memory(prediction: dict[str, Any]) -> dict[str, Any]:
    """The quote's memory plan (quotes priced before it was stated have none)."""
    if "memoryGBPerGpu" not in prediction:
        return {}
    return {"memoryGBPerGpu": round(prediction["memoryGBPerGpu"], 3), "shard": prediction.get("shard", "none"),
            "activationCheckpointing": prediction.get("activationCheckpointing", "none")}


def views(quotes: list[dict[str, Any]], chosen: str | None, *, now: datetime | None = None) -> list[dict[str, Any]]:
    """Quotes as the CLI and the portal show them: how each differs from the cheapest, which one is
    recommended, whether it has expired, and times that never read the same when they differ."""
    now = now or datetime.now(UTC)
    items = [_view(q, chosen, now) for q in quotes]
    cheapest = min((Decimal(q["price"]["total"]) for q in items), default=Decimal(0))
    for i, item in enumerate(items):
        same = next((o["label"] for o in items[:i] if _same_offer(o, item)), None)
        item["sameAs"] = same
        item["recommended"] = item["label"] == RECOMMENDED
        item["timesCheapest"] = float(Decimal(item["price"]["total"]) / cheapest) if cheapest > 0 else 1.0
        item["confirm"] = item["timesCheapest"] >= CONFIRM_ABOVE_CHEAPEST
        item["note"] = "; ".join(n for n in (
            "expired" if item["state"] == "expired" else "",
            f"same as {same}" if same else "", "recommended" if item["recommended"] else "",
            (item.get("trains") or {}).get("note") or "") if n)
    for item, text in zip(items, distinct_durations([i["predictedSeconds"] for i in items]), strict=True):
        item["predictedDuration"] = text
    return items


def placement_summary(lines: list[dict[str, Any]]) -> str:
    """One line per quote: "2xH100@fra-1,1xA100@ams-1"; a pipeline's stages in order,
    "s0:1xCPU@a>s1:1xCPU@b" (the activations' path); its replicas apart, "s0:…>s1:… | s0:…>s1:…"."""
    if not any(p.get("stage") is not None for p in lines):
        return ",".join(f"{p['gpus']}x{p['gpuModel']}@{p['site']}" for p in lines)
    replicas: dict[int, list[dict[str, Any]]] = {}
    for p in lines:
        replicas.setdefault(p.get("replica") or 0, []).append(p)
    return " | ".join(">".join(f"s{p['stage']}:{p['gpus']}x{p['gpuModel']}@{p['site']}"
                               for p in sorted(chain, key=lambda p: p.get("stage") or 0))
                      for _, chain in sorted(replicas.items()))


def _view(q: dict[str, Any], chosen: str | None, now: datetime) -> dict[str, Any]:
    q = dict(q)
    q["metadata"] = {"name": q["label"]}
    q["chosen"] = "*" if chosen is not None and chosen in (q["label"], q["id"]) else ""
    q["placementSummary"] = placement_summary(q["placement"])
    q["gpus"] = sum(p["gpus"] for p in q["placement"])
    if q["state"] == "open" and datetime.fromisoformat(q["expiresAt"]) <= now:
        q["state"] = "expired"
    return q


def _same_offer(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (a["placement"], a["strategy"], a["price"]["total"]) == (b["placement"], b["strategy"], b["price"]["total"])
