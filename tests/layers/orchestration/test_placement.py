"""Placement: constraints, infeasibility messages, solver agreement, quotes and the worked example."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from decimal import Decimal

import pytest

from cpn.core.errors import Infeasible
from layers.orchestration.planning import bench, exact, heuristic, placement
from layers.orchestration.planning.types import ClusterOffer, JobRequirements, ModelShape, Objective, WanLink

BALANCED = Objective(cost=0.5, time=0.5)


def offer(name: str, site: str, region: str, model: str = "H100", gpus: int = 32, price: str = "2.50",
          tflops: float | None = None) -> ClusterOffer:
    peak = tflops or {"H100": 989.0, "A100": 312.0, "L40S": 362.0}[model]
    return ClusterOffer(name=name, site=site, region=region, provider="p", gpu_model=model, tflops=peak,
                        memory_gb=80, free_gpus=gpus, price_per_gpu_hour=Decimal(price), inter_node_gbps=200.0)


OFFERS = [
    offer("par-h100", "par", "eu-west", "H100", 48, "2.40"),
    offer("ams-h100", "ams", "eu-west", "H100", 32, "2.70"),
    offer("ams-a100", "ams", "eu-west", "A100", 64, "1.10"),
    offer("iad-h100", "iad", "us-east", "H100", 64, "2.10"),
]
LINKS = [
    WanLink("ams", "par", 100.0, 9.0, Decimal("0.02")),
    WanLink("iad", "par", 10.0, 80.0, Decimal("0.05")),
    WanLink("ams", "iad", 5.0, 85.0, Decimal("0.05")),
]


def job(**kw) -> JobRequirements:
    base = {"model": ModelShape(7_000_000_000, 32, 4096, 4096), "tokens": 20_000_000_000,
            "global_batch_tokens": 4_194_304}
    return JobRequirements(**{**base, **kw})


@pytest.fixture(params=["heuristic", "exact"])
def solver(request) -> str:
    return request.param


def test_placement_respects_models_regions_sites_and_exclusions(solver):
    req = job(gpu_models=frozenset({"H100"}), regions=frozenset({"eu-west"}), exclude_sites=frozenset({"par"}))
    plan = placement.plan(req, OFFERS, LINKS, BALANCED, solver)
    assert {a.cluster for a in plan.assignments} == {"ams-h100"}
    plan = placement.plan(job(sites=frozenset({"iad"})), OFFERS, LINKS, BALANCED, solver)
    assert {a.site for a in plan.assignments} == {"iad"}


def test_placement_respects_gpu_and_site_bounds(solver):
    plan = placement.plan(job(gpus_min=100, gpus_max=120, sites_max=2), OFFERS, LINKS, BALANCED, solver)
    assert 100 <= sum(a.gpus for a in plan.assignments) <= 120
    assert len({a.site for a in plan.assignments}) == 2 == len(plan.ring)
    plan = placement.plan(job(gpus_max=8, sites_min=2), OFFERS, LINKS, BALANCED, solver)
    assert sum(a.gpus for a in plan.assignments) <= 8 and len({a.site for a in plan.assignments}) >= 2


def test_deadline_and_budget_are_met():
    free = placement.plan(job(), OFFERS, LINKS, Objective(cost=1.0, time=0.0), "heuristic")
    deadline = free.prediction.total_seconds / 2
    fast = placement.plan(job(deadline_seconds=deadline), OFFERS, LINKS, Objective(cost=1.0, time=0.0), "heuristic")
    assert fast.prediction.total_seconds <= deadline
    quick = placement.plan(job(), OFFERS, LINKS, Objective(cost=0.0, time=1.0), "heuristic")
    budget = Decimal(str(round(quick.prediction.est_cost * 0.8, 2)))
    cheap = placement.plan(job(budget=budget), OFFERS, LINKS, Objective(cost=0.0, time=1.0), "heuristic")
    assert cheap.prediction.est_cost <= float(budget)


@pytest.mark.parametrize(("req", "field", "text"), [
    (job(gpu_models=frozenset({"H100"}), regions=frozenset({"eu-west"}), gpus_min=200), "spec.gpus.min",
     "No placement has 200 H100 GPUs free in regions [eu-west]; at most 80 are"),
    (job(gpu_models=frozenset({"B200"})), "spec.gpus.models", "no clusters offer GPU models [B200]"),
    (job(regions=frozenset({"ap-south"})), "spec.placement.regions", "no clusters in regions [ap-south]"),
    # a new user's placement: the field named is the one written, and 'outside' reads as English
    (job(sites=frozenset({"nosuch"})), "spec.placement.sites", "no clusters at sites [nosuch]"),
    (job(exclude_sites=frozenset({"ams", "par", "fra", "iad", "sfo", "lon", "waw"})), "spec.placement.excludeSites",
     "no clusters outside sites [ams, fra, iad, lon, par, sfo, waw]"),
    (job(sites=frozenset({"par"}), sites_min=2), "spec.sites.min", "spans 2 sites with free GPUs at sites [par]; at most 1 does"),
    (job(deadline_seconds=3600), "spec.deadline", "the deadline allows 1 h 00 min"),
    (job(budget=Decimal("100")), "spec.budget", "budget is 100 USD"),
])
def test_infeasible_names_the_binding_constraint(req, field, text):
    with pytest.raises(Infeasible) as caught:
        placement.plan(req, OFFERS, LINKS, BALANCED, "heuristic")
    assert caught.value.field == field
    assert text in caught.value.message


def test_deadline_message_gives_the_fastest_time():
    with pytest.raises(Infeasible, match=r"fastest feasible placement needs \d+ (h|d) \d+ (min|h), the deadline allows 1 h 00 min$"):
        placement.plan(job(deadline_seconds=3600), OFFERS, LINKS, BALANCED, "heuristic")


def test_auto_strategy_follows_the_links():
    fat = placement.plan(job(sites=frozenset({"ams", "par"}), sites_min=2), OFFERS, LINKS,
                         Objective(cost=0.0, time=1.0), "heuristic")
    thin = placement.plan(job(sites=frozenset({"ams", "iad"}), sites_min=2), OFFERS, LINKS,
                          Objective(cost=0.0, time=1.0), "heuristic")
    assert fat.strategy in ("hierarchical", "diloco") and thin.strategy == "diloco"
    pinned = placement.plan(job(strategy="hierarchical", sites_min=2), OFFERS, LINKS, BALANCED, "heuristic")
    assert pinned.strategy == "hierarchical"


def test_quotes_trade_cost_against_time():
    quotes = placement.quote_options(job(), OFFERS, LINKS, BALANCED, "heuristic")
    assert list(quotes) == ["cheapest", "fastest", "balanced"]
    cheapest, fastest, balanced = (quotes[k].prediction for k in ("cheapest", "fastest", "balanced"))
    assert cheapest.est_cost <= balanced.est_cost <= fastest.est_cost
    assert cheapest.total_seconds >= balanced.total_seconds >= fastest.total_seconds


def test_heuristic_is_close_to_exact_on_small_random_catalogues():
    rng = random.Random(5)
    for seed in range(3):
        offers, links = bench.world(3, 7, seed)
        req, objective = bench.random_job(rng, offers)
        problem = placement.build_problem(replace(req, gpus_min=8), offers, links, objective)
        fast = heuristic.solve(problem)
        best = exact.solve(problem, incumbent=fast)  # only cases that could beat the heuristic
        assert fast is not None and best is not None
        assert fast.objective_value <= best.objective_value * 1.03


def test_worked_example_beats_cheapest_gpus_first():
    rows = bench.worked_example()
    planner = rows["planner"]
    assert planner["strategy"] == "diloco" and "bom-a100" not in planner["assignments"]
    for label in ("cheapest GPUs first, hierarchical", "cheapest GPUs first, diloco"):
        assert "bom-a100" in rows[label]["assignments"]
        assert planner["objective"] < rows[label]["objective"]


def test_offers_from_manifests_splits_node_pools():
    docs = [
        {"kind": "Site", "metadata": {"name": "s1"}, "spec": {"region": "eu"}},
        {"kind": "Cluster", "metadata": {"name": "c1", "labels": {"cpn.io/provider": "acme"}},
         "spec": {"site": "s1", "interconnect": {"intraNodeGbps": 900, "interNodeGbps": 400}, "nodePools": [
             {"name": "big", "gpu": {"model": "H100", "memoryGB": 80, "tflops": 989}, "gpusPerNode": 8,
              "nodes": 2, "pricePerGpuHour": "2.5"},
             {"name": "small", "gpu": {"model": "L40S", "memoryGB": 48, "tflops": 362}, "gpusPerNode": 4,
              "nodes": 1, "pricePerGpuHour": "0.9"}]}},
        {"kind": "Link", "metadata": {"name": "l"}, "spec": {"a": "s1", "b": "s2", "bandwidthGbps": 10,
                                                             "rttMs": 20, "pricePerGB": "0.02"}},
    ]
    offers, links = bench.offers_from_manifests(docs)
    assert [(o.name, o.free_gpus, o.region, o.provider) for o in offers] == [
        ("c1/big", 16, "eu", "acme"), ("c1/small", 4, "eu", "acme")]
    assert offers[0].price_per_gpu_hour == Decimal("2.5") and offers[0].inter_node_gbps == 400
    assert links == [WanLink("s1", "s2", 10.0, 20.0, Decimal("0.02"))]


def test_bench_scheduler_command_writes_the_report(tmp_path):
    from click.testing import CliRunner

    from cpn.cli.bench import bench_scheduler_cmd

    args = ["--clusters", "20", "--links", "10", "--jobs", "1", "--instances", "1", "--gap-clusters", "3",
            "--json", "--out", str(tmp_path)]
    result = CliRunner().invoke(bench_scheduler_cmd, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["gap"]["instances"] == 1 and set(report["latency_ms"]) == {"p50", "p95", "p99"}
    assert json.loads((tmp_path / "scheduler.json").read_text())["command"].startswith("cpn bench scheduler")
    assert "heuristic gap vs exact" in (tmp_path / "scheduler.md").read_text()


def test_a_model_that_fits_no_offered_gpu_is_refused_with_the_figures():
    """70 B parameters sharded over the 8 GPUs the job may use: 16 B x 70e9 / 8 = 140 GB of state, plus
    one block's gathered buffers (8 B x 805 M), one sequence's checkpointed activations (2 x 8192 x 80 x
    4096 + 34 x 8192 x 4096 B) and 1 GB for the runtime: 154.0 GB, above every 80 GB GPU."""
    huge = job(model=ModelShape(70_000_000_000, 80, 8192, 4096), gpus_max=8)
    with pytest.raises(Infeasible) as caught:
        placement.plan(huge, OFFERS, LINKS, BALANCED, "heuristic")
    assert caught.value.field == "spec.model"
    assert "needs at least 154.0 GB per GPU" in caught.value.message
    assert "sharded over the 8 GPUs of a site" in caught.value.message and "has 80 GB" in caught.value.message
    # with every GPU it may use, the same model is sharded over each site's GPUs and fits
    fits = placement.plan(replace(huge, gpus_max=None), OFFERS, LINKS, BALANCED, "heuristic")
    assert fits.prediction.shard == "site" and fits.prediction.memory_gb_per_gpu <= 80


def test_offers_too_small_for_the_model_are_left_out():
    """Even sharded over 512 of them, a 4 GB GPU cannot hold one sequence's checkpointed activations of
    a 7 B model besides a block's gathered parameters and the runtime's own gigabyte."""
    small_gpus = [*OFFERS, ClusterOffer(name="cheap-4g", site="par", region="eu-west", provider="p",
                                        gpu_model="RTX4090", tflops=165.0, memory_gb=4, free_gpus=512,
                                        price_per_gpu_hour=Decimal("0.10"))]
    plan = placement.plan(job(), small_gpus, LINKS, Objective(cost=1.0, time=0.0), "heuristic")
    assert "cheap-4g" not in {a.cluster for a in plan.assignments}


@pytest.mark.parametrize("weights", [(1e308, 1.0), (1.0, 1e308)])
def test_weights_no_placement_can_score_with_are_named_not_a_crash(weights):
    """Found by the seeded fuzz: objective weights near the float limit overflow every score (inf, then
    NaN), the solver keeps nothing, and the diagnosis, which assumed a deadline and a budget were set,
    divided None. The API bounds the weights (spec.objective.*, at most 1e6); the planner names them."""
    cost, time = weights
    try:
        placement.plan(job(), OFFERS, LINKS, Objective(cost=cost, time=time), "heuristic")
    except Infeasible as exc:
        assert exc.field == "spec.objective" and "objective weights" in exc.message, exc
