"""The synchronous parameter servers as TrainingJob strategies (issue 15): `spec.strategy: ps_sync` and
`ps_backup` are quoted and priced, accepted with the knobs the runtime gets (`spec.backupWorkers`,
`spec.psReplicas` in the attempt's TrainConfig), published in the OpenAPI document, and a knob that
cannot run is a 422 naming its field."""

from __future__ import annotations

from decimal import Decimal

from sqlalchemy import select

from layers.orchestration.lifecycle.plan import attempt_plan
from layers.resource.capacity import LinkView
from layers.service.models import JobRow
from layers.service.schemas import BACKUP_WORKERS, TrainingJobSpec
from tests.api.test_jobs import quotes, submit
from tests.api.test_resource import cluster, link, site

SITES = ("fra-1", "ams-1", "waw-1")


async def _register(api) -> None:  # type: ignore[no-untyped-def]
    """Three sites of one 24 GB GPU each; waw-1's is half as fast."""
    items: list[dict] = []
    for name in SITES:
        c = cluster(f"{name}-gpu", name, gpus_per_node=1, nodes=1, price="0.50")
        c["spec"]["nodePools"][0]["gpu"] = {"model": "RTX4090", "memoryGB": 24,
                                            "tflops": 82.5 if name == "waw-1" else 165}
        items += [site(name), c]
    items += [link("fra-ams", "fra-1", "ams-1", 10), link("ams-waw", "ams-1", "waw-1", 10),
              link("fra-waw", "fra-1", "waw-1", 10)]
    resp = await api.client.post("/api/v1/apply", json={"items": items}, headers=api.auth("prov-a"))
    assert resp.status == 200, await resp.text()
    for name in SITES:
        resp = await api.client.post(f"/api/v1/clusters/{name}-gpu/heartbeat", headers=api.auth("prov-a"),
                                     json={"allocatableGpus": 1, "conditions": [{"type": "Ready", "status": "True"}]})
        assert resp.status == 200


def _job(name: str, **spec) -> dict:  # type: ignore[no-untyped-def]
    base = {"model": "tiny", "tokens": 60_000, "globalBatchTokens": 768, "gpus": {"min": 3, "max": 3},
            "sites": {"min": 3, "max": 3}}
    return {"apiVersion": "cpn/v1", "kind": "TrainingJob", "metadata": {"name": name}, "spec": {**base, **spec}}


async def _error(api, body: dict) -> dict:  # type: ignore[no-untyped-def]
    resp = await submit(api, body)
    error = (await resp.json())["error"]
    assert resp.status == 422, error
    return error


def _links() -> list[LinkView]:
    return [LinkView(name=f"{a}-{b}", a=a, b=b, bandwidth_gbps=10, rtt_ms=20, price_per_gb="0.02", owner_id="")
            for a, b in (("fra-1", "ams-1"), ("ams-1", "waw-1"), ("fra-1", "waw-1"))]


async def _accepted(api, db, name: str) -> tuple[dict, dict]:  # type: ignore[no-untyped-def]
    """Accept the balanced quote; the TrainConfig its attempt will run (what the reconciler hands the runtime)."""
    resp = await api.client.post(f"/api/v1/jobs/{name}/accept", json={"quote": "balanced"}, headers=api.auth("alice"))
    assert resp.status == 200, await resp.text()
    async with db.session() as s:
        job = (await s.execute(select(JobRow).where(JobRow.name == f"alice/{name}"))).scalar_one()
        status, spec = dict(job.status), TrainingJobSpec.model_validate(job.spec)
    _, train = attempt_plan(spec, status["strategy"], status["placement"], status["ring"], _links())
    return status, train


async def test_ps_sync_and_ps_backup_are_quoted_priced_and_accepted_with_their_knobs(api, db) -> None:  # type: ignore[no-untyped-def]
    await _register(api)
    for strategy, extra in (("ps_sync", {}), ("ps_backup", {"backupWorkers": 1, "psReplicas": 1})):
        name = strategy.replace("_", "-")
        resp = await submit(api, _job(name, strategy=strategy, **extra))
        assert resp.status == 201, await resp.text()
        items = await quotes(api, name)
        assert {q["label"] for q in items} == {"cheapest", "fastest", "balanced"}
        for q in items:
            assert q["strategy"] == strategy, q
            assert {x["item"] for x in q["price"]["lines"]} == {"gpu-hours", "egress"}, q  # GPUs, every push's bytes
            assert all(Decimal(x["quantity"]) > 0 for x in q["price"]["lines"]) and q["wanGB"] > 0, q
            assert {p["site"] for p in q["placement"]} == set(SITES)
    status, train = await _accepted(api, db, "ps-backup")
    knobs = train["strategy"]
    assert status["strategy"] == "ps_backup" and knobs["name"] == "ps_backup" and knobs["ps"] == 3, knobs
    assert knobs["backup_workers"] == 1 and knobs["ps_replicas"] == 1, knobs


async def test_an_unset_backup_workers_runs_the_runtimes_default(api, db) -> None:  # type: ignore[no-untyped-def]
    await _register(api)
    resp = await submit(api, _job("defaults", strategy="ps_backup"))
    assert resp.status == 201, await resp.text()
    _, train = await _accepted(api, db, "defaults")
    assert train["strategy"]["backup_workers"] == BACKUP_WORKERS == 1 and "ps_replicas" not in train["strategy"]


async def test_a_larger_ps_backup_job_is_predicted_sooner_and_cheaper_than_ps_sync(api) -> None:  # type: ignore[no-untyped-def]
    await _register(api)
    totals = {}
    for strategy in ("ps_sync", "ps_backup"):
        name = f"big-{strategy.replace('_', '-')}"
        resp = await submit(api, _job(name, strategy=strategy, tokens=3_000_000_000))
        assert resp.status == 201, await resp.text()
        balanced = next(q for q in await quotes(api, name) if q["label"] == "balanced")
        totals[strategy] = (balanced["predictedSeconds"], Decimal(balanced["price"]["total"]))
    assert totals["ps_sync"][1] > 0
    # every GPU is billed for the whole run: waiting for the slow site costs time and money
    assert totals["ps_backup"][0] < totals["ps_sync"][0] and totals["ps_backup"][1] < totals["ps_sync"][1], totals


async def test_knobs_that_cannot_run_are_422_naming_the_field(api) -> None:  # type: ignore[no-untyped-def]
    await _register(api)
    error = await _error(api, _job("too-many", strategy="ps_backup", backupWorkers=3))
    assert error["field"] == "spec.backupWorkers" and "below the job's workers" in error["message"], error
    assert "use at most 2" in error["message"], error
    error = await _error(api, _job("one-gpu", strategy="ps_backup", gpus={"min": 1, "max": 1}))  # default b = 1
    assert error["field"] == "spec.backupWorkers" and "unset: the default" in error["message"], error
    error = await _error(api, _job("negative", strategy="ps_backup", backupWorkers=-1))
    assert error["field"] == "spec.backupWorkers", error
    error = await _error(api, _job("wrong-strategy", strategy="ps_sync", backupWorkers=1))
    assert error["field"] == "spec.backupWorkers" and "ps_backup" in error["message"], error
    error = await _error(api, _job("ddp-replicas", strategy="ddp", psReplicas=1))
    assert error["field"] == "spec.psReplicas", error
    error = await _error(api, _job("replicas", strategy="ps_sync", psReplicas=3))
    assert error["field"] == "spec.psReplicas" and "need 4 sites" in error["message"], error


async def test_openapi_publishes_the_strategies_and_their_knobs(api) -> None:  # type: ignore[no-untyped-def]
    doc = await (await api.client.get("/api/v1/openapi.json")).json()
    spec = next(v for k, v in doc["components"]["schemas"].items() if k.startswith("TrainingJobSpec"))
    assert {"ps_sync", "ps_backup"} <= set(spec["properties"]["strategy"]["enum"])
    backups = spec["properties"]["backupWorkers"]
    assert "ps_backup" in backups["description"]
    assert any(x.get("minimum") == 0 for x in backups.get("anyOf", [backups])), backups
    assert "psReplicas" in spec["properties"]
