"""Money after a re-placement and across providers: every cluster a job ran on is billed at a defined
price (a cluster the quote never named: at its list price when the re-placement was written), and its
provider sees the job; the providers' payouts add up to the user's total to the cent; an invoice
line's amount is its quantity × unit price as shown; unit prices read the same on quotes and invoices."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal

from sqlalchemy import select

from layers.orchestration.lifecycle import metering
from layers.orchestration.lifecycle.models import SubtaskRow
from layers.service import billing
from layers.service.contracts import contract_of
from layers.service.models import JobRow
from tests.api.test_money import _invoice, _running
from tests.layers.orchestration.test_reconciler import _accept, _job_of, _reconciler, _world

MICRO = Decimal("0.000001")


async def _payouts(api, token: str, job: str) -> list[dict]:  # type: ignore[no-untyped-def]
    resp = await api.client.get("/api/v1/invoices", headers=api.auth(token))
    assert resp.status == 200, await resp.text()
    return [i["status"] for i in (await resp.json())["items"] if i["spec"]["job"] == job]


async def _ingest(db, name: str, attempt: int, **report: float) -> None:  # type: ignore[no-untyped-def]
    async with db.session() as s:
        job = (await s.execute(select(JobRow).where(JobRow.name == f"alice/{name}").with_for_update())).scalar_one()
        t = (await s.execute(select(SubtaskRow).where(SubtaskRow.job == job.name,
                                                      SubtaskRow.attempt == attempt))).scalar_one()
        await metering.ingest(s, job, await contract_of(s, job),
                              [{"rank": t.first_rank, "site": t.site_index, "step": 1, **report}])


async def test_work_after_a_re_placement_is_billed_at_the_new_clusters_list_price(api, db) -> None:  # type: ignore[no-untyped-def]
    """The reported defect: a job re-placed off a dead agent's cluster onto one its quote never named ran
    there and billed nothing (lines [], total 0.00), and that cluster's provider never saw the job."""
    await _world(api)
    await _accept(api, "moved", strategy="ddp", maxPricePerGpuHour="1.00")  # consents to a dearer cluster
    quoted = await _job_of(db, "moved")
    first = quoted.status["placement"][0]["cluster"]
    await _reconciler(db, 60).reconcile_once()
    async with db.session() as s:  # claimed ten minutes ago by an agent that then died
        row = (await s.execute(select(SubtaskRow).where(SubtaskRow.job == "alice/moved"))).scalar_one()
        row.phase, row.claimed_at = "Launching", datetime.now(UTC) - timedelta(minutes=10)
    await _reconciler(db, 60).reconcile_once()  # the claim timeout: attempt 1 lost, re-placed
    await _reconciler(db, 3600).reconcile_once()
    job = await _job_of(db, "moved")
    moved_to = job.status["placement"][0]["cluster"]
    assert job.status["attempt"] == 2 and moved_to != first, job.status
    assert moved_to not in {q["cluster"] for q in job.status["quoteLines"]}
    resp = await api.client.get("/api/v1/clusters", headers=api.auth("alice"))
    listed = {c["metadata"]["name"]: c["spec"]["nodePools"][0]["pricePerGpuHour"] for c in (await resp.json())["items"]}
    price = Decimal(str(listed[moved_to]))
    async with db.session() as s:
        t = (await s.execute(select(SubtaskRow).where(SubtaskRow.job == "alice/moved",
                                                      SubtaskRow.attempt == 2))).scalar_one()
        t.phase = t.reported = "Running"
        t.launched_at = datetime.now(UTC) - timedelta(seconds=30)  # claimed 30 s ago: 16 s fit in it
    await _ingest(db, "moved", 2, gpuSeconds=16.0, wallSeconds=15.0)
    inv = await _invoice(api, "moved")
    [line] = inv["lines"]
    hours = (Decimal(16) / Decimal(3600)).quantize(MICRO, rounding=ROUND_HALF_UP)
    assert (line["cluster"], line["item"], Decimal(line["unitPrice"]), Decimal(line["quantity"])) == \
        (moved_to, "gpu-hours", price, hours), line  # at the list price the re-placement found
    assert Decimal(line["amount"]) == (hours * price).quantize(MICRO, rounding=ROUND_HALF_UP) > 0
    assert line["provider"] == "prov-a"  # ams-1's, where the quote (nyc-1, prov-b) never had a line
    [payout] = await _payouts(api, "prov-a", "alice/moved")  # the new cluster's provider sees the job
    assert payout["lines"] == inv["lines"] and payout["total"] == inv["total"]
    [repriced] = [x for x in job.status["repricedLines"] if x["item"] == "gpu-hours"]
    assert (repriced["cluster"], repriced["unitPrice"], repriced["attempt"]) == (moved_to, line["unitPrice"], 2)


async def test_providers_payouts_add_up_to_the_users_total(api, db) -> None:  # type: ignore[no-untyped-def]
    """The reported figures: lines of 0.011331 (one provider) and 0.004934 (another) invoice 0.02; each
    view rounding its own total paid the providers 0.01 + 0.00. Largest remainder pays 0.01 + 0.01."""
    await _world(api)
    await _accept(api, "split", strategy="ddp")
    async with db.session() as s:
        job = (await s.execute(select(JobRow).where(JobRow.name == "alice/split"))).scalar_one()
        contract = await contract_of(s, job)
        assert contract is not None
        sellers = await metering._sellers(s, {"ams-1-cpu", "nyc-1-cpu"})
        for cluster, hours, price in (("ams-1-cpu", "0.018885", "0.60"), ("nyc-1-cpu", "0.010964", "0.45")):
            provider, account = sellers[cluster]
            billing.post(s, contract, provider=provider, provider_account_id=account, cluster=cluster,
                         item="gpu-hours", quantity=Decimal(hours), unit_price=Decimal(price))
    inv = await _invoice(api, "split")
    assert [x["amount"] for x in inv["lines"]] == ["0.011331", "0.004934"]
    assert (inv["subtotal"], inv["total"]) == ("0.016265", "0.02")
    a, b = (await _payouts(api, "prov-a", "alice/split"))[0], (await _payouts(api, "prov-b", "alice/split"))[0]
    assert (a["subtotal"], b["subtotal"]) == ("0.011331", "0.004934")  # each sees its own lines only
    assert Decimal(a["total"]) + Decimal(b["total"]) == Decimal(inv["total"]), (a["total"], b["total"])
    assert (a["total"], b["total"]) == ("0.01", "0.01")  # the left-over cent to the larger remainder
    assert sorted((p["provider"], p["total"]) for p in inv["providers"]) == [("prov-a", "0.01"), ("prov-b", "0.01")]


async def test_a_lines_amount_is_its_quantity_times_its_unit_price_as_shown(api, db) -> None:  # type: ignore[no-untyped-def]
    """1.3 s at 0.45/h: the exact hours (0.000361111…) × 0.45 round to 0.000163, but the line shows
    0.000361 × 0.45 = 0.000162; and the invoice showed the ledger's '0.450000' where the quote said '0.45'."""
    await _world(api)
    t = await _running(api, db, "exact", launched_ago=10)
    await _ingest(db, "exact", t.attempt, gpuSeconds=1.3)
    job = await _job_of(db, "exact")
    quoted = {q["cluster"]: q["unitPrice"] for q in job.status["quoteLines"] if q["item"] == "gpu-hours"}
    [line] = (await _invoice(api, "exact"))["lines"]
    assert line["unitPrice"] == quoted[line["cluster"]] == "0.45", (line, quoted)
    assert line["quantity"] == "0.000361"
    assert Decimal(line["amount"]) == (Decimal(line["quantity"]) * Decimal(line["unitPrice"])).quantize(
        MICRO, rounding=ROUND_HALF_UP) == Decimal("0.000162"), line
