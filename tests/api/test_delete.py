"""Deletion that respects history: a finished job goes (its bills and audit stay, its name is free),
clusters and sites are retired (no new placements), and a blocked delete names what blocks it."""

from __future__ import annotations

from sqlalchemy import select

from cpn.core.store import RETIRED
from layers.control.models import LeaseRow
from layers.orchestration.lifecycle.models import SubtaskRow
from layers.service.models import ContractRow, JobRow
from tests.layers.orchestration.test_reconciler import _accept, _reconciler, _world


async def _finish(db, name: str) -> None:  # type: ignore[no-untyped-def]
    async with db.session() as s:
        job = (await s.execute(select(JobRow).where(JobRow.name == f"alice/{name}"))).scalar_one()
        job.phase = "Succeeded"
        for lease in (await s.execute(select(LeaseRow).where(LeaseRow.job == f"alice/{name}"))).scalars():
            lease.state = "released"


async def test_a_finished_job_is_deleted_its_bill_stays_and_its_name_is_free(api, db) -> None:
    await _world(api)
    await _accept(api, "lm", strategy="ddp")
    await _reconciler(db, 3600).reconcile_once()  # sub-tasks and events exist
    running = await api.client.delete("/api/v1/jobs/lm", headers=api.auth("alice"))
    assert running.status == 409 and "cancel it first" in (await running.json())["error"]["message"]
    await _finish(db, "lm")
    assert (await api.client.delete("/api/v1/jobs/lm", headers=api.auth("bob"))).status == 404  # not bob's
    resp = await api.client.delete("/api/v1/jobs/lm", headers=api.auth("alice"))
    assert resp.status in (200, 204), await resp.text()
    assert (await api.client.get("/api/v1/jobs/lm", headers=api.auth("alice"))).status == 404
    listed = await (await api.client.get("/api/v1/jobs", headers=api.auth("alice"))).json()
    assert [j["metadata"]["name"] for j in listed["items"]] == []
    async with db.session() as s:
        contract = (await s.execute(select(ContractRow))).scalar_one()
        retired = (await s.execute(select(JobRow).where(JobRow.id == contract.job_id))).scalar_one()
        assert retired.name == f"{RETIRED}{retired.id}" and retired.labels["cpn.io/retired-name"] == "lm"
        assert not list((await s.execute(select(SubtaskRow).where(SubtaskRow.job == "alice/lm"))).scalars())
    assert (await api.client.get("/api/v1/events?job=lm", headers=api.auth("alice"))).status == 404
    invoices = await (await api.client.get("/api/v1/invoices?job=lm", headers=api.auth("alice"))).json()
    assert len(invoices["items"]) == 1  # the contract's invoice outlives the job

    await _accept(api, "lm", strategy="ddp")  # the name is free again, for a new job with its own uid
    again = await (await api.client.get("/api/v1/jobs/lm", headers=api.auth("alice"))).json()
    assert again["metadata"]["uid"] != retired.id and again["status"]["phase"] == "Reserved"
    events = await (await api.client.get("/api/v1/events?job=lm", headers=api.auth("alice"))).json()
    assert {e["reason"] for e in events["items"]} == {"Submitted", "Quoted", "Reserved"}  # none of the old job's
    assert (await api.client.get(f"/api/v1/jobs/{RETIRED}{retired.id}", headers=api.auth("alice"))).status == 404


async def test_clusters_and_sites_are_retired_and_blocked_deletes_say_why(api, db) -> None:
    await _world(api)
    await _accept(api, "busy", strategy="ddp")
    async with db.session() as s:
        held = (await s.execute(select(LeaseRow.cluster).where(LeaseRow.job == "alice/busy"))).scalar_one()
    owner = "prov-a" if held in ("fra-1-cpu", "ams-1-cpu") else "prov-b"
    blocked = await api.client.delete(f"/api/v1/clusters/{held}", headers=api.auth(owner))
    assert blocked.status == 409 and "leased by job(s) alice/busy" in (await blocked.json())["error"]["message"]
    site = held.removesuffix("-cpu")
    in_use = await api.client.delete(f"/api/v1/sites/{site}", headers=api.auth(owner))
    assert in_use.status == 409 and f"cluster(s) {held}" in (await in_use.json())["error"]["message"]

    await _finish(db, "busy")
    assert (await api.client.delete(f"/api/v1/clusters/{held}", headers=api.auth(owner))).status in (200, 204)
    names = [c["metadata"]["name"] for c in (await (await api.client.get(
        "/api/v1/clusters", headers=api.auth("admin"))).json())["items"]]
    assert held not in names and len(names) == 2
    again = await api.client.post("/api/v1/jobs?dryRun=true", headers=api.auth("alice"), json={
        "apiVersion": "cpn/v1", "kind": "TrainingJob", "metadata": {"name": "next"},
        "spec": {"model": "tiny", "tokens": 200_000, "strategy": "ddp", "gpus": {"min": 1, "max": 1},
                 "sites": {"max": 1}}})
    assert again.status == 200, await again.text()
    assert all(p["cluster"] != held for q in (await again.json())["status"]["quotes"] for p in q["placement"])
    links = await api.client.delete(f"/api/v1/sites/{site}", headers=api.auth(owner))
    if links.status == 409:  # its links block it, by name
        assert "link(s)" in (await links.json())["error"]["message"]
