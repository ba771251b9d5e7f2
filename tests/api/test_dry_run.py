"""Quotes without a job (`?dryRun=true`), quotes only for what can run, and quotes that read well."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

from sqlalchemy import func, select, update

from layers.service.models import JobRow, QuoteRow
from layers.service.quotes import CONFIRM_ABOVE_CHEAPEST, views
from tests.api.test_jobs import job, quotes, register_world, submit


async def dry_run(api, body: dict, who: str = "alice"):
    return await api.client.post("/api/v1/jobs?dryRun=true", json=body, headers=api.auth(who))


async def counts(db) -> tuple[int, int]:
    async with db.session() as s:
        jobs = (await s.execute(select(func.count()).select_from(JobRow))).scalar_one()
        offers = (await s.execute(select(func.count()).select_from(QuoteRow))).scalar_one()
    return jobs, offers


async def test_dry_run_prices_three_options_and_stores_nothing(api, db) -> None:
    await register_world(api)
    resp = await dry_run(api, job("look", gpus={"min": 4, "max": 8}))
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    assert body["metadata"]["name"] == "look" and body["status"]["dryRun"] is True
    assert body["status"]["draft"] is False
    items = body["status"]["quotes"]
    assert [q["label"] for q in items] == ["cheapest", "fastest", "balanced"]
    assert all(q["id"] is None and q["state"] == "open" and "pricingOnly" not in q for q in items)
    assert all(q["model"]["shard"] == "none" and 0 < q["model"]["memoryGBPerGpu"] < 80 for q in items)
    assert [q["recommended"] for q in items] == [False, False, True]
    assert all(sum(p["gpus"] for p in q["placement"]) <= 8 for q in items)
    assert await counts(db) == (0, 0)
    assert (await api.client.get("/api/v1/jobs/look", headers=api.auth("alice"))).status == 404

    wider = await dry_run(api, job("look", gpus={"min": 16, "max": 24}))  # the form changed: price again
    assert wider.status == 200, await wider.text()
    assert all(sum(p["gpus"] for p in q["placement"]) >= 16 for q in (await wider.json())["status"]["quotes"])
    assert await counts(db) == (0, 0)


async def test_dry_run_refuses_what_submit_would_and_marks_a_users_draft(api, db) -> None:
    await register_world(api)
    bad = await dry_run(api, job("big", gpus={"min": 64}))
    assert bad.status == 422
    err = (await bad.json())["error"]
    assert err["field"] == "spec.gpus.min" and "at most 24 are" in err["message"]
    assert (await submit(api, job("mine"))).status == 201
    again = await dry_run(api, job("mine", gpus={"min": 8, "max": 8}))
    assert again.status == 200 and (await again.json())["status"]["draft"] is True
    theirs = await dry_run(api, job("mine"), who="bob")  # bob's own namespace: the name is free for him
    assert theirs.status == 200 and (await theirs.json())["status"]["draft"] is False
    assert await counts(db) == (1, 3)
    wrong_kind = await api.client.post("/api/v1/sites?dryRun=true", json={}, headers=api.auth("prov-a"))
    assert wrong_kind.status == 422 and (await wrong_kind.json())["error"]["field"] == "dryRun"
    junk = await api.client.post("/api/v1/jobs?dryRun=maybe", json=job("x"), headers=api.auth("alice"))
    assert junk.status == 422 and (await junk.json())["error"]["field"] == "dryRun"


async def test_apply_dry_run_quotes_jobs_and_rolls_everything_back(api, db) -> None:
    await register_world(api)
    resp = await api.client.post("/api/v1/apply?dryRun=true", json={"items": [job("a1"), job("a2", gpus={"min": 8})]},
                                 headers=api.auth("alice"))
    assert resp.status == 200, await resp.text()
    items = (await resp.json())["items"]
    assert [(i["name"], i["action"], i["dryRun"], len(i["quotes"])) for i in items] == [
        ("a1", "created", True, 3), ("a2", "created", True, 3)]
    assert await counts(db) == (0, 0)


async def test_a_model_no_offered_gpu_can_hold_is_refused(api, db) -> None:
    await register_world(api)
    for model in ("llama-70b", {"layers": 60, "hidden": 6656, "heads": 52, "vocab": 32_000, "seqLen": 2048}):
        resp = await submit(api, job("huge", model=model, gpus={"min": 1, "max": 4}))
        assert resp.status == 422, await resp.text()
        err = (await resp.json())["error"]
        assert err["field"] == "spec.model" and "per GPU" in err["message"] and "80 GB" in err["message"]
    assert await counts(db) == (0, 0)


async def test_every_model_the_runtime_builds_is_quoted_and_can_be_accepted(api) -> None:
    """Nothing is priced for reference only any more (issue 28): gpt2-xl, once quoted with a note and
    refused at accept, is a model the runtime builds; its quotes carry no pricingOnly and one is accepted."""
    await register_world(api)
    resp = await submit(api, job("ref", model="gpt2-xl", tokens=20_000_000_000))
    assert resp.status == 201, await resp.text()
    items = await quotes(api, "ref")
    assert len(items) == 3 and all("pricingOnly" not in q and "pricing only" not in q["note"] for q in items)
    accepted = await api.client.post("/api/v1/jobs/ref/accept", json={"quote": "cheapest"}, headers=api.auth("alice"))
    assert accepted.status == 200, await accepted.text()
    job_now = await (await api.client.get("/api/v1/jobs/ref", headers=api.auth("alice"))).json()
    assert job_now["status"]["phase"] == "Reserved"
    assert job_now["status"]["memory"]["shard"] in ("none", "site")  # the quote's memory plan, for the runtime


async def test_quotes_show_expiry_before_they_are_clicked(api, db) -> None:
    await register_world(api)
    await submit(api, job("old"))
    async with db.session() as s:
        await s.execute(update(QuoteRow).values(expires_at=datetime.now(UTC) - timedelta(seconds=1)))
    assert {q["state"] for q in await quotes(api, "old")} == {"expired"}


def quote(label: str, total: str, gpus: int = 4, seconds: float = 100.0) -> dict:
    return {"id": label, "label": label, "placement": [{"cluster": "c", "site": "s", "gpus": gpus, "gpuModel": "H100"}],
            "strategy": "ddp", "predictedSeconds": seconds, "wanGB": 0.0, "state": "open",
            "price": {"total": total, "currency": "USD", "lines": []},
            "expiresAt": (datetime.now(UTC) + timedelta(minutes=5)).isoformat()}


def test_views_say_how_options_differ() -> None:
    same = views([quote("cheapest", "10.00"), quote("fastest", "10.00"), quote("balanced", "12.00", 8, 60)], None)
    assert [q["sameAs"] for q in same] == [None, "cheapest", None]
    assert [q["recommended"] for q in same] == [False, False, True]
    assert same[2]["timesCheapest"] == 1.2 and not any(q["confirm"] for q in same)
    dear = views([quote("cheapest", "1.00"), quote("fastest", str(Decimal(CONFIRM_ABOVE_CHEAPEST) + 1), 64, 5)],
                 "fastest")
    assert [q["confirm"] for q in dear] == [False, True] and [q["chosen"] for q in dear] == ["", "*"]


async def test_no_quote_is_offered_that_the_workers_would_refuse(api, db) -> None:
    """hierarchical needs the same worker count at every site: 3 GPUs over 2 sites cannot be even."""
    await register_world(api)
    body = job("uneven", model="tiny", tokens=2_000_000, strategy="hierarchical", gpus={"min": 3, "max": 3},
               sites={"min": 2, "max": 2})
    resp = await dry_run(api, body)
    assert resp.status == 422, await resp.text()
    err = (await resp.json())["error"]
    assert err["field"] == "spec.strategy" and "same number of GPUs" in err["message"]
    even = await dry_run(api, {**body, "spec": {**body["spec"], "gpus": {"min": 4, "max": 4}}})
    assert even.status == 200, await even.text()
    placements = [[p["gpus"] for p in q["placement"]] for q in (await even.json())["status"]["quotes"]]
    assert all(len(set(p)) == 1 for p in placements), placements


async def test_a_quote_says_what_the_run_will_really_train(api, db) -> None:
    """10,000-token batches are not whole 128-token sequences: the quote says what the batch becomes, and the
    run still trains exactly the 100,000 tokens asked (the last step trimmed)."""
    await register_world(api)
    body = job("odd", model="tiny", tokens=100_000, globalBatchTokens=10_000, strategy="ddp",
               gpus={"min": 3, "max": 3}, sites={"max": 1})
    resp = await dry_run(api, body)
    assert resp.status == 200, await resp.text()
    for q in (await resp.json())["status"]["quotes"]:
        assert q["trains"]["globalBatchTokens"] == 10_112 and q["trains"]["tokens"] == 100_000, q["trains"]
        assert ("trains 100,000 tokens: 9 steps × 10,112 and a last step of 8,992 (batch of whole 128-token "
                "sequences") in q["note"]
    exact = await dry_run(api, job("even", model="tiny", tokens=98_304, globalBatchTokens=12_288, strategy="ddp",
                                   gpus={"min": 3, "max": 3}, sites={"max": 1}))
    assert all(q["trains"]["note"] is None and "trains" not in q["note"]
               for q in (await exact.json())["status"]["quotes"])
