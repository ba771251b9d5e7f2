"""A failed job gets an invoice, like a cancelled one, its total rounded once; it should pay for the
work done when the failure was its own code's, and nothing for the work a lost site took with it."""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal

from sqlalchemy import select

from layers.orchestration.lifecycle.models import SubtaskRow
from tests.api.test_money import CENT, _invoice, _report, _running
from tests.layers.orchestration.test_reconciler import _job_of, _reconciler, _world


async def _fail(api, db, name: str, exit_code: int) -> tuple[SubtaskRow, dict]:  # type: ignore[no-untyped-def]
    """A running ddp job reports 20 s of work, then its site's agent reports the workers failed."""
    await _world(api)
    t = await _running(api, db, name, launched_ago=90)
    await _report(db, name, t, 20.0)
    async with db.session() as s:
        row = (await s.execute(select(SubtaskRow).where(SubtaskRow.id == t.id))).scalar_one()
        row.reported, row.exit_codes = "Failed", {"0": exit_code}
        row.handle = {"message": f"rank 0 exited {exit_code}"}
    await _reconciler(db, 3600).reconcile_once()
    job = await _job_of(db, name)
    assert job.phase == "Failed", job.status
    inv = await _invoice(api, name)  # exactly one
    assert inv["contractState"] == "failed"
    assert Decimal(inv["subtotal"]) == sum(Decimal(x["amount"]) for x in inv["lines"])
    assert Decimal(inv["total"]) == Decimal(inv["subtotal"]).quantize(CENT, rounding=ROUND_HALF_UP)  # once
    resp = await api.client.get(f"/api/v1/jobs/{name}", headers=api.auth("alice"))
    assert (await resp.json())["status"]["cost"]["total"] == inv["total"]  # the job shows what the bill says
    return t, inv


async def test_a_failed_job_gets_one_invoice(api, db) -> None:  # type: ignore[no-untyped-def]
    _, inv = await _fail(api, db, "failed-job", 1)
    assert inv["entries"] >= 1 and inv["lines"] and all(x["item"] == "gpu-hours" for x in inv["lines"]), inv


async def test_a_job_whose_own_code_crashed_pays_for_the_work_done(api, db) -> None:  # type: ignore[no-untyped-def]
    t, inv = await _fail(api, db, "own-crash", 1)  # exit 1: the user's code, not the site
    hours = sum(Decimal(x["quantity"]) for x in inv["lines"] if x["item"] == "gpu-hours")
    assert Decimal(85) / 3600 <= hours * t.gpus <= Decimal(120) / 3600, hours  # the ~90 s held, not 0
    assert Decimal(inv["credits"]) == 0 and Decimal(inv["total"]) > 0, inv
