"""Scheduler benchmark: the heuristic's optimality gap against the exact solver, and placement latency.

Catalogues come from :func:`layers.resource.catalog.generate_world` (manifest dicts), turned into
offers by :func:`offers_from_manifests`. Jobs are random but plausible: 1–70 B parameters, a few
billion to a trillion tokens, random weights, sometimes int8 compression, GPU-model or region
restrictions and GPU minimums. The gap of one instance is (J_heuristic − J_exact)/J_exact, both
scored by the real model; it is negative when the heuristic's plan scores better.
"""

from __future__ import annotations

import os
import platform
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import numpy as np

from cpn.core.errors import Infeasible
from layers.orchestration.planning import exact, heuristic, placement
from layers.orchestration.planning.types import ClusterOffer, JobRequirements, ModelShape, Objective, WanLink

__all__ = ["example_world", "offers_from_manifests", "optimality_gap", "run", "worked_example"]

PROVIDER_LABEL = "cpn.io/provider"
# Data parallel only: each worker holds a whole replica, so the sizes stop where one 80 GB GPU still can
# (perf.worker_memory_gb); larger models would need tensor or pipeline parallelism, which CPN does not plan.
MODEL_SIZES = (350_000_000, 1_300_000_000, 2_700_000_000, 7_000_000_000, 13_000_000_000)


def offers_from_manifests(docs: Iterable[dict[str, Any]]) -> tuple[list[ClusterOffer], list[WanLink]]:
    """Site/Cluster/Link manifests → offers (one per node pool: `cluster`, or `cluster/pool`) and links."""
    docs = list(docs)
    regions = {d["metadata"]["name"]: d["spec"].get("region", "") for d in docs if d["kind"] == "Site"}
    offers, links = [], []
    for doc in docs:
        spec = doc["spec"]
        if doc["kind"] == "Cluster":
            offers.extend(_cluster_offers(doc, regions))
        elif doc["kind"] == "Link":
            links.append(WanLink(a=spec["a"], b=spec["b"], bandwidth_gbps=float(spec["bandwidthGbps"]),
                                 rtt_ms=float(spec["rttMs"]), price_per_gb=Decimal(str(spec["pricePerGB"]))))
    return offers, links


def _cluster_offers(doc: dict[str, Any], regions: dict[str, str]) -> list[ClusterOffer]:
    spec, name = doc["spec"], doc["metadata"]["name"]
    pools = spec.get("nodePools", [])
    net = spec.get("interconnect", {})
    out = []
    for k, pool in enumerate(pools):
        gpu = pool["gpu"]
        out.append(ClusterOffer(
            name=name if len(pools) == 1 else f"{name}/{pool.get('name', k)}", site=spec["site"],
            region=regions.get(spec["site"], ""), provider=doc["metadata"].get("labels", {}).get(PROVIDER_LABEL, ""),
            gpu_model=gpu["model"], tflops=float(gpu["tflops"]), memory_gb=float(gpu.get("memoryGB", 0)),
            free_gpus=int(pool["gpusPerNode"]) * int(pool["nodes"]),
            price_per_gpu_hour=Decimal(str(pool["pricePerGpuHour"])), currency=spec.get("currency", "USD"),
            intra_node_gbps=float(net.get("intraNodeGbps", 600.0)), inter_node_gbps=float(net.get("interNodeGbps", 100.0)),
            gpus_per_node=int(pool["gpusPerNode"]),
        ))
    return out


def world(sites: int, clusters: int, seed: int, links: int | None = None) -> tuple[list[ClusterOffer], list[WanLink]]:
    from layers.resource.catalog import generate_world

    return offers_from_manifests(generate_world(sites, clusters, seed=seed, providers=3, links=links))


def random_job(rng: random.Random, offers: list[ClusterOffer]) -> tuple[JobRequirements, Objective]:
    params = rng.choice(MODEL_SIZES)
    tokens = int(params * rng.choice((2, 5, 20)))
    models = sorted({o.gpu_model for o in offers})
    regions = sorted({o.region for o in offers})
    req = JobRequirements(
        model=ModelShape(parameters=params, layers=32, hidden=4096, seq_len=4096), tokens=tokens,
        global_batch_tokens=rng.choice((1, 2, 4)) * 1_048_576, inner_steps=rng.choice((50, 100, 500)),
        compression=rng.choice((None, None, "int8", "bf16")), gpus_min=rng.choice((1, 8, 16, 32)),
        gpu_models=frozenset(rng.sample(models, k=max(1, len(models) - 1))) if rng.random() < 0.3 else None,
        regions=frozenset(rng.sample(regions, k=max(1, len(regions) - 1))) if rng.random() < 0.2 else None,
    )
    weight = rng.choice((0.0, 0.2, 0.5, 0.8, 1.0))
    return req, Objective(cost=weight, time=1.0 - weight)


@dataclass
class GapResult:
    gaps: list[float]
    exact_ms: list[float]
    heuristic_ms: list[float]
    infeasible: int


def optimality_gap(instances: int, clusters: int, seed: int) -> GapResult:
    """Heuristic vs exact on `instances` random catalogues of `clusters` clusters (one job each)."""
    rng = random.Random(seed)
    result = GapResult([], [], [], 0)
    attempt = 0
    while len(result.gaps) < instances and attempt < 4 * instances:
        attempt += 1
        offers, links = world(max(2, clusters // 4), clusters, seed * 1000 + attempt)
        req, objective = random_job(rng, offers)
        try:
            problem = placement.build_problem(req, offers, links, objective)
        except Infeasible:
            result.infeasible += 1
            continue
        started = time.perf_counter()
        fast = heuristic.solve(problem)
        middle = time.perf_counter()
        best = exact.solve(problem)
        done = time.perf_counter()
        if fast is None or best is None:
            result.infeasible += 1
            continue
        result.gaps.append((fast.objective_value - best.objective_value) / best.objective_value)
        result.heuristic_ms.append((middle - started) * 1e3)
        result.exact_ms.append((done - middle) * 1e3)
    return result


def latency(clusters: int, links: int, jobs: int, seed: int) -> tuple[list[float], list[float]]:
    """(wall, CPU) milliseconds of `placement.plan(..., solver="heuristic")` per job on one large catalogue."""
    offers, wan = world(max(2, clusters // 5), clusters, seed, links=links)
    rng = random.Random(seed)
    wall, cpu = [], []
    for _ in range(jobs):
        req, objective = random_job(rng, offers)
        started, started_cpu = time.perf_counter(), time.process_time()
        try:
            placement.plan(req, offers, wan, objective, solver="heuristic")
        except Infeasible:
            pass
        wall.append((time.perf_counter() - started) * 1e3)
        cpu.append((time.process_time() - started_cpu) * 1e3)
    return wall, cpu


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p95": 0.0, "p99": 0.0}
    p50, p95, p99 = np.percentile(values, [50, 95, 99])
    return {"p50": round(float(p50), 2), "p95": round(float(p95), 2), "p99": round(float(p99), 2)}


def run(clusters: int, links: int, jobs: int, instances: int, gap_clusters: int, seed: int) -> dict[str, Any]:
    gap = optimality_gap(instances, gap_clusters, seed)
    times, cpu = latency(clusters, links, jobs, seed)
    exact_p50 = float(np.median(gap.exact_ms)) if gap.exact_ms else 0.0
    heuristic_p50 = float(np.median(gap.heuristic_ms)) if gap.heuristic_ms else 0.0
    return {
        "gap": {
            "max": round(max(gap.gaps, default=0.0), 6), "mean": round(float(np.mean(gap.gaps)) if gap.gaps else 0.0, 6),
            "instances": len(gap.gaps), "clusters": gap_clusters,
            "heuristic_better": sum(1 for g in gap.gaps if g < -1e-9), "skipped_infeasible": gap.infeasible,
        },
        "latency_ms": percentiles(times),
        "latency_cpu_ms": percentiles(cpu),
        "catalogue": {"clusters": clusters, "links": links, "jobs": jobs},
        "small_catalogue_ms": {"exact": percentiles(gap.exact_ms), "heuristic": percentiles(gap.heuristic_ms),
                               "speedup_p50": round(exact_p50 / heuristic_p50, 1) if heuristic_p50 else None},
        "seed": seed,
        "machine": {"python": platform.python_version(), "processor": platform.machine(), "cpus": os.cpu_count(),
                    "load_average_1m": round(os.getloadavg()[0], 1)},
    }


def markdown(report: dict[str, Any], command: str) -> str:
    gap, lat, small = report["gap"], report["latency_ms"], report["small_catalogue_ms"]
    cpu, machine = report["latency_cpu_ms"], report["machine"]
    return "\n".join([
        "# Scheduler benchmark",
        "",
        f"Produced by `{command}` (seed {report['seed']}); numbers in `scheduler.json`.",
        "",
        "| measure | value | target |",
        "|---|---|---|",
        f"| heuristic gap vs exact, max over {gap['instances']} instances of {gap['clusters']} clusters "
        f"| {gap['max'] * 100:.2f} % | ≤ 3 % |",
        f"| heuristic gap, mean | {gap['mean'] * 100:.3f} % | |",
        f"| instances where the heuristic scored better | {gap['heuristic_better']} | |",
        f"| exact / heuristic time, p50, {gap['clusters']} clusters | {small['exact']['p50']} ms / "
        f"{small['heuristic']['p50']} ms (×{small['speedup_p50']}) | ≥ 25× |",
        f"| heuristic placement, {report['catalogue']['clusters']} clusters / {report['catalogue']['links']} links, "
        f"p50 / p95 / p99 (wall) | {lat['p50']} / {lat['p95']} / {lat['p99']} ms | p95 ≤ 200 ms |",
        f"| the same, CPU time of the planning process | {cpu['p50']} / {cpu['p95']} / {cpu['p99']} ms | |",
        "",
        "Gap = (J_heuristic − J_exact) / J_exact, both plans scored by `perf.predict`; negative when the",
        "heuristic's plan is better (the exact solver is exact for its per-case model, see",
        "`layers/orchestration/planning/exact.py`). Latency is wall time of `placement.plan(...,",
        "solver=\"heuristic\")` including candidate filtering; CPU time is the planning process's own.",
        f"Machine: {machine['cpus']} CPUs shared with other work, 1-minute load average {machine['load_average_1m']}",
        "when the run ended: wall time is inflated by waiting for a core, CPU time is not.",
        "",
    ])


def example_world() -> tuple[list[ClusterOffer], list[WanLink]]:
    """Two well-linked European sites with H100s, and the cheapest TFLOPs in Mumbai behind a 1 Gbps link."""
    def cluster(name: str, site: str, region: str, model: str, tflops: float, gpus: int, price: str,
                fabric: float) -> ClusterOffer:
        return ClusterOffer(name=name, site=site, region=region, provider="example", gpu_model=model, tflops=tflops,
                            memory_gb=80, free_gpus=gpus, price_per_gpu_hour=Decimal(price), intra_node_gbps=600.0,
                            inter_node_gbps=fabric, gpus_per_node=8)

    offers = [
        cluster("fra-h100", "fra", "eu-central", "H100", 989.0, 64, "2.60", 400.0),
        cluster("ams-h100", "ams", "eu-west", "H100", 989.0, 64, "2.45", 400.0),
        cluster("bom-a100", "bom", "ap-southeast", "A100", 312.0, 64, "0.75", 200.0),
    ]
    links = [
        WanLink("ams", "fra", 100.0, 8.0, Decimal("0.02")),
        WanLink("bom", "fra", 1.0, 120.0, Decimal("0.08")),
        WanLink("ams", "bom", 1.0, 125.0, Decimal("0.08")),
    ]
    return offers, links


EXAMPLE_JOB = JobRequirements(model=ModelShape(parameters=7_000_000_000, layers=32, hidden=4096, seq_len=4096),
                              tokens=140_000_000_000, global_batch_tokens=4_194_304, gpus_min=128, gpus_max=128)
EXAMPLE_OBJECTIVE = Objective(cost=0.5, time=0.5)


def cheapest_first(req: JobRequirements, offers: list[ClusterOffer], links: list[WanLink], objective: Objective,
                   strategy: str = "hierarchical") -> placement.Plan:
    """The naive baseline: gpus_min GPUs in ascending price per effective TFLOP, wherever they are."""
    problem = placement.build_problem(req, offers, links, objective)
    order = np.argsort(problem.price / problem.eff, kind="stable")
    units = np.repeat(order, problem.free[order])[: problem.gpus_min]
    ids, counts = np.unique(units, return_counts=True)
    found = problem.evaluate(dict(zip(ids.tolist(), counts.tolist(), strict=True)), strategy, "cheapest-first")
    if found is None:
        raise Infeasible("the cheapest-first placement breaks a constraint")
    return found


def worked_example() -> dict[str, Any]:
    offers, links = example_world()
    chosen = placement.plan(EXAMPLE_JOB, offers, links, EXAMPLE_OBJECTIVE, solver="exact")
    rows = {"planner": chosen}
    for strategy in ("hierarchical", "diloco"):
        rows[f"cheapest GPUs first, {strategy}"] = cheapest_first(EXAMPLE_JOB, offers, links, EXAMPLE_OBJECTIVE,
                                                                  strategy)
    return {label: {"assignments": {a.cluster: a.gpus for a in p.assignments}, "strategy": p.strategy,
                    "hours": round(p.prediction.total_seconds / 3600, 2), "cost": round(p.prediction.est_cost, 2),
                    "wan_tb": round(p.prediction.wan_bytes / 1e12, 2), "objective": round(p.objective_value, 4)}
            for label, p in rows.items()}
