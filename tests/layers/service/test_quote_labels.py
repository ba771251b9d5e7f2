"""Labels that are true (issue 32): over 200 generated worlds, each with a random job planned by the
real planner and priced by the real price lines, no quote labelled "fastest" is slower than another
offer of the job, none labelled "cheapest" is dearer, and "balanced" is never slower and dearer than
another offer."""

from __future__ import annotations

import random
from datetime import timedelta
from decimal import Decimal

import pytest

from cpn.core.errors import Infeasible
from layers.orchestration.jobs.workflow import solver_for
from layers.orchestration.planning import bench, placement
from layers.service import pricing
from layers.service.quotes import new_quote, true_labels

WORLDS = 200


def priced(plans: dict, offers: list, links: list) -> list:
    """The planner's labelled plans as the workflow prices them (GPU-hours and egress lines, the total
    rounded once to the cent)."""
    sellers = {o.name: pricing.Seller(provider=o.provider or "p", provider_account_id=o.provider or "p", site=o.site,
                                      price_per_gpu_hour=o.price_per_gpu_hour, currency=o.currency) for o in offers}
    link_prices = {frozenset((ln.a, ln.b)): ln.price_per_gb for ln in links}
    rows = []
    for label, plan in plans.items():
        pred = plan.prediction
        lines = pricing.price_lines(pred.gpu_seconds_by_cluster, pred.egress_bytes_by_link, sellers, link_prices)
        rows.append(new_quote(None, label, placement=[{"cluster": a.cluster, "gpus": a.gpus} for a in plan.assignments],
                              strategy=plan.strategy, ring=plan.ring, prediction={}, predicted_seconds=pred.total_seconds,
                              wan_gb=pred.wan_bytes / 1e9, lines=lines, total=pricing.total(lines), currency="USD",
                              ttl=timedelta(minutes=5)))
    return rows


def untrue(rows: list) -> list[str]:
    """What a user would be misled by: a label its offer does not deserve."""
    found = []
    for q in rows:
        for o in rows:
            if q.label == "fastest" and o.predicted_seconds < q.predicted_seconds:
                found.append(f"fastest {q.predicted_seconds:.0f} s, {o.label} {o.predicted_seconds:.0f} s")
            if q.label == "cheapest" and o.total < q.total:
                found.append(f"cheapest {q.total}, {o.label} {o.total}")
            if (o.total <= q.total and o.predicted_seconds <= q.predicted_seconds
                    and (o.total < q.total or o.predicted_seconds < q.predicted_seconds)):
                found.append(f"{q.label} ({q.total}, {q.predicted_seconds:.0f} s) dominated by {o.label} "
                             f"({o.total}, {o.predicted_seconds:.0f} s)")
    return found


@pytest.mark.slow
def test_no_label_lies_over_200_generated_worlds() -> None:
    rng = random.Random(32)
    checked, misled_before, seed = 0, 0, 0
    while checked < WORLDS:
        seed += 1
        assert seed < 4 * WORLDS, f"only {checked} feasible worlds in {seed} tries"
        # catalogues past workflow.EXACT_MAX_OFFERS, planned by the heuristic as the API plans them
        offers, links = bench.world(rng.randint(3, 8), rng.randint(13, 30), seed)
        req, objective = bench.random_job(rng, offers)
        try:
            plans = placement.quote_options(req, offers, links, objective, solver=solver_for(len(offers)))
        except Infeasible:
            continue
        rows = priced(plans, offers, links)
        misled_before += bool(untrue(rows))
        labelled = true_labels(rows)
        assert [q.label for q in labelled] == [q.label for q in rows]
        assert not untrue(labelled), (seed, untrue(labelled))
        # relabelling only ever moves labels between the job's own offers
        offered = {(q.total, q.predicted_seconds, q.strategy) for q in rows}
        assert {(q.total, q.predicted_seconds, q.strategy) for q in labelled} <= offered
        checked += 1
    print(f"{checked} worlds; the planner's own labels misled in {misled_before}")


def test_the_issue_s_offers_are_relabelled() -> None:
    """The issue's numbers: fastest 7 min 9 s at 0.29 USD against balanced 6 min 38 s at 0.10 USD."""
    def quote(label: str, seconds: float, total: str):  # type: ignore[no-untyped-def]
        return new_quote(None, label, placement=[{"cluster": label, "gpus": 1}], strategy="ddp", ring=[],
                         prediction={}, predicted_seconds=seconds, wan_gb=0.0, lines=[], total=Decimal(total),
                         currency="USD", ttl=timedelta(minutes=5))

    rows = [quote("cheapest", 500, "0.08"), quote("fastest", 429, "0.29"), quote("balanced", 398, "0.10")]
    out = {q.label: q for q in true_labels(rows)}
    assert (out["fastest"].predicted_seconds, out["fastest"].total) == (398, Decimal("0.10"))
    assert out["fastest"].placement == [{"cluster": "balanced", "gpus": 1}] and out["fastest"].expires_at == rows[2].expires_at
    assert out["cheapest"] is rows[0] and out["balanced"] is rows[2]
    # a dominated balanced gives way to the offer that is cheaper and faster
    rows = [quote("cheapest", 300, "0.05"), quote("fastest", 200, "0.50"), quote("balanced", 400, "0.20")]
    out = {q.label: q for q in true_labels(rows)}
    assert (out["balanced"].predicted_seconds, out["balanced"].total) == (300, Decimal("0.05"))
    assert true_labels([]) == []
