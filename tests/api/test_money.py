"""Exact money: the ledger keeps 6 decimal places and the invoice total is rounded once; a cancelled
job pays for the work done and gets an invoice; a provider prices only its own egress."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal

from sqlalchemy import select

from layers.orchestration.lifecycle import metering
from layers.orchestration.lifecycle.models import SubtaskRow
from layers.service.contracts import contract_of
from layers.service.models import JobRow, LedgerEntry
from tests.api.test_resource import link
from tests.layers.orchestration.test_reconciler import _accept, _reconciler, _world

CENT, MICRO = Decimal("0.01"), Decimal("0.000001")


async def _running(api, db, name: str, launched_ago: float = 0.0) -> SubtaskRow:  # type: ignore[no-untyped-def]
    await _accept(api, name, strategy="ddp")
    await _reconciler(db, 3600).reconcile_once()
    async with db.session() as s:
        row = (await s.execute(select(SubtaskRow).where(SubtaskRow.job == f"alice/{name}"))).scalar_one()
        row.phase = row.reported = "Running"
        row.launched_at = datetime.now(UTC) - timedelta(seconds=launched_ago)
        job = (await s.execute(select(JobRow).where(JobRow.name == f"alice/{name}"))).scalar_one()
        job.phase = "Running"
    return row


async def _report(db, name: str, t: SubtaskRow, seconds: float) -> None:  # type: ignore[no-untyped-def]
    async with db.session() as s:
        job = (await s.execute(select(JobRow).where(JobRow.name == f"alice/{name}").with_for_update())).scalar_one()
        await metering.ingest(s, job, await contract_of(s, job),
                              [{"rank": t.first_rank, "site": t.site_index, "step": 1, "wallSeconds": seconds}])


async def _invoice(api, name: str) -> dict:  # type: ignore[no-untyped-def]
    resp = await api.client.get(f"/api/v1/invoices?job={name}", headers=api.auth("alice"))
    assert resp.status == 200, await resp.text()
    items = (await resp.json())["items"]
    assert len(items) == 1, items
    return items[0]["status"]


async def test_many_small_reports_add_up_to_one_rounding(api, db) -> None:  # type: ignore[no-untyped-def]
    await _world(api)
    t = await _running(api, db, "tiny-bill", launched_ago=300)  # 210 s reported within 300 s observed
    reports, step = 300, 0.7
    for i in range(1, reports + 1):
        await _report(db, "tiny-bill", t, step * i)
    async with db.session() as s:
        rows = list((await s.execute(select(LedgerEntry).where(LedgerEntry.job == "alice/tiny-bill"))).scalars())
    price = Decimal(rows[0].unit_price)
    exact = Decimal(repr(step * reports)) / Decimal(3600) * price
    # one entry per report at 1e-6 each would drift by up to 0.5e-6 per entry; the running total does not
    assert abs(sum(Decimal(r.amount) for r in rows) - exact) <= MICRO, (sum(Decimal(r.amount) for r in rows), exact)
    inv = await _invoice(api, "tiny-bill")
    assert Decimal(inv["subtotal"]) == sum(Decimal(x["amount"]) for x in inv["lines"])
    assert len(inv["lines"][0]["amount"].split(".")[1]) == 6  # lines are not rounded to the cent
    assert Decimal(inv["total"]) == Decimal(inv["subtotal"]).quantize(CENT, rounding=ROUND_HALF_UP)
    assert Decimal(inv["total"]) > 0 and "rounded once" in inv["rounding"]
    resp = await api.client.get("/api/v1/jobs/tiny-bill", headers=api.auth("alice"))
    assert (await resp.json())["status"]["cost"]["total"] == inv["total"]  # the job shows what the bill says


async def test_a_cancelled_job_pays_for_the_work_done_and_gets_an_invoice(api, db) -> None:  # type: ignore[no-untyped-def]
    await _world(api)
    t = await _running(api, db, "stopped", launched_ago=120)
    await _report(db, "stopped", t, 30.0)  # the workers reported 30 s, then ran on unreported until the cancel
    resp = await api.client.post("/api/v1/jobs/stopped/cancel", headers=api.auth("alice"))
    assert resp.status == 200, await resp.text()
    inv = await _invoice(api, "stopped")
    assert inv["contractState"] == "cancelled"
    hours = sum(Decimal(x["quantity"]) for x in inv["lines"] if x["item"] == "gpu-hours")
    assert Decimal(115) / 3600 <= hours * t.gpus <= Decimal(140) / 3600, hours  # ~120 s held, not only 30 s
    assert Decimal(inv["total"]) > 0


async def test_a_job_cancelled_before_it_ran_gets_a_zero_invoice(api, db) -> None:  # type: ignore[no-untyped-def]
    await _world(api)
    await _accept(api, "never-ran")
    resp = await api.client.post("/api/v1/jobs/never-ran/cancel", headers=api.auth("alice"))
    assert resp.status == 200, await resp.text()
    inv = await _invoice(api, "never-ran")
    assert inv["total"] == "0.00" and inv["lines"] == [] and inv["contractState"] == "cancelled"


async def test_a_provider_prices_only_egress_from_its_own_sites(api) -> None:  # type: ignore[no-untyped-def]
    """The egress price of spec.a binds only once spec.a's provider applied it: another provider's link that
    names it is pending (unused, unpriced) until then (issue 35 M4)."""
    await _world(api)  # prov-a: fra-1, ams-1; prov-b: nyc-1
    resp = await api.client.delete("/api/v1/links/ams-1--nyc-1", headers=api.auth("prov-a"))
    assert resp.status == 200, await resp.text()
    priced = link("nyc-ams", "nyc-1", "ams-1")  # source nyc-1 belongs to prov-b
    resp = await api.client.post("/api/v1/links", json=priced, headers=api.auth("prov-a"))
    assert resp.status == 201, await resp.text()
    cond = (await resp.json())["status"]["conditions"][0]
    assert cond["reason"] == "AwaitingOtherProvider" and "nyc-1" in cond["message"] and "prov-b" in cond["message"]
    resp = await api.client.post("/api/v1/links", json=link("nyc-ams-b", "nyc-1", "ams-1"),
                                 headers=api.auth("prov-b"))
    assert resp.status == 201, await resp.text()  # the same figures: prov-b's consent to its own egress price
    got = await resp.json()
    assert got["metadata"]["name"] == "nyc-ams" and got["status"]["accepted"] is True


async def test_progress_follows_the_newest_count_whichever_rank_reports_it(api, db) -> None:  # type: ignore[no-untyped-def]
    """Barrier-free strategies: ranks see the job-wide token count at different times; rank 0 may be last."""
    from layers.orchestration.lifecycle.models import MetricRow

    await _world(api)
    await _running(api, db, "gossipy")
    async with db.session() as s:
        job = (await s.execute(select(JobRow).where(JobRow.name == "alice/gossipy"))).scalar_one()
        total = int(job.status["train"]["tokens"])
        for rank, tokens in ((0, total - 7168), (1, total + 1024), (2, total)):
            s.add(MetricRow(job="alice/gossipy", attempt=1, rank=rank, site=rank, step=10, tokens=tokens,
                            tokens_per_second=100.0))
        await s.flush()
        await metering.refresh_progress(s, job)
        assert job.status["progress"]["percent"] == 100.0 and job.status["progress"]["tokens"] == total


async def test_an_ended_job_has_no_eta(api, db) -> None:  # type: ignore[no-untyped-def]
    """A probe: `get jobs -o wide` showed `ETA 0 s` for a cancelled job."""
    from layers.orchestration.lifecycle.models import MetricRow
    from layers.service.jobs import set_phase

    await _world(api)
    await _running(api, db, "halfway")
    async with db.session() as s:
        job = (await s.execute(select(JobRow).where(JobRow.name == "alice/halfway"))).scalar_one()
        s.add(MetricRow(job="alice/halfway", attempt=1, rank=0, site=0, step=5, tokens=1024, tokens_per_second=100.0))
        await s.flush()
        await metering.refresh_progress(s, job)
        assert job.status["progress"]["etaSeconds"] > 0  # running: the rest at the measured rate
        set_phase(job, "Cancelled", "Cancelled", "cancelled by the user")
        await metering.refresh_progress(s, job)
        assert job.status["progress"]["etaSeconds"] is None
