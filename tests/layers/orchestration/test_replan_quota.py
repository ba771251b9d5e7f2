"""A job re-placed after a site failure leases its new placement within its owner's maxGpus quota (issue 31,
item 2: no lease beyond the quota ever exists), or fails saying which quota left too few GPUs."""

from __future__ import annotations

from sqlalchemy import func, select

from layers.control.models import LeaseRow
from tests.api.test_jobs import job, register_world, submit
from tests.layers.orchestration.test_reconciler import _accept, _job_of, _reconciler, _world


async def _quota(api, **spec: object) -> None:  # type: ignore[no-untyped-def]
    body = {"apiVersion": "cpn/v1", "kind": "Quota", "metadata": {"name": "alice-gpus"},
            "spec": {"account": "alice", **spec}}
    resp = await api.client.post("/api/v1/quotas", json=body, headers=api.auth("admin"))
    assert resp.status == 201, await resp.text()


async def _active_gpus(db) -> int:  # type: ignore[no-untyped-def]
    async with db.session() as s:
        return int(await s.scalar(select(func.coalesce(func.sum(LeaseRow.gpus), 0)).where(LeaseRow.state == "active")))


async def test_a_re_placement_takes_no_more_gpus_than_the_quota_leaves(api, db) -> None:  # type: ignore[no-untyped-def]
    await register_world(api)  # three clusters of 8 GPUs
    body = job("grows", strategy="ddp", gpus={"min": 1, "max": 8},
               sites={"min": 1, "max": 1}, objective={"cost": 0, "time": 1}, maxPricePerGpuHour="100")
    assert (await submit(api, body)).status == 201
    resp = await api.client.post("/api/v1/jobs/grows/accept", json={"quote": "fastest"}, headers=api.auth("alice"))
    assert resp.status == 200, await resp.text()
    assert await _active_gpus(db) > 2  # the fastest offer takes more than the quota will allow
    await _quota(api, maxGpus=2)  # set after the accept: the re-placement must keep to it
    reconciler = _reconciler(db, 0)  # no agent ever claims: the site counts as lost, the job is re-placed
    await reconciler.reconcile_once()  # launches
    await reconciler.reconcile_once()  # unclaimed: re-placed
    job_row = await _job_of(db, "grows")
    assert job_row.status["attempt"] == 2 and job_row.phase == "Reserved", job_row.status
    assert sum(p["gpus"] for p in job_row.status["placement"]) <= 2 and 0 < await _active_gpus(db) <= 2


async def test_a_re_placement_the_quota_leaves_no_room_for_fails_naming_it(api, db) -> None:  # type: ignore[no-untyped-def]
    await _world(api)
    await _quota(api, maxGpus=1)
    await _accept(api, "stuck", maxPricePerGpuHour="100")
    async with db.session() as s:  # an admin lowered the quota under what the job holds
        from layers.orchestration.quotas.models import QuotaRow

        row = (await s.execute(select(QuotaRow))).scalar_one()
        row.spec = {**row.spec, "maxGpus": 0}
    reconciler = _reconciler(db, 0)
    await reconciler.reconcile_once()
    await reconciler.reconcile_once()
    job = await _job_of(db, "stuck")
    assert job.phase == "Failed" and "within quota alice-gpus (account/alice): maxGpus leaves 0 GPUs" in \
        job.status["message"], job.status
    assert await _active_gpus(db) == 0
