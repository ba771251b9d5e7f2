"""What schemathesis found, pinned: NUL bytes are bad input (422, not a database error), query values
are checked against the published schema, error field paths are the user's, 405 names the methods."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("path, field", [
    ("/api/v1/reservations?job=%00abc", "job"),
    ("/api/v1/subtasks?job=%22%00", "job"),
    ("/api/v1/invoices?job=a%00", "job"),
    ("/api/v1/clusters?site=%00", "site"),          # an undeclared filter: refused all the same
    ("/api/v1/jobs/a%00b", "path"),
    ("/api/v1/audit?limit=", "limit"),
    ("/api/v1/audit?limit=abc", "limit"),
    ("/api/v1/jobs?limit=0", "limit"),
    ("/api/v1/jobs?labelSelector=a%20b", "labelSelector"),
    ("/api/v1/subtasks?timeoutSeconds=31", "timeoutSeconds"),
    ("/api/v1/subtasks?watch=yes", "watch"),
])
async def test_bad_query_and_nul_are_422_naming_the_parameter(api, path: str, field: str) -> None:
    r = await api.client.get(path, headers=api.auth("alice"))
    body = await r.json()
    assert r.status == 422, body
    assert body["error"]["field"] == field and body["error"]["code"] == "invalid"


async def test_nul_in_a_body_is_422_with_its_path(api) -> None:
    for content_type, text in [("application/json", '{"quote": "a\\u0000b"}'),
                               ("application/yaml", 'quote: "a\\0b"\n')]:
        r = await api.client.post("/api/v1/jobs/x/accept", data=text, headers={
            **api.auth("alice"), "Content-Type": content_type})
        body = await r.json()
        assert r.status == 422 and body["error"]["field"] == "quote", body


async def test_error_fields_are_user_paths(api) -> None:
    job = {"apiVersion": "cpn/v1", "kind": "TrainingJob", "metadata": {"name": "j"},
           "spec": {"model": {"preset": "nope"}, "tokens": True}}
    r = await api.client.post("/api/v1/jobs", json=job, headers=api.auth("alice"))
    body = await r.json()
    assert r.status == 422
    fields = [d["field"] for d in body["error"]["details"]]
    assert "spec.model" in fields and "spec.tokens" in fields, fields
    assert "function-after" not in str(body) and "ModelSpec" not in str(body)


async def test_405_says_allow_and_document_states_the_rules(api) -> None:
    r = await api.client.request("TRACE", "/healthz")
    assert r.status == 405 and "GET" in r.headers["Allow"]
    doc = await (await api.client.get("/api/v1/openapi.json")).json()
    params = {p["name"]: p["schema"] for p in doc["paths"]["/api/v1/jobs"]["get"]["parameters"]}
    assert params["limit"]["type"] == "integer" and params["limit"]["minimum"] == 1
    assert doc["paths"]["/api/v1/sites/{name}"]["patch"]["requestBody"]["required"] is True
    links = doc["paths"]["/api/v1/jobs"]["post"]["responses"]["201"]["links"]
    assert {"Get_item", "Delete_item", "Post_accept", "Get_quotes"} <= set(links)
    schemas = doc["components"]["schemas"]
    assert schemas["ObjectMeta"]["properties"]["name"]["pattern"].startswith("^[a-z0-9]")
    site_spec = next(v for k, v in schemas.items() if k.startswith("SiteSpec"))
    assert site_spec["properties"]["region"]["pattern"] == "^[a-z0-9][-a-z0-9]{0,62}$"
    assert doc["paths"]["/api/v1/sites/{name}"]["delete"]["responses"]["200"]["content"]["application/json"][
        "schema"] == {"$ref": "#/components/schemas/Status"}


@pytest.mark.parametrize("path, body, field", [
    ("status", {"phase": "Failed", "exitCodes": {"k": True}}, "exitCodes.k"),
    ("logs", {"lines": [{"rank": True, "line": "x"}]}, "lines[0].rank"),
    ("claim", {"rendezvous": {"host": "h", "port": True}}, "rendezvous.port"),
])
async def test_true_is_not_a_number_in_the_agent_protocol(api, path: str, body: dict, field: str) -> None:
    """schemathesis (CI, ST201): `exitCodes: {k: true}` was accepted as exit code 1 — pydantic's lax mode
    reads a boolean as an integer where the published schema says integer."""
    r = await api.client.post(f"/api/v1/subtasks/0b5a1b5e-0000-4000-8000-000000000000/{path}", json=body,
                              headers=api.auth("prov-a"))
    out = await r.json()
    assert r.status == 422, out
    fields = [out["error"].get("field"), *(d["field"] for d in out["error"].get("details", []))]
    assert field in fields, out


async def test_a_whole_float_is_an_integer_in_the_agent_protocol(api) -> None:
    """…while 6724.0 is one (JSON Schema's integer; schemathesis sent it and a strict int refused it)."""
    r = await api.client.post("/api/v1/subtasks/0b5a1b5e-0000-4000-8000-000000000000/logs",
                              json={"lines": [{"rank": 6724.0, "line": "x"}]}, headers=api.auth("prov-a"))
    assert r.status == 404, await r.json()  # valid body, unknown sub-task


@pytest.mark.parametrize("text, says", [
    ("1" * 5000, "malformed JSON: Exceeds the limit"),  # int(str) refuses over 4300 digits
    ("[" * 100_000 + "]" * 100_000, "malformed JSON: nested deeper than 32 levels"),
    ('{"a":' * 50_000 + "1" + "}" * 50_000, "malformed JSON: nested deeper than 32 levels"),
    ('{"spec":' * 40 + "1" + "}" * 40, "nested deeper than 32 levels"),  # parsed, then refused before the model
])
async def test_bodies_too_deep_or_too_long_a_number_are_400_not_500(api, text: str, says: str) -> None:
    """An API probe: these were 500s (ValueError from int(), RecursionError from the decoder)."""
    r = await api.client.post("/api/v1/jobs", data=text, headers={**api.auth("alice"),
                                                                   "Content-Type": "application/json"})
    body = await r.json()
    assert r.status == 400 and body["error"]["code"] == "malformed", body
    assert says in body["error"]["message"], body


@pytest.mark.parametrize("budget, says", [
    ("1e999999999", "must be a decimal amount"),  # blocked the server 40 s formatting a billion digits, then 500
    ("1e400", "must be a decimal amount"),
    ("1_000", "must be a decimal amount"),
    (" 1 ", "must be a decimal amount"),
    ("-0", "must be a decimal amount"),
    (10**15, "must be at most 1000000000000"),
    ("1" + "0" * 5000, "must be at most 1000000000000"),
])
async def test_a_budget_is_digits_and_a_point_within_bounds(api, budget: object, says: str) -> None:
    from tests.api.test_jobs import job

    r = await api.client.post("/api/v1/jobs", json=job(budget=budget), headers=api.auth("alice"))
    body = await r.json()
    assert r.status == 422, body
    details = body["error"].get("details") or [body["error"]]
    assert any(d["field"] == "spec.budget" and says in d["message"] for d in details), body


async def test_a_huge_layer_count_is_refused_before_the_planner_and_nan_weights_say_finite(api) -> None:
    """An API probe: spec.model.layers 10000 kept the planner (on the event loop) busy for minutes."""
    import time

    from tests.api.test_jobs import job, register_world

    await register_world(api)
    shape = {"hidden": 2048, "heads": 16, "vocab": 256, "seqLen": 1024}  # the built-in model's shape
    r = await api.client.post("/api/v1/jobs", json=job("deep", model={**shape, "layers": 10_000}),
                              headers=api.auth("alice"))
    body = await r.json()
    assert r.status == 422 and "less than or equal to 1024" in str(body) and "spec.model.layers" in str(body), body
    started = time.monotonic()
    r = await api.client.post("/api/v1/jobs", json=job("widest", model={**shape, "layers": 1024}, gpus={"min": 1, "max": 3}),
                              headers=api.auth("alice"))
    assert r.status in (201, 422), await r.text()  # quoted, or refused for memory: either way promptly
    assert time.monotonic() - started < 20
    r = await api.client.post("/api/v1/jobs", data='{"apiVersion": "cpn/v1", "kind": "TrainingJob", "metadata": '
                              '{"name": "nan"}, "spec": {"model": "small", "tokens": 1000000, "objective": {"cost": NaN}}}',
                              headers={**api.auth("alice"), "Content-Type": "application/json"})
    body = await r.json()
    assert r.status == 422 and "finite" in str(body) and "spec.objective.cost" in str(body), body


async def test_an_unknown_path_says_where_the_api_is(api) -> None:
    """A probe: `--server http://HOST:PORT/api` gave a bare "error: Not Found"."""
    r = await api.client.get("/api/api/v1/jobs", headers=api.auth("alice"))
    body = await r.json()
    assert r.status == 404 and body["error"]["code"] == "not_found", body
    assert "no such path /api/api/v1/jobs: the API is under /api/v1" in body["error"]["message"], body
    r = await api.client.get("/api/v1/jobs/nope", headers=api.auth("alice"))  # a route's own 404 keeps its words
    assert "nope" in (await r.json())["error"]["message"]


def test_a_non_cpn_answer_is_named_as_such() -> None:
    """A probe: an address answering a bare 404 gave "error: HTTP 404: " and nothing after it."""
    import httpx

    from cpn.client import ApiError, Client

    client = Client("http://example.invalid:8080")
    client._http = httpx.Client(base_url="http://example.invalid:8080",  # noqa: SLF001
                                transport=httpx.MockTransport(lambda request: httpx.Response(404)))
    with pytest.raises(ApiError) as caught:
        client.get("/api/v1/jobs")
    assert "HTTP 404 from http://example.invalid:8080/api/v1/jobs, not a CPN API answer (Not Found)" in str(caught.value)


async def test_planning_runs_off_the_event_loop_and_others_are_answered_meanwhile(api, monkeypatch) -> None:
    """A large job's planning (seconds) ran on the event loop, where every other user's request and the
    sites' heartbeats waited for it; it runs on a worker thread now, and the loop answers meanwhile."""
    import asyncio
    import threading
    import time

    from layers.orchestration.planning import placement
    from tests.api.test_jobs import job, register_world

    await register_world(api)
    loop_thread, seen, release = threading.current_thread(), [], threading.Event()
    plan = placement.quote_options

    def slow_plan(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - wraps the real planner
        seen.append(threading.current_thread())
        release.wait(10)  # held until the loop has answered another request: on the loop, this would deadlock
        return plan(*args, **kwargs)

    monkeypatch.setattr(placement, "quote_options", slow_plan)
    submit = asyncio.ensure_future(api.client.post("/api/v1/jobs", json=job("big"), headers=api.auth("alice")))
    while not seen:
        await asyncio.sleep(0.01)
    started = time.monotonic()
    r = await api.client.get("/healthz")
    answered = time.monotonic() - started
    release.set()
    assert r.status == 200 and answered < 5, answered
    assert (await submit).status == 201
    assert seen and all(t is not loop_thread and t.name.startswith("cpn-planner") for t in seen)
