"""Jobs through the API: quotes, pricing to the cent, idempotency, tenancy, accept and leases."""

from __future__ import annotations

import asyncio
import os
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from sqlalchemy import func, select, update

from layers.control.models import LeaseRow
from layers.service.models import QuoteRow
from tests.api.test_resource import cluster, link, site


def world() -> tuple[list[dict], list[dict]]:
    a = [site("fra-1"), site("ams-1", "eu-west"),
         cluster("fra-h100", "fra-1", gpus_per_node=8, nodes=1, price="2.50"),
         cluster("ams-a100", "ams-1", gpus_per_node=8, nodes=1, price="1.10"),
         link("fra-ams", "fra-1", "ams-1", 10)]
    a[3]["spec"]["nodePools"][0]["gpu"] = {"model": "A100", "memoryGB": 80, "tflops": 312}
    b = [site("nyc-1", "us-east"), cluster("nyc-h100", "nyc-1", gpus_per_node=8, nodes=1, price="1.90"),
         link("nyc-fra", "nyc-1", "fra-1", 1)]
    return a, b


def job(name: str = "j1", **spec) -> dict:
    base = {"model": "small", "tokens": 2_000_000_000, "globalBatchTokens": 262144, "strategy": "auto",
            "gpus": {"min": 4, "max": 16}}
    base.update(spec)
    return {"apiVersion": "cpn/v1", "kind": "TrainingJob", "metadata": {"name": name}, "spec": base}


async def register_world(api) -> None:
    a, b = world()
    # prov-a applies prov-b's link to fra-1 too: its consent, without which no plan uses it (issue 35 M4)
    for who, items in (("prov-a", a), ("prov-b", b), ("prov-a", [d for d in b if d["kind"] == "Link"])):
        resp = await api.client.post("/api/v1/apply", json={"items": items}, headers=api.auth(who))
        assert resp.status == 200, await resp.text()
    for who, name in (("prov-a", "fra-h100"), ("prov-a", "ams-a100"), ("prov-b", "nyc-h100")):
        resp = await api.client.post(f"/api/v1/clusters/{name}/heartbeat", headers=api.auth(who),
                                     json={"allocatableGpus": 8, "conditions": [{"type": "Ready", "status": "True"}]})
        assert resp.status == 200


async def submit(api, body: dict, who: str = "alice", key: str | None = None):
    headers = api.auth(who)
    if key:
        headers["Idempotency-Key"] = key
    return await api.client.post("/api/v1/jobs", json=body, headers=headers)


async def quotes(api, name: str, who: str = "alice") -> list[dict]:
    resp = await api.client.get(f"/api/v1/jobs/{name}/quotes", headers=api.auth(who))
    assert resp.status == 200, await resp.text()
    return (await resp.json())["items"]


async def test_submit_quotes_three_labelled_offers_with_exact_lines_and_a_cent_total(api) -> None:
    await register_world(api)
    resp = await submit(api, job())
    assert resp.status == 201, await resp.text()
    assert (await resp.json())["status"]["phase"] == "Quoted"
    items = await quotes(api, "j1")
    assert {q["label"] for q in items} == {"cheapest", "fastest", "balanced"}
    for q in items:
        lines = q["price"]["lines"]
        assert lines and all(Decimal(x["amount"]) == (Decimal(x["quantity"]) * Decimal(x["unitPrice"]))
                             .quantize(Decimal("0.000001"), rounding="ROUND_HALF_UP") for x in lines)
        assert Decimal(q["price"]["total"]) == sum(Decimal(x["amount"]) for x in lines).quantize(
            Decimal("0.01"), rounding="ROUND_HALF_UP")  # lines exact, the total rounded once
        assert q["price"]["total"].count(".") == 1 and len(q["price"]["total"].split(".")[1]) == 2
        assert sum(p["gpus"] for p in q["placement"]) >= 4
        assert q["expiresAt"] and q["strategy"] in ("ddp", "hierarchical", "diloco")
    by = {q["label"]: q for q in items}
    assert Decimal(by["cheapest"]["price"]["total"]) <= Decimal(by["fastest"]["price"]["total"])
    assert by["fastest"]["predictedSeconds"] <= by["cheapest"]["predictedSeconds"]


async def test_idempotent_submission_returns_the_same_job(api, db) -> None:
    await register_world(api)
    first = await submit(api, job("idem"), key="k-123")
    again = await submit(api, job("idem"), key="k-123")
    assert first.status == 201 and again.status == 200
    assert (await first.json())["metadata"]["uid"] == (await again.json())["metadata"]["uid"]
    async with db.session() as s:
        assert await s.scalar(select(func.count()).select_from(QuoteRow)) == len(await quotes(api, "idem"))
    other = await submit(api, job("idem"), key="k-other")
    assert other.status == 409


async def test_tenancy_users_see_only_their_own(api) -> None:
    await register_world(api)
    assert (await submit(api, job("mine"))).status == 201
    assert (await api.client.get("/api/v1/jobs/mine", headers=api.auth("bob"))).status == 404
    assert (await api.client.get("/api/v1/jobs/mine/quotes", headers=api.auth("bob"))).status == 404
    resp = await api.client.post("/api/v1/jobs/mine/accept", json={"quote": "cheapest"}, headers=api.auth("bob"))
    assert resp.status == 404
    listed = await (await api.client.get("/api/v1/jobs", headers=api.auth("bob"))).json()
    assert listed["items"] == []
    assert (await api.client.get("/api/v1/jobs/mine", headers=api.auth("admin"))).status == 200
    assert (await submit(api, job("prov"), who="prov-a")).status == 403


async def test_constraints_are_respected(api) -> None:
    await register_world(api)
    resp = await submit(api, job("eu", placement={"regions": ["eu-west"]}, gpus={"min": 1, "max": 8}))
    assert resp.status == 201, await resp.text()
    for q in await quotes(api, "eu"):
        assert {p["site"] for p in q["placement"]} == {"ams-1"}
    resp = await submit(api, job("h100", gpus={"min": 2, "max": 16, "models": ["H100"]}))
    for q in await quotes(api, "h100"):
        assert {p["gpuModel"] for p in q["placement"]} == {"H100"}
    resp = await submit(api, job("x", placement={"excludeSites": ["fra-1", "nyc-1"]}, gpus={"min": 1}))
    for q in await quotes(api, "x"):
        assert {p["site"] for p in q["placement"]} == {"ams-1"}


async def test_infeasible_jobs_get_422_naming_the_constraint(api) -> None:
    await register_world(api)
    cases = [
        (job("too-big", gpus={"min": 64}), "spec.gpus.min"),
        (job("no-model", gpus={"min": 1, "models": ["B200"]}), "spec.gpus.models"),
        (job("broke", budget="0.01"), "spec.budget"),
        (job("rush", deadline="1s"), "spec.deadline"),
    ]
    for body, field in cases:
        resp = await submit(api, body)
        assert resp.status == 422, (field, await resp.text())
        err = (await resp.json())["error"]
        assert err["field"] == field, err
    gone = await api.client.get("/api/v1/jobs/too-big", headers=api.auth("alice"))
    assert gone.status == 404  # nothing half-written


async def test_accept_reserves_and_reduces_capacity(api) -> None:
    await register_world(api)
    await submit(api, job("acc", gpus={"min": 8, "max": 8}, strategy="ddp", sites={"min": 1, "max": 1}))
    resp = await api.client.post("/api/v1/jobs/acc/accept", json={"quote": "cheapest"}, headers=api.auth("alice"))
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    assert body["status"]["phase"] == "Reserved"
    assert sum(x["gpus"] for x in body["status"]["leases"]) == 8
    rsv = (await (await api.client.get("/api/v1/reservations", headers=api.auth("alice"))).json())["items"]
    assert sum(r["spec"]["gpus"] for r in rsv) == 8 and rsv[0]["status"]["state"] == "active"
    cluster_name = rsv[0]["spec"]["cluster"]
    prov = "prov-b" if cluster_name.startswith("nyc") else "prov-a"
    seen = (await (await api.client.get("/api/v1/reservations", headers=api.auth(prov))).json())["items"]
    assert [r["spec"]["cluster"] for r in seen] == [cluster_name]
    assert (await (await api.client.get("/api/v1/reservations", headers=api.auth("bob"))).json())["items"] == []
    again = await api.client.post("/api/v1/jobs/acc/accept", json={"quote": "cheapest"}, headers=api.auth("alice"))
    assert again.status == 409
    # the leased cluster is no longer offered to a new job
    await submit(api, job("next", gpus={"min": 8, "max": 8}, strategy="ddp", sites={"min": 1, "max": 1}))
    for q in await quotes(api, "next"):
        assert all(p["cluster"] != cluster_name for p in q["placement"])
        assert q["chosen"] == ""  # nothing accepted yet: `recommended` says which is advised
    assert [q["chosen"] for q in await quotes(api, "acc")].count("*") == 1
    events = (await (await api.client.get("/api/v1/events?job=acc", headers=api.auth("alice"))).json())["items"]
    assert [e["reason"] for e in events] == ["Submitted", "Quoted", "Reserved"]
    assert events[1]["message"].startswith("quoted: ") and "None" not in events[1]["message"], events[1]
    # ?limit= keeps the latest, in time order (it was ignored: a new user's `cpnctl get events --limit 3` got 62)
    latest = (await (await api.client.get("/api/v1/events?job=acc&limit=2", headers=api.auth("alice"))).json())["items"]
    assert [e["reason"] for e in latest] == ["Quoted", "Reserved"]
    names = [e["metadata"]["name"] for e in events]  # an event's name is its own, not its place in a listing
    assert [e["metadata"]["name"] for e in latest] == names[1:] and len(set(names)) == 3
    # re-applying the reserved job's manifest as it is: "unchanged" (it was a 409); a changed one says what to do
    body = job("acc", gpus={"min": 8, "max": 8}, strategy="ddp", sites={"min": 1, "max": 1})
    same = await api.client.post("/api/v1/apply", json={"items": [body]}, headers=api.auth("alice"))
    assert same.status == 200 and (await same.json())["items"][0]["action"] == "unchanged", await same.text()
    body["spec"]["tokens"] = body["spec"].get("tokens", 10**6) + 1
    changed = await api.client.post("/api/v1/apply", json={"items": [body]}, headers=api.auth("alice"))
    assert changed.status == 409 and "under a new name" in (await changed.json())["error"]["message"]


async def test_expired_quote_is_409_with_fresh_quotes(api, db) -> None:
    await register_world(api)
    await submit(api, job("exp"))
    async with db.session() as s:
        await s.execute(update(QuoteRow).values(expires_at=datetime.now(UTC) - timedelta(seconds=1)))
    resp = await api.client.post("/api/v1/jobs/exp/accept", json={"quote": "balanced"}, headers=api.auth("alice"))
    assert resp.status == 409
    err = (await resp.json())["error"]
    assert err["code"] == "quote_unavailable"
    fresh = err["details"]["freshQuotes"]
    assert {q["label"] for q in fresh} == {"cheapest", "fastest", "balanced"}
    ok = await api.client.post("/api/v1/jobs/exp/accept", json={"quote": fresh[0]["id"]}, headers=api.auth("alice"))
    assert ok.status == 200, await ok.text()


async def test_concurrent_accepts_never_double_book(api, db) -> None:
    if not os.environ.get("CPN_TEST_DATABASE_URL"):
        pytest.skip("row-lock concurrency is exercised on PostgreSQL (CPN_TEST_DATABASE_URL); SQLite serialises")
    await register_world(api)
    n = 50
    for i in range(n):
        resp = await submit(api, job(f"c{i}", gpus={"min": 4, "max": 4}, sites={"min": 1, "max": 1}))
        assert resp.status == 201
    results = await asyncio.gather(*[
        api.client.post(f"/api/v1/jobs/c{i}/accept", json={"quote": "cheapest"}, headers=api.auth("alice"))
        for i in range(n)])
    codes = [r.status for r in results]
    assert set(codes) <= {200, 409}, codes
    async with db.session() as s:
        per = dict((await s.execute(select(LeaseRow.cluster, func.sum(LeaseRow.gpus))
                                    .where(LeaseRow.state == "active").group_by(LeaseRow.cluster))).all())
    assert all(total <= 8 for total in per.values()), per
    assert codes.count(200) == sum(per.values()) // 4 and codes.count(200) <= 6
