"""Charges are bounded by what the server itself saw (issue 35, C1/H3/H4; issue 36, item 4): a
sub-task's GPU time by its GPUs x the time since its claim, a job's charges by its budget (or its
quote plus a stated tolerance), figures no worker sends are refused with a 422 naming them, a job
that trained nothing does not succeed, and an attempt that never formed is not charged."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

from sqlalchemy import select

from layers.orchestration.lifecycle import metering
from layers.orchestration.lifecycle.models import MetricRow, SubtaskRow
from layers.service.models import ContractRow
from tests.api.billing_helpers import _job_of, claim, events, invoice, post_metrics, report, started
from tests.layers.orchestration.test_reconciler import _accept, _reconciler, _world


def _gpu_hours(inv: dict) -> Decimal:
    return sum((Decimal(x["quantity"]) for x in inv["lines"] if x["item"] == "gpu-hours"), Decimal(0))


def _reason(job) -> str:  # type: ignore[no-untyped-def]
    return next(c["reason"] for c in job.status["conditions"] if c["type"] == job.phase)


async def _unit_price(db, name: str, cluster: str) -> Decimal:  # type: ignore[no-untyped-def]
    job = await _job_of(db, name)
    return next(Decimal(q["unitPrice"]) for q in job.status["quoteLines"]
                if q["item"] == "gpu-hours" and q["cluster"] == cluster)


async def test_a_forged_gpu_seconds_is_capped_by_the_time_the_server_saw(api, db) -> None:  # type: ignore[no-untyped-def]
    """The probe's figure: 360,000,000 gpuSeconds from a worker token billed 100,000 USD. The server saw
    the sub-task claimed 60 s ago on one GPU: at most those 60 s are billed, before and after it ends."""
    await _world(api)
    contract = await started(api, db, "forged", ago=60)
    claimed = datetime.now(UTC) - timedelta(seconds=60)
    resp = await post_metrics(api, contract["worker_token"], "forged", [
        {"rank": 0, "site": contract["site_index"], "step": 1, "tokens": 1024, "gpuSeconds": 360_000_000}])
    assert resp.status == 200, await resp.text()
    await report(api, contract, "Succeeded")
    await _reconciler(db, 3600).reconcile_once()
    assert (await _job_of(db, "forged")).phase == "Succeeded"
    seen = Decimal((datetime.now(UTC) - claimed).total_seconds() + 1)
    inv = await invoice(api, "forged")
    price = await _unit_price(db, "forged", contract["cluster"])
    assert Decimal(0) < _gpu_hours(inv) <= seen / 3600, inv  # 1 GPU x the seconds since the claim
    assert Decimal(inv["subtotal"]) <= seen / 3600 * price + Decimal("0.000001"), (inv, price)


async def test_nan_infinity_and_negative_figures_are_refused_and_the_job_can_still_be_cancelled(api, db) -> None:  # type: ignore[no-untyped-def]
    """H4: one NaN gpuSeconds was stored as null; every later report and the cancel answered 500."""
    await _world(api)
    contract = await started(api, db, "nan", ago=30)
    token, site = contract["worker_token"], contract["site_index"]
    for field, value in (("gpuSeconds", float("nan")), ("wallSeconds", float("inf")), ("wanBytes", -1.0),
                         ("tokens", -5)):
        resp = await post_metrics(api, token, "nan", [{"rank": 0, "site": site, "step": 1, "tokens": 1},
                                                      {"rank": 0, "site": site, "step": 2, "tokens": 2, field: value}])
        assert resp.status == 422, (field, resp.status, await resp.text())
        assert f"reports[1].{field}" in await resp.text(), await resp.text()
    resp = await post_metrics(api, token, "nan", [{"rank": 0, "site": site, "step": 3, "tokens": 3, "gpuSeconds": 5.0}])
    assert resp.status == 200 and (await resp.json())["accepted"] == 1, await resp.text()
    # a diverged run's loss is no bill's figure: kept as null, so the batch's GPU time is not lost with it
    resp = await post_metrics(api, token, "nan", [{"rank": 0, "site": site, "step": 4, "tokens": 4,
                                                   "gpuSeconds": 6.0, "trainLoss": float("nan")}])
    assert resp.status == 200 and (await resp.json())["accepted"] == 1, await resp.text()
    async with db.session() as s:
        losses = (await s.execute(select(MetricRow.train_loss).where(MetricRow.job == "alice/nan",
                                                                     MetricRow.step == 4))).scalars().all()
    assert losses == [None], losses
    resp = await api.client.post("/api/v1/jobs/nan/cancel", headers=api.auth("alice"))
    assert resp.status == 200, await resp.text()
    assert (await _job_of(db, "nan")).phase == "Cancelled"
    resp = await api.client.get("/api/v1/reservations?job=nan", headers=api.auth("alice"))
    assert all(r["status"]["state"] != "active" for r in (await resp.json())["items"])


async def test_charges_never_exceed_the_budget(api, db) -> None:  # type: ignore[no-untyped-def]
    await _world(api)
    contract = await started(api, db, "budgeted", ago=7200, budget="0.20")
    resp = await post_metrics(api, contract["worker_token"], "budgeted", [
        {"rank": 0, "site": contract["site_index"], "step": 1, "tokens": 1024, "gpuSeconds": 7000.0}])
    assert resp.status == 200, await resp.text()
    resp = await api.client.post("/api/v1/jobs/budgeted/cancel", headers=api.auth("alice"))  # settles the rest
    assert resp.status == 200, await resp.text()
    inv = await invoice(api, "budgeted")
    assert Decimal("0.19") <= Decimal(inv["subtotal"]) <= Decimal("0.20"), inv  # 2 h at list price: far more
    capped = [e for e in await events(api, "budgeted") if e["reason"] == "ChargesCapped"]
    assert len(capped) == 1 and "spec.budget" in capped[0]["message"], capped


async def test_without_a_budget_charges_stop_at_the_quote_plus_the_tolerance(api, db) -> None:  # type: ignore[no-untyped-def]
    await _world(api)
    contract = await started(api, db, "overrun", ago=7200)
    resp = await post_metrics(api, contract["worker_token"], "overrun", [
        {"rank": 0, "site": contract["site_index"], "step": 1, "tokens": 1024, "gpuSeconds": 7100.0}])
    assert resp.status == 200, await resp.text()
    async with db.session() as s:
        quoted = (await s.execute(select(ContractRow.quoted_total).where(ContractRow.job == "alice/overrun"))).scalar_one()
    ceiling = Decimal(quoted) + max(Decimal(quoted) * metering.QUOTE_TOLERANCE, metering.QUOTE_TOLERANCE_FLOOR)
    price = await _unit_price(db, "overrun", contract["cluster"])
    assert Decimal(7100) / 3600 * price > ceiling  # what the report asks for is past the ceiling
    inv = await invoice(api, "overrun")
    assert ceiling - Decimal("0.01") <= Decimal(inv["subtotal"]) <= ceiling, (inv, ceiling)


async def test_a_job_that_trained_nothing_fails_and_is_settled(api, db) -> None:  # type: ignore[no-untyped-def]
    """H3: code that reports no metrics and exits 0 ended Succeeded at 0 % with a 0.00 invoice."""
    await _world(api)
    contract = await started(api, db, "idle", ago=30)
    await report(api, contract, "Succeeded")
    await _reconciler(db, 3600).reconcile_once()
    job = await _job_of(db, "idle")
    assert (job.phase, _reason(job)) == ("Failed", "NothingTrained"), job.status
    assert "never reported a trained token" in job.status["message"]
    inv = await invoice(api, "idle")
    assert inv["contractState"] == "failed" and Decimal(29) / 3600 <= _gpu_hours(inv), inv  # the 30 s held


async def test_an_attempt_that_never_formed_is_not_charged(api, db) -> None:  # type: ignore[no-untyped-def]
    """Issue 36, item 4: two sites waited for a third that never claimed; the waiting peers ended
    Cancelled and were billed, and the event said "the job continues on the other sites"."""
    await _world(api)
    await _accept(api, "unformed", gpus={"min": 2, "max": 2}, sites={"min": 2, "max": 2})
    await _reconciler(db, 3600).reconcile_once()
    await claim(api, db, "unformed", ago=100)  # rank 0's site claimed, its workers wait at the rendezvous
    async with db.session() as s:  # the other site's agent died right after the accept
        other = (await s.execute(select(SubtaskRow).where(SubtaskRow.job == "alice/unformed",
                                                          SubtaskRow.first_rank != 0))).scalar_one()
        other.created_at = datetime.now(UTC) - timedelta(minutes=10)
    await _reconciler(db, 60).reconcile_once()  # the claim timeout: the world never met
    resp = await api.client.post("/api/v1/jobs/unformed/cancel", headers=api.auth("alice"))
    assert resp.status == 200, await resp.text()
    inv = await invoice(api, "unformed")
    assert Decimal(inv["subtotal"]) == 0 and not [x for x in inv["lines"] if Decimal(x["amount"]) > 0], inv
    [failed] = [e for e in await events(api, "unformed") if e["reason"] == "SiteFailed"]
    assert "never formed" in failed["message"] and "continues on the other sites" not in failed["message"], failed


async def test_a_re_placement_onto_a_dearer_cluster_fails_without_the_users_consent(api, db) -> None:  # type: ignore[no-untyped-def]
    """M1: attempt 2 moved to a cluster at a higher list price than the quote's, with nobody asked."""
    await _world(api)
    await _accept(api, "dearer", strategy="ddp")
    await _reconciler(db, 60).reconcile_once()
    async with db.session() as s:  # claimed ten minutes ago by an agent that then died
        row = (await s.execute(select(SubtaskRow).where(SubtaskRow.job == "alice/dearer"))).scalar_one()
        row.phase, row.claimed_at = "Launching", datetime.now(UTC) - timedelta(minutes=10)
    await _reconciler(db, 60).reconcile_once()
    job = await _job_of(db, "dearer")
    assert (job.phase, _reason(job)) == ("Failed", "PriceCapExceeded"), job.status
    assert "spec.maxPricePerGpuHour" in job.status["message"], job.status["message"]
    resp = await api.client.get("/api/v1/reservations?job=dearer", headers=api.auth("alice"))
    assert all(r["status"]["state"] != "active" for r in (await resp.json())["items"])
