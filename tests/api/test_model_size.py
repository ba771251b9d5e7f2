"""How big is your code: a job with spec.code states spec.model.parameters (and optionally flopsPerUnit
and bytesPerUnit); without it the API says which field and why, and a preset is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select

from layers.orchestration.planning import perf
from layers.orchestration.planning.types import JobRequirements, ModelShape
from layers.service.models import JobRow, QuoteRow
from tests.api.test_bundles import hex_of, put, user_code
from tests.api.test_jobs import job, register_world, submit


async def _code(api, tmp_path: Path) -> dict:  # type: ignore[no-untyped-def]
    data = user_code(tmp_path)
    assert (await put(api, data)).status == 201
    return {"entrypoint": "train:main", "digest": f"sha256:{hex_of(data)}"}


def _job(name: str, code: dict, **spec) -> dict:  # type: ignore[no-untyped-def]
    body = job(name, code=code, tokens=10_000_000, globalBatchTokens=4096, gpus={"min": 1, "max": 1},
               placement={"sites": ["fra-1"]}, strategy="ddp", **spec)
    if "model" not in spec:
        del body["spec"]["model"]
    return body


async def test_code_without_its_size_is_refused_naming_spec_model_parameters(api, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    await register_world(api)
    code = await _code(api, tmp_path)
    for name, extra in (("no-model", {}), ("shape-only", {"model": {"layers": 4, "hidden": 256}})):
        for path in ("/api/v1/jobs", "/api/v1/jobs?dryRun=true"):
            resp = await api.client.post(path, json=_job(name, code, **extra), headers=api.auth("alice"))
            error = (await resp.json())["error"]
            assert resp.status == 422 and error["field"] == "spec.model.parameters", error
            assert "CPN cannot price your code without knowing its size" in error["message"], error
            assert "required field is missing" not in error["message"]
    resp = await api.client.post("/api/v1/apply", headers=api.auth("alice"), json={"items": [_job("batch", code)]})
    error = (await resp.json())["error"]
    assert resp.status == 422 and error["field"] == "items[0].spec.model.parameters", error


async def test_a_preset_with_code_is_refused_with_the_reason(api, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    await register_world(api)
    code = await _code(api, tmp_path)
    for model in ("small", {"preset": "llama-7b"}):
        resp = await submit(api, _job("preset", code, model=model))
        error = (await resp.json())["error"]
        assert resp.status == 422 and error["field"] == "spec.model.preset", error
        assert "your code builds its own" in error["message"] and "spec.model.parameters" in error["message"]
    assert (await submit(api, job("lm", model="small"))).status == 201  # CPN's own LM keeps its presets


async def test_flops_per_unit_replaces_six_per_parameter_in_the_price(api, db, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    await register_world(api)
    code = await _code(api, tmp_path)
    params = 50_000_000
    resp = await submit(api, _job("rule", code, model={"parameters": params}))
    assert resp.status == 201, await resp.text()
    resp = await submit(api, _job("stated", code, model={"parameters": params, "flopsPerUnit": 60 * params}))
    assert resp.status == 201, await resp.text()
    async with db.session() as s:
        jobs = {j.name: j.id for j in (await s.execute(select(JobRow))).scalars()}
        per_step = {}
        for name in ("rule", "stated"):
            q = (await s.execute(select(QuoteRow).where(QuoteRow.job_id == jobs[f"alice/{name}"],
                                                        QuoteRow.label == "balanced"))).scalar_one()
            per_step[name] = q.prediction["computeSecondsPerStep"]
            assert q.placement[0]["site"] == "fra-1"
    assert abs(per_step["stated"] / per_step["rule"] - 10.0) < 1e-9, per_step  # 60 vs 6 FLOPs per parameter


async def test_bytes_per_unit_sizes_the_memory_a_worker_needs(api, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    await register_world(api)
    code = await _code(api, tmp_path)
    fits = {"parameters": 1_000_000, "seqLen": 1024, "bytesPerUnit": 1_000_000}  # ~1 GB of activations
    assert (await submit(api, _job("fits", code, model=fits))).status == 201
    huge = {**fits, "bytesPerUnit": 100_000_000}  # 102 GB per sequence: no 80 GB GPU holds it
    resp = await submit(api, _job("huge", code, model=huge))
    error = (await resp.json())["error"]
    assert resp.status == 422 and error["field"] == "spec.model" and "GB per GPU" in error["message"], error


def test_the_compute_model_uses_the_stated_figures() -> None:
    base = JobRequirements(model=ModelShape(parameters=1000, layers=2, hidden=8, seq_len=16), tokens=10,
                           global_batch_tokens=32)
    assert perf.flops_per_step(base) == 6.0 * 1000 * 32
    assert perf.worker_memory_gb(base) == pytest.approx(
        (1000 * perf.TRAINING_STATE_BYTES + perf.ACTIVATION_BYTES * 16 * 8 * 2) / 1e9 + perf.RUNTIME_OVERHEAD_GB)
    stated = JobRequirements(model=ModelShape(parameters=1000, layers=2, hidden=8, seq_len=16, flops_per_unit=5e5,
                                              bytes_per_unit=3e6), tokens=10, global_batch_tokens=32)
    assert perf.flops_per_step(stated) == 5e5 * 32
    assert perf.worker_memory_gb(stated) == pytest.approx(
        (1000 * perf.TRAINING_STATE_BYTES + 3e6 * 16) / 1e9 + perf.RUNTIME_OVERHEAD_GB)
