"""Prices a plan exactly, with decimals: GPU-hours per cluster and egress per sending site."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

CENT = Decimal("0.01")
MICRO = Decimal("0.000001")


@dataclass(frozen=True)
class Seller:
    """Who is paid for a cluster's GPUs (and for egress leaving its site)."""

    provider: str
    provider_account_id: str
    site: str
    price_per_gpu_hour: Decimal
    currency: str


def amount(quantity: Decimal, unit_price: Decimal) -> Decimal:
    """A line's amount, exact to 6 places: only the total is rounded to the cent (billing.ROUNDING_RULE)."""
    return (quantity * unit_price).quantize(MICRO, rounding=ROUND_HALF_UP)


def price_text(unit_price: Decimal) -> str:
    """A unit price as quotes and invoices both show it: exact, without the ledger's padding to 6
    places (2.450000 shows as 2.45), and at least to the cent (3 shows as 3.00)."""
    shown = format(unit_price.normalize(), "f")
    return shown if unit_price != unit_price.quantize(CENT) else str(unit_price.quantize(CENT))


def line(provider: str, cluster: str, item: str, quantity: Decimal, unit_price: Decimal) -> dict[str, Any]:
    quantity = quantity.quantize(MICRO, rounding=ROUND_HALF_UP)
    return {"provider": provider, "cluster": cluster, "item": item, "quantity": str(quantity),
            "unitPrice": price_text(unit_price), "amount": str(amount(quantity, unit_price))}


def price_lines(gpu_seconds: dict[str, float], egress_bytes: dict[tuple[str, str], float],
                sellers: dict[str, Seller], link_prices: dict[frozenset[str], Decimal],
                link_owners: dict[frozenset[str], str] | None = None) -> list[dict[str, Any]]:
    """GPU-hours for every cluster, then egress billed by the provider of the sending site. Each
    provider prices only its own egress: a link's price applies to traffic leaving a site of the
    link's owner (given `link_owners`); traffic leaving another provider's site over it is free."""
    lines = []
    site_cluster: dict[str, str] = {}
    for cluster, seconds in sorted(gpu_seconds.items()):
        seller = sellers[cluster]
        site_cluster.setdefault(seller.site, cluster)
        hours = Decimal(repr(seconds)) / Decimal(3600)
        lines.append(line(seller.provider, cluster, "gpu-hours", hours, seller.price_per_gpu_hour))
    per_site: dict[tuple[str, Decimal], Decimal] = defaultdict(Decimal)
    for (src, dst), nbytes in sorted(egress_bytes.items()):
        unit = link_prices.get(frozenset((src, dst)))
        if unit is None or nbytes <= 0 or src not in site_cluster:
            continue
        owner = (link_owners or {}).get(frozenset((src, dst)))
        if owner is not None and owner != sellers[site_cluster[src]].provider_account_id:
            continue
        per_site[(src, unit)] += Decimal(repr(nbytes)) / Decimal(10**9)
    for (src, unit), gb in sorted(per_site.items()):
        cluster = site_cluster[src]
        lines.append(line(sellers[cluster].provider, cluster, "egress", gb, unit))
    return lines


def data_transfer_lines(transfers: list[tuple[str, float, Decimal]], sellers: dict[str, Seller]) -> list[dict[str, Any]]:
    """One ``data-transfer`` line per placed site without a replica of the job's dataset, from
    (receiving cluster, GB copied, price per GB of the path it comes over): billed by the provider of
    the cluster that receives it, whose workers pull the copy."""
    return [line(sellers[cluster].provider, cluster, "data-transfer", Decimal(repr(gb)), unit)
            for cluster, gb, unit in sorted(transfers)]


def total(lines: list[dict[str, Any]]) -> Decimal:
    """The exact sum of the lines, rounded once to the cent, half up."""
    return sum((Decimal(x["amount"]) for x in lines), Decimal(0)).quantize(CENT, rounding=ROUND_HALF_UP)
