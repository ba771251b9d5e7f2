"""The site ring maximises its slowest WAN hop."""

from __future__ import annotations

import itertools
import random
from decimal import Decimal

from layers.orchestration.planning.ring import best_ring, bottleneck, link_index
from layers.orchestration.planning.types import WanLink


def link(a: str, b: str, gbps: float, rtt: float = 10.0) -> WanLink:
    return WanLink(a, b, gbps, rtt, Decimal("0.02"))


def brute_force(sites: list[str], links: list[WanLink]) -> float:
    index = link_index(links)
    return max(bottleneck([sites[0], *rest], index)[0] for rest in itertools.permutations(sites[1:]))


def test_hand_example_avoids_the_thin_diagonals():
    # a square a-b-c-d with 100 Gbps sides and 1 Gbps diagonals: a-c-b-d would cross the diagonals
    links = [link("a", "b", 100), link("b", "c", 100), link("c", "d", 100), link("d", "a", 100),
             link("a", "c", 1), link("b", "d", 1)]
    ring = best_ring(["a", "c", "b", "d"], links)
    assert bottleneck(ring, link_index(links))[0] == 100
    assert ring[0] == "a" and set(ring) == {"a", "b", "c", "d"}


def test_missing_links_count_as_zero():
    links = [link("a", "b", 10), link("b", "c", 10), link("c", "d", 10), link("d", "a", 10)]
    ring = best_ring(["a", "b", "d", "c"], links)
    assert bottleneck(ring, link_index(links))[0] == 10


def test_ties_prefer_the_smaller_total_rtt():
    sides = {frozenset(pair) for pair in ("ab", "bc", "cd", "da")}
    links = [link(a, b, 10, 1.0 if frozenset((a, b)) in sides else 50.0) for a, b in itertools.combinations("abcd", 2)]
    ring = best_ring(["a", "c", "b", "d"], links)
    assert ring in (["a", "b", "c", "d"], ["a", "d", "c", "b"])


def test_exhaustive_search_matches_brute_force():
    rng = random.Random(3)
    for _ in range(5):
        sites = [f"s{k}" for k in range(6)]
        links = [link(a, b, rng.choice((1, 2, 5, 10, 40, 100))) for a, b in itertools.combinations(sites, 2)]
        assert bottleneck(best_ring(sites, links), link_index(links))[0] == brute_force(sites, links)


def test_large_rings_find_a_hidden_fast_cycle():
    sites = [f"s{k:02d}" for k in range(12)]
    hidden = sites[:]
    random.Random(7).shuffle(hidden)
    fast = {frozenset((hidden[k], hidden[(k + 1) % 12])) for k in range(12)}
    links = [link(a, b, 100 if frozenset((a, b)) in fast else 1) for a, b in itertools.combinations(sites, 2)]
    assert bottleneck(best_ring(sites, links), link_index(links))[0] == 100


def test_small_rings_keep_their_order():
    assert best_ring(["x"], []) == ["x"]
    assert best_ring(["x", "y"], []) == ["x", "y"]
