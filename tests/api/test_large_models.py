"""Large models through the API (issue 28): a Llama 3 8B with DiLoCo on two sites of 8 x 80 GB GPUs is
quoted sharded inside each site (`model.shard: site`, `model.memoryGBPerGpu` within the GPU's 80 GB) and
accepted, the attempt's TrainConfig carrying the plan; on sites of one 24 GB GPU each it is refused at
`spec.model` with the GB it needs per GPU and the most a site offers. A custom shape is quoted as the
shape the runtime builds; a bad one is a 422 at its key."""

from __future__ import annotations

from cpn.cli.ctl import output
from cpn.runtime import presets
from layers.orchestration.lifecycle.plan import attempt_plan
from layers.orchestration.planning import perf
from layers.orchestration.planning.types import JobRequirements, ModelShape
from layers.resource.capacity import LinkView
from layers.service.schemas import MODEL_PRESETS, TrainingJobSpec
from tests.api.test_jobs import quotes, submit
from tests.api.test_resource import cluster, link, site

SITES = ("fra-1", "ams-1")


async def _register(api, gpus: int, memory_gb: float) -> None:  # type: ignore[no-untyped-def]
    """Two sites of `gpus` H100-class GPUs (one node) declaring `memory_gb` each, linked at 10 Gbit/s."""
    items: list[dict] = []
    for name in SITES:
        c = cluster(f"{name}-gpu", name, gpus_per_node=gpus, nodes=1, price="2.00")
        c["spec"]["nodePools"][0]["gpu"] = {"model": "H100", "memoryGB": memory_gb, "tflops": 989}
        items += [site(name), c]
    items.append(link("fra-ams", "fra-1", "ams-1", 10))
    resp = await api.client.post("/api/v1/apply", json={"items": items}, headers=api.auth("prov-a"))
    assert resp.status == 200, await resp.text()
    for name in SITES:
        resp = await api.client.post(f"/api/v1/clusters/{name}-gpu/heartbeat", headers=api.auth("prov-a"),
                                     json={"allocatableGpus": gpus, "conditions": [{"type": "Ready", "status": "True"}]})
        assert resp.status == 200


def _job(name: str, **spec) -> dict:  # type: ignore[no-untyped-def]
    return {"apiVersion": "cpn/v1", "kind": "TrainingJob", "metadata": {"name": name},
            "spec": {"model": "llama3-8b", "strategy": "diloco", "tokens": 2_000_000_000,
                     "globalBatchTokens": 131_072, **spec}}


async def test_llama3_8b_with_diloco_is_sharded_inside_each_site_and_accepted(api) -> None:  # type: ignore[no-untyped-def]
    await _register(api, gpus=8, memory_gb=80)
    resp = await submit(api, _job("l8", gpus={"min": 16, "max": 16}))
    assert resp.status == 201, await resp.text()
    items = await quotes(api, "l8")
    assert len(items) == 3
    for q in items:
        assert q["strategy"] == "diloco" and sum(p["gpus"] for p in q["placement"]) == 16, q
        plan = q["model"]
        # 8.03 B parameters x 16 B = 128 GB: no 80 GB GPU holds them whole; over a site's 8 GPUs it does
        assert plan["shard"] == "site" and 0 < plan["memoryGBPerGpu"] <= 80, plan
        assert plan["activationCheckpointing"] in ("none", "full")
    kinds = (await (await api.client.get("/api/v1/kinds")).json())["items"]
    columns = next(k["columns"] for k in kinds if k["kind"] == "Quote")
    wide = output.table(items, columns, wide=True).splitlines()  # `cpnctl get quotes l8 -o wide`
    header = wide[0].split()
    assert {"MEM/GPU", "SHARD", "RECOMPUTE"} <= set(header), wide[0]
    assert all(f"{q['model']['memoryGBPerGpu']} GB" in line and " site " in line for q, line in zip(items, wide[1:],
                                                                                                   strict=True)), wide
    assert "MEM/GPU" not in output.table(items, columns)  # the plain table stays as it was
    resp = await api.client.post("/api/v1/jobs/l8/accept", json={"quote": "balanced"}, headers=api.auth("alice"))
    assert resp.status == 200, await resp.text()
    status = (await (await api.client.get("/api/v1/jobs/l8", headers=api.auth("alice"))).json())["status"]
    assert status["phase"] == "Reserved" and status["memory"]["shard"] == "site"
    links = [LinkView(name="fra-ams", a="fra-1", b="ams-1", bandwidth_gbps=10, rtt_ms=20, price_per_gb="0.02",
                      owner_id="")]
    spec = TrainingJobSpec.model_validate(_job("l8", gpus={"min": 16, "max": 16})["spec"])
    _, train = attempt_plan(spec, status["strategy"], status["placement"], status["ring"], links, memory=status["memory"])
    assert train["model"] == "llama3-8b" and train["shard"] == "site"  # what the attempt's workers build
    assert train["activation_checkpointing"] == status["memory"]["activationCheckpointing"]


async def test_llama3_8b_on_single_24gb_gpus_is_refused_naming_the_memory(api) -> None:  # type: ignore[no-untyped-def]
    await _register(api, gpus=1, memory_gb=24)
    resp = await submit(api, _job("l8-small"))
    assert resp.status == 422, await resp.text()
    error = (await resp.json())["error"]
    assert error["field"] == "spec.model", error
    shape = MODEL_PRESETS["llama3-8b"]
    whole = perf.worker_memory_gb(JobRequirements(  # one GPU per site: nothing to shard over
        model=ModelShape(shape["parameters"], shape["layers"], shape["hidden"], shape["seqLen"], vocab=128_256),
        tokens=1, global_batch_tokens=1), checkpointing=True)
    assert f"needs at least {whole:.1f} GB per GPU" in error["message"], error
    assert "has 24 GB" in error["message"], error


async def test_shard_none_is_kept_as_asked_and_refused_when_nothing_holds_it(api) -> None:  # type: ignore[no-untyped-def]
    await _register(api, gpus=8, memory_gb=80)
    resp = await submit(api, _job("whole", gpus={"min": 16, "max": 16}, parallelism={"shard": "none"}))
    assert resp.status == 422, await resp.text()
    error = (await resp.json())["error"]
    assert error["field"] == "spec.model" and "on every GPU" in error["message"], error


def test_a_custom_shape_is_priced_as_the_model_the_runtime_builds() -> None:
    shape = {"layers": 4, "hidden": 256, "heads": 8, "kvHeads": 4, "ffnHidden": 704, "vocab": 256, "seqLen": 128}
    spec = TrainingJobSpec.model_validate({"model": shape, "tokens": 10**6})
    built = presets.resolve(shape)
    assert spec.model.shape() == {"parameters": built.parameters, "layers": 4, "hidden": 256, "seqLen": 128,
                                  "vocab": 256}
    assert spec.model.runtime_model() == shape and built.parameters == presets.PRESETS["llama-nano"].parameters


async def test_a_custom_shape_is_quoted_accepted_and_built_by_the_runtime(api) -> None:  # type: ignore[no-untyped-def]
    await _register(api, gpus=8, memory_gb=80)
    shape = {"layers": 4, "hidden": 256, "heads": 8, "kvHeads": 4, "ffnHidden": 704, "vocab": 256, "seqLen": 128}
    resp = await submit(api, _job("custom", model=shape, strategy="ddp", tokens=1_000_000, globalBatchTokens=4096,
                                  gpus={"min": 2, "max": 2}))
    assert resp.status == 201, await resp.text()
    items = await quotes(api, "custom")
    assert all(q["model"]["shard"] == "none" and q["model"]["activationCheckpointing"] == "none" for q in items)
    resp = await api.client.post("/api/v1/jobs/custom/accept", json={"quote": "cheapest"}, headers=api.auth("alice"))
    assert resp.status == 200, await resp.text()


async def test_a_bad_custom_shape_names_its_key(api) -> None:  # type: ignore[no-untyped-def]
    shape = {"layers": 4, "hidden": 256, "heads": 8, "kvHeads": 4, "ffnHidden": 704, "vocab": 256, "seqLen": 128}
    for bad, key in (({**shape, "heads": 3}, "hidden"), ({**shape, "kvHeads": 3}, "heads"),
                     ({k: v for k, v in shape.items() if k != "vocab"}, "vocab"),
                     ({**shape, "parameters": 10**6}, "parameters")):
        resp = await submit(api, _job("bad", model=bad))
        error = (await resp.json())["error"]
        assert resp.status == 422 and error["field"] == f"spec.model.{key}", (bad, error)
    resp = await submit(api, _job("counted", model={"parameters": 10**9, "layers": 8, "hidden": 2048, "seqLen": 512}))
    error = (await resp.json())["error"]  # a bare parameter count describes one's own code, not the built-in model
    assert resp.status == 422 and error["field"] == "spec.model.parameters" and "spec.code" in error["message"], error


async def test_shard_site_with_a_strategy_that_cannot_run_sharded_is_refused(api) -> None:  # type: ignore[no-untyped-def]
    await _register(api, gpus=8, memory_gb=80)
    for strategy in ("gossip", "async_ps", "pipeline"):
        resp = await submit(api, _job("ps", strategy=strategy, parallelism={"shard": "site"}))
        error = (await resp.json())["error"]
        assert resp.status == 422 and error["field"] == "spec.parallelism.shard", error
        assert "ddp, hierarchical" in error["message"], error
