"""Placement: choose clusters, GPUs per cluster and a strategy that minimise the weighted objective.

A job is decomposed into one data-parallel replica group per chosen cluster (a sub-task each); the
groups of one site share the site's fabric, the sites talk over the ring that `ring.best_ring`
picks. The objective is unit-free::

    J = w_cost · cost / cost_ref + w_time · time / time_ref

with lower bounds as references: ``time_ref`` is the compute-only time on the fastest GPUs the job
may use (up to ``gpus_max``), ``cost_ref`` the compute-only cost at the best price per effective
TFLOP among the candidates. So J ≥ w_cost + w_time, and a weight of 0.5 means "as important as the
other". Every plan is scored with :func:`perf.predict` on its real ring, whatever solver found it.

Constraints: free GPUs now, GPU models, regions, sites allow/deny, sites min/max, GPUs min/max,
deadline and budget. Multi-site placements need a direct link between each pair of chosen sites
(sites with no link are unreachable to each other), and at most :data:`MAX_SITES` sites take part
unless `sites_min` asks for more. With strategy ``auto`` the planner weighs ddp on one site against
hierarchical all-reduce and DiLoCo (with the job's compression and overlap) across sites, so the
link bandwidth decides; an explicit strategy is the only one considered.

Two solvers share this module's :class:`Problem`: `exact` (mixed-integer programs, HiGHS) and
`heuristic` (greedy, numpy). `auto` runs the heuristic, then, for up to :data:`EXACT_UP_TO`
candidate clusters, the exact solver from the heuristic's plan for at most
:data:`AUTO_EXACT_SECONDS` (a quote must not stall an API request). When nothing is feasible,
:func:`plan` raises :class:`Infeasible` naming the binding constraint.
"""

from __future__ import annotations

import copy
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from decimal import Decimal
from typing import Any

import numpy as np

from cpn.core.errors import Infeasible
from cpn.core.manifest import distinct_durations, duration_text
from layers.orchestration.planning import calibration, data, perf, pipeline
from layers.orchestration.planning.ring import Key, best_ring, bottleneck, link_index
from layers.orchestration.planning.types import (
    STRATEGIES,
    Assignment,
    ClusterOffer,
    DataMove,
    JobRequirements,
    Objective,
    Plan,
    WanLink,
)

__all__ = ["EXACT_UP_TO", "MAX_SITES", "Fabric", "Problem", "plan", "quote_options"]

EXACT_UP_TO = 40
AUTO_EXACT_SECONDS = 1.0  # `auto` gives the exact solver this long, then keeps the best plan so far
TIE_BREAK = 1e-6  # weight added to both terms: among equally cheap plans the faster wins, and vice versa
MAX_SITES = 8
AUTO_STRATEGIES = ("ddp", "hierarchical", "diloco")
SOLVERS = ("auto", "exact", "heuristic")


@dataclass(frozen=True)
class Fabric:
    """A site's network as the surrogates assume it: NVLink up to one node, the node fabric beyond."""

    nvlink_gbps: float
    node_gbps: float
    gpus_per_node: int

    @classmethod
    def of(cls, problem: Problem, members: np.ndarray) -> Fabric:
        """The slowest links among candidate clusters `members` (indices)."""
        return cls(float(problem.nvlink[members].min()), float(problem.node_gbps[members].min()),
                   int(problem.per_node[members].max()))

    def gbps(self, gpus_per_site: Any, one_cluster: Any = True) -> Any:
        """NVLink while each site's GPUs fit in one node of one cluster, else the node fabric."""
        nvlink = (np.asarray(gpus_per_site) <= self.gpus_per_node) & np.asarray(one_cluster)
        return np.where(nvlink, self.nvlink_gbps, self.node_gbps)


@dataclass
class Problem:
    """The candidates of one request as arrays, the references of its objective, and its scoring."""

    req: JobRequirements
    objective: Objective
    offers: list[ClusterOffer]
    links: list[WanLink]
    eff: np.ndarray  # effective TFLOP/s per GPU
    price: np.ndarray  # per GPU-hour
    free: np.ndarray
    site_of: np.ndarray  # index into `sites`
    sites: list[str]
    index: dict[Key, WanLink]
    nvlink: np.ndarray  # intra_node_gbps
    node_gbps: np.ndarray  # inter_node_gbps
    per_node: np.ndarray  # gpus_per_node
    flops: float  # TFLOP per step
    gpus_min: int
    gpus_max: int
    sites_min: int
    sites_max: int
    time_ref: float = 1.0
    cost_ref: float = 1.0
    data_routes: dict[str, DataMove | None] = field(default_factory=dict)  # site → its copy of req.data
    _rings: dict[frozenset[str], list[str]] = field(default_factory=dict)
    _bottlenecks: dict[tuple[str, ...], tuple[float, float]] = field(default_factory=dict)

    def links_among(self, sites: list[str]) -> list[WanLink]:
        return [self.index[(a, b)] for k, a in enumerate(sites) for b in sites[k + 1:] if (a, b) in self.index]

    def strategies(self, sites: int) -> tuple[str, ...]:
        if self.req.strategy != "auto":
            return (self.req.strategy,)
        return ("ddp",) if sites == 1 else AUTO_STRATEGIES[1:]

    def site_counts(self) -> range:
        return range(self.sites_min, min(self.sites_max, len(self.sites)) + 1)

    def linked(self, a: str, b: str) -> float:
        """Bandwidth of the direct link between two sites (0 when there is none)."""
        link = self.index.get((a, b))
        return link.bandwidth_gbps if link else 0.0

    def ring(self, sites: list[str]) -> list[str]:
        key = frozenset(sites)
        if key not in self._rings:
            ordered = sorted(sites)
            self._rings[key] = best_ring(ordered, self.links_among(ordered)) if len(sites) > 1 else ordered
        return self._rings[key]

    def score(self, cost: Any, seconds: Any) -> Any:
        w_cost, w_time = self.objective.cost + TIE_BREAK, self.objective.time + TIE_BREAK
        return w_cost * cost / self.cost_ref + w_time * seconds / self.time_ref

    def surrogate(self, strategy: str, sites: list[str], gpus: Any, price: Any, tflops: Any,
                  fabric: Fabric, one_cluster: Any = True) -> tuple[Any, Any, Any]:
        """(objective, seconds, cost) of placements on `sites` with these totals (arrays welcome).

        The sites share the GPUs equally and `fabric` (NVLink only where `one_cluster` says each
        site uses a single cluster); the real split only moves the intra-site term, which
        :func:`perf.predict` then settles.
        """
        ring = self.ring(sites)
        wan, rtt = self._bottlenecks.setdefault(tuple(ring), bottleneck(ring, self.index))
        compute = self.flops / np.maximum(tflops, 1e-12)
        share = np.maximum(gpus / len(sites), 1.0)
        comm, sent = perf.site_comm(self.req, strategy, compute, dict.fromkeys(sites, share),
                                    dict.fromkeys(sites, fabric.gbps(share, one_cluster)), wan, rtt)
        steps = perf.steps_for(self.req, strategy)
        seconds = steps * (compute + comm) + perf.STARTUP_SECONDS
        egress = 0.0
        for a, b in zip(ring, ring[1:] + ring[:1], strict=True) if len(ring) > 1 else ():
            egress = egress + sent[a] * steps / 1e9 * float(self.index[(a, b)].price_per_gb)
        wait, fee = data.site_costs(self.data_routes, sites)  # copies of the dataset to sites without one
        seconds = seconds + wait
        cost = price * seconds / 3600 + egress + fee
        return self.score(cost, seconds), seconds, cost

    def holding(self, used: dict[int, int], strategy: str) -> dict[int, int]:
        """``used`` with each site that has too few GPUs to hold its shard of the model (sharded over its
        ranks, :func:`perf.memory_options`) grown to the fewest that do: the solvers price GPUs, not
        memory, and would otherwise offer too few GPUs of a site to shard a large model over. GPUs come
        from the site's clusters already used, then its cheapest per effective TFLOP, within the
        clusters' free GPUs; past the job's GPU bound, from the other sites' GPUs beyond what they need
        themselves (their dearest first). A placement that cannot be mended is left as it is
        (:func:`perf.predict` then finds it does not fit)."""
        options = perf.memory_options(self.req, strategy)
        if not used or not any(shard == "site" for shard, _ in options):
            return used
        out = dict(used)
        sites = sorted({int(self.site_of[i]) for i in used})
        memory = {k: min((self.offers[i].memory_gb for i in out if self.site_of[i] == k and self.offers[i].memory_gb > 0),
                         default=0.0) for k in sites}
        pools = {k: [i for i in range(len(self.offers)) if self.site_of[i] == k
                     and (self.offers[i].memory_gb <= 0 or memory[k] <= 0 or self.offers[i].memory_gb >= memory[k])]
                 for k in sites}
        least = {k: 1 if memory[k] <= 0 else next(
            (n for n in range(1, int(sum(self.free[i] for i in pools[k])) + 1) if self._holds(n, memory[k], options)),
            None) for k in sites}
        if any(n is None for n in least.values()) or sum(least.values()) > self.gpus_max:  # type: ignore[arg-type]
            return used
        have = {k: sum(g for i, g in out.items() if self.site_of[i] == k) for k in sites}
        for k in sites:
            short = least[k] - have[k]  # type: ignore[operator]
            if short <= 0:
                continue
            room = self.gpus_max - sum(out.values())
            for other in sorted(sites, key=lambda o: -(have[o] - least[o])):  # type: ignore[operator]
                if room >= short:
                    break
                give = min(short - room, have[other] - least[other])  # type: ignore[operator]
                if other == k or give <= 0:
                    continue
                for i in sorted((i for i in out if self.site_of[i] == other), key=lambda i: -self.price[i] / self.eff[i]):
                    drop = min(give, out[i])
                    out[i], give, have[other], room = out[i] - drop, give - drop, have[other] - drop, room + drop
            for i in sorted(pools[k], key=lambda i: (-out.get(i, 0), self.price[i] / self.eff[i])):
                take = min(short, room, int(self.free[i]) - out.get(i, 0))
                if take > 0:
                    out[i], short, room, have[k] = out.get(i, 0) + take, short - take, room - take, have[k] + take
        return {i: g for i, g in out.items() if g > 0}

    def _holds(self, ranks: int, memory_gb: float, options: list[tuple[str, str]]) -> bool:
        return any(perf.worker_memory_gb(self.req, shard=ranks if shard == "site" else 1,
                                         checkpointing=checkpointing == "full") <= memory_gb
                   for shard, checkpointing in options)

    def evaluate(self, counts: dict[int, int], strategy: str, solver: str) -> Plan | None:
        """Score a placement (candidate index → GPUs) with the real model; None if it breaks a constraint.
        A site with too few GPUs to hold its shard of the model is grown first (:meth:`holding`)."""
        used = self.holding({i: g for i, g in counts.items() if g > 0}, strategy)
        sites = sorted({self.sites[self.site_of[i]] for i in used})
        total = sum(used.values())
        if not used or not self.gpus_min <= total <= self.gpus_max:
            return None
        if not self.sites_min <= len(sites) <= self.sites_max:
            return None
        if any(self.linked(a, b) <= 0 for k, a in enumerate(sites) for b in sites[k + 1:]):
            return None
        ring = self.ring(sites)
        assignments = [Assignment(self.offers[i].name, self.offers[i].site, g, self.offers[i].gpu_model)
                       for i, g in sorted(used.items(), key=lambda item: self.offers[item[0]].name)]
        offers = {self.offers[i].name: self.offers[i] for i in used}
        prediction = perf.predict(self.req, assignments, strategy, offers, self.links_among(sites), ring)
        if not prediction.fits_memory:  # these GPUs cannot hold the model however it is sharded
            return None
        if self.req.data is not None:
            data.add_to(prediction, self.data_routes, assignments, offers)
        if self.req.deadline_seconds is not None and prediction.total_seconds > self.req.deadline_seconds:
            return None
        if self.req.budget is not None and prediction.est_cost > float(self.req.budget):
            return None
        weight = perf.TOKEN_EFFICIENCY[strategy]  # time and cost to ddp's loss: strategies compare by that
        value = float(self.score(prediction.est_cost * weight, prediction.total_seconds * weight))
        return Plan(assignments, prediction, value, solver, ring)


def plan(req: JobRequirements, offers: list[ClusterOffer], links: list[WanLink], objective: Objective,
         solver: str = "auto") -> Plan:
    """The best placement of `req`; raises :class:`Infeasible` naming the binding constraint."""
    best, why = _best(req, offers, links, objective, solver)
    if best is None:
        assert why is not None
        raise why
    return best


def pipeline_mode(req: JobRequirements) -> str:
    """``only``: the job asks for a pipeline (strategy or spec.parallelism.pipelineStages); ``may``:
    strategy auto on CPN's built-in model, a pipeline when it is the only fit or predicted faster;
    ``never``: a data-parallel strategy was asked for, or the runtime cannot cut the job's model."""
    if req.strategy == "pipeline" or req.stages is not None:
        return "only"
    if req.shard == "site":  # a pipeline's stages are not sharded (perf.SHARDABLE_STRATEGIES)
        return "never"
    return "may" if req.strategy == "auto" and pipeline.allowed(req) is None else "never"


def _pipeline_hint(req: JobRequirements, why: Infeasible | None) -> Infeasible | None:
    """A user's model too big for any GPU, with strategy auto but not described enough to be cut: the
    reason, and what would let the planner place it as a pipeline instead."""
    cannot = pipeline.allowed(req)
    if why is None or why.field != "spec.model" or req.strategy != "auto" or cannot is None:
        return why
    return Infeasible(f"{why.message}, or let CPN cut it into pipeline stages across sites: {cannot}", field=why.field)


def _best(req: JobRequirements, offers: list[ClusterOffer], links: list[WanLink], objective: Objective,
          solver: str) -> tuple[Plan | None, Infeasible | None]:
    """(the best plan, None) or (None, why nothing fits): data parallel, a pipeline, or the better of
    the two under :func:`pipeline_mode`."""
    mode = pipeline_mode(req)
    whole: Plan | None = None
    why: Infeasible | None = None
    if mode != "only":
        try:
            problem = build_problem(req, offers, links, objective)
            whole = solve(problem, solver)
            if whole is None:
                why = diagnose(problem, solver)
        except Infeasible as exc:
            why = exc
        if mode == "never" or (whole is None and why is not None and why.field != "spec.model"):
            return whole, _pipeline_hint(req, why)  # only a model too big for one GPU makes a pipeline worth a look
    staged_problem = build_problem(req, offers, links, objective, whole_replica=False)
    if whole is not None and pipeline.lower_bound_seconds(staged_problem) >= whole.prediction.total_seconds:
        return whole, None  # no pipeline can be faster
    staged = pipeline.solve(staged_problem)
    if staged is None:
        return whole, (None if whole is not None else pipeline.diagnose(staged_problem, why))
    if whole is None:
        return staged, None
    faster = staged.prediction.total_seconds < whole.prediction.total_seconds
    better = staged.objective_value <= float(staged_problem.score(whole.prediction.est_cost,
                                                                  whole.prediction.total_seconds))
    return (staged if faster and better else whole), None


def quote_options(req: JobRequirements, offers: list[ClusterOffer], links: list[WanLink], objective: Objective,
                  solver: str = "auto") -> dict[str, Plan]:
    """Cheapest, fastest and balanced (the user's weights) plans; equal plans may repeat under two labels.

    Planned once per distinct (requirements, catalogue snapshot, objective, solver): a burst of
    submissions of the same job against the same live capacity pays for one planning, and every
    caller gets its own copy of the plans. Any change in the inputs (a heartbeat that moves a free
    GPU count, a lease, a learned factor) is a different key."""
    key = (req, offers if isinstance(offers, tuple) else tuple(offers),  # a tuple as given: it may hash once
           links if isinstance(links, tuple) else tuple(links), objective, solver)
    hit = _memo_or_claim(key)
    if hit is None:
        try:
            hit = _quote_options(req, offers, links, objective, solver)
            _remember(key, hit)
        finally:
            _release(key)
    return copy.deepcopy(hit)


def _memo_or_claim(key: tuple[Any, ...]) -> dict[str, Plan] | None:
    """The memo's plans for ``key``; or None, and this thread plans them: the API plans on worker
    threads (off its event loop), and callers with the same inputs wait for the one planning."""
    while True:
        with _QUOTE_LOCK:
            hit = _QUOTE_MEMO.get(key)
            if hit is not None:
                _QUOTE_MEMO.move_to_end(key)
                return hit
            running = _PLANNING.get(key)
            if running is None:
                _PLANNING[key] = threading.Event()
                return None
        running.wait()  # then read the memo, or plan if that planning failed


def _remember(key: tuple[Any, ...], plans: dict[str, Plan]) -> None:
    with _QUOTE_LOCK:
        _QUOTE_MEMO[key] = plans
        while len(_QUOTE_MEMO) > QUOTE_MEMO_SIZE:
            _QUOTE_MEMO.popitem(last=False)


def _release(key: tuple[Any, ...]) -> None:
    with _QUOTE_LOCK:
        _PLANNING.pop(key).set()


QUOTE_MEMO_SIZE = 64  # distinct (job, snapshot) plans kept; each is three small Plan objects
_QUOTE_MEMO: OrderedDict[tuple[Any, ...], dict[str, Plan]] = OrderedDict()
_QUOTE_LOCK = threading.Lock()
_PLANNING: dict[tuple[Any, ...], threading.Event] = {}  # the keys being planned now


def _quote_options(req: JobRequirements, offers: list[ClusterOffer], links: list[WanLink], objective: Objective,
                   solver: str) -> dict[str, Plan]:
    out = {"balanced": plan(req, offers, links, objective, solver)}
    for label, weights in (("cheapest", Objective(cost=1.0, time=0.0)), ("fastest", Objective(cost=0.0, time=1.0))):
        out[label] = _best(req, offers, links, weights, solver)[0] or out["balanced"]
    return {label: out[label] for label in ("cheapest", "fastest", "balanced")}


def solve(problem: Problem, solver: str = "auto") -> Plan | None:
    from layers.orchestration.planning import exact, heuristic

    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")
    quick = heuristic.solve(problem)
    if solver == "exact":
        return runnable(problem, exact.solve(problem, incumbent=quick))
    if solver == "auto" and len(problem.offers) <= EXACT_UP_TO:
        return runnable(problem, exact.solve(problem, incumbent=quick, time_limit=AUTO_EXACT_SECONDS))
    return runnable(problem, quick)


def runnable(problem: Problem, best: Plan | None) -> Plan | None:
    """The plan as the runtime can run it. Hierarchical all-reduce needs the same number of workers
    at every site (`cpn.runtime.train.preflight`): an uneven plan is evened out, or, when the user
    left the strategy to CPN, run with DiLoCo instead; None when neither fits the constraints."""
    if best is None or best.strategy != "hierarchical":
        return best
    per_site: dict[str, int] = {}
    for a in best.assignments:
        per_site[a.site] = per_site.get(a.site, 0) + a.gpus
    if len(set(per_site.values())) == 1:
        return best
    position = {o.name: i for i, o in enumerate(problem.offers)}
    counts = {position[a.cluster]: a.gpus for a in best.assignments}
    even = _evened(problem, counts, sorted(per_site))
    fixed = problem.evaluate(even, "hierarchical", best.solver) if even else None
    if fixed is None and problem.req.strategy == "auto":
        fixed = problem.evaluate(counts, "diloco", best.solver)
    return fixed


def _evened(problem: Problem, counts: dict[int, int], sites: list[str]) -> dict[int, int] | None:
    """The same sites with an equal number of GPUs each, as close to the plan's total as the limits allow;
    each site fills from the clusters the plan used there first, then its cheapest per effective TFLOP."""
    n, total = len(sites), sum(counts.values())
    members = {s: [i for i in range(len(problem.offers)) if problem.offers[i].site == s] for s in sites}
    room = min(int(problem.free[members[s]].sum()) for s in sites)
    options = [t for t in range(1, room + 1) if problem.gpus_min <= t * n <= problem.gpus_max]
    if not options:
        return None
    per_site = min(options, key=lambda t: (abs(t * n - total), -t))
    even: dict[int, int] = {}
    for s in sites:
        order = sorted(members[s], key=lambda i: (-counts.get(i, 0), problem.price[i] / problem.eff[i]))
        need = per_site
        for i in order:
            take = min(need, int(problem.free[i]))
            if take:
                even[i], need = take, need - take
    return even


def build_problem(req: JobRequirements, offers: list[ClusterOffer], links: list[WanLink],
                  objective: Objective, whole_replica: bool = True) -> Problem:
    """Filter the candidates and set the references; raises Infeasible when the filters leave too little.
    ``whole_replica=False`` keeps GPUs too small for a whole replica (a pipeline stage may fit them)."""
    _check_request(req, objective)
    candidates = _candidates(req, offers, whole_replica)
    sites = sorted({o.site for o in candidates})
    site_pos = {s: k for k, s in enumerate(sites)}
    wanted = set(sites)
    near = [link for link in links if link.a in wanted and link.b in wanted and link.a != link.b]
    eff = np.array([o.tflops for o in candidates], dtype=float) * np.array(
        [calibration.mfu(o.gpu_model) for o in candidates])
    free = np.array([o.free_gpus for o in candidates], dtype=np.int64)
    gpus_max = int(min(req.gpus_max if req.gpus_max is not None else free.sum(), free.sum()))
    problem = Problem(
        req=req, objective=objective, offers=candidates, links=near, eff=eff,
        price=np.array([float(o.price_per_gpu_hour) for o in candidates], dtype=float), free=free,
        site_of=np.array([site_pos[o.site] for o in candidates], dtype=np.int64), sites=sites,
        index=link_index(near), nvlink=np.array([o.intra_node_gbps for o in candidates], dtype=float),
        node_gbps=np.array([o.inter_node_gbps for o in candidates], dtype=float),
        per_node=np.array([o.gpus_per_node for o in candidates], dtype=np.int64), flops=perf.flops_per_step(req) / 1e12, gpus_min=max(1, req.gpus_min),
        gpus_max=gpus_max, sites_min=max(1, req.sites_min),
        sites_max=req.sites_max if req.sites_max is not None else max(MAX_SITES, req.sites_min),
    )
    if req.data is not None:  # over every link: a replica may sit at a site with no free GPUs
        problem.data_routes = data.routes_for(req.data, tuple(sites), tuple(links))
    _set_references(problem)
    return problem


def _check_request(req: JobRequirements, objective: Objective) -> None:
    if req.strategy != "auto" and req.strategy not in STRATEGIES:
        raise Infeasible(f"unknown strategy {req.strategy!r}; use auto or one of {', '.join(STRATEGIES)}",
                         field="spec.strategy")
    if objective.cost < 0 or objective.time < 0 or objective.cost + objective.time <= 0:
        raise Infeasible("objective weights must be non-negative and not both zero", field="spec.objective")
    if req.gpus_max is not None and req.gpus_max < req.gpus_min:
        raise Infeasible(f"gpus.max {req.gpus_max} is below gpus.min {req.gpus_min}", field="spec.gpus.max")
    if req.sites_max is not None and req.sites_max < req.sites_min:
        raise Infeasible(f"sites.max {req.sites_max} is below sites.min {req.sites_min}", field="spec.sites.max")


def _where(req: JobRequirements) -> str:
    parts = []
    if req.regions:
        parts.append(f"in regions [{', '.join(sorted(req.regions))}]")
    if req.sites:
        parts.append(f"at sites [{', '.join(sorted(req.sites))}]")
    if req.exclude_sites:
        parts.append(f"outside sites [{', '.join(sorted(req.exclude_sites))}]")
    if req.data is not None and req.data.regions:
        parts.append(f"in dataset {req.data.name}'s regions [{', '.join(sorted(req.data.regions))}]")
    return " and ".join(parts) if parts else "anywhere"


def _where_field(req: JobRequirements) -> str:
    """The spec field that confines the job most: what to change when nothing is left where it may run."""
    if req.sites:
        return "spec.placement.sites"
    if req.exclude_sites and not req.regions:
        return "spec.placement.excludeSites"
    if req.regions:
        return "spec.placement.regions"
    return "spec.dataset" if req.data is not None and req.data.regions else "spec.placement"


def _models(req: JobRequirements) -> str:
    return "/".join(sorted(req.gpu_models)) if req.gpu_models else ""


def _candidates(req: JobRequirements, offers: list[ClusterOffer], whole_replica: bool = True) -> list[ClusterOffer]:
    models = [o for o in offers if req.gpu_models is None or o.gpu_model in req.gpu_models]
    if not offers:  # the caller filtered the market to Ready clusters with free GPUs in the job's currency
        raise Infeasible(f"no Ready cluster has free GPUs priced in {req.currency}")
    if not models:
        offered = ", ".join(sorted({o.gpu_model for o in offers}))
        raise Infeasible(f"no clusters offer GPU models [{', '.join(sorted(req.gpu_models or ()))}]; "
                         f"offered: {offered}", field="spec.gpus.models")
    placed = [o for o in models if (req.regions is None or o.region in req.regions)
              and (req.sites is None or o.site in req.sites) and o.site not in req.exclude_sites]
    if not placed:
        raise Infeasible(f"no {_models(req)} clusters {_where(req)}".replace("  ", " "), field=_where_field(req))
    placed = _resident(req, placed)
    fitting = _fitting(req, placed) if whole_replica else placed
    candidates = [o for o in fitting if o.free_gpus > 0 and o.currency == req.currency]
    free = sum(o.free_gpus for o in candidates)
    if free < req.gpus_min:
        label = f"{_models(req)} GPUs" if req.gpu_models else "GPUs"
        raise Infeasible(f"No placement has {req.gpus_min} {label} free {_where(req)}; at most {free} "
                         f"{'is' if free == 1 else 'are'}", field="spec.gpus.min")
    sites = {o.site for o in candidates}
    if len(sites) < req.sites_min:
        raise Infeasible(f"No placement spans {req.sites_min} sites with free GPUs {_where(req)}; at most "
                         f"{len(sites)} {'does' if len(sites) == 1 else 'do'}", field="spec.sites.min")
    return candidates


def _resident(req: JobRequirements, offers: list[ClusterOffer]) -> list[ClusterOffer]:
    """Offers in the regions the job's dataset may be processed in (all of them without residency)."""
    if req.data is None or not req.data.regions:
        return offers
    inside = [o for o in offers if o.region in req.data.regions]
    if not inside:
        found = ", ".join(sorted({o.region for o in offers}))
        raise Infeasible(f"spec.dataset: dataset {req.data.name!r} may only be processed in regions "
                         f"[{', '.join(sorted(req.data.regions))}] (its spec.regions), and no {_models(req)} "
                         f"cluster the job may use is there (their regions: {found})".replace("  ", " "),
                         field="spec.dataset")
    return inside


def _fitting(req: JobRequirements, offers: list[ClusterOffer]) -> list[ClusterOffer]:
    """Offers whose GPUs hold the job's training state in the least a placement there needs: sharded
    over every GPU of their site the job may use, with activation checkpointing, where the runtime can
    (:func:`perf.memory_options`); memory 0 = not reported: kept. Each plan then fixes its own memory
    plan (:func:`perf.memory_plan`) and is dropped when its GPUs do not hold it."""
    if not offers:
        return offers
    need = _least_memory_gb(req, offers)
    fits = [o for o in offers if o.memory_gb <= 0 or o.memory_gb >= need[o.site][0]]
    if not fits:
        largest = max(offers, key=lambda o: o.memory_gb)
        least, ways = need[largest.site]
        amount = f"{least:.1f}" if least >= 0.1 else f"{least:.3g}"  # a declared toy GPU's megabytes still read
        raise Infeasible(f"The model needs at least {amount} GB per GPU to train ({ways}); the largest GPU "
                         f"offered {_where(req)} has {largest.memory_gb:g} GB. Choose a smaller model, or GPUs "
                         "with more memory", field="spec.model")
    return fits


def _least_memory_gb(req: JobRequirements, offers: list[ClusterOffer]) -> dict[str, tuple[float, str]]:
    """Per site: the least GB per GPU any placement there needs, and how it holds the model then."""
    free: dict[str, int] = {}
    for o in offers:
        free[o.site] = free.get(o.site, 0) + o.free_gpus
    strategies = AUTO_STRATEGIES if req.strategy == "auto" else (req.strategy,)
    options = {pair for strategy in strategies for pair in perf.memory_options(req, strategy)}
    out: dict[str, tuple[float, str]] = {}
    for site, gpus in free.items():
        ranks = max(1, min(gpus, req.gpus_max or gpus))
        out[site] = min((perf.worker_memory_gb(req, shard=ranks if shard == "site" else 1,
                                               checkpointing=checkpointing == "full"),
                         _memory_words(req, shard, checkpointing, ranks)) for shard, checkpointing in options)
    return out


def _memory_words(req: JobRequirements, shard: str, checkpointing: str, ranks: int) -> str:
    """How a GPU holds the model, in the refusal's words."""
    state = (f"its parameters, gradients and optimizer state, {perf.TRAINING_STATE_BYTES} bytes per parameter, "
             + (f"sharded over the {ranks} GPUs of a site" if shard == "site" and ranks > 1 else "on every GPU"))
    acts = "one sequence's activations" + (", each block's recomputed" if checkpointing == "full" else "")
    return f"{state}, {acts}, {perf.RUNTIME_OVERHEAD_GB:g} GB for the runtime"


def _set_references(problem: Problem) -> None:
    """time_ref: compute only, on the fastest GPUs of the `sites_max` strongest sites (≤ gpus_max);
    cost_ref: compute only, at the best price per effective TFLOP. Both are lower bounds."""
    per_site = np.bincount(problem.site_of, weights=problem.free * problem.eff, minlength=len(problem.sites))
    strong = np.argsort(-per_site, kind="stable")[: problem.sites_max]
    allowed = np.isin(problem.site_of, strong)
    order = np.argsort(-np.where(allowed, problem.eff, 0.0), kind="stable")
    free = np.where(allowed, problem.free, 0)[order]
    taken = np.clip(free - np.maximum(np.cumsum(free) - problem.gpus_max, 0), 0, free)
    fastest = float((taken * problem.eff[order]).sum())
    steps = min(perf.steps_for(problem.req, s) for s in STRATEGIES)
    problem.time_ref = steps * problem.flops / fastest + perf.STARTUP_SECONDS
    best_ratio = float((problem.price / problem.eff).min())
    problem.cost_ref = max(steps * problem.flops * best_ratio / 3600, 0.01)


def diagnose(problem: Problem, solver: str) -> Infeasible:
    """Why no placement fits: the deadline, the budget, both, or the site graph."""
    req = problem.req
    relaxed = _relax(problem, deadline=None, budget=None)
    fastest = solve(_with_objective(relaxed, Objective(cost=0.0, time=1.0)), solver)
    if fastest is None and req.strategy == "hierarchical":
        return Infeasible(f"no placement gives every site the same number of GPUs, which hierarchical "
                          f"all-reduce needs, between {problem.gpus_min} and {problem.gpus_max} GPUs over "
                          f"{problem.sites_min} or more sites: use ddp or diloco, or a GPU count the sites "
                          "can share evenly", field="spec.strategy")
    if fastest is None:
        return Infeasible(f"no placement: no {problem.sites_min} sites with free GPUs {_where(req)} "
                          "are all linked to each other", field="spec.sites.min")
    if req.deadline_seconds is not None and fastest.prediction.total_seconds > req.deadline_seconds:
        needs, allows = distinct_durations([fastest.prediction.total_seconds, max(req.deadline_seconds, 0.0)])
        return Infeasible(f"fastest feasible placement needs {needs}, the deadline allows {allows}",
                          field="spec.deadline")
    cheapest = solve(_with_objective(relaxed, Objective(cost=1.0, time=0.0)), solver)
    cost = cheapest.prediction.est_cost if cheapest else math.inf
    if req.budget is not None and cost > float(req.budget):
        shown = f"{cost:.2f}" if cost >= 0.01 or math.isinf(cost) else f"{cost:.2g}"  # 0.0018, not 0.00
        return Infeasible(f"cheapest feasible placement costs {shown} {req.currency}, budget is "
                          f"{req.budget} {req.currency}", field="spec.budget")
    if req.deadline_seconds is not None and req.budget is not None:
        takes, allows = distinct_durations([fastest.prediction.total_seconds, max(req.deadline_seconds, 0.0)])
        return Infeasible(f"no placement meets both the deadline ({allows}) and "
                          f"the budget ({req.budget} {req.currency}): the fastest takes {takes} for "
                          f"{fastest.prediction.est_cost:.2f} {req.currency}", field="spec.budget")
    o = problem.objective  # placements fit, but none scored under these weights
    return Infeasible(f"no placement could be scored with objective weights cost {o.cost:g} and time {o.time:g} "
                      f"(the fastest fitting one takes {duration_text(fastest.prediction.total_seconds)} for "
                      f"{fastest.prediction.est_cost:.2f} {req.currency}): use weights of similar size, e.g. cost 0.5 and time 0.5",
                      field="spec.objective")


def _relax(problem: Problem, deadline: float | None, budget: Decimal | None) -> Problem:
    return replace(problem, req=replace(problem.req, deadline_seconds=deadline, budget=budget))


def _with_objective(problem: Problem, objective: Objective) -> Problem:
    return replace(problem, objective=objective)
