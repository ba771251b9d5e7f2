"""A model too big for any one GPU, through the API (issue 14): quotes with a staged placement
(`placement[].stage`, strategy pipeline), accepted, and the attempt's topology in stage order;
`spec.parallelism` forces the stage count; dataReplicas D > 1 is quoted as D disjoint chains of sites
(lines with `stage` and `replica`, the attempt's sites replica-major and `strategy.stages` P), and a D
the sites cannot hold is refused naming its field. A user's nn.Sequential (spec.code) is cut and priced
by its own shape (spec.model.parameters, layers, hidden), or refused naming spec.model.layers."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select

from layers.orchestration.lifecycle.plan import attempt_plan
from layers.orchestration.planning import perf
from layers.orchestration.planning.types import JobRequirements, ModelShape
from layers.resource.capacity import LinkView
from layers.service.models import JobRow, QuoteRow
from layers.service.schemas import MODEL_PRESETS, TrainingJobSpec
from tests.api.test_bundles import hex_of, put, user_code
from tests.api.test_jobs import quotes, submit
from tests.api.test_resource import cluster, link, site

SITES = ("fra-1", "ams-1", "waw-1")


def _tiny() -> JobRequirements:
    shape = MODEL_PRESETS["tiny"]
    return JobRequirements(model=ModelShape(shape["parameters"], shape["layers"], shape["hidden"], shape["seqLen"]),
                           tokens=60_000, global_batch_tokens=768)


def _small_gb() -> float:
    """A GPU that holds one stage of `tiny` but not the whole model (declared memory: what the provider
    states): halfway between what the largest of two stages and the whole replica need."""
    req = _tiny()
    cuts = perf.stage_cuts(req, 2)
    stage = max(perf.stage_memory_gb(req, 2, s, perf.micro_batches(req, 1), cuts) for s in range(2))
    return round((stage + perf.worker_memory_gb(req)) / 2, 5)


SMALL_GB = _small_gb()


def small_world(memory_gb: float = SMALL_GB, sites: tuple[str, ...] = SITES) -> list[dict]:
    items: list[dict] = []
    for name in sites:
        c = cluster(f"{name}-small", name, gpus_per_node=1, nodes=1, price="0.50")
        c["spec"]["nodePools"][0]["gpu"] = {"model": "RTX4090", "memoryGB": memory_gb, "tflops": 165}
        items += [site(name), c]
    if sites != SITES:  # every pair linked
        return items + [link(f"{a}-{b}", a, b, 10) for i, a in enumerate(sites) for b in sites[i + 1:]]
    return items + [link("fra-ams", "fra-1", "ams-1", 10), link("ams-waw", "ams-1", "waw-1", 10),
                    link("fra-waw", "fra-1", "waw-1", 1)]


async def _register(api, memory_gb: float = SMALL_GB, sites: tuple[str, ...] = SITES) -> None:  # type: ignore[no-untyped-def]
    resp = await api.client.post("/api/v1/apply", json={"items": small_world(memory_gb, sites)},
                                 headers=api.auth("prov-a"))
    assert resp.status == 200, await resp.text()
    for name in sites:
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


async def staged_quotes(api, name: str) -> list[dict]:  # type: ignore[no-untyped-def]
    """The job's three quotes, each a pipeline of stages 0 .. P-1 (P >= 2) with its ring in stage order."""
    items = await quotes(api, name)
    assert {q["label"] for q in items} == {"cheapest", "fastest", "balanced"}
    for q in items:
        assert q["strategy"] == "pipeline", q
        stages = sorted(p["stage"] for p in q["placement"])
        assert stages == list(range(len(stages))) and len(stages) >= 2, q["placement"]
        assert q["ring"] == [p["site"] for p in sorted(q["placement"], key=lambda p: p["stage"])]
    return items


async def test_a_model_too_big_for_any_gpu_is_quoted_as_a_pipeline_and_accepted(api, db) -> None:  # type: ignore[no-untyped-def]
    await _register(api)
    resp = await submit(api, _job("staged"))
    assert resp.status == 201, await resp.text()
    items = await staged_quotes(api, "staged")
    for q in items:
        assert len({p["site"] for p in q["placement"]}) == len(q["placement"])  # one site per stage
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


async def test_parallelism_forces_the_stage_count_and_refuses_replicas_the_sites_cannot_hold(api) -> None:  # type: ignore[no-untyped-def]
    await _register(api, memory_gb=24)
    resp = await submit(api, _job("three", parallelism={"pipelineStages": 3}))
    assert resp.status == 201, await resp.text()
    for q in await quotes(api, "three"):
        assert q["strategy"] == "pipeline" and sorted(p["stage"] for p in q["placement"]) == [0, 1, 2], q
    resp = await submit(api, _job("replicas", parallelism={"dataReplicas": 2}))  # 2 x 2 stages: 4 sites, 3 here
    error = (await resp.json())["error"]
    assert resp.status == 422 and error["field"] == "spec.parallelism.dataReplicas", error
    assert "need 4 sites" in error["message"], error
    resp = await submit(api, _job("ddp-replicas", strategy="ddp", parallelism={"dataReplicas": 2}))
    error = (await resp.json())["error"]
    assert resp.status == 422 and error["field"] == "spec.parallelism.dataReplicas", error
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


FOUR_SITES = ("fra-1", "ams-1", "waw-1", "par-1")


async def test_two_replicas_are_quoted_on_disjoint_sites_and_planned_replica_major(api, db) -> None:  # type: ignore[no-untyped-def]
    await _register(api, memory_gb=24, sites=FOUR_SITES)  # GPUs that hold it whole: dataReplicas asks for the pipeline
    resp = await submit(api, _job("twice", parallelism={"dataReplicas": 2}))
    assert resp.status == 201, await resp.text()
    items = await quotes(api, "twice")
    assert {q["label"] for q in items} == {"cheapest", "fastest", "balanced"}
    for q in items:
        assert q["strategy"] == "pipeline", q
        slots = sorted((p["replica"], p["stage"]) for p in q["placement"])
        assert slots == [(0, 0), (0, 1), (1, 0), (1, 1)], q["placement"]
        assert len({p["site"] for p in q["placement"]}) == 4, q["placement"]  # disjoint chains
        order = sorted(q["placement"], key=lambda p: (p["replica"], p["stage"]))
        assert q["ring"] == [p["site"] for p in order], q
        first, second = q["placementSummary"].split(" | ")  # each replica's chain of stages, apart
        assert first.startswith(f"s0:{order[0]['gpus']}x{order[0]['gpuModel']}@{order[0]['site']}>s1:") and second.startswith("s0:"), q["placementSummary"]
    async with db.session() as s:  # the stored prediction: the stages' averaging, inside the step and the WAN bytes
        stored = (await s.execute(select(QuoteRow).join(JobRow, JobRow.id == QuoteRow.job_id)
                                  .where(JobRow.name == "alice/twice"))).scalars().all()
    assert len(stored) == 3
    for row in stored:
        pred = row.prediction
        assert pred["replicaInnerSteps"] >= 1 and 0 < pred["replicaWanBytes"] < pred["wanBytes"], pred
        assert 0 < pred["replicaSecondsPerStep"] < pred["stepSeconds"], pred
    resp = await submit(api, _job("thrice", parallelism={"dataReplicas": 2, "pipelineStages": 3}))  # 6 sites
    error = (await resp.json())["error"]
    assert resp.status == 422 and error["field"] == "spec.parallelism.dataReplicas", error
    assert "need 6 sites" in error["message"], error
    resp = await api.client.post("/api/v1/jobs/twice/accept", json={"quote": "balanced"}, headers=api.auth("alice"))
    assert resp.status == 200, await resp.text()
    async with db.session() as s:
        job = (await s.execute(select(JobRow).where(JobRow.name == "alice/twice"))).scalar_one()
        status, spec = dict(job.status), TrainingJobSpec.model_validate(job.spec)
    assert sorted((p["replica"], p["stage"]) for p in status["placement"]) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    links = [LinkView(name=f"{a}-{b}", a=a, b=b, bandwidth_gbps=10, rtt_ms=20, price_per_gb="0.02", owner_id="")
             for i, a in enumerate(FOUR_SITES) for b in FOUR_SITES[i + 1:]]
    topo, train = attempt_plan(spec, "pipeline", list(reversed(status["placement"])), ["zzz"], links)
    order = sorted(status["placement"], key=lambda p: (p["replica"], p["stage"]))
    assert [x["name"] for x in topo["sites"]] == [p["site"] for p in order]
    assert train["strategy"]["name"] == "pipeline" and train["strategy"]["stages"] == 2


def test_the_attempt_runs_p_stages_on_sites_in_replica_major_order() -> None:
    spec = TrainingJobSpec.model_validate(_job("x", strategy="pipeline",
                                               parallelism={"dataReplicas": 2, "pipelineStages": 2})["spec"])
    lines = [{"cluster": f"{site}-small", "site": site, "gpus": 1, "gpuModel": "RTX4090", "region": "eu",
              "stage": stage, "replica": replica}
             for site, replica, stage in (("par-1", 1, 1), ("fra-1", 0, 1), ("waw-1", 1, 0), ("ams-1", 0, 0))]
    links = [LinkView(name=f"{a}-{b}", a=a, b=b, bandwidth_gbps=10, rtt_ms=20, price_per_gb="0.02", owner_id="")
             for i, a in enumerate(FOUR_SITES) for b in FOUR_SITES[i + 1:]]
    topo, train = attempt_plan(spec, "pipeline", lines, ["fra-1", "ams-1", "waw-1", "par-1"], links)
    assert [x["name"] for x in topo["sites"]] == ["ams-1", "fra-1", "waw-1", "par-1"]  # site d·P + s: (d, s)
    assert train["strategy"]["stages"] == 2  # P, not the 4 sites: the runtime runs 4 / 2 replicas
    one = [dict(p, replica=None) for p in lines if p["replica"] == 0]
    _, single = attempt_plan(spec, "pipeline", one, ["fra-1", "ams-1"], links)
    assert single["strategy"]["stages"] == 2


async def test_a_lost_site_re_places_all_replicas_or_those_the_live_sites_hold_or_fails_naming_why(api, db) -> None:  # type: ignore[no-untyped-def]
    from datetime import timedelta

    from cpn.core.errors import Infeasible
    from layers.orchestration.lifecycle.replan import replace_placement, replicas_of, stages_of

    five = (*FOUR_SITES, "vie-1")
    await _register(api, memory_gb=24, sites=five)
    assert (await submit(api, _job("kept", parallelism={"dataReplicas": 2}))).status == 201
    resp = await api.client.post("/api/v1/jobs/kept/accept", json={"quote": "balanced"}, headers=api.auth("alice"))
    assert resp.status == 200, await resp.text()
    limits = {"heartbeat_timeout": timedelta(seconds=60), "lease_ttl": timedelta(hours=1)}
    async with db.session() as s:
        row = (await s.execute(select(JobRow).where(JobRow.name == "alice/kept"))).scalar_one()
        first = row.status["placement"]
        assert (stages_of(first), replicas_of(first)) == (2, 2)
        lost = next(p["site"] for p in first if (p["replica"], p["stage"]) == (1, 1))
        placed = await replace_placement(s, row, {lost}, **limits)
        assert sorted((p["replica"], p["stage"]) for p in placed) == [(0, 0), (0, 1), (1, 0), (1, 1)], placed
        assert lost not in {p["site"] for p in placed} and len({p["site"] for p in placed}) == 4, placed
        gone = {lost, first[0]["site"]}  # 3 sites left for 2 x 2 stages: the one replica they hold goes on
        row.status = {**row.status, "placement": placed}
        fewer = await replace_placement(s, row, gone, **limits)
        assert sorted((p["replica"], p["stage"]) for p in fewer) == [(0, 0), (0, 1)], fewer
        assert not gone & {p["site"] for p in fewer}, fewer
        row.status = {**row.status, "placement": fewer}  # and stays one replica: its checkpoint holds no more
        again = await replace_placement(s, row, set(), **limits)
        assert sorted((p["replica"], p["stage"]) for p in again) == [(0, 0), (0, 1)], again
        left = [x for x in five if x not in gone]
        with pytest.raises(Infeasible) as err:  # 1 site left for 2 stages
            await replace_placement(s, row, {*gone, *left[:2]}, **limits)
    assert err.value.field is None, err.value  # the lost sites' fault, no field of the spec's
    assert "holds 2 pipeline stages, each to resume on a site of its own" in err.value.message, err.value.message
    assert "only 1 live site(s) remain" in err.value.message, err.value.message


# a user's nn.Sequential: 6 children, a cut carries 256 values at each of 16 positions per unit
CODE_MODEL = {"parameters": 2_000_000, "layers": 6, "hidden": 256, "seqLen": 16}


async def _bundle(api, tmp_path: Path) -> dict:  # type: ignore[no-untyped-def]
    data = user_code(tmp_path)
    assert (await put(api, data)).status == 201
    return {"entrypoint": "train:main", "digest": f"sha256:{hex_of(data)}"}


def _code_job(name: str, code: dict, model: dict | None = None, **spec) -> dict:  # type: ignore[no-untyped-def]
    return _job(name, code=code, model=model or CODE_MODEL, **spec)


async def _stored(db, name: str) -> list[tuple[int, dict]]:  # type: ignore[no-untyped-def]
    """(stages, prediction) of the job's stored quotes."""
    async with db.session() as s:
        rows = (await s.execute(select(QuoteRow).join(JobRow, JobRow.id == QuoteRow.job_id)
                                .where(JobRow.name == f"alice/{name}"))).scalars().all()
    return [(len({p["stage"] for p in row.placement}), dict(row.prediction)) for row in rows]


async def test_a_users_sequential_is_quoted_in_stages_priced_by_its_own_cut_and_accepted(api, db, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    await _register(api, memory_gb=24)  # GPUs that hold it whole: strategy pipeline asks for the cut
    code = await _bundle(api, tmp_path)
    resp = await submit(api, _code_job("seq", code, strategy="pipeline"))
    assert resp.status == 201, await resp.text()
    await staged_quotes(api, "seq")
    stored = await _stored(db, "seq")
    assert len(stored) == 3
    for stages, pred in stored:  # per step: each cut units x hidden x seqLen x 4 B each way, 1 B of targets a unit
        cut = 768 * 256 * 16 * 4
        assert pred["steps"] == -(-60_000 // 768)
        assert pred["wanBytes"] == pytest.approx(pred["steps"] * (2 * cut * (stages - 1) + 768)), (stages, pred)
    resp = await api.client.post("/api/v1/jobs/seq/accept", json={"quote": "balanced"}, headers=api.auth("alice"))
    assert resp.status == 200, await resp.text()
    async with db.session() as s:
        job = (await s.execute(select(JobRow).where(JobRow.name == "alice/seq"))).scalar_one()
        status, spec = dict(job.status), TrainingJobSpec.model_validate(job.spec)
    by_stage = sorted(status["placement"], key=lambda p: p["stage"])
    assert status["strategy"] == "pipeline" and [p["stage"] for p in by_stage] == list(range(len(by_stage)))
    links = [LinkView(name=f"{a}-{b}", a=a, b=b, bandwidth_gbps=gbps, rtt_ms=20, price_per_gb="0.02", owner_id="")
             for a, b, gbps in (("fra-1", "ams-1", 10), ("ams-1", "waw-1", 10), ("fra-1", "waw-1", 1))]
    topo, train = attempt_plan(spec, "pipeline", list(reversed(status["placement"])), ["zzz"], links)
    assert [x["name"] for x in topo["sites"]] == [p["site"] for p in by_stage]
    assert train["strategy"]["name"] == "pipeline" and train["strategy"]["stages"] == len(by_stage)


async def test_a_users_code_without_its_children_is_refused_naming_spec_model_layers(api, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    await _register(api, memory_gb=24)
    code = await _bundle(api, tmp_path)
    for name, model, extra in (
            ("no-layers", {"parameters": 2_000_000, "hidden": 256}, {"strategy": "pipeline"}),
            ("few-layers", {**CODE_MODEL, "layers": 2}, {"parallelism": {"pipelineStages": 3}}),
            ("one-layer", {**CODE_MODEL, "layers": 1}, {"strategy": "pipeline"}),
            ("replicas", {"parameters": 2_000_000}, {"parallelism": {"dataReplicas": 2}})):
        for path in ("/api/v1/jobs", "/api/v1/jobs?dryRun=true"):
            resp = await api.client.post(path, json=_code_job(name, code, model, **extra), headers=api.auth("alice"))
            error = (await resp.json())["error"]
            assert resp.status == 422 and error["field"] == "spec.model.layers", (name, error)
            do = "add" if "layers" not in model else "set"
            assert f"{do} spec.model.layers to the number of the Sequential's children" in error["message"], error
    resp = await submit(api, _code_job("few-layers", code, {**CODE_MODEL, "layers": 2},
                                       parallelism={"pipelineStages": 3}))
    assert "at least 3 for 3 pipeline stages" in (await resp.json())["error"]["message"]
    resp = await submit(api, _code_job("no-hidden", code, {"parameters": 2_000_000, "layers": 6}, strategy="pipeline"))
    error = (await resp.json())["error"]
    assert resp.status == 422 and error["field"] == "spec.model.hidden", error
    resp = await submit(api, _code_job("auto", code, {"parameters": 2_000_000}))  # auto: data parallel, as before
    assert resp.status == 201, await resp.text()
    assert all(q["strategy"] != "pipeline" for q in await quotes(api, "auto"))


async def test_replicas_of_a_users_pipeline_are_quoted_and_planned_replica_major(api, db, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    await _register(api, memory_gb=24, sites=FOUR_SITES)
    code = await _bundle(api, tmp_path)
    resp = await submit(api, _code_job("twice", code, parallelism={"dataReplicas": 2}))
    assert resp.status == 201, await resp.text()
    for q in await quotes(api, "twice"):
        assert q["strategy"] == "pipeline", q
        assert sorted((p["replica"], p["stage"]) for p in q["placement"]) == [(0, 0), (0, 1), (1, 0), (1, 1)], q
        assert len({p["site"] for p in q["placement"]}) == 4, q["placement"]
    for _, pred in await _stored(db, "twice"):  # two replicas, each one cut on half the batch, and their averaging
        own = pred["steps"] * 2 * (2 * 384 * 256 * 16 * 4 + 384)
        assert pred["wanBytes"] == pytest.approx(own + pred["replicaWanBytes"]) and pred["replicaWanBytes"] > 0, pred
    resp = await api.client.post("/api/v1/jobs/twice/accept", json={"quote": "balanced"}, headers=api.auth("alice"))
    assert resp.status == 200, await resp.text()
    async with db.session() as s:
        job = (await s.execute(select(JobRow).where(JobRow.name == "alice/twice"))).scalar_one()
        status, spec = dict(job.status), TrainingJobSpec.model_validate(job.spec)
    links = [LinkView(name=f"{a}-{b}", a=a, b=b, bandwidth_gbps=10, rtt_ms=20, price_per_gb="0.02", owner_id="")
             for i, a in enumerate(FOUR_SITES) for b in FOUR_SITES[i + 1:]]
    topo, train = attempt_plan(spec, "pipeline", list(reversed(status["placement"])), ["zzz"], links)
    order = sorted(status["placement"], key=lambda p: (p["replica"], p["stage"]))
    assert [x["name"] for x in topo["sites"]] == [p["site"] for p in order]
    assert train["strategy"]["name"] == "pipeline" and train["strategy"]["stages"] == 2


async def test_auto_code_too_big_for_any_gpu_names_its_memory_and_the_pipeline_as_a_way_out(api, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    await _register(api, memory_gb=24)  # a 20 B-parameter model does not fit a 24 GB GPU whole
    code = await _bundle(api, tmp_path)
    resp = await submit(api, _code_job("big", code, {"parameters": 20_000_000_000}))
    body = await resp.json()
    assert resp.status == 422, body.get("status")
    error = body["error"]
    head, _, tail = error["message"].partition(", or let CPN cut it into pipeline stages across sites: ")
    # 20e9 parameters x 16 B of state, the runtime's 1 GB, a negligible 34 B of stated activations
    assert "321.0 GB per GPU" in head and tail.startswith("spec.model.layers 1 (unset: 1)"), error
    assert error["field"] == "spec.model", error  # the binding constraint is the model's memory
