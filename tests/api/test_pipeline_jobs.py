"""A model too big for any one GPU, through the API (issue 14): quotes with a staged placement
(`placement[].stage`, strategy pipeline), accepted, and the attempt's topology in stage order;
`spec.parallelism` forces the stage count, and dataReplicas > 1 is refused naming its field."""

from __future__ import annotations

from sqlalchemy import select

from layers.orchestration.lifecycle.plan import attempt_plan
from layers.orchestration.planning import perf
from layers.orchestration.planning.types import JobRequirements, ModelShape
from layers.resource.capacity import LinkView
from layers.service.models import JobRow
from layers.service.schemas import MODEL_PRESETS, TrainingJobSpec
from tests.api.test_jobs import quotes, submit
from tests.api.test_resource import cluster, link, site

SITES = ("fra-1", "ams-1", "waw-1")
# a GPU that holds one stage of `tiny` but not the whole model (declared memory: what the provider states)
SMALL_GB = 0.001


def _tiny() -> JobRequirements:
    shape = MODEL_PRESETS["tiny"]
    return JobRequirements(model=ModelShape(shape["parameters"], shape["layers"], shape["hidden"], shape["seqLen"]),
                           tokens=60_000, global_batch_tokens=768)


def small_world(memory_gb: float = SMALL_GB) -> list[dict]:
    items: list[dict] = []
    for name in SITES:
        c = cluster(f"{name}-small", name, gpus_per_node=1, nodes=1, price="0.50")
        c["spec"]["nodePools"][0]["gpu"] = {"model": "RTX4090", "memoryGB": memory_gb, "tflops": 165}
        items += [site(name), c]
    return items + [link("fra-ams", "fra-1", "ams-1", 10), link("ams-waw", "ams-1", "waw-1", 10),
                    link("fra-waw", "fra-1", "waw-1", 1)]


async def _register(api, memory_gb: float = SMALL_GB) -> None:  # type: ignore[no-untyped-def]
    resp = await api.client.post("/api/v1/apply", json={"items": small_world(memory_gb)}, headers=api.auth("prov-a"))
    assert resp.status == 200, await resp.text()
    for name in SITES:
        resp = await api.client.post(f"/api/v1/clusters/{name}-small/heartbeat", headers=api.auth("prov-a"),
                                     json={"allocatableGpus": 1, "conditions": [{"type": "Ready", "status": "True"}]})
        assert resp.status == 200


def _job(name: str, **spec) -> dict:  # type: ignore[no-untyped-def]
    return {"apiVersion": "cpn/v1", "kind": "TrainingJob", "metadata": {"name": name},
            "spec": {"model": "tiny", "tokens": 60_000, "globalBatchTokens": 768, **spec}}


def test_the_world_is_what_the_test_claims() -> None:
    req = _tiny()
    assert perf.worker_memory_gb(req) > SMALL_GB  # a whole replica does not fit
    cuts = perf.stage_cuts(req, 2)
    assert all(perf.stage_memory_gb(req, 2, s, perf.micro_batches(req, 1), cuts) <= SMALL_GB for s in range(2))


async def test_a_model_too_big_for_any_gpu_is_quoted_as_a_pipeline_and_accepted(api, db) -> None:  # type: ignore[no-untyped-def]
    await _register(api)
    resp = await submit(api, _job("staged"))
    assert resp.status == 201, await resp.text()
    items = await quotes(api, "staged")
    assert {q["label"] for q in items} == {"cheapest", "fastest", "balanced"}
    for q in items:
        assert q["strategy"] == "pipeline", q
        stages = sorted(p["stage"] for p in q["placement"])
        assert stages == list(range(len(stages))) and len(stages) >= 2, q["placement"]
        assert len({p["site"] for p in q["placement"]}) == len(stages)  # one site per stage
        assert q["ring"] == [p["site"] for p in sorted(q["placement"], key=lambda p: p["stage"])]
        assert q["placementSummary"].startswith("s0:") and ">s1:" in q["placementSummary"], q["placementSummary"]
    balanced = next(q for q in items if q["label"] == "balanced")
    # the slow fra–waw link (1 Gbit/s against 10) carries no cut of a two-stage pipeline
    if len(balanced["placement"]) == 2:
        assert {p["site"] for p in balanced["placement"]} != {"fra-1", "waw-1"}, balanced["placement"]
    resp = await api.client.post("/api/v1/jobs/staged/accept", json={"quote": "balanced"}, headers=api.auth("alice"))
    assert resp.status == 200, await resp.text()
    async with db.session() as s:
        job = (await s.execute(select(JobRow).where(JobRow.name == "alice/staged"))).scalar_one()
        status, spec = dict(job.status), TrainingJobSpec.model_validate(job.spec)
    assert status["strategy"] == "pipeline" and all(p["stage"] is not None for p in status["placement"])
    links = [LinkView(name=f"{a}-{b}", a=a, b=b, bandwidth_gbps=gbps, rtt_ms=20, price_per_gb="0.02", owner_id="")
             for a, b, gbps in (("fra-1", "ams-1", 10), ("ams-1", "waw-1", 10), ("fra-1", "waw-1", 1))]
    placement = list(reversed(status["placement"]))  # the stages, not the lines' order, set the sites' order
    topo, train = attempt_plan(spec, "pipeline", placement, ["zzz"], links)
    by_stage = sorted(status["placement"], key=lambda p: p["stage"])
    assert [x["name"] for x in topo["sites"]] == [p["site"] for p in by_stage]
    assert train["strategy"]["name"] == "pipeline" and train["strategy"]["stages"] == len(by_stage)


async def test_the_same_model_on_gpus_that_hold_it_stays_data_parallel(api) -> None:  # type: ignore[no-untyped-def]
    await _register(api, memory_gb=24)
    assert (await submit(api, _job("whole"))).status == 201
    assert all(q["strategy"] != "pipeline" and all(p.get("stage") is None for p in q["placement"])
               for q in await quotes(api, "whole"))


async def test_parallelism_forces_the_stage_count_and_refuses_replicas(api) -> None:  # type: ignore[no-untyped-def]
    await _register(api, memory_gb=24)
    resp = await submit(api, _job("three", parallelism={"pipelineStages": 3}))
    assert resp.status == 201, await resp.text()
    for q in await quotes(api, "three"):
        assert q["strategy"] == "pipeline" and sorted(p["stage"] for p in q["placement"]) == [0, 1, 2], q
    resp = await submit(api, _job("replicas", parallelism={"dataReplicas": 2}))
    error = (await resp.json())["error"]
    assert resp.status == 422 and error["field"] == "spec.parallelism.dataReplicas", error
    assert "one pipeline per job" in error["message"], error
    resp = await submit(api, _job("ddp-stages", strategy="ddp", parallelism={"pipelineStages": 2}))
    error = (await resp.json())["error"]
    assert resp.status == 422 and error["field"] == "spec.parallelism.pipelineStages", error
    resp = await submit(api, _job("four", parallelism={"pipelineStages": 4}))  # three sites only
    error = (await resp.json())["error"]
    assert resp.status == 422 and error["field"] == "spec.parallelism.pipelineStages", error
    assert "at most 3 stages" in error["message"], error


async def test_no_stage_fits_names_the_figures(api) -> None:  # type: ignore[no-untyped-def]
    await _register(api, memory_gb=0.0001)
    resp = await submit(api, _job("hopeless"))
    error = (await resp.json())["error"]
    assert resp.status == 422 and error["field"] == "spec.model", error
    assert "pipeline stages" in error["message"] and "largest stage still needs" in error["message"], error
