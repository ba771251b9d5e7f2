"""Datasets in placement: what copying a job's data to the placed sites costs in time and money.

A Dataset's replicas live at some sites. A placed site without one receives a copy before its
workers train: from the replica whose cheapest link path (hops' egress prices per GB summed) reaches
it, at that path's slowest hop. With no link path the copy crosses the public internet at the
stated defaults :data:`DEFAULT_PRICE_PER_GB` and :data:`DEFAULT_GBPS`. Copies to several sites run
at once, so the job waits for the slowest; its workers hold their GPUs meanwhile (they read the
data), so the wait is run time like any other: in the predicted time and the GPU-hours. The copies
themselves are the quote's ``data-transfer`` lines.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping
from decimal import Decimal
from functools import lru_cache

from layers.orchestration.planning.types import (
    Assignment,
    ClusterOffer,
    DataMove,
    DataNeed,
    Prediction,
    WanLink,
)

__all__ = ["DEFAULT_GBPS", "DEFAULT_PRICE_PER_GB", "add_to", "moves", "routes", "routes_for", "site_costs"]

DEFAULT_PRICE_PER_GB = Decimal("0.09")  # public-internet egress: the common cloud list price per GB
DEFAULT_GBPS = 1.0  # what one site can count on pulling from the internet


def routes(need: DataNeed, sites: Iterable[str], links: Iterable[WanLink]) -> dict[str, DataMove | None]:
    """Each site's copy of the dataset (None: it holds a replica), over the cheapest link paths from
    any replica (a multi-source Dijkstra on price; ties go to the fewer hops)."""
    graph: dict[str, list[WanLink]] = {}
    for link in links:
        graph.setdefault(link.a, []).append(link)
        graph.setdefault(link.b, []).append(link)
    best: dict[str, tuple[Decimal, int, float, str]] = {}  # site → (price, hops, bottleneck Gbps, source)
    heap = [(Decimal(0), 0, -float("inf"), site, site) for site in sorted(need.replicas)]
    while heap:
        price, hops, neg_gbps, site, source = heapq.heappop(heap)
        if site in best:
            continue
        best[site] = (price, hops, -neg_gbps, source)
        for link in graph.get(site, ()):
            other = link.b if link.a == site else link.a
            if other not in best:
                heapq.heappush(heap, (price + link.price_per_gb, hops + 1,
                                      max(neg_gbps, -link.bandwidth_gbps), other, source))
    out: dict[str, DataMove | None] = {}
    for site in sites:
        if site in need.replicas:
            out[site] = None
            continue
        price, _, gbps, source = best.get(site, (DEFAULT_PRICE_PER_GB, 0, DEFAULT_GBPS, ""))
        out[site] = DataMove(source=source or None, gb=need.size_gb, price_per_gb=price,
                             seconds=need.size_gb * 8 / max(gbps, 1e-9))
    return out


@lru_cache(maxsize=64)
def routes_for(need: DataNeed, sites: tuple[str, ...], links: tuple[WanLink, ...]) -> dict[str, DataMove | None]:
    """:func:`routes` once per (dataset, sites, links): a quote plans three objectives on the same inputs.
    The result is shared: read it, never change it."""
    return routes(need, sites, links)


def moves(routes_: Mapping[str, DataMove | None], sites: Iterable[str]) -> dict[str, DataMove]:
    """The copies a placement on `sites` needs."""
    return {s: m for s in sorted(set(sites)) if (m := routes_.get(s)) is not None}


def site_costs(routes_: Mapping[str, DataMove | None], sites: Iterable[str]) -> tuple[float, float]:
    """(seconds the job waits for its copies, their price) for a placement on `sites`."""
    needed = moves(routes_, sites).values()
    return max((m.seconds for m in needed), default=0.0), sum(m.gb * float(m.price_per_gb) for m in needed)


def add_to(prediction: Prediction, routes_: Mapping[str, DataMove | None], assignments: list[Assignment],
           offers: Mapping[str, ClusterOffer]) -> None:
    """Count the placement's copies in `prediction`: the wait in the time and every GPU's hours, the
    copies' price in the estimated cost."""
    used = [a for a in assignments if a.gpus > 0]
    needed = moves(routes_, (a.site for a in used))
    wait = max((m.seconds for m in needed.values()), default=0.0)
    for a in used:
        prediction.gpu_seconds_by_cluster[a.cluster] = prediction.gpu_seconds_by_cluster.get(a.cluster, 0.0) \
            + a.gpus * wait
        prediction.est_cost += a.gpus * wait / 3600 * float(offers[a.cluster].price_per_gpu_hour)
    prediction.est_cost += sum(m.gb * float(m.price_per_gb) for m in needed.values())
    prediction.total_seconds += wait
    prediction.data_seconds, prediction.data_moves = wait, needed
