"""Metering into an append-only ledger, and invoices (users) / payouts (providers) read from it."""

from __future__ import annotations

from collections import defaultdict
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from cpn.core.principal import Principal, Role
from layers.service.models import ContractRow, LedgerEntry

CENT = Decimal("0.01")
MICRO = Decimal("0.000001")


def post(session: AsyncSession, contract: ContractRow, *, provider: str, provider_account_id: str, cluster: str,
         item: str, quantity: Decimal, unit_price: Decimal, kind: str = "charge", note: str | None = None
         ) -> LedgerEntry:
    """Append one entry. Credits carry negative quantities and amounts."""
    quantity = quantity.quantize(MICRO, rounding=ROUND_HALF_UP)
    entry = LedgerEntry(contract_id=contract.id, job=contract.job, account_id=contract.account_id,
                        provider=provider, provider_account_id=provider_account_id, cluster=cluster, item=item,
                        quantity=quantity, unit_price=unit_price,
                        amount=(quantity * unit_price).quantize(MICRO, rounding=ROUND_HALF_UP),
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


def invoices(rows: list[LedgerEntry], provider_view: bool = False) -> list[dict[str, Any]]:
    """One invoice per contract: lines grouped by (provider, cluster, item, unit price), each rounded to
    the cent; the total is the sum of the lines, so lines always add up to the invoice."""
    by_contract: dict[str, list[LedgerEntry]] = defaultdict(list)
    for row in rows:
        by_contract[row.contract_id].append(row)
    out = []
    for contract_id, items in by_contract.items():
        groups: dict[tuple[str, str, str, Decimal], list[Decimal]] = defaultdict(lambda: [Decimal(0), Decimal(0)])
        for e in items:
            acc = groups[(e.provider, e.cluster, e.item, Decimal(e.unit_price))]
            acc[0] += Decimal(e.quantity)
            acc[1] += Decimal(e.amount)
        lines = [{"provider": p, "cluster": c, "item": i, "quantity": str(q.quantize(MICRO)),
                  "unitPrice": str(u), "amount": str(a.quantize(CENT, rounding=ROUND_HALF_UP))}
                 for (p, c, i, u), (q, a) in sorted(groups.items())]
        total = sum((Decimal(x["amount"]) for x in lines), Decimal("0.00"))
        out.append({"apiVersion": "cpn/v1", "kind": "Invoice" if not provider_view else "Payout",
                    "metadata": {"name": f"{items[0].job}-{contract_id[:8]}"},
                    "spec": {"job": items[0].job, "contract": contract_id, "currency": items[0].currency},
                    "status": {"lines": lines, "lineCount": len(lines), "total": str(total), "entries": len(items)}})
    return out
