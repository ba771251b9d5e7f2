"""Metering into an append-only ledger, and invoices (users) / payouts (providers) read from it.

Money rule (one place): every quantity and amount is a decimal kept at 6 decimal places (MICRO)
through quotes, the ledger and invoice lines, and a line's amount is its quantity × unit price as
shown, rounded to 6 places (the meter posts running totals so that the entries add up to that). The
only rounding to the cent happens once, on an invoice's (or a quote's) total, half up; a contract's
providers split that total by largest remainder (each gets its exact share rounded down to the cent,
and the cents left over go to the largest remainders), so the payouts add up to the user's total to
the cent. Unit prices are shown alike on quotes and invoices (pricing.price_text).
"""

from __future__ import annotations

from collections import defaultdict
from decimal import ROUND_FLOOR, ROUND_HALF_UP, Decimal
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from cpn.core.principal import Principal, Role
from cpn.core.store import split_key
from layers.service.models import ContractRow, LedgerEntry
from layers.service.pricing import price_text

CENT = Decimal("0.01")
MICRO = Decimal("0.000001")
ROUNDING_RULE = ("lines and ledger entries are exact to 6 decimal places; the total is their sum, "
                 "rounded once to the cent, half up; providers split it by largest remainder")


def micro(value: Decimal) -> Decimal:
    return value.quantize(MICRO, rounding=ROUND_HALF_UP)


def to_cent(value: Decimal) -> Decimal:
    """The one rounding to the cent: an invoice's or a quote's total."""
    return value.quantize(CENT, rounding=ROUND_HALF_UP)


def post(session: AsyncSession, contract: ContractRow, *, provider: str, provider_account_id: str, cluster: str,
         item: str, quantity: Decimal, unit_price: Decimal, kind: str = "charge", note: str | None = None,
         amount: Decimal | None = None) -> LedgerEntry:
    """Append one entry. Credits carry negative quantities and amounts. A caller that meters a running
    total passes `amount` (the difference of the running total's rounded values) so that many small
    entries add up to the exact total instead of accumulating one rounding each."""
    quantity = micro(quantity)
    entry = LedgerEntry(contract_id=contract.id, job=contract.job, account_id=contract.account_id,
                        provider=provider, provider_account_id=provider_account_id, cluster=cluster, item=item,
                        quantity=quantity, unit_price=unit_price,
                        amount=micro(quantity * unit_price if amount is None else amount),
                        currency=contract.currency, kind=kind, note=note)
    session.add(entry)
    return entry


async def entries(session: AsyncSession, principal: Principal, job: str | None = None) -> list[LedgerEntry]:
    stmt = select(LedgerEntry).order_by(LedgerEntry.at, LedgerEntry.id)
    if principal.role is Role.PROVIDER:
        stmt = stmt.where(LedgerEntry.provider_account_id == principal.account_id)
    elif not principal.is_admin:
        stmt = stmt.where(LedgerEntry.account_id == principal.account_id)
    if job is not None:
        stmt = stmt.where(LedgerEntry.job == job)
    return list((await session.execute(stmt)).scalars())


async def contracts(session: AsyncSession, principal: Principal, job: str | None = None) -> list[ContractRow]:
    """The contracts a user (or an admin) is invoiced for, including those nothing was metered on yet."""
    stmt = select(ContractRow).order_by(ContractRow.created_at, ContractRow.id)
    if principal.role is Role.PROVIDER:
        return []
    if not principal.is_admin:
        stmt = stmt.where(ContractRow.account_id == principal.account_id)
    if job is not None:
        stmt = stmt.where(ContractRow.job == job)
    return list((await session.execute(stmt)).scalars())


async def invoice_list(session: AsyncSession, principal: Principal, job: str | None = None,
                       namespace: str | None = None) -> list[dict[str, Any]]:
    """Invoices (users, admins) or payouts (providers): one per contract. A user's contract is invoiced
    even when nothing was metered (a job cancelled before it ran bills 0.00). A payout's total is the
    provider's part of the user's total, so it is split over every entry of the contract (read here,
    never shown: the provider sees its own lines only)."""
    rows = await entries(session, principal, job)
    provider_view = principal.role is Role.PROVIDER
    whole = await _contract_entries(session, {r.contract_id for r in rows}) if provider_view else None
    out = invoices(rows, provider_view=provider_view, contracts=await contracts(session, principal, job), whole=whole)
    return out if namespace is None else [i for i in out if split_key(i["spec"]["job"])[0] == namespace]


async def _contract_entries(session: AsyncSession, contract_ids: set[str]) -> dict[str, list[LedgerEntry]]:
    out: dict[str, list[LedgerEntry]] = defaultdict(list)
    if contract_ids:
        for row in (await session.execute(select(LedgerEntry).where(LedgerEntry.contract_id.in_(contract_ids)))).scalars():
            out[row.contract_id].append(row)
    return out


def invoices(rows: list[LedgerEntry], provider_view: bool = False, contracts: list[ContractRow] | None = None,
             whole: dict[str, list[LedgerEntry]] | None = None) -> list[dict[str, Any]]:
    """One invoice per contract: lines grouped by (provider, cluster, item, unit price) at 6 decimal
    places; the total is their exact sum rounded once to the cent (see ROUNDING_RULE). `whole` (the
    provider view) holds every entry of each contract, to split the user's total across providers."""
    by_contract: dict[str, list[LedgerEntry]] = defaultdict(list)
    for c in contracts or []:
        by_contract[c.id] = []
    for row in rows:
        by_contract[row.contract_id].append(row)
    info = {c.id: c for c in contracts or []}
    return [_invoice(cid, items, info.get(cid), provider_view, (whole or {}).get(cid, items))
            for cid, items in by_contract.items()]


def allocate(total: Decimal, shares: dict[str, Decimal]) -> dict[str, Decimal]:
    """Largest remainder: whole cents for each share that add up to `total` (a sum of the shares
    rounded to the cent). Each share gets itself rounded down to the cent; the cents still missing
    go one each to the largest remainders (ties: by key, so every view computes the same split)."""
    parts = {k: v.quantize(CENT, rounding=ROUND_FLOOR) for k, v in shares.items()}
    missing = int((total - sum(parts.values(), Decimal(0))) / CENT)  # 0 … len(shares) when total rounds the sum
    for k in sorted(shares, key=lambda k: (parts[k] - shares[k], k))[:max(0, missing)]:
        parts[k] += CENT
    return parts


def _lines(items: list[LedgerEntry]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str, str, Decimal], list[Decimal]] = defaultdict(lambda: [Decimal(0), Decimal(0)])
    for e in items:
        acc = groups[(e.provider, e.cluster, e.item, Decimal(e.unit_price))]
        acc[0] += Decimal(e.quantity)
        acc[1] += Decimal(e.amount)
    return [{"provider": p, "cluster": c, "item": i, "quantity": str(micro(q)), "unitPrice": price_text(u),
             "amount": str(micro(a))} for (p, c, i, u), (q, a) in sorted(groups.items())]


def _shares(items: list[LedgerEntry]) -> dict[str, Decimal]:
    """Each provider account's exact part of a contract's entries."""
    out: dict[str, Decimal] = defaultdict(Decimal)
    for e in items:
        out[e.provider_account_id] += Decimal(e.amount)
    return out


def _invoice(contract_id: str, items: list[LedgerEntry], contract: ContractRow | None,
             provider_view: bool, whole: list[LedgerEntry]) -> dict[str, Any]:
    lines = _lines(items)
    subtotal = sum((Decimal(x["amount"]) for x in lines), Decimal(0))
    credits = sum((Decimal(e.amount) for e in items if e.kind == "credit"), Decimal(0))
    shares = _shares(whole)
    split = allocate(to_cent(sum(shares.values(), Decimal(0))), shares)
    total = sum((split[a] for a in _shares(items)), Decimal(0)) if provider_view else to_cent(subtotal)
    job = items[0].job if items else contract.job if contract else ""
    currency = items[0].currency if items else contract.currency if contract else "USD"
    status: dict[str, Any] = {"lines": lines, "lineCount": len(lines), "subtotal": str(micro(subtotal)),
                              "credits": str(micro(credits)), "total": str(total.quantize(CENT)),
                              "entries": len(items), "rounding": ROUNDING_RULE}
    if not provider_view:
        names = {e.provider_account_id: e.provider for e in whole}
        status["providers"] = [{"provider": names[a], "subtotal": str(micro(shares[a])), "total": str(split[a])}
                               for a in sorted(split, key=lambda a: (names[a], a))]
    if contract is not None:
        status["contractState"] = contract.state
        status["quotedTotal"] = str(to_cent(Decimal(contract.quoted_total)))
    return {"apiVersion": "cpn/v1", "kind": "Invoice" if not provider_view else "Payout",
            "metadata": {"name": f"{split_key(job)[1]}-{contract_id[:8]}"},
            "spec": {"job": job, "contract": contract_id, "currency": currency},
            "status": status}
