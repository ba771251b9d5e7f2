"""The fast placement solver: greedy site sets, GPUs filled by price per effective TFLOP, numpy prefixes.

1. Rank sites by their best compute-only objective on their own (every prefix of the site's clusters
   in price-per-TFLOP order, vectorised over all sites at once).
2. Site sets: the best single sites; and for every bandwidth level b (the distinct link speeds) and
   each of the best few seeds, its pairs with the well-ranked sites linked to it at ≥ b, and a set
   grown one site at a time, adding the best-ranked site linked at ≥ b to every site already in
   (the same rule the exact solver enforces), up to the site limit.
3. For each set and strategy, line the set's GPUs up one by one, cheapest per effective TFLOP first
   among the clusters whose node fabric reaches each level present (a slow fabric slows the whole
   site's all-reduce), and fastest first when `gpus_max` binds; each site's first GPU goes first, so
   every prefix uses every site. Score every prefix with the case model (:meth:`Problem.surrogate`)
   in one numpy pass, honouring GPU bounds, deadline and budget.
4. Score the best few prefixes with the real model (:func:`perf.predict` on the real ring) and keep
   the best that satisfies every constraint.

For a fixed set of sites and total throughput, filling by price per TFLOP is the cheapest way to
get that throughput, and the objective grows with cost and with time, so only the site choice and
integer rounding separate this from the exact solver.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from layers.orchestration.planning import perf
from layers.orchestration.planning.types import Plan

if TYPE_CHECKING:
    from layers.orchestration.planning.placement import Problem

__all__ = ["solve"]

SEEDS = 4
FINALISTS = 4


def solve(problem: Problem) -> Plan | None:
    rank = _site_scores(problem)
    order = [int(k) for k in np.argsort(rank, kind="stable")]
    shortlist: list[tuple[float, str, list[int], dict[int, int]]] = []
    by_site = np.argsort(problem.site_of, kind="stable")
    bounds = np.searchsorted(problem.site_of[by_site], np.arange(len(problem.sites) + 1))
    for sites in _site_sets(problem, order):
        members = np.concatenate([by_site[bounds[k]:bounds[k + 1]] for k in sites])
        for strategy in problem.strategies(len(sites)):
            shortlist.extend(_best_prefixes(problem, strategy, members, sites))
    shortlist.sort(key=lambda item: item[0])
    best: Plan | None = None
    tried: set[tuple[str, tuple[tuple[int, int], ...]]] = set()
    for _, strategy, _, counts in shortlist:
        key = (strategy, tuple(sorted(counts.items())))
        if key in tried:
            continue
        tried.add(key)
        candidate = problem.evaluate(counts, strategy, "heuristic")
        if candidate is not None and (best is None or candidate.objective_value < best.objective_value):
            best = candidate
        if best is not None and len(tried) >= FINALISTS:
            break
    return best


def _site_scores(problem: Problem) -> np.ndarray:
    """Each site's best compute-only objective on its own clusters, whether or not they reach gpus_min."""
    order = np.lexsort((problem.price / problem.eff, problem.site_of))
    site, free = problem.site_of[order], problem.free[order]
    taken = np.clip(free - np.maximum(_group_cumsum(free, site) - problem.gpus_max, 0), 0, free)
    tflops = np.maximum(_group_cumsum(taken * problem.eff[order], site), 1e-12)
    price = _group_cumsum(taken * problem.price[order], site)
    seconds = perf.steps_for(problem.req, "ddp") * problem.flops / tflops + perf.STARTUP_SECONDS
    score = problem.score(price * seconds / 3600, seconds)
    out = np.full(len(problem.sites), np.inf)
    np.minimum.at(out, site, score)
    return out


def _group_cumsum(values: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """Running sums that restart at each new value of the (sorted) `groups`."""
    total = np.cumsum(values, dtype=float)
    starts = np.flatnonzero(np.r_[True, groups[1:] != groups[:-1]])
    before = np.repeat(total[starts] - values[starts], np.diff(np.r_[starts, len(values)]))
    return total - before


def _site_sets(problem: Problem, order: list[int]) -> list[list[int]]:
    if not order:
        return []
    sets: dict[frozenset[int], list[int]] = {}
    if problem.sites_min <= 1:
        capacity = np.bincount(problem.site_of, weights=problem.free, minlength=len(problem.sites))
        for k in [k for k in order if capacity[k] >= problem.gpus_min][:2 * SEEDS]:
            sets.setdefault(frozenset([k]), [k])
    top = max(problem.site_counts(), default=1)
    if top < 2:
        return list(sets.values())
    position = {k: p for p, k in enumerate(order)}
    levels = sorted({link.bandwidth_gbps for link in problem.links}, reverse=True)
    neighbours = _neighbours(problem)
    widest = np.array([max(neighbours[k].values(), default=0.0) for k in order])
    for level in levels:
        seeds = [order[p] for p in np.flatnonzero(widest >= level)[:SEEDS]]
        for seed in seeds:
            chosen, common = [seed], {n for n, bw in neighbours[seed].items() if bw >= level}
            if problem.sites_min <= 2:  # pairs with other well-ranked sites, not only the best partner
                for other in common:
                    if position[other] < 2 * SEEDS:
                        sets.setdefault(frozenset((seed, other)), [seed, other])
            while len(chosen) < top and common:
                nxt = min(common, key=position.__getitem__)
                chosen.append(nxt)
                common &= {n for n, bw in neighbours[nxt].items() if bw >= level}
                if len(chosen) >= problem.sites_min:
                    sets.setdefault(frozenset(chosen), list(chosen))
    return list(sets.values())


def _neighbours(problem: Problem) -> dict[int, dict[int, float]]:
    pos = {s: k for k, s in enumerate(problem.sites)}
    out: dict[int, dict[int, float]] = {k: {} for k in range(len(problem.sites))}
    for link in problem.links:
        a, b = pos[link.a], pos[link.b]
        out[a][b] = max(out[a].get(b, 0.0), link.bandwidth_gbps)
        out[b][a] = out[a][b]
    return out


def _best_prefixes(problem: Problem, strategy: str, members: np.ndarray, sites: list[int],
                   ) -> list[tuple[float, str, list[int], dict[int, int]]]:
    """The best prefix of each line-up of the `members` clusters' GPUs, as (score, strategy, sites, counts)."""
    from layers.orchestration.planning.placement import Fabric

    if problem.free[members].sum() < problem.gpus_min:
        return []
    names = [problem.sites[k] for k in sites]
    ratio = problem.price[members] / problem.eff[members]
    by_ratio = members[np.argsort(ratio, kind="stable")]
    _, first = np.unique(problem.site_of[by_ratio], return_index=True)
    lineups = [by_ratio[np.sort(first)]]  # each site's best cluster alone: NVLink while it fits a node
    for level in np.unique(problem.node_gbps[members])[::-1]:
        lineups.append(by_ratio[problem.node_gbps[by_ratio] >= level])
    if problem.free[members].sum() > problem.gpus_max:  # the cap binds: the fastest GPUs may win
        lineups.append(members[np.argsort(-problem.eff[members], kind="stable")])
    out = []
    seen: set[bytes] = set()
    for ranked in lineups:
        if ranked.tobytes() in seen:
            continue
        seen.add(ranked.tobytes())
        units = _one_per_site_first(problem, ranked, len(sites))
        units = units[: problem.gpus_max]
        if len(units) < max(problem.gpus_min, len(sites)):
            continue
        gpus = np.arange(1, len(units) + 1)
        one_cluster = np.logical_and.accumulate(_is_first_cluster(problem, units))
        value, seconds, cost = problem.surrogate(strategy, names, gpus, np.cumsum(problem.price[units]),
                                                 np.cumsum(problem.eff[units]), Fabric.of(problem, ranked),
                                                 one_cluster)
        value = np.where(_allowed(problem, gpus, seconds, cost) & (gpus >= len(sites)), value, np.inf)
        best = int(np.argmin(value))
        if np.isfinite(value[best]):
            counts = np.bincount(units[: best + 1], minlength=len(problem.offers))
            taken = {int(i): int(counts[i]) for i in np.flatnonzero(counts)}
            out.append((float(value[best]), strategy, sites, taken))
    return out


def _is_first_cluster(problem: Problem, units: np.ndarray) -> np.ndarray:
    """Per GPU of a line-up: does it belong to the first cluster its site contributes?"""
    sites = problem.site_of[units]
    _, first = np.unique(sites, return_index=True)
    lead = np.full(len(problem.sites), -1)
    lead[sites[first]] = units[first]
    return lead[sites] == units


def _one_per_site_first(problem: Problem, ranked: np.ndarray, sites: int) -> np.ndarray:
    """The line-up's GPUs one by one, each site's first GPU moved to the front so that every prefix
    of `sites` or more GPUs uses every site (empty if a site has no cluster in the line-up)."""
    _, first = np.unique(problem.site_of[ranked], return_index=True)
    if len(first) < sites:
        return ranked[:0]
    first = np.sort(first)
    free = problem.free[ranked].copy()
    free[first] -= 1
    return np.concatenate([ranked[first], np.repeat(ranked, free)])


def _allowed(problem: Problem, gpus: np.ndarray, seconds: np.ndarray, cost: np.ndarray) -> np.ndarray:
    ok = gpus >= problem.gpus_min
    if problem.req.deadline_seconds is not None:
        ok &= seconds <= problem.req.deadline_seconds
    if problem.req.budget is not None:
        ok &= cost <= float(problem.req.budget)
    return ok
