"""The exact placement solver: mixed-integer programs (scipy.optimize.milp, HiGHS) with tangent cuts.

Variables: x_i ∈ {0..free_i} GPUs of candidate cluster i, z_s ∈ {0, 1} site s used. A *case* fixes
the strategy, the number of sites S, a WAN level b (two chosen sites must be linked at ≥ b, so the
ring's slowest hop is at least b) and a node-fabric level (only clusters whose `inter_node_gbps`
reaches it may be used). Within a case the communication per step is a constant C,
and with P = Σ x_i·price_i ($/h), F = Σ x_i·tflops_i·MFU_i (TFLOP/s), work = steps · TFLOP/step,
B = steps·C + start-up and E the egress bill::

    time = work/F + B,   cost = P·time/3600 + E
    J    = (a·P + c)/F + b·P + k,   a = w_c·work/(3600·cost_ref), b = w_c·B/(3600·cost_ref),
                                    c = w_t·work/time_ref,         k = w_c·E/cost_ref + w_t·B/time_ref

J grows with P and falls with F. A placement beats the best value θ found so far iff
P < h(F) = ((θ−k)·F − c)/(a + b·F); h is concave, so the set of better (P, F) is convex and lies
below every tangent of h. The solver maximises δ subject to δ ≤ tangent_j(F) − P over a growing set
of tangents (Kelley's cutting planes): δ ≤ 0 proves that no placement beats θ; a point below the
tangents but not below h adds the tangent at its F; a better point lowers θ and the tangents with
it. The budget, P·(work + B·F) ≤ 3600·(budget − E)·F, is the same kind of concave bound and gets
the same cuts; the deadline is linear, F ≥ work/(deadline − B).

Linear constraints: x_i ≤ free_i·z_s(i), z_s ≤ Σ_{i∈s} x_i, Σ z = S, gpus_min ≤ Σ x ≤ gpus_max,
z_s + z_t ≤ 1 for sites not linked at ≥ b. Cases are visited in order of a lower bound on J
(compute on the fastest allowed GPUs, communication at b with no latency and nothing hidden) and
the search stops when the bound reaches the best plan. "Exact" is exact for this case model; every
solution is re-scored with :func:`perf.predict` on its real ring and the best real score wins.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix, csr_matrix, vstack

from layers.orchestration.planning import perf
from layers.orchestration.planning.placement import TIE_BREAK, Fabric
from layers.orchestration.planning.types import Plan

if TYPE_CHECKING:
    from layers.orchestration.planning.placement import Problem

__all__ = ["fastest_tflops", "solve"]

MAX_CUTS = 30
MIP_GAP = 1e-7
PRUNE_GAP = 1e-4  # a case is skipped when its bound is within 0.01 % of the best plan
DELTA_TOLERANCE = 1e-6  # stop when no placement is cheaper by more than this share of a GPU-hour
GRID = 8  # tangents placed up front, geometrically between the least and the most throughput


def solve(problem: Problem, incumbent: Plan | None = None, time_limit: float | None = None) -> Plan | None:
    """The best plan; cases whose bound cannot beat `incumbent` (if given) are skipped.

    With `time_limit` (seconds) the search stops when it runs out and returns the best plan so far.
    """
    best = incumbent
    clock = _Clock(time_limit)
    for bound, strategy, sites, level, fabric in sorted(_cases(problem), key=lambda case: case[0]):
        if (best is not None and bound >= best.objective_value * (1 - PRUNE_GAP)) or clock.expired():
            break
        case = _Case(problem, strategy, sites, level, fabric, clock)
        found = case.solve(best.objective_value if best else np.inf)
        if found is not None and (best is None or found.objective_value < best.objective_value):
            best = found
    return best


def _cases(problem: Problem) -> list[tuple[float, str, int, float, float]]:
    """(bound, strategy, S, WAN level, node-fabric level) for every case worth a look."""
    levels = sorted({link.bandwidth_gbps for link in problem.links}, reverse=True)
    cases = []
    for fabric in np.unique(problem.node_gbps)[::-1]:
        eligible = np.flatnonzero(problem.node_gbps >= fabric)
        if problem.free[eligible].sum() < problem.gpus_min:
            continue
        fastest = fastest_tflops(problem, eligible)
        for sites in problem.site_counts():
            for level in ([np.inf] if sites == 1 else levels):
                for strategy in problem.strategies(sites):
                    bound = _lower_bound(problem, strategy, sites, level, eligible, fastest)
                    cases.append((bound, strategy, sites, level, float(fabric)))
    return cases


def fastest_tflops(problem: Problem, members: np.ndarray | None = None) -> float:
    """Throughput of the gpus_max fastest GPUs among `members` (default: all candidates)."""
    members = np.arange(len(problem.offers)) if members is None else members
    order = members[np.argsort(-problem.eff[members], kind="stable")]
    free = problem.free[order]
    taken = np.clip(free - np.maximum(np.cumsum(free) - problem.gpus_max, 0), 0, free)
    return float((taken * problem.eff[order]).sum())


def _lower_bound(problem: Problem, strategy: str, sites: int, level: float, eligible: np.ndarray,
                 fastest: float) -> float:
    """Compute on the fastest eligible GPUs; communication of gpus_min GPUs spread evenly, at the
    case's WAN level, without latency and with nothing hidden; overhead billed for gpus_min GPUs."""
    names = [f"s{k}" for k in range(sites)]
    share = max(problem.gpus_min / sites, 1.0)
    fabric = Fabric(float(problem.nvlink[eligible].max()), float(problem.node_gbps[eligible].min()),
                    int(problem.per_node[eligible].max()))
    comm, _ = perf.site_comm(problem.req, strategy, 1e18, dict.fromkeys(names, share),
                             dict.fromkeys(names, float(fabric.gbps(share))), level, 0.0)
    steps = perf.steps_for(problem.req, strategy)
    overhead = steps * float(comm) + perf.STARTUP_SECONDS
    seconds = steps * problem.flops / fastest + overhead
    cost = steps * problem.flops * float((problem.price[eligible] / problem.eff[eligible]).min()) / 3600
    cost += problem.gpus_min * float(problem.price[eligible].min()) * overhead / 3600
    return float(problem.score(cost, seconds))


class _Clock:
    """An optional deadline shared by the cases of one solve."""

    def __init__(self, limit: float | None):
        self.end = None if limit is None else time.monotonic() + limit

    def left(self) -> float | None:
        return None if self.end is None else max(0.0, self.end - time.monotonic())

    def expired(self) -> bool:
        return self.end is not None and time.monotonic() >= self.end


class _Case:
    """One (strategy, S, WAN level, fabric level) case: its constants, fixed rows and cutting-plane loop."""

    def __init__(self, problem: Problem, strategy: str, sites: int, level: float, fabric: float,
                 clock: _Clock | None = None):
        self.problem, self.strategy, self.sites, self.level = problem, strategy, sites, level
        self.clock = clock or _Clock(None)
        self.eligible = problem.node_gbps >= fabric
        near = [link for link in problem.links if link.bandwidth_gbps >= level]
        self.rtt = float(np.median([link.rtt_ms for link in near])) if near else 0.0
        self.egress_price = float(np.median([float(link.price_per_gb) for link in near])) if near else 0.0
        self.fabric = Fabric.of(problem, np.flatnonzero(self.eligible))
        self.steps = perf.steps_for(problem.req, strategy)
        self.work = self.steps * problem.flops
        self.n, self.m = len(problem.offers), len(problem.sites)
        self.width = self.n + self.m + 1  # x, z, delta
        self.p_scale = float(problem.price.max())
        self.rows, self.lower, self.upper = self._fixed_rows()

    def solve(self, target: float = np.inf) -> Plan | None:
        """Best plan of the case scoring below `target`: cutting planes at the constants of the
        largest throughput, then once more at those of the result if they moved."""
        best: Plan | None = None
        tflops, gpus = fastest_tflops(self.problem, np.flatnonzero(self.eligible)), float(self.problem.gpus_max)
        constants = self._constants(tflops, gpus)
        for _ in range(2):
            points = self._cutting_planes(tflops, gpus, target)
            for x in points:
                plan = self.problem.evaluate({i: int(g) for i, g in enumerate(x) if g > 0}, self.strategy, "exact")
                if plan is not None and (best is None or plan.objective_value < best.objective_value):
                    best = plan
            if not points:
                break
            tflops, gpus = float(points[-1] @ self.problem.eff), float(points[-1].sum())
            updated = self._constants(tflops, gpus)
            if np.allclose(updated, constants, rtol=1e-3, atol=1e-6):
                break
            constants = updated
        return best

    def _constants(self, tflops: float, gpus: float) -> tuple[float, float]:
        """(B = steps·C + start-up, egress bill) at this throughput and GPU count."""
        names = [f"s{k}" for k in range(self.sites)]
        share = max(gpus / self.sites, 1.0)
        comm, sent = perf.site_comm(self.problem.req, self.strategy, self.problem.flops / tflops,
                                    dict.fromkeys(names, share), dict.fromkeys(names, float(self.fabric.gbps(share))),
                                    self.level, self.rtt)
        egress = sum(float(v) for v in sent.values()) * self.steps / 1e9 * self.egress_price
        return self.steps * float(comm) + perf.STARTUP_SECONDS, egress

    def _cutting_planes(self, tflops_hat: float, gpus_hat: float, target: float) -> list[np.ndarray]:
        """The successively better placements found, the best last (empty if none beats `target`)."""
        p = self.problem
        base, egress = self._constants(tflops_hat, gpus_hat)
        w_cost = (p.objective.cost + TIE_BREAK) / p.cost_ref
        w_time = (p.objective.time + TIE_BREAK) / p.time_ref
        a, b = w_cost * self.work / 3600, w_cost * base / 3600
        c, k = w_time * self.work, w_cost * egress / p.cost_ref + w_time * base / p.time_ref
        budget = None if p.req.budget is None else 3600 * (float(p.req.budget) - egress)
        if budget is not None and budget <= 0:
            return []
        floor = 0.0
        if p.req.deadline_seconds is not None:
            if p.req.deadline_seconds <= base:
                return []
            floor = self.work / (p.req.deadline_seconds - base)
        theta, found = target, []
        low = max(float(np.sort(p.eff)[: p.gpus_min].sum()), floor, 1e-9)
        cuts = list(np.geomspace(low, max(fastest_tflops(p, np.flatnonzero(self.eligible)), low), GRID))
        budget_cuts: list[float] = []
        for _ in range(MAX_CUTS):
            if self.clock.expired():
                break
            x = self._milp(cuts, budget_cuts, theta - k, (a, b, c, base), budget, floor)
            if x is None:
                break
            price, tflops = float(x @ p.price), float(x @ p.eff)
            if budget is not None and price * (self.work + base * tflops) > budget * tflops * (1 + 1e-9):
                budget_cuts.append(tflops)
                continue
            value = (a * price + c) / tflops + b * price + k
            if value < theta * (1 - 1e-9):
                theta = value
                found.append(x)
            elif not np.isfinite(theta) or tflops in cuts:
                break
            cuts.append(tflops)
        return found

    def _milp(self, cuts: list[float], budget_cuts: list[float], theta: float,
              coefficients: tuple[float, float, float, float], budget: float | None,
              floor: float) -> np.ndarray | None:
        """Maximise δ ≤ tangent_j(F) − P (or, with no θ yet, the feasible point of least P)."""
        p, n, m = self.problem, self.n, self.m
        a, b, c, base = coefficients
        rows, lower, upper = [self.rows], list(self.lower), list(self.upper)
        zeros = np.zeros(m)
        if floor > 0:
            rows.append(csr_matrix(np.r_[p.eff, zeros, 0.0][None, :]))
            lower.append(floor)
            upper.append(np.inf)
        for f in budget_cuts if budget is not None else ():
            denom = self.work + base * f  # P ≤ g(F) = budget·F/(work + B·F), below its tangent at f
            g, slope = budget * f / denom, budget * self.work / denom**2
            rows.append(csr_matrix(np.r_[p.price - slope * p.eff, zeros, 0.0][None, :]))
            lower.append(-np.inf)
            upper.append(g - slope * f)
        if np.isfinite(theta):
            for f in cuts:  # a > 0: both weights carry TIE_BREAK
                lower.append(-np.inf)
                h = (theta * f - c) / (a + b * f)
                slope = (theta * a + b * c) / (a + b * f) ** 2
                rows.append(csr_matrix(np.r_[p.price - slope * p.eff, zeros, self.p_scale][None, :]))
                upper.append(h - slope * f)
            objective = np.r_[np.zeros(n + m), -1.0]
        else:
            objective = np.r_[p.price / self.p_scale - 1e-9 * p.eff, zeros, 0.0]
        left = self.clock.left()
        result = milp(objective, constraints=LinearConstraint(vstack(rows, format="csr"), lower, upper),
                      integrality=np.r_[np.ones(n + m), 0.0],
                      bounds=Bounds(np.r_[np.zeros(n + m), -1e6], np.r_[p.free * self.eligible, np.ones(m), 1e6]),
                      options={"mip_rel_gap": MIP_GAP, **({} if left is None else {"time_limit": max(left, 0.01)})})
        if result.x is None or (np.isfinite(theta) and result.x[-1] <= DELTA_TOLERANCE * self.p_scale):
            return None
        return np.round(result.x[:n]).astype(np.int64)

    def _fixed_rows(self) -> tuple[csr_matrix, list[float], list[float]]:
        p, n, m = self.problem, self.n, self.m
        idx = np.arange(n)
        rows = np.r_[idx, idx, n + p.site_of, n + np.arange(m)]
        cols = np.r_[idx, n + p.site_of, idx, n + np.arange(m)]
        vals = np.r_[np.ones(n), -p.free.astype(float), -np.ones(n), np.ones(m)]
        linking = coo_matrix((vals, (rows, cols)), shape=(n + m, self.width))
        lower, upper = [-np.inf] * (n + m), [0.0] * (n + m)
        blocks = [linking, coo_matrix(np.r_[np.zeros(n), np.ones(m), 0.0][None, :]),
                  coo_matrix(np.r_[np.ones(n), np.zeros(m), 0.0][None, :])]
        lower += [self.sites, p.gpus_min]
        upper += [self.sites, p.gpus_max]
        if self.sites > 1:
            pairs = np.array([(s, t) for s in range(m) for t in range(s + 1, m)
                              if p.linked(p.sites[s], p.sites[t]) < self.level]).reshape(-1, 2)
            if len(pairs):
                r = np.repeat(np.arange(len(pairs)), 2)
                blocks.append(coo_matrix((np.ones(2 * len(pairs)), (r, n + pairs.ravel())),
                                         shape=(len(pairs), self.width)))
                lower += [-np.inf] * len(pairs)
                upper += [1.0] * len(pairs)
        return vstack(blocks, format="csr"), lower, upper
