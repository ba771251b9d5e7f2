"""Resource layer through the API: two providers, ownership, validation, heartbeats."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import update

from layers.resource.models import ClusterRow


def site(name: str, region: str = "eu-central") -> dict:
    return {"apiVersion": "cpn/v1", "kind": "Site", "metadata": {"name": name}, "spec": {"region": region}}


def cluster(name: str, site_name: str, gpus_per_node: int = 8, nodes: int = 2, price: str = "2.45",
            **spec) -> dict:
    return {"apiVersion": "cpn/v1", "kind": "Cluster", "metadata": {"name": name},
            "spec": {"site": site_name, "nodePools": [{
                "name": "main", "gpu": {"model": "H100", "memoryGB": 80, "tflops": 989},
                "gpusPerNode": gpus_per_node, "nodes": nodes, "pricePerGpuHour": price}], **spec}}


def link(name: str, a: str, b: str, gbps: float = 10) -> dict:
    return {"apiVersion": "cpn/v1", "kind": "Link", "metadata": {"name": name},
            "spec": {"a": a, "b": b, "bandwidthGbps": gbps, "rttMs": 20, "pricePerGB": "0.02"}}


WORLD_A = [site("fra-1"), site("ams-1", "eu-west"), cluster("fra-h100", "fra-1"),
           cluster("fra-a100", "fra-1", price="1.20"), cluster("ams-l40s", "ams-1", price="0.90"),
           link("fra-ams", "fra-1", "ams-1")]
WORLD_B = [site("nyc-1", "us-east"), cluster("nyc-h100", "nyc-1"), cluster("nyc-4090", "nyc-1", price="0.40"),
           link("nyc-fra", "nyc-1", "fra-1", 2), link("nyc-ams", "nyc-1", "ams-1", 2)]


async def apply(api, who: str, items: list[dict]):
    return await api.client.post("/api/v1/apply", json={"items": items}, headers=api.auth(who))


async def test_two_providers_register_a_world(api) -> None:
    assert (await apply(api, "prov-a", WORLD_A)).status == 200
    resp = await apply(api, "prov-b", WORLD_B)
    assert resp.status == 200, await resp.text()
    items = (await (await api.client.get("/api/v1/clusters", headers=api.auth("alice"))).json())["items"]
    assert sorted(c["metadata"]["name"] for c in items) == ["ams-l40s", "fra-a100", "fra-h100", "nyc-4090",
                                                            "nyc-h100"]
    links = (await (await api.client.get("/api/v1/links", headers=api.auth("alice"))).json())["items"]
    assert len(links) == 3
    sites = (await (await api.client.get("/api/v1/sites", headers=api.auth("alice"))).json())["items"]
    assert {s["metadata"]["name"]: s["spec"]["provider"] for s in sites} == {
        "fra-1": "prov-a", "ams-1": "prov-a", "nyc-1": "prov-b"}


async def test_provider_b_cannot_change_provider_a(api) -> None:
    await apply(api, "prov-a", WORLD_A)
    changed = cluster("fra-h100", "fra-1", price="0.01")
    resp = await api.client.put("/api/v1/clusters/fra-h100", json=changed, headers=api.auth("prov-b"))
    assert resp.status == 403
    assert (await api.client.delete("/api/v1/clusters/fra-h100", headers=api.auth("prov-b"))).status == 403
    resp = await api.client.post("/api/v1/clusters", json=cluster("sneaky", "fra-1"), headers=api.auth("prov-b"))
    assert resp.status == 403
    resp = await api.client.post("/api/v1/clusters/fra-h100/heartbeat", json={"allocatableGpus": 1},
                                 headers=api.auth("prov-b"))
    assert resp.status == 403
    assert (await api.client.put("/api/v1/clusters/fra-h100", json=changed, headers=api.auth("admin"))).status == 200


async def test_another_providers_bad_body_is_refused_for_the_owner_not_checked(api) -> None:
    """Ownership first: provider B's invalid PATCH or PUT of A's cluster gets 403, not a validation
    error that tells B what A's object holds or accepts (it used to be 422)."""
    await apply(api, "prov-a", WORLD_A)
    bad = {"spec": {"gpus": -5}}
    for method, body in (("patch", bad), ("put", {"kind": "Cluster", "spec": {"gpus": "many"}})):
        resp = await getattr(api.client, method)("/api/v1/clusters/fra-h100", json=body, headers=api.auth("prov-b"))
        assert resp.status == 403, (method, await resp.text())
        resp = await getattr(api.client, method)("/api/v1/clusters/fra-h100", json=body, headers=api.auth("prov-a"))
        assert resp.status == 422, (method, await resp.text())  # the owner still hears what is wrong


async def test_apply_is_all_or_nothing(api) -> None:
    resp = await apply(api, "prov-a", [site("fra-1"), cluster("bad", "nowhere")])
    assert resp.status == 422
    err = (await resp.json())["error"]
    assert err["field"] == "items[1].spec.site"
    listed = (await (await api.client.get("/api/v1/sites", headers=api.auth("alice"))).json())["items"]
    assert listed == []


async def test_validation_names_the_field(api) -> None:
    await apply(api, "prov-a", [site("fra-1"), site("ams-1")])
    bad_pool = cluster("c1", "fra-1")
    bad_pool["spec"]["nodePools"].append({**bad_pool["spec"]["nodePools"][0], "name": "two", "gpusPerNode": 0})
    cases = [
        (bad_pool, "spec.nodePools[1].gpusPerNode"),
        (cluster("c2", "fra-1", price="1.1234567"), "spec.nodePools[0].pricePerGpuHour"),
        (cluster("c3", "fra-1", nodes=-2), "spec.nodePools[0].nodes"),
        (link("self", "fra-1", "fra-1"), "spec.b"),
        (cluster("c4", "fra-1", driver="kubernetes"), "spec.kubernetes"),
    ]
    unknown_gpu = cluster("c5", "fra-1")
    unknown_gpu["spec"]["nodePools"][0]["gpu"]["fp8"] = 1979
    cases.append((unknown_gpu, "spec.nodePools[0].gpu.fp8"))
    for body, field in cases:
        resp = await api.client.post(f"/api/v1/{body['kind'].lower()}s", json=body, headers=api.auth("prov-a"))
        assert resp.status == 422, (field, await resp.text())
        assert (await resp.json())["error"]["field"] == field
    assert (await apply(api, "prov-a", [link("l1", "fra-1", "ams-1")])).status == 200
    resp = await api.client.post("/api/v1/links", json=link("l2", "ams-1", "fra-1"), headers=api.auth("prov-a"))
    assert resp.status == 422 and (await resp.json())["error"]["field"] == "spec.b"


async def test_site_with_clusters_cannot_be_deleted(api) -> None:
    await apply(api, "prov-a", WORLD_A)
    resp = await api.client.delete("/api/v1/sites/fra-1", headers=api.auth("prov-a"))
    assert resp.status == 409 and (await resp.json())["error"]["code"] == "in_use"


async def test_kubeconfig_reference_is_write_only(api) -> None:
    await apply(api, "prov-a", [site("fra-1")])
    body = cluster("k8s", "fra-1", driver="kubernetes",
                   kubernetes={"kubeconfigSecret": "vault:fra/kube", "namespace": "train"})
    assert (await api.client.post("/api/v1/clusters", json=body, headers=api.auth("prov-a"))).status == 201
    for who in ("alice", "prov-a", "admin"):
        got = await (await api.client.get("/api/v1/clusters/k8s", headers=api.auth(who))).json()
        assert "kubeconfigSecret" not in got["spec"]["kubernetes"], who
        assert got["spec"]["kubernetes"]["namespace"] == "train"


async def test_heartbeats_drive_ready_and_allocatable(api, db) -> None:
    await apply(api, "prov-a", WORLD_A)
    got = await (await api.client.get("/api/v1/clusters/fra-h100", headers=api.auth("alice"))).json()
    assert got["status"]["ready"] == "False" and got["status"]["allocatable"]["gpus"] == 0
    beat = {"allocatableGpus": 12, "conditions": [{"type": "Ready", "status": "True"}]}
    resp = await api.client.post("/api/v1/clusters/fra-h100/heartbeat", json=beat, headers=api.auth("prov-a"))
    assert resp.status == 200, await resp.text()
    got = await (await api.client.get("/api/v1/clusters/fra-h100", headers=api.auth("alice"))).json()
    assert got["status"]["ready"] == "True"
    assert got["status"]["allocatable"]["gpus"] == 12 and got["status"]["capacity"]["gpus"] == 16
    # the agent goes silent: its last heartbeat ages past the 60 s timeout
    async with db.session() as s:
        await s.execute(update(ClusterRow).where(ClusterRow.name == "fra-h100")
                        .values(last_heartbeat_at=datetime.now(UTC) - timedelta(seconds=61)))
    got = await (await api.client.get("/api/v1/clusters/fra-h100", headers=api.auth("alice"))).json()
    ready = next(c for c in got["status"]["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False" and ready["reason"] == "HeartbeatTimeout"
    assert got["status"]["allocatable"]["gpus"] == 0
    too_many = {"allocatableGpus": 17}
    resp = await api.client.post("/api/v1/clusters/fra-h100/heartbeat", json=too_many, headers=api.auth("prov-a"))
    assert resp.status == 422 and (await resp.json())["error"]["field"] == "allocatableGpus"


async def test_a_batch_of_heartbeats_is_recorded_whole_or_not_at_all(api) -> None:
    await apply(api, "prov-a", WORLD_A)
    await apply(api, "prov-b", WORLD_B)
    ready = [{"type": "Ready", "status": "True"}]
    batch = {"items": [{"cluster": "fra-h100", "allocatableGpus": 9, "conditions": ready},
                       {"cluster": "ams-l40s", "allocatableGpus": 3, "conditions": ready}]}
    resp = await api.client.post("/api/v1/heartbeats", json=batch, headers=api.auth("prov-a"))
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    assert body["kind"] == "HeartbeatResult" and body["accepted"] == 2
    assert set(body["resourceVersions"]) == {"fra-h100", "ams-l40s"}
    for name, gpus in (("fra-h100", 9), ("ams-l40s", 3)):
        got = await (await api.client.get(f"/api/v1/clusters/{name}", headers=api.auth("alice"))).json()
        assert got["status"]["ready"] == "True" and got["status"]["allocatable"]["gpus"] == gpus
    # one item that is not the caller's (or exceeds capacity) refuses the whole batch, naming it
    for bad, status, field in (({"cluster": "nyc-h100", "allocatableGpus": 1}, 403, "items[1].cluster"),
                               ({"cluster": "fra-a100", "allocatableGpus": 99}, 422, "items[1].allocatableGpus"),
                               ({"cluster": "nowhere", "allocatableGpus": 1}, 404, "items[1].cluster")):
        again = {"items": [{"cluster": "fra-h100", "allocatableGpus": 1, "conditions": ready}, bad]}
        resp = await api.client.post("/api/v1/heartbeats", json=again, headers=api.auth("prov-a"))
        err = (await resp.json())["error"]
        assert resp.status == status and err["field"] == field and "items[1]" in err["message"], err
    got = await (await api.client.get("/api/v1/clusters/fra-h100", headers=api.auth("alice"))).json()
    assert got["status"]["allocatable"]["gpus"] == 9  # nothing of the refused batches landed
    empty = await api.client.post("/api/v1/heartbeats", json={"items": []}, headers=api.auth("prov-a"))
    assert empty.status == 422 and (await empty.json())["error"]["field"] == "items"


async def test_label_selector_and_pagination(api) -> None:
    items = [site(f"s-{i}") for i in range(5)]
    for i, it in enumerate(items):
        it["metadata"]["labels"] = {"tier": "edge" if i % 2 else "core"}
    await apply(api, "prov-a", items)
    got = await (await api.client.get("/api/v1/sites?labelSelector=tier=edge", headers=api.auth("alice"))).json()
    assert [s["metadata"]["name"] for s in got["items"]] == ["s-1", "s-3"]
    page = await (await api.client.get("/api/v1/sites?limit=2", headers=api.auth("alice"))).json()
    names = [s["metadata"]["name"] for s in page["items"]]
    while (page.get("metadata") or {}).get("continue"):
        page = await (await api.client.get(f"/api/v1/sites?limit=2&continue={page['metadata']['continue']}",
                                           headers=api.auth("alice"))).json()
        names += [s["metadata"]["name"] for s in page["items"]]
    assert names == [f"s-{i}" for i in range(5)]


async def test_patch_merges_and_keeps_provider(api) -> None:
    await apply(api, "prov-a", [site("fra-1")])
    resp = await api.client.patch("/api/v1/sites/fra-1", json={"metadata": {"labels": {"a": "b"}},
                                                               "spec": {"provider": "mallory"}},
                                  headers=api.auth("prov-a"))
    assert resp.status == 200, await resp.text()
    got = await resp.json()
    assert got["metadata"]["labels"] == {"a": "b"} and got["spec"]["provider"] == "prov-a"


async def test_a_batch_moves_each_cluster_one_version_and_the_manifest_agrees(api) -> None:
    await apply(api, "prov-a", WORLD_A)
    ready = [{"type": "Ready", "status": "True"}]
    seen = []
    for gpus in (5, 6):
        batch = {"items": [{"cluster": "fra-h100", "allocatableGpus": gpus, "conditions": ready},
                           {"cluster": "ams-l40s", "allocatableGpus": 2, "conditions": ready}]}
        resp = await api.client.post("/api/v1/heartbeats", json=batch, headers=api.auth("prov-a"))
        assert resp.status == 200, await resp.text()
        seen.append((await resp.json())["resourceVersions"])
    assert {n: int(v) for n, v in seen[1].items()} == {n: int(v) + 1 for n, v in seen[0].items()}
    got = await (await api.client.get("/api/v1/clusters/fra-h100", headers=api.auth("prov-a"))).json()
    assert got["metadata"]["resourceVersion"] == seen[1]["fra-h100"]
    assert got["status"]["allocatable"]["gpus"] == 6 and got["status"]["ready"] == "True"


async def test_the_inventory_a_process_holds_follows_every_write(api, db) -> None:
    """inventory() reuses the catalogue it loaded while the database says nothing changed; any write
    (a heartbeat, a bulk UPDATE, a new link, a deleted cluster) shows on the next call."""
    from layers.resource.capacity import inventory

    await apply(api, "prov-a", WORLD_A)
    ready = [{"type": "Ready", "status": "True"}]
    beat = {"items": [{"cluster": "fra-h100", "allocatableGpus": 7, "conditions": ready}]}
    assert (await api.client.post("/api/v1/heartbeats", json=beat, headers=api.auth("prov-a"))).status == 200

    async def seen() -> tuple[dict[str, tuple[bool, int]], list[str]]:
        async with db.session() as s:
            clusters, links = await inventory(s, timedelta(seconds=60))
        return {c.name: (c.ready, c.allocatable_gpus) for c in clusters}, [ln.name for ln in links]

    first = await seen()
    assert first == await seen() and first[0]["fra-h100"] == (True, 7) and first[1] == ["fra-ams"]
    async with db.session() as s:
        await s.execute(update(ClusterRow).where(ClusterRow.name == "fra-h100").values(allocatable_gpus=3))
    assert (await seen())[0]["fra-h100"] == (True, 3)
    async with db.session() as s:  # silent past the timeout: no longer Ready, with nothing else written
        await s.execute(update(ClusterRow).where(ClusterRow.name == "fra-h100")
                        .values(last_heartbeat_at=datetime.now(UTC) - timedelta(seconds=61)))
    assert (await seen())[0]["fra-h100"] == (False, 0)
    await apply(api, "prov-a", [site("par-1"), link("fra-par", "fra-1", "par-1")])
    assert (await seen())[1] == ["fra-ams", "fra-par"]
    assert (await api.client.delete("/api/v1/clusters/fra-a100", headers=api.auth("prov-a"))).status in (200, 204)
    assert "fra-a100" not in (await seen())[0]


async def test_allocatable_over_reported_capacity_names_the_field_and_the_document_says_the_rule(api) -> None:
    # schemathesis found it: a heartbeat whose allocatableGpus exceeds its own capacityGpus was refused
    # (rightly) but the document did not say so, and the error named the item, not the field
    await apply(api, "prov-a", WORLD_A)
    beat = {"cluster": "fra-h100", "capacityGpus": 4, "allocatableGpus": 5}
    resp = await api.client.post("/api/v1/heartbeats", json={"items": [beat]}, headers=api.auth("prov-a"))
    err = (await resp.json())["error"]
    assert resp.status == 422 and err["field"] == "items[0].allocatableGpus", err
    resp = await api.client.post("/api/v1/clusters/fra-h100/heartbeat", json={"capacityGpus": 4, "allocatableGpus": 5},
                                 headers=api.auth("prov-a"))
    assert resp.status == 422 and (await resp.json())["error"]["field"] == "allocatableGpus"
    resp = await api.client.post("/api/v1/clusters/fra-h100/heartbeat", json={"capacityGpus": 4, "allocatableGpus": 4},
                                 headers=api.auth("prov-a"))
    assert resp.status == 200, await resp.text()
    doc = await (await api.client.get("/api/v1/openapi.json")).json()
    schema = next(v for k, v in doc["components"]["schemas"].items() if k.startswith("HeartbeatRequest"))
    assert "at most capacityGpus" in schema["properties"]["allocatableGpus"]["description"]


async def test_another_users_bad_job_body_is_not_found_not_checked(api) -> None:
    """A job is invisible to other accounts: their PUT or PATCH of it, valid or not, finds nothing."""
    from tests.api.test_jobs import job, register_world

    await register_world(api)
    assert (await api.client.post("/api/v1/jobs", json=job("mine"), headers=api.auth("alice"))).status == 201
    for method, body in (("put", {"kind": "TrainingJob", "spec": {"tokens": "lots"}}), ("patch", {"spec": {"tokens": -1}})):
        resp = await getattr(api.client, method)("/api/v1/jobs/mine", json=body, headers=api.auth("bob"))
        assert resp.status == 404, (method, await resp.text())
        resp = await getattr(api.client, method)("/api/v1/jobs/mine", json=body, headers=api.auth("alice"))
        assert resp.status == 422, (method, await resp.text())
