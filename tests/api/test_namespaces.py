"""Per-owner job names: two users can each have a job `lm`; admins say whose as NAMESPACE/NAME."""

from __future__ import annotations

from sqlalchemy import select

from layers.service.models import JobRow
from tests.api.test_jobs import job, register_world, submit


async def _get(api, path: str, who: str):
    return await api.client.get(path, headers=api.auth(who))


async def test_two_users_each_have_a_job_of_the_same_name(api, db) -> None:
    await register_world(api)
    assert (await submit(api, job("lm", gpus={"min": 1, "max": 2}))).status == 201
    resp = await submit(api, job("lm", gpus={"min": 4, "max": 8}), who="bob")
    assert resp.status == 201, await resp.text()
    body = await resp.json()
    assert body["metadata"]["name"] == "lm" and body["metadata"]["namespace"] == "bob"

    alice = await (await _get(api, "/api/v1/jobs/lm", "alice")).json()
    bob = await (await _get(api, "/api/v1/jobs/lm", "bob")).json()
    assert alice["metadata"]["namespace"] == "alice" and bob["metadata"]["namespace"] == "bob"
    assert alice["metadata"]["uid"] != bob["metadata"]["uid"]
    assert alice["spec"]["gpus"]["max"] == 2 and bob["spec"]["gpus"]["max"] == 8
    async with db.session() as s:
        assert sorted((await s.execute(select(JobRow.name))).scalars()) == ["alice/lm", "bob/lm"]

    # each sees only their own: bob cannot reach alice's by naming her namespace
    assert (await _get(api, "/api/v1/jobs/alice%2Flm", "bob")).status == 404
    mine = await (await _get(api, "/api/v1/jobs", "bob")).json()
    assert [(j["metadata"]["namespace"], j["metadata"]["name"]) for j in mine["items"]] == [("bob", "lm")]
    # quotes, events and cancel act on the caller's own job
    assert (await _get(api, "/api/v1/jobs/lm/quotes", "bob")).status == 200
    cancelled = await api.client.post("/api/v1/jobs/lm/cancel", headers=api.auth("bob"))
    assert cancelled.status == 200, await cancelled.text()
    assert (await (await _get(api, "/api/v1/jobs/lm", "alice")).json())["status"]["phase"] == "Quoted"


async def test_admins_name_the_namespace_when_a_name_is_ambiguous(api) -> None:
    await register_world(api)
    assert (await submit(api, job("lm"))).status == 201
    assert (await submit(api, job("solo"), who="bob")).status == 201
    # one job of that name anywhere: a bare name finds it
    found = await _get(api, "/api/v1/jobs/solo", "admin")
    assert found.status == 200 and (await found.json())["metadata"]["namespace"] == "bob"
    assert (await submit(api, job("lm"), who="bob")).status == 201
    ambiguous = await _get(api, "/api/v1/jobs/lm", "admin")
    err = (await ambiguous.json())["error"]
    assert ambiguous.status == 422 and "alice/lm" in err["message"] and "bob/lm" in err["message"]
    assert err["field"] == "metadata.name"
    exact = await _get(api, "/api/v1/jobs/bob%2Flm", "admin")
    assert exact.status == 200 and (await exact.json())["metadata"]["namespace"] == "bob"
    everyone = await (await _get(api, "/api/v1/jobs", "admin")).json()
    assert [(j["metadata"]["namespace"], j["metadata"]["name"]) for j in everyone["items"]] == [
        ("alice", "lm"), ("bob", "lm"), ("bob", "solo")]
    only_bob = await (await _get(api, "/api/v1/jobs?namespace=bob", "admin")).json()
    assert [j["metadata"]["name"] for j in only_bob["items"]] == ["lm", "solo"]


async def test_jobs_are_created_only_in_the_callers_namespace(api) -> None:
    await register_world(api)
    body = job("lm")
    body["metadata"]["namespace"] = "alice"
    resp = await submit(api, body, who="bob")
    err = (await resp.json())["error"]
    assert resp.status == 403 and err["field"] == "metadata.namespace" and "'bob'" in err["message"]
    body["metadata"]["namespace"] = "bob"
    assert (await submit(api, body, who="bob")).status == 201  # naming one's own namespace is fine


async def test_invoices_follow_the_namespace_asked(api) -> None:
    """A new user's session: `cpnctl -n bob get invoices` listed the caller's own invoices (the API ignored
    ?namespace=); admins saw every namespace's."""

    await register_world(api)
    await submit(api, job("billed", gpus={"min": 1, "max": 1}, strategy="ddp", sites={"min": 1, "max": 1}))
    resp = await api.client.post("/api/v1/jobs/billed/accept", json={"quote": "cheapest"}, headers=api.auth("alice"))
    assert resp.status == 200, await resp.text()

    async def names(who: str, query: str) -> list[str]:
        r = await api.client.get(f"/api/v1/invoices{query}", headers=api.auth(who))
        assert r.status == 200, await r.text()
        return [i["spec"]["job"] for i in (await r.json())["items"]]

    assert await names("alice", "") == ["alice/billed"]
    assert await names("alice", "?namespace=alice") == ["alice/billed"]
    assert await names("alice", "?namespace=bob") == []
    assert await names("admin", "?namespace=alice") == ["alice/billed"]
    assert await names("admin", "?namespace=nosuch") == []
    for path in ("/api/v1/events", "/api/v1/reservations"):  # the other job lists filter alike
        for who, ns, some in (("alice", "alice", True), ("alice", "bob", False), ("admin", "nosuch", False)):
            r = await api.client.get(f"{path}?namespace={ns}", headers=api.auth(who))
            items = (await r.json())["items"]
            assert r.status == 200 and bool(items) is some, (path, who, ns, items)
            assert all(i.get("job", i.get("spec", {}).get("job", "")).startswith(f"{ns}/") for i in items)
