"""Placement with a Dataset: copies priced over the cheapest link path, their wait in the time, a
preference for sites that hold a replica, and residency."""

from __future__ import annotations

from dataclasses import replace
from decimal import Decimal

import pytest

from cpn.core.errors import Infeasible
from layers.orchestration.planning import data, placement
from layers.orchestration.planning.types import DataMove, DataNeed, WanLink
from tests.layers.orchestration.test_placement import BALANCED, job, offer

TWINS = [offer("par-h100", "par", "eu-west", "H100", 16, "2.00"), offer("ams-h100", "ams", "eu-west", "H100", 16, "2.00")]
LINKS = [WanLink("ams", "par", 10.0, 9.0, Decimal("0.02")), WanLink("fra", "ams", 40.0, 5.0, Decimal("0.03")),
         WanLink("fra", "par", 2.0, 5.0, Decimal("0.01"))]


@pytest.fixture(params=["heuristic", "exact", "auto"])
def solver(request) -> str:  # type: ignore[no-untyped-def]
    return request.param


def need(*replicas: str, size: float = 200.0, regions: frozenset[str] | None = None) -> DataNeed:
    return DataNeed(name="corpus", size_gb=size, replicas=frozenset(replicas), regions=regions)


def test_routes_take_the_cheapest_path_and_its_slowest_hop() -> None:
    routes = data.routes(need("fra"), ["par", "ams", "fra", "nyc"], LINKS)
    assert routes["fra"] is None  # a replica: no copy
    assert routes["par"] == DataMove(source="fra", gb=200.0, price_per_gb=Decimal("0.01"), seconds=800.0)
    # fra → ams directly costs 0.03; fra → par → ams 0.03 as well: the fewer hops win, at 40 Gbps
    assert routes["ams"] == DataMove(source="fra", gb=200.0, price_per_gb=Decimal("0.03"), seconds=40.0)
    assert routes["nyc"] == DataMove(source=None, gb=200.0, price_per_gb=data.DEFAULT_PRICE_PER_GB,
                                          seconds=200.0 * 8 / data.DEFAULT_GBPS)


def test_between_equal_sites_the_one_holding_the_data_wins(solver: str) -> None:
    req = job(gpus_min=8, gpus_max=8, sites_max=1, tokens=2_000_000_000)
    for holder in ("par", "ams"):
        plan = placement.plan(replace(req, data=need(holder)), TWINS, LINKS, BALANCED, solver)
        assert {a.site for a in plan.assignments} == {holder}, (solver, holder)
        assert plan.prediction.data_moves == {} and plan.prediction.data_seconds == 0.0


def test_a_copy_adds_its_wait_to_the_time_and_the_gpu_hours_and_its_price_to_the_cost() -> None:
    req = job(gpus_min=8, gpus_max=8, sites=frozenset({"par"}), tokens=2_000_000_000)
    bare = placement.plan(req, TWINS, LINKS, BALANCED, "heuristic")
    moved = placement.plan(replace(req, data=need("ams")), TWINS, LINKS, BALANCED, "heuristic")
    wait = 200 * 8 / 10.0  # 200 GB over the 10 Gbps ams-par link
    assert moved.prediction.data_seconds == pytest.approx(wait)
    assert moved.prediction.total_seconds == pytest.approx(bare.prediction.total_seconds + wait)
    assert moved.prediction.gpu_seconds_by_cluster["par-h100"] == pytest.approx(
        bare.prediction.gpu_seconds_by_cluster["par-h100"] + 8 * wait)
    extra = 8 * wait / 3600 * 2.00 + 200 * 0.02
    assert moved.prediction.est_cost == pytest.approx(bare.prediction.est_cost + extra)
    assert moved.prediction.data_moves["par"].source == "ams"


def test_residency_keeps_the_job_inside_the_regions_or_names_spec_dataset(solver: str) -> None:
    offers = [*TWINS, offer("iad-h100", "iad", "us-east", "H100", 64, "1.00")]
    links = [*LINKS, WanLink("iad", "par", 10.0, 80.0, Decimal("0.05"))]
    req = job(gpus_min=8, gpus_max=8, tokens=2_000_000_000)
    assert {a.site for a in placement.plan(req, offers, links, BALANCED, solver).assignments} == {"iad"}
    resident = replace(req, data=need("iad", size=1.0, regions=frozenset({"eu-west"})))
    assert {a.site for a in placement.plan(resident, offers, links, BALANCED, solver).assignments} <= {"par", "ams"}
    with pytest.raises(Infeasible) as err:
        placement.plan(replace(req, data=need("iad", regions=frozenset({"ap-south"}))), offers, links, BALANCED, solver)
    assert err.value.field == "spec.dataset" and "ap-south" in err.value.message
