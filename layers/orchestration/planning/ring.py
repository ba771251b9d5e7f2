"""The order in which a job's sites pass all-reduce chunks around: maximise the slowest WAN hop.

A ring all-reduce moves at the pace of its thinnest hop, so the ring is chosen to maximise the
minimum link bandwidth between consecutive sites (the bottleneck travelling-salesman problem),
ties broken by the smaller total RTT. Up to :data:`EXACT_UP_TO` sites every ring is searched (depth
first, first site fixed, a partial ring dropped as soon as it cannot beat the best); beyond that a
greedy widest-next-hop ring is improved by 2-opt moves. Sites with no link between them are never
adjacent unless no ring avoids it; such a hop has bandwidth 0.
"""

from __future__ import annotations

from collections.abc import Iterable

from layers.orchestration.planning.types import WanLink

__all__ = ["EXACT_UP_TO", "best_ring", "bottleneck", "hops", "link_index"]

EXACT_UP_TO = 8

Key = tuple[str, str]


def link_index(links: Iterable[WanLink]) -> dict[Key, WanLink]:
    """Both directions of every link, keyed by (site, site); the widest wins if listed twice."""
    index: dict[Key, WanLink] = {}
    for link in links:
        for key in ((link.a, link.b), (link.b, link.a)):
            old = index.get(key)
            if old is None or link.bandwidth_gbps > old.bandwidth_gbps:
                index[key] = link
    return index


def hops(ring: list[str]) -> list[Key]:
    """Consecutive (from, to) pairs of a ring, closing it; a two-site ring uses its link both ways."""
    if len(ring) < 2:
        return []
    return [(ring[i], ring[(i + 1) % len(ring)]) for i in range(len(ring))]


def bottleneck(ring: list[str], index: dict[Key, WanLink]) -> tuple[float, float]:
    """(slowest hop's Gbps, largest hop RTT ms) of a ring; missing links count as 0 Gbps."""
    pairs = hops(ring)
    if not pairs:
        return float("inf"), 0.0
    bws = [index[p].bandwidth_gbps if p in index else 0.0 for p in pairs]
    rtts = [index[p].rtt_ms if p in index else 0.0 for p in pairs]
    return min(bws), max(rtts)


def best_ring(sites: list[str], links: list[WanLink]) -> list[str]:
    """A ring over `sites` (first site kept first) whose slowest hop is as fast as possible."""
    sites = list(dict.fromkeys(sites))
    if len(sites) <= 3:
        return sites  # every order of three or fewer sites is the same ring
    index = link_index(links)
    if len(sites) <= EXACT_UP_TO:
        return _exhaustive(sites, index)
    return _two_opt(_greedy(sites, index), index)


def _score(ring: list[str], index: dict[Key, WanLink]) -> tuple[float, float]:
    pairs = hops(ring)
    bws = [index[p].bandwidth_gbps if p in index else 0.0 for p in pairs]
    return min(bws), -sum(index[p].rtt_ms if p in index else 1e6 for p in pairs)


def _exhaustive(sites: list[str], index: dict[Key, WanLink]) -> list[str]:
    bw = {(a, b): (index[(a, b)].bandwidth_gbps if (a, b) in index else 0.0) for a in sites for b in sites}
    rtt = {(a, b): (index[(a, b)].rtt_ms if (a, b) in index else 1e6) for a in sites for b in sites}
    first, rest = sites[0], sites[1:]
    best: list[tuple[tuple[float, float], list[str]]] = [((-1.0, 0.0), sites)]

    def visit(path: list[str], left: list[str], low: float, total: float) -> None:
        if low < best[0][0][0]:
            return
        if not left:
            score = (min(low, bw[(path[-1], first)]), -(total + rtt[(path[-1], first)]))
            if score > best[0][0]:
                best[0] = (score, list(path))
            return
        for i, site in enumerate(left):
            path.append(site)
            visit(path, left[:i] + left[i + 1:], min(low, bw[(path[-2], site)]), total + rtt[(path[-2], site)])
            path.pop()

    visit([first], rest, float("inf"), 0.0)
    return best[0][1]


def _greedy(sites: list[str], index: dict[Key, WanLink]) -> list[str]:
    ring, left = [sites[0]], set(sites[1:])
    while left:
        here = ring[-1]
        nxt = max(sorted(left), key=lambda s: (index[(here, s)].bandwidth_gbps, -index[(here, s)].rtt_ms)
                  if (here, s) in index else (0.0, -1e6))
        ring.append(nxt)
        left.remove(nxt)
    return ring


def _two_opt(ring: list[str], index: dict[Key, WanLink]) -> list[str]:
    best, improved = _score(ring, index), True
    while improved:
        improved = False
        for i in range(1, len(ring) - 1):
            for j in range(i + 1, len(ring)):
                candidate = ring[:i] + ring[i:j + 1][::-1] + ring[j + 1:]
                score = _score(candidate, index)
                if score > best:
                    ring, best, improved = candidate, score, True
    return ring
