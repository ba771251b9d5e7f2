"""What the quotas binding an account allow, and the check an accept makes in its own transaction.

A quota binds one account (spec.account) or every member of a team (spec.team). What it counts:
- maxGpus: GPUs of the bound accounts' active leases;
- maxJobs: their jobs in Accepted, Reserved, Launching or Running;
- gpuHoursPerMonth / spendPerMonth: this calendar month's (UTC) metered GPU-hours / charges in the
  quota's currency, plus what the accepted quotes of their active contracts have yet to meter (a job
  counts what it was quoted the moment it is accepted, so concurrent accepts cannot overshoot).

`admit` locks the binding quota rows (SELECT … FOR UPDATE, in name order) before it counts, so two
accepts bound by one quota run one after the other on PostgreSQL; on SQLite accepts are serialised
in the process already (Database.serialized). The lock is taken after the job's and before the
clusters' (leases.reserve), the order every accept takes them in.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import bindparam, func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from cpn.core import errors
from cpn.core.phases import JobPhase
from cpn.core.store import split_key
from layers.control.models import LeaseRow
from layers.orchestration.identity.models import Account
from layers.orchestration.quotas.models import QuotaRow, TeamMemberRow, TeamRow
from layers.service.models import ContractRow, JobRow, LedgerEntry, QuoteRow
from layers.service.pricing import price_text

HELD_PHASES = (JobPhase.ACCEPTED.value, JobPhase.RESERVED.value, JobPhase.LAUNCHING.value, JobPhase.RUNNING.value)
GPU_HOURS = "gpu-hours"  # the ledger's item for GPU time (billing.post)
HOURS = Decimal("0.001")


def month_start(now: datetime) -> datetime:
    return now.astimezone(UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)


@dataclass(frozen=True)
class Request:
    """What accepting one quote adds."""

    gpus: int
    gpu_hours: Decimal
    spend: Decimal
    currency: str
    jobs: int = 1

    @classmethod
    def of(cls, placement: list[dict[str, Any]], lines: list[dict[str, Any]], total: Any, currency: str) -> Request:
        return cls(gpus=sum(int(p["gpus"]) for p in placement), gpu_hours=quoted_hours(lines),
                   spend=Decimal(str(total)), currency=currency)


def quoted_hours(lines: list[dict[str, Any]] | None) -> Decimal:
    return sum((Decimal(str(x["quantity"])) for x in lines or [] if x.get("item") == GPU_HOURS), Decimal(0))


@dataclass
class Used:
    accounts: list[str]
    gpus: int = 0
    jobs: int = 0
    gpu_hours: Decimal = Decimal(0)
    spend: Decimal = Decimal(0)
    month: str = ""
    by_currency: dict[str, Decimal] = field(default_factory=dict)

    def wire(self) -> dict[str, Any]:
        return {"gpus": self.gpus, "jobs": self.jobs, "gpuHours": hours_text(self.gpu_hours),
                "spend": price_text(self.spend)}


def _whole(value: Decimal) -> str:
    return str(int(value))


def hours_text(value: Decimal) -> str:
    shown = value.quantize(HOURS)
    return format(shown.normalize(), "f") if shown else "0"


def bound_to(row: QuotaRow) -> str:
    return f"team/{row.team}" if row.team else f"account/{row.account}"


def teams_of_stmt(account: Any) -> Any:
    return select(TeamRow.name).join(TeamMemberRow, TeamMemberRow.team_id == TeamRow.id).where(
        TeamMemberRow.account == account)


def binding_stmt(account: Any) -> Any:
    """The quotas that bind `account`: its own and its teams'."""
    return select(QuotaRow).where(or_(QuotaRow.account == account, QuotaRow.team.in_(teams_of_stmt(account)))
                                  ).order_by(QuotaRow.name)


BINDS_ACCOUNT = "quota_account"
# whether any quota binds the account given as BINDS_ACCOUNT: a column a caller's own read can carry (built once)
BINDS = binding_stmt(bindparam(BINDS_ACCOUNT)).exists()


async def binding(session: AsyncSession, account: str, *, lock: bool = False) -> list[QuotaRow]:
    stmt = binding_stmt(account)
    return list((await session.execute(stmt.with_for_update() if lock else stmt)).scalars())


async def members(session: AsyncSession, row: QuotaRow) -> list[str]:
    if row.account:
        return [row.account]
    stmt = (select(TeamMemberRow.account).join(TeamRow, TeamRow.id == TeamMemberRow.team_id)
            .where(TeamRow.name == row.team).order_by(TeamMemberRow.account))
    return list((await session.execute(stmt)).scalars())


async def usage(session: AsyncSession, row: QuotaRow, now: datetime | None = None) -> Used:
    """What the accounts a quota binds hold now and used this month (see the module's docstring)."""
    now = now or datetime.now(UTC)
    start = month_start(now)
    names = await members(session, row)
    used = Used(accounts=names, month=start.strftime("%Y-%m"))
    ids = list((await session.execute(select(Account.id).where(Account.name.in_(names)))).scalars()) if names else []
    if not ids:
        return used
    used.gpus = int(await session.scalar(select(func.coalesce(func.sum(LeaseRow.gpus), 0)).where(
        LeaseRow.owner_id.in_(ids), LeaseRow.state == "active")) or 0)
    used.jobs = int(await session.scalar(select(func.count()).select_from(JobRow).where(
        JobRow.owner_id.in_(ids), JobRow.phase.in_(HELD_PHASES))) or 0)
    currency = (row.spec or {}).get("currency", "USD")
    metered = await session.execute(
        select(LedgerEntry.item, LedgerEntry.currency, func.sum(LedgerEntry.quantity), func.sum(LedgerEntry.amount))
        .where(LedgerEntry.account_id.in_(ids), LedgerEntry.at >= start)
        .group_by(LedgerEntry.item, LedgerEntry.currency))
    for item, cur, quantity, amount in metered.all():
        if item == GPU_HOURS:
            used.gpu_hours += Decimal(quantity or 0)
        if cur == currency:
            used.spend += Decimal(amount or 0)
    hours, spend = await _outstanding(session, ids, currency)
    used.gpu_hours += hours
    used.spend += spend
    return used


async def _outstanding(session: AsyncSession, ids: list[str], currency: str) -> tuple[Decimal, Decimal]:
    """(GPU-hours, spend in `currency`) the accepted quotes of the accounts' active contracts have yet
    to meter: each contract's quoted figure less what it was charged so far, never below 0."""
    active = (await session.execute(
        select(ContractRow.id, ContractRow.quoted_total, ContractRow.currency, QuoteRow.lines)
        .join(QuoteRow, QuoteRow.id == ContractRow.quote_id)
        .where(ContractRow.account_id.in_(ids), ContractRow.state == "active"))).all()
    if not active:
        return Decimal(0), Decimal(0)
    charged: dict[str, Decimal] = defaultdict(Decimal)
    metered_hours: dict[str, Decimal] = defaultdict(Decimal)
    rows = await session.execute(
        select(LedgerEntry.contract_id, LedgerEntry.item, func.sum(LedgerEntry.quantity), func.sum(LedgerEntry.amount))
        .where(LedgerEntry.contract_id.in_([c.id for c in active]))
        .group_by(LedgerEntry.contract_id, LedgerEntry.item))
    for contract_id, item, quantity, amount in rows.all():
        charged[contract_id] += Decimal(amount or 0)
        if item == GPU_HOURS:
            metered_hours[contract_id] += Decimal(quantity or 0)
    hours, spend = Decimal(0), Decimal(0)
    for c in active:
        hours += max(Decimal(0), quoted_hours(c.lines) - metered_hours[c.id])
        if c.currency == currency:
            spend += max(Decimal(0), Decimal(c.quoted_total) - charged[c.id])
    return hours, spend


def checks(row: QuotaRow, used: Used, request: Request) -> list[dict[str, Any]]:
    """One check per limit the quota sets: {quota, boundTo, resource, unit, used, requested, limit, fits}."""
    spec = row.spec or {}
    currency = spec.get("currency", "USD")
    out = []
    for resource, unit, have, want, text in (
            ("maxGpus", "GPUs", Decimal(used.gpus), Decimal(request.gpus), _whole),
            ("maxJobs", "jobs", Decimal(used.jobs), Decimal(request.jobs), _whole),
            ("gpuHoursPerMonth", "GPU-hours", used.gpu_hours, request.gpu_hours, hours_text),
            ("spendPerMonth", currency, used.spend, request.spend, price_text)):
        if spec.get(resource) is None:
            continue
        limit = Decimal(str(spec[resource]))
        other = resource == "spendPerMonth" and request.currency != currency  # priced in another currency
        out.append({"quota": row.name, "boundTo": bound_to(row), "resource": resource, "unit": unit,
                    "used": text(have), "requested": text(want) + (f" {request.currency}" if other else ""),
                    "limit": text(limit), "fits": have + want <= limit and not other})
    return out


async def standing(session: AsyncSession, account: str, request: Request, now: datetime | None = None,
                   *, lock: bool = False) -> dict[str, Any] | None:
    """{fits, checks} for one request against every quota binding `account`; None when none binds."""
    rows = await binding(session, account, lock=lock)
    if not rows:
        return None
    found = [c for row in rows for c in checks(row, await usage(session, row, now), request)]
    return {"fits": all(c["fits"] for c in found), "checks": found}


async def admit(session: AsyncSession, job: JobRow, quote: QuoteRow, now: datetime | None = None) -> None:
    """Refuse (409 QuotaExceeded) an accept of `quote` that would take the job's account or one of its
    teams past a quota. Called in the accept's transaction before the leases are taken; the binding
    quota rows stay locked until it commits."""
    await admit_request(session, job, Request.of(quote.placement, quote.lines, quote.total, quote.currency), now)


async def admit_gpus(session: AsyncSession, job: JobRow, gpus: int, now: datetime | None = None) -> None:
    """`admit` for GPUs leased before any quote (a profile run, spec.profile): only maxGpus can refuse it."""
    await admit_request(session, job, Request(gpus=gpus, gpu_hours=Decimal(0), spend=Decimal(0), currency="",
                                              jobs=0), now, only=("maxGpus",))


async def admit_request(session: AsyncSession, job: JobRow, request: Request, now: datetime | None = None,
                        only: tuple[str, ...] | None = None) -> None:
    account = split_key(job.name)[0] or ""
    found = await standing(session, account, request, now, lock=True)
    failed = next((c for c in (found or {}).get("checks", []) if not c["fits"] and (only is None or c["resource"] in only)),
                  None)
    if failed is not None:
        raise errors.QuotaExceeded(refusal(failed), field="quote", details=failed)


async def gpu_room(session: AsyncSession, job: JobRow, now: datetime | None = None) -> tuple[int, str] | None:
    """(GPUs the job's owner may still lease under its tightest maxGpus quota, that quota's name), or None when
    no maxGpus binds it. Locks the binding quota rows (as `admit`): a re-placement (replan.py) leases within it."""
    room: tuple[int, str] | None = None
    for row in await binding(session, split_key(job.name)[0] or "", lock=True):
        limit = (row.spec or {}).get("maxGpus")
        if limit is None:
            continue
        left = max(0, int(limit) - (await usage(session, row, now)).gpus)
        if room is None or left < room[0]:
            room = (left, f"{row.name} ({bound_to(row)})")
    return room


def refusal(check: dict[str, Any]) -> str:
    """The 409's message: the quota, what it binds, what is used, the limit and what to do."""
    c = check
    if c["resource"] == "spendPerMonth" and " " in c["requested"]:
        return (f"quota {c['quota']!r} ({c['boundTo']}) counts spendPerMonth in {c['unit']}; this quote is priced in "
                f"{c['requested'].split()[-1]}: submit the job with spec.currency {c['unit']}")
    when = ("wait until jobs of " + c["boundTo"] + " end" if c["resource"] in ("maxGpus", "maxJobs")
            else "the count starts again on the 1st of the month (UTC)")
    return (f"quota {c['quota']!r} ({c['boundTo']}) {c['resource']}: {c['used']} {c['unit']} used of a limit of "
            f"{c['limit']}; this quote needs {c['requested']} more ({when}, or ask an admin to raise the quota)")


async def annotate(session: AsyncSession, account: str, quotes: list[dict[str, Any]],
                   now: datetime | None = None) -> None:
    """Give each open quote (as quotes.views shows it) `quota`: {fits, checks} against the quotas that bind
    `account`, the job's owner; nothing when none binds."""
    shown = [q for q in quotes if q.get("state") == "open"]
    rows = await binding(session, account) if shown else []
    if not rows:
        return
    used = [(row, await usage(session, row, now)) for row in rows]
    for q in shown:
        price = q["price"]
        request = Request.of(q["placement"], price.get("lines") or [], price["total"], price["currency"])
        found = [c for row, u in used for c in checks(row, u, request)]
        q["quota"] = {"fits": all(c["fits"] for c in found), "checks": found}
        over = [f"over quota {c['quota']} {c['resource']} ({c['used']} used + {c['requested']} > {c['limit']})"
                for c in found if not c["fits"]]
        if over:  # the NOTE column of `cpnctl get quotes` says it before an accept is refused
            q["note"] = "; ".join(n for n in (q.get("note"), *over) if n)
