"""M4 (issue 35): a link between two providers' sites needs both. One provider's apply is pending and unused
by planning; the other's apply of the same link accepts it, of other figures replaces it; nobody but the two
(or an admin) changes or deletes it; an admin's link is active at once."""

from __future__ import annotations

from datetime import timedelta

from layers.orchestration.jobs.data import wan_links
from layers.resource.capacity import inventory
from tests.api.test_resource import apply, cluster, link, site


async def _two_providers(api) -> None:  # type: ignore[no-untyped-def]
    assert (await apply(api, "prov-a", [site("fra-1"), site("ams-1"), cluster("fra-h100", "fra-1")])).status == 200
    assert (await apply(api, "prov-b", [site("nyc-1", "us-east"), cluster("nyc-h100", "nyc-1")])).status == 200


async def _get(api, name: str, who: str = "alice") -> tuple[int, dict]:  # type: ignore[no-untyped-def]
    resp = await api.client.get(f"/api/v1/links/{name}", headers=api.auth(who))
    return resp.status, await resp.json()


def _accepted(body: dict) -> dict:
    return next(c for c in body["status"]["conditions"] if c["type"] == "Accepted")


async def _planned(db) -> tuple[list[str], list[tuple[str, str]]]:  # type: ignore[no-untyped-def]
    """The links planning and pricing see: the catalogue's and the data-transfer model's."""
    async with db.session() as s:
        _, links = await inventory(s, timedelta(seconds=60))
        wan = await wan_links(s)
    return [ln.name for ln in links], [(w.a, w.b) for w in wan]


async def test_a_link_to_another_providers_site_is_pending_until_it_applies_the_same(api, db) -> None:
    await _two_providers(api)
    resp = await apply(api, "prov-a", [link("fra-nyc", "fra-1", "nyc-1")])
    assert resp.status == 200, await resp.text()
    status, body = await _get(api, "fra-nyc")
    cond = _accepted(body)
    assert status == 200 and body["status"]["accepted"] is False and body["status"]["state"] == "Pending"
    assert cond["status"] == "False" and cond["reason"] == "AwaitingOtherProvider"
    assert "prov-b" in cond["message"] and "nyc-1" in cond["message"] and "bandwidthGbps" in cond["message"]
    assert await _planned(db) == ([], [])  # not offered to any plan while pending
    # prov-b applies the same link under its own name: that is its consent, not a clash
    resp = await apply(api, "prov-b", [link("nyc-side", "fra-1", "nyc-1")])
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["items"][0]["action"] == "configured"
    status, body = await _get(api, "fra-nyc")
    assert body["status"]["accepted"] is True and _accepted(body)["reason"] == "BothProviders"
    assert body["status"]["state"] == "Active"  # what `cpnctl get links` shows in its STATE column
    assert {p["provider"]: p["accepted"] for p in body["status"]["parties"]} == {"prov-a": True, "prov-b": True}
    assert (await _get(api, "nyc-side"))[0] == 404  # one link per pair of sites
    assert await _planned(db) == (["fra-nyc"], [("fra-1", "nyc-1")])
    # a change of figures by either provider needs the other's consent again
    changed = link("fra-nyc", "fra-1", "nyc-1", gbps=40)
    resp = await api.client.put("/api/v1/links/fra-nyc", json=changed, headers=api.auth("prov-b"))
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    assert body["status"]["accepted"] is False and "prov-a" in _accepted(body)["message"]
    assert await _planned(db) == ([], [])
    assert (await apply(api, "prov-a", [changed])).status == 200
    assert (await _get(api, "fra-nyc"))[1]["status"]["accepted"] is True


async def test_a_squatters_link_never_blocks_the_other_provider(api, db) -> None:
    await _two_providers(api)
    squat = link("squat", "nyc-1", "fra-1")  # prov-a names prov-b's egress price from nyc-1
    resp = await api.client.post("/api/v1/links", json=squat, headers=api.auth("prov-a"))
    assert resp.status == 201, await resp.text()
    assert (await resp.json())["status"]["accepted"] is False
    assert await _planned(db) == ([], [])  # its figures bind nobody and price nothing
    # prov-b's own link between the same sites, with its own figures, replaces the proposal
    own = link("nyc-fra", "nyc-1", "fra-1", gbps=2)
    resp = await api.client.post("/api/v1/links", json=own, headers=api.auth("prov-b"))
    assert resp.status == 201, await resp.text()
    body = await resp.json()
    assert body["metadata"]["name"] == "nyc-fra" and body["spec"]["bandwidthGbps"] == 2
    assert body["status"]["accepted"] is False and "prov-a" in _accepted(body)["message"]
    assert (await _get(api, "squat"))[0] == 404
    # prov-b may also simply delete a pending link touching its site (declining it)
    assert (await apply(api, "prov-a", [link("nyc-fra", "nyc-1", "fra-1", gbps=2)])).status == 200  # accepted
    assert (await _get(api, "nyc-fra"))[1]["status"]["accepted"] is True
    resp = await api.client.delete("/api/v1/links/nyc-fra", headers=api.auth("prov-a"))  # not its creator
    assert resp.status == 200, await resp.text()
    assert (await _get(api, "nyc-fra"))[0] == 404 and await _planned(db) == ([], [])
    resp = await api.client.post("/api/v1/links", json=squat, headers=api.auth("prov-a"))
    assert resp.status == 201
    assert (await api.client.delete("/api/v1/links/squat", headers=api.auth("prov-b"))).status == 200


async def test_a_provider_cannot_touch_a_link_between_two_sites_of_another(api) -> None:
    await _two_providers(api)
    assert (await apply(api, "prov-a", [link("fra-ams", "fra-1", "ams-1")])).status == 200
    status, body = await _get(api, "fra-ams")
    assert body["status"]["accepted"] is True and _accepted(body)["reason"] == "OneProvider"
    for method, body_ in (("DELETE", None), ("PUT", link("fra-ams", "fra-1", "ams-1", gbps=1))):
        resp = await api.client.request(method, "/api/v1/links/fra-ams", json=body_, headers=api.auth("prov-b"))
        err = (await resp.json())["error"]
        assert resp.status == 403 and "other providers" in err["message"], err
    resp = await api.client.post("/api/v1/links", json=link("mine", "ams-1", "fra-1"), headers=api.auth("prov-b"))
    err = (await resp.json())["error"]
    assert resp.status == 403 and err["field"] == "spec.a" and "fra-1" in err["message"], err
    # the owner's second link over the same pair names the one to change instead
    resp = await api.client.post("/api/v1/links", json=link("again", "ams-1", "fra-1"), headers=api.auth("prov-a"))
    err = (await resp.json())["error"]
    assert resp.status == 422 and err["field"] == "spec.b" and "fra-ams" in err["message"], err


async def test_an_admin_creates_a_link_between_two_providers_active(api, db) -> None:
    await _two_providers(api)
    resp = await api.client.post("/api/v1/links", json=link("fra-nyc", "fra-1", "nyc-1"), headers=api.auth("admin"))
    assert resp.status == 201, await resp.text()
    body = await resp.json()
    assert body["status"]["accepted"] is True and _accepted(body)["reason"] == "Admin"
    assert await _planned(db) == (["fra-nyc"], [("fra-1", "nyc-1")])
    # both providers of its ends may delete it
    assert (await api.client.delete("/api/v1/links/fra-nyc", headers=api.auth("prov-b"))).status == 200


async def test_the_demo_world_with_its_consents_has_every_link_active(api, db) -> None:
    """The demo (and the e2e World) apply beta's world, alpha's (with its links to nyc-1, pending), then
    beta-dc's consents: every link of the demo is then active."""
    from cpn.cli.demo import LINKS
    from tests.layers.orchestration.test_reconciler import _world

    await _world(api)
    items = (await (await api.client.get("/api/v1/links", headers=api.auth("alice"))).json())["items"]
    assert sorted(i["metadata"]["name"] for i in items) == sorted(f"{a}--{b}" for a, b, *_ in LINKS)
    assert all(i["status"]["accepted"] is True for i in items), [i["status"] for i in items]
    assert sorted((await _planned(db))[0]) == sorted(f"{a}--{b}" for a, b, *_ in LINKS)


async def test_a_job_quoted_over_the_two_sites_sees_the_link_only_once_both_applied_it(api) -> None:
    """Two sites must be linked for a two-site plan: over a squatter's pending link there is none."""
    from tests.api.test_jobs import job

    await _two_providers(api)
    for who, name in (("prov-a", "fra-h100"), ("prov-b", "nyc-h100")):
        resp = await api.client.post(f"/api/v1/clusters/{name}/heartbeat", headers=api.auth(who),
                                     json={"allocatableGpus": 16, "conditions": [{"type": "Ready", "status": "True"}]})
        assert resp.status == 200, await resp.text()
    assert (await apply(api, "prov-a", [link("fra-nyc", "fra-1", "nyc-1")])).status == 200

    two_sites = job("over", gpus={"min": 2, "max": 32}, sites={"min": 2, "max": 2})
    resp = await api.client.post("/api/v1/jobs?dryRun=true", json=two_sites, headers=api.auth("alice"))
    err = (await resp.json())["error"]
    assert resp.status == 422 and err["field"] == "spec.sites.min" and "linked" in err["message"], err
    assert (await apply(api, "prov-b", [link("fra-nyc", "fra-1", "nyc-1")])).status == 200  # consent
    resp = await api.client.post("/api/v1/jobs?dryRun=true", json=two_sites, headers=api.auth("alice"))
    assert resp.status == 200, await resp.text()
    quotes = (await resp.json())["status"]["quotes"]
    assert quotes and all({p["cluster"] for p in q["placement"]} == {"fra-h100", "nyc-h100"} for q in quotes)
