"""The fast placement solver: greedy site sets, GPUs filled by price per effective TFLOP, numpy prefixes.

1. Rank sites by their best compute-only objective on their own (every prefix of the site's clusters
   in price-per-TFLOP order, vectorised over all sites at once).
2. Site sets: the best single sites; and for every bandwidth level b (the distinct link speeds) and
   each of the best few seeds, grow a set one site at a time, adding the best-ranked site linked at
   ≥ b to every site already in (the same rule the exact solver enforces), up to the site limit.
3. For each set and strategy, line the set's GPUs up one by one, cheapest per effective TFLOP first
   (and, for when `gpus_max` binds, fastest first), and score every prefix with the model's
   surrogate (:meth:`Problem.surrogate`) in one numpy pass, honouring GPU bounds, deadline and budget.
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

SEEDS = 4
FINALISTS = 4


def solve(problem: Problem) -> Plan | None:
    rank = _site_scores(problem)
    order = [int(k) for k in np.argsort(rank, kind="stable") if np.isfinite(rank[k])]
    shortlist: list[tuple[float, str, list[int], dict[int, int]]] = []
    for sites in _site_sets(problem, order):
        names = [problem.sites[k] for k in sites]
        for strategy in problem.strategies(len(sites)):
            shortlist.extend(_best_prefixes(problem, strategy, sites, names))
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
    """Each site's best compute-only objective on its own clusters (inf if it cannot reach gpus_min)."""
    order = np.lexsort((problem.price / problem.eff, problem.site_of))
    site, free = problem.site_of[order], problem.free[order]
    taken = np.clip(free - np.maximum(_group_cumsum(free, site) - problem.gpus_max, 0), 0, free)
    gpus = _group_cumsum(taken, site)
    tflops = np.maximum(_group_cumsum(taken * problem.eff[order], site), 1e-12)
    price = _group_cumsum(taken * problem.price[order], site)
    seconds = perf.steps_for(problem.req, "ddp") * problem.flops / tflops + perf.STARTUP_SECONDS
    score = problem.score(price * seconds / 3600, seconds)
    score = np.where(gpus >= problem.gpus_min, score, np.inf)
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
        for k in order[:2 * SEEDS]:
            sets.setdefault(frozenset([k]), [k])
    top = max(problem.site_counts(), default=1)
    if top < 2:
        return list(sets.values())
    position = {k: p for p, k in enumerate(order)}
    levels = sorted({link.bandwidth_gbps for link in problem.links}, reverse=True)
    neighbours = _neighbours(problem)
    for level in levels:
        seeds = [k for k in order if any(bw >= level for bw in neighbours[k].values())][:SEEDS]
        for seed in seeds:
            chosen, common = [seed], {n for n, bw in neighbours[seed].items() if bw >= level}
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


def _best_prefixes(problem: Problem, strategy: str, sites: list[int], names: list[str],
                   ) -> list[tuple[float, str, list[int], dict[int, int]]]:
    from layers.orchestration.planning.placement import Fabric

    members = np.flatnonzero(np.isin(problem.site_of, sites))
    if problem.free[members].sum() < problem.gpus_min:
        return []
    fabric = Fabric.of([problem.offers[i] for i in members])
    out = []
    for key in (problem.price[members] / problem.eff[members], -problem.eff[members]):
        ranked = members[np.argsort(key, kind="stable")]
        units = np.repeat(ranked, problem.free[ranked])[: problem.gpus_max]
        gpus = np.arange(1, len(units) + 1)
        tflops = np.cumsum(problem.eff[units])
        price = np.cumsum(problem.price[units])
        value, seconds, cost = problem.surrogate(strategy, names, gpus, price, tflops, fabric)
        value = np.where(_allowed(problem, gpus, seconds, cost), value, np.inf)
        best = int(np.argmin(value))
        if np.isfinite(value[best]):
            taken = units[: best + 1]
            ids, counts = np.unique(taken, return_counts=True)
            out.append((float(value[best]), strategy, sites, dict(zip(ids.tolist(), counts.tolist(), strict=True))))
    return out


def _allowed(problem: Problem, gpus: np.ndarray, seconds: np.ndarray, cost: np.ndarray) -> np.ndarray:
    ok = gpus >= problem.gpus_min
    if problem.req.deadline_seconds is not None:
        ok &= seconds <= problem.req.deadline_seconds
    if problem.req.budget is not None:
        ok &= cost <= float(problem.req.budget)
    return ok
