"""Validation as a new user meets it: every error at once, the user's field paths, valid values listed,
YAML line and column, scientific notation for numbers, kinds named as the CLI names them."""

from __future__ import annotations

import pytest

from tests.api.test_jobs import job, register_world, submit

YAML = {"Content-Type": "application/yaml"}


async def test_every_error_is_reported_with_the_users_field_path(api) -> None:
    body = job(model="huge", tokens="lots", gpus=4, strategy="warp", colour="blue")
    resp = await submit(api, body)
    assert resp.status == 422
    err = (await resp.json())["error"]
    fields = [d["field"] for d in err["details"]]
    assert fields == ["spec.model", "spec.tokens", "spec.strategy", "spec.gpus", "spec.colour"]
    assert err["field"] == "spec.model"
    assert "more)" not in err["message"] and "function-after" not in err["message"]
    assert all(f"{f}:" in err["message"] for f in fields)
    by = {d["field"]: d["message"] for d in err["details"]}
    for preset in ("tiny", "small", "medium", "base", "large", "gpt2-xl", "llama-7b", "llama-13b", "llama-70b"):
        assert preset in by["spec.model"]
    assert "gpus: {min: 4, max: 4}" in by["spec.gpus"] and "instance of" not in by["spec.gpus"]
    assert all(s in by["spec.strategy"] for s in ("ddp", "hierarchical", "diloco", "gossip", "ssp", "async_ps"))
    assert by["spec.colour"] == "unknown field"


async def test_yaml_errors_carry_line_and_column(api) -> None:
    text = "apiVersion: cpn/v1\nkind: TrainingJob\nmetadata: {name: x\nspec: {}\n"
    resp = await api.client.post("/api/v1/jobs", data=text, headers={**api.auth("alice"), **YAML})
    assert resp.status == 400
    assert "line 4 column" in (await resp.json())["error"]["message"]


async def test_scientific_notation_is_a_number_where_the_schema_is_numeric(api) -> None:
    await register_world(api)
    text = ("apiVersion: cpn/v1\nkind: trainingjob\nmetadata: {name: sci}\n"
            "spec: {model: tiny, tokens: 1e5, globalBatchTokens: 4.096e3, gpus: {min: 2, max: 4}}\n")
    resp = await api.client.post("/api/v1/jobs", data=text, headers={**api.auth("alice"), **YAML})
    assert resp.status == 201, await resp.text()
    spec = (await resp.json())["spec"]
    assert spec["tokens"] == 100000 and spec["globalBatchTokens"] == 4096
    bad = text.replace("tokens: 1e5", "tokens: 1.5e0").replace("name: sci", "name: sci2")
    resp = await api.client.post("/api/v1/jobs", data=bad, headers={**api.auth("alice"), **YAML})
    assert resp.status == 422
    assert (await resp.json())["error"]["field"] == "spec.tokens"


async def test_apply_takes_kinds_in_any_case_singular_plural_or_short(api) -> None:
    await register_world(api)
    items = [{**job("k1"), "kind": "trainingjob"}, {**job("k2"), "kind": "TrainingJobs"}]
    resp = await api.client.post("/api/v1/apply", json={"items": items}, headers=api.auth("alice"))
    assert resp.status == 200, await resp.text()
    assert [i["kind"] for i in (await resp.json())["items"]] == ["TrainingJob", "TrainingJob"]
    resp = await api.client.post("/api/v1/apply", json={"items": [{**job("k3"), "kind": "Jobz"}]},
                                 headers=api.auth("alice"))
    assert resp.status == 422
    err = (await resp.json())["error"]
    assert err["field"] == "items[0].kind"
    assert all(k in err["message"] for k in ("Cluster", "Link", "Site", "TrainingJob"))



async def test_objective_weights_are_bounded(api) -> None:
    """1e308 passed the schema and overflowed the planner's scores into a 500; now a 422 naming the field."""
    resp = await submit(api, job(objective={"cost": 1e308, "time": 1}))
    assert resp.status == 422
    err = (await resp.json())["error"]
    assert err["field"] == "spec.objective.cost", err


@pytest.mark.parametrize("spec, field, text", [
    ({"model": {"parameters": 1000}, "tokens": 1000, "code": {"entrypoint": "train"}}, "spec.code.entrypoint",
     "must be module:function inside the bundle (e.g. train:main), got 'train'"),
    ({"model": {"parameters": True}, "tokens": 1000}, "spec.model.parameters", "must be a number, got true"),
    ({"model": "tiny", "tokens": 1000, "budget": True}, "spec.budget", "must be a number, got true"),
])
async def test_messages_are_in_the_users_words(api, spec: dict, field: str, text: str) -> None:
    """A new user's session: a regular expression, Python's `True` and a union's 'must be a valid string'
    beside the real complaint reached the user."""
    body = {"apiVersion": "cpn/v1", "kind": "TrainingJob", "metadata": {"name": "words"}, "spec": spec}
    r = await api.client.post("/api/v1/jobs", json=body, headers=api.auth("alice"))
    error = (await r.json())["error"]
    assert r.status == 422 and error["field"] == field, error
    assert text in error["message"] and "valid string" not in error["message"], error
