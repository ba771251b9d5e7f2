"""Pipeline placement: how many stages, which site runs which stage, how many GPUs each.

A job whose whole replica does not fit one GPU (:func:`perf.worker_memory_gb` above every offered
GPU's memory) can still train when the model is cut into P contiguous stages, one per site
(:mod:`cpn.runtime.strategies.pipeline`): each GPU then holds one stage (:func:`perf.stage_memory_gb`).
The search, over the candidates of one :class:`~layers.orchestration.planning.placement.Problem`:

- P from 2 (or ``spec.parallelism.pipelineStages`` exactly) up to the sites allowed and the model's
  units (the built-in LM: layers + 2; a user's ``nn.Sequential``, spec.code: its ``spec.model.layers``
  children, priced as equal units, :func:`perf.stage_cuts`);
- every ordered choice of P distinct sites (stage s → the s-th), consecutive stages and the first and
  last (they share the tied token table; a user's model: stage 0 sends the last stage its targets)
  directly linked; exhaustive while the ordered choices number
  at most :data:`EXHAUSTIVE_CHOICES` (solver ``exact``), else over the strongest sites only, as many
  as keep the count under it (solver ``heuristic``);
- W GPUs at every stage (the runtime needs the same number at each site), a handful of widths
  between the job's GPU bounds; each stage fills its W from the site's clusters whose GPUs hold that
  stage, cheapest per effective TFLOP first.

Each choice is priced with :func:`perf.predict_pipeline` (its step is (M + P − 1)/M times the slower
of the slowest stage's compute and the slowest cut's transfer) and scored with the problem's
objective; the deadline and budget bind as for data-parallel plans.

Replicas (``spec.parallelism.dataReplicas`` D > 1, the runtime's replicas of the pipeline): D disjoint
chains of P sites, D·P sites in all, every stage W GPUs wide. A heuristic, not an exhaustive search:
every chain of P sites (as above, P·D within the sites allowed) is priced as one replica on 1/D of the
batch with each width W; then, for each (P, W), chains are taken greedily, fastest first and cheapest
first, each starting from one of the :data:`REPLICA_STARTS` best chains, every further chain disjoint
from those taken and with each of its stage sites linked to the same stage's sites already taken (the
replicas of a stage average over those links). Each set of D chains is then priced whole
(:func:`perf.predict_pipeline`: the slowest replica plus the stages' averaging every H steps); its
solver is ``heuristic``. Replica d's lines carry ``replica`` d and the plan's ring lists the sites
replica-major, stage-minor (the runtime's order: site d·P + s runs stage s of replica d).
"""

from __future__ import annotations

import itertools
import math
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from cpn.core.errors import Infeasible
from layers.orchestration.planning import data, perf
from layers.orchestration.planning.types import Assignment, ClusterOffer, JobRequirements, Plan

if TYPE_CHECKING:
    from layers.orchestration.planning.placement import Problem

__all__ = ["EXHAUSTIVE_CHOICES", "REPLICA_STARTS", "allowed", "diagnose", "lower_bound_seconds", "solve", "stage_counts"]

EXHAUSTIVE_CHOICES = 600  # ordered stage→site choices (over every P) priced one by one
WIDTHS = 6  # GPUs-per-stage values tried for each choice
REPLICA_STARTS = 4  # D > 1: greedy sets of chains started from this many of the best chains (per ranking)
HEURISTIC_ORDERS = 240  # stage→site orders priced for one P when the ordered choices outnumber EXHAUSTIVE_CHOICES
WALK_STEPS = 64  # chains expanded per start site and stage in that bounded walk (pipeline._orders)
_MEMO: OrderedDict[tuple[Any, ...], list[Plan]] = OrderedDict()
_MEMO_LOCK = threading.Lock()
_MEMO_SIZE = 16


def allowed(req: JobRequirements) -> str | None:
    """Why this job cannot run as a pipeline (None: it can): the runtime cuts CPN's built-in LM, and a
    user's ``nn.Sequential`` (spec.code) whose children spec.model.layers counts (2 or more)."""
    if perf.is_code(req) and req.model.layers < 2:
        return (f"spec.model.layers {req.model.layers} (unset: 1): the pipeline cuts your code's nn.Sequential "
                "between its children, so it needs their number; add spec.model.layers (the Sequential's "
                "children, 2 or more) and spec.model.hidden (the values one unit sends across a cut)")
    return None


def _data_parallel_first(problem: Problem) -> bool:
    """Strategy auto on a user's code keeps its data-parallel plans (as before its model could be cut):
    a pipeline only when no offered GPU holds a whole replica."""
    req = problem.req
    if not perf.is_code(req) or req.strategy != "auto" or req.stages is not None or req.data_replicas > 1:
        return False
    need = perf.worker_memory_gb(req)
    return any(o.memory_gb <= 0 or o.memory_gb >= need for o in problem.offers)


def stage_counts(problem: Problem) -> range:
    """The stage counts P the search tries: D·P sites (one stage of one replica each) within the sites
    allowed and the sites with free GPUs, P within the model's units."""
    req = problem.req
    top = _top(problem)
    if req.stages is not None:
        return range(req.stages, req.stages + 1) if req.stages <= top else range(0)
    return range(max(2, -(-problem.sites_min // _replicas(req))), top + 1)


def _replicas(req: JobRequirements) -> int:
    return max(1, req.data_replicas)


def _top(problem: Problem) -> int:
    return min(min(problem.sites_max, len(problem.sites)) // _replicas(problem.req), perf.max_stages(problem.req))


def lower_bound_seconds(problem: Problem) -> float:
    """No pipeline on these candidates is faster than this: every GPU busy on compute, no bubble."""
    throughput = float((problem.free * problem.eff).sum()) * 1e12
    return perf.steps_for(problem.req, "pipeline") * problem.flops * 1e12 / max(throughput, 1e-9)


def solve(problem: Problem) -> Plan | None:
    """The best-scoring pipeline plan under the problem's objective (None: no pipeline fits)."""
    plans = candidates(problem)
    if not plans:
        return None
    best = min(plans, key=lambda p: float(problem.score(p.prediction.est_cost, p.prediction.total_seconds)))
    return Plan(best.assignments, best.prediction,
                float(problem.score(best.prediction.est_cost, best.prediction.total_seconds)), best.solver,
                list(best.ring))


def candidates(problem: Problem) -> list[Plan]:
    """Every pipeline plan the search prices that meets the constraints (objective left at 0); the
    same inputs give the same list (memoised: a quote scores it under three objectives)."""
    req = problem.req
    key = (req, tuple(problem.offers), tuple(problem.links))
    with _MEMO_LOCK:  # planning runs on worker threads (placement.quote_options)
        hit = _MEMO.get(key)
    if hit is None:
        hit = _search(problem)
        with _MEMO_LOCK:
            _MEMO[key] = hit
            while len(_MEMO) > _MEMO_SIZE:
                _MEMO.popitem(last=False)
    return hit


def _search(problem: Problem) -> list[Plan]:
    req = problem.req
    counts = stage_counts(problem)
    if not len(counts) or allowed(req) is not None or _data_parallel_first(problem):
        return []
    d = _replicas(req)
    by_site: dict[str, list[int]] = {}
    ratio = problem.price / np.maximum(problem.eff, 1e-12)
    for i in sorted(range(len(problem.offers)), key=lambda i: (ratio[i], problem.offers[i].name)):
        by_site.setdefault(problem.offers[i].site, []).append(i)
    strength = {s: float(sum(problem.free[i] * problem.eff[i] for i in members)) for s, members in by_site.items()}
    sites = sorted(by_site, key=lambda s: (-strength[s], s))
    k = len(sites)
    while k > max(counts.start * d, 2) and sum(math.perm(k, p) for p in counts if p * d <= k) > EXHAUSTIVE_CHOICES:
        k -= 1
    solver = "exact" if k == len(sites) and d == 1 else "heuristic"
    sites = sites[:k]
    out: list[Plan] = []
    for stages in counts:
        if stages * d > k:
            break
        cuts = perf.stage_cuts(req, stages)
        chains: list[Plan] = []
        if math.perm(k, stages) > EXHAUSTIVE_CHOICES:  # only at the fewest sites D·P a plan needs
            solver = "heuristic"
        for order in _orders(problem, sites, stages):
            chains.extend(_widths(problem, list(order), cuts, by_site, solver))
        out.extend(chains if d == 1 else _replicated(problem, chains, d))
    return out


def _linked_ring(problem: Problem, order: tuple[str, ...]) -> bool:
    return all(problem.linked(a, b) > 0 for a, b in zip(order, order[1:], strict=False)) and \
        problem.linked(order[0], order[-1]) > 0


def _orders(problem: Problem, sites: list[str], stages: int) -> Iterator[tuple[str, ...]]:
    """The stage→site orders priced: every linked one while the ordered choices number at most
    :data:`EXHAUSTIVE_CHOICES`; else (D·P sites at the least, or P fixed high) at most
    :data:`HEURISTIC_ORDERS`, a bounded depth-first walk from each site that prefers the sites after it
    in strength order, so the walks from different starts give disjoint chains for D replicas (issue 35,
    H2: every ordered choice of 4 of 40 sites cost 38 s and, at D = 10, 11.7 GB)."""
    if math.perm(len(sites), stages) <= EXHAUSTIVE_CHOICES:
        yield from (order for order in itertools.permutations(sites, stages) if _linked_ring(problem, order))
        return
    per_start = max(1, HEURISTIC_ORDERS // len(sites))
    given = 0
    for i, first in enumerate(sites):
        preferred = sites[i + 1:] + sites[:i]
        stack, found, expanded = [(first,)], 0, 0
        while stack and found < per_start and expanded < WALK_STEPS * stages and given < HEURISTIC_ORDERS:
            order = stack.pop()
            expanded += 1
            if len(order) == stages:
                if problem.linked(order[-1], order[0]) > 0:
                    found, given = found + 1, given + 1
                    yield order
                continue
            stack.extend((*order, s) for s in reversed(preferred) if s not in order and problem.linked(order[-1], s) > 0)


def _replicated(problem: Problem, chains: list[Plan], d: int) -> list[Plan]:
    """Sets of ``d`` disjoint chains of one width, taken greedily (see the module's docstring), each
    priced whole; the deadline and budget bind the set, not its chains."""
    by_width: dict[int, list[Plan]] = {}
    for chain in chains:
        by_width.setdefault(sum(a.gpus for a in chain.assignments if a.stage == 0), []).append(chain)
    out: list[Plan] = []
    seen: set[tuple[int, tuple[str, ...]]] = set()
    for width, group in by_width.items():
        rankings = (sorted(group, key=lambda c: (c.prediction.total_seconds, c.prediction.est_cost, c.ring)),
                    sorted(group, key=lambda c: (c.prediction.est_cost, c.prediction.total_seconds, c.ring)))
        for ranked in rankings:
            for first in ranked[:REPLICA_STARTS]:
                taken = [first]
                for chain in ranked:
                    if len(taken) == d:
                        break
                    if _fits_beside(problem, chain, taken):
                        taken.append(chain)
                ring = tuple(site for chain in taken for site in chain.ring)
                if len(taken) < d or (width, ring) in seen:
                    continue
                seen.add((width, ring))
                assignments = [replace(a, replica=r) for r, chain in enumerate(taken) for a in chain.assignments]
                plan = _priced(problem, assignments, list(ring), "heuristic")
                if plan is not None:
                    out.append(plan)
    return out


def _fits_beside(problem: Problem, chain: Plan, taken: list[Plan]) -> bool:
    """Disjoint from the chains taken, and each stage's site linked to that stage's sites there."""
    used = {site for other in taken for site in other.ring}
    if used & set(chain.ring):
        return False
    return all(problem.linked(site, other.ring[s]) > 0 for other in taken for s, site in enumerate(chain.ring))


def _fit(problem: Problem, members: list[int], need_gb: float) -> list[int]:
    return [i for i in members if problem.offers[i].memory_gb <= 0 or problem.offers[i].memory_gb >= need_gb]


def _width_options(low: int, high: int) -> list[int]:
    if high < low:
        return []
    picks = {low, high} | {2**j for j in range(int(math.log2(high)) + 1) if low <= 2**j <= high}
    ordered = sorted(picks)
    if len(ordered) > WIDTHS:  # keep both ends and the powers of two spread between them
        ordered = sorted({ordered[round(j * (len(ordered) - 1) / (WIDTHS - 1))] for j in range(WIDTHS)})
    return ordered


def _widths(problem: Problem, order: list[str], cuts: list[tuple[float, float]], by_site: dict[str, list[int]],
            solver: str) -> list[Plan]:
    req, stages = problem.req, len(order)
    d = _replicas(req)
    out: list[Plan] = []
    low = max(1, -(-problem.gpus_min // (stages * d)))
    room = None
    fitting: list[list[int]] = []
    for s, site in enumerate(order):  # memory: the most micro-batches in flight (width 1) bounds every width
        need = perf.stage_memory_gb(req, stages, s, perf.micro_batches(req, 1), cuts)
        members = _fit(problem, by_site[site], need)
        fitting.append(members)
        free = int(sum(problem.free[i] for i in members))
        room = free if room is None else min(room, free)
    high = min(room or 0, problem.gpus_max // (stages * d))
    for width in _width_options(low, high):
        assignments = []
        for s, members in enumerate(fitting):
            need = width
            for i in members:
                take = min(need, int(problem.free[i]))
                if take:
                    o = problem.offers[i]
                    assignments.append(Assignment(o.name, o.site, take, o.gpu_model, stage=s))
                    need -= take
                if not need:
                    break
        plan = _priced(problem, assignments, order, solver) if d == 1 else _chain(problem, assignments, order)
        if plan is not None:
            out.append(plan)
    return out


def _chain(problem: Problem, assignments: list[Assignment], order: list[str]) -> Plan:
    """One replica of D on its own, priced on 1/D of the batch and of the tokens (so on the job's steps),
    without the replicas' averaging, the deadline or the budget: what the greedy sets rank chains by."""
    req, d = problem.req, _replicas(problem.req)
    one = replace(req, tokens=max(1, -(-req.tokens // d)), global_batch_tokens=max(1, req.global_batch_tokens // d),
                  data_replicas=1, data=None, deadline_seconds=None, budget=None)
    offers = {a.cluster: next(o for o in problem.offers if o.name == a.cluster) for a in assignments}
    prediction = perf.predict_pipeline(one, assignments, offers, problem.links_among(sorted(set(order))))
    return Plan(assignments, prediction, 0.0, "heuristic", list(order))


def _priced(problem: Problem, assignments: list[Assignment], order: list[str], solver: str) -> Plan | None:
    req = problem.req
    offers: dict[str, ClusterOffer] = {a.cluster: next(o for o in problem.offers if o.name == a.cluster)
                                       for a in assignments}
    prediction = perf.predict_pipeline(req, assignments, offers, problem.links_among(sorted(set(order))))
    if req.data is not None:
        data.add_to(prediction, problem.data_routes, assignments, offers)
    if req.deadline_seconds is not None and prediction.total_seconds > req.deadline_seconds:
        return None
    if req.budget is not None and prediction.est_cost > float(req.budget):
        return None
    return Plan(assignments, prediction, 0.0, solver, list(order))


def diagnose(problem: Problem, whole: Infeasible | None) -> Infeasible:
    """Why no pipeline fits either: stages beyond the sites or the model's units, no linked chain of
    sites, memory even for the smallest stage, or the deadline/budget."""
    req = problem.req
    reason = allowed(req)
    if reason is not None:
        return Infeasible(reason, field="spec.model.layers")
    counts = stage_counts(problem)
    d = _replicas(req)
    room = min(problem.sites_max, len(problem.sites))
    top = min(room, perf.max_stages(req))
    prefix = f"{whole.message.removesuffix('. Choose a smaller model')}. " if whole is not None else ""
    if not len(counts):
        least = req.stages if req.stages is not None and req.stages <= perf.max_stages(req) else 2
        if d > 1 and least * d > room:
            return Infeasible(f"{prefix}spec.parallelism.dataReplicas {d}: {d} replicas of a pipeline of {least} "
                              f"stages need {d * least} sites (one stage of one replica per site); "
                              f"{len(problem.sites)} sites with free GPUs are allowed"
                              + (f" and spec.sites.max is {problem.sites_max}" if problem.sites_max < d * least
                                 else ""), field="spec.parallelism.dataReplicas")
        if req.stages is not None and perf.is_code(req) and req.stages > perf.max_stages(req):
            return Infeasible(f"{prefix}spec.parallelism.pipelineStages {req.stages}: your model has "
                              f"spec.model.layers {req.model.layers} units to cut; raise spec.model.layers to the "
                              "Sequential's children, or ask fewer stages", field="spec.model.layers")
        if req.stages is not None:
            return Infeasible(f"{prefix}spec.parallelism.pipelineStages {req.stages}: at most {top} stages here "
                              f"(one per site: {len(problem.sites)} sites with free GPUs are allowed; the model "
                              f"has {perf.max_stages(req)} units)", field="spec.parallelism.pipelineStages")
        return Infeasible(f"{prefix}A pipeline needs 2 or more sites; {len(problem.sites)} with free GPUs "
                          "are allowed", field="spec.sites.max" if problem.sites_max < 2 else "spec.model")
    need, stages = min((_largest_stage_gb(req, p), p) for p in counts)  # more stages hold more in flight
    largest = max(o.memory_gb for o in problem.offers)
    if 0 < largest < need:
        return Infeasible(f"{prefix}Cut into {stages} pipeline stages (one per site) its largest stage still "
                          f"needs {need:.3g} GB per GPU; the largest GPU offered has {largest:g} GB. Choose a "
                          "smaller model", field="spec.model")
    stages = counts.stop - 1
    if d > 1:
        return Infeasible(f"{prefix}spec.parallelism.dataReplicas {d}: no {d} disjoint chains of {counts.start}–"
                          f"{stages} linked sites, each stage's sites linked across the replicas, have GPUs that "
                          "hold each stage at one width within the job's limits (GPUs, deadline, budget)",
                          field="spec.parallelism.dataReplicas")
    return Infeasible(f"{prefix}No pipeline of {counts.start}–{stages} stages fits: no chain of that many linked "
                      f"sites has GPUs that hold each stage within the job's limits (GPUs, deadline, budget)",
                      field="spec.parallelism.pipelineStages" if req.stages is not None else "spec.model")


def _largest_stage_gb(req: JobRequirements, stages: int) -> float:
    cuts = perf.stage_cuts(req, stages)
    return max(perf.stage_memory_gb(req, stages, s, perf.micro_batches(req, 1), cuts) for s in range(stages))
