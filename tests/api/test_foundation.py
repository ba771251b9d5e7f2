"""The API's common behaviour: health, metrics, OpenAPI, auth, errors, audit, concurrency."""

from __future__ import annotations

from sqlalchemy import select

from layers.orchestration.identity.models import AuditRecord, Token

SITE = {"apiVersion": "cpn/v1", "kind": "Site", "metadata": {"name": "fra-1"}, "spec": {"region": "eu-central"}}


async def test_healthz_and_metrics(api) -> None:
    resp = await api.client.get("/healthz")
    assert resp.status == 200 and (await resp.json())["status"] == "ok"
    await api.client.get("/api/v1/sites", headers=api.auth("alice"))
    text = await (await api.client.get("/metrics", headers=api.auth("admin"))).text()
    assert "cpn_http_requests_total" in text and 'route="/api/v1/sites"' in text


async def test_openapi_is_3_1_and_names_schemas(api) -> None:
    spec = await (await api.client.get("/api/v1/openapi.json")).json()
    assert spec["openapi"] == "3.1.0"
    assert "/api/v1/clusters/{name}" in spec["paths"]
    assert {"ClusterManifest", "SiteManifest", "LinkManifest", "Error"} <= set(spec["components"]["schemas"])
    pool = spec["components"]["schemas"]["NodePool"]
    assert "gpusPerNode" in pool["properties"] and pool.get("additionalProperties") is False


async def test_missing_and_bad_tokens_are_401(api) -> None:
    missing = await api.client.get("/api/v1/sites")
    assert missing.status == 401
    assert "CPN_TOKEN, or cpnctl config set-context" in (await missing.json())["error"]["message"]  # where to put one
    resp = await api.client.get("/api/v1/sites", headers={"Authorization": "Bearer cpn_nope_nope"})
    assert resp.status == 401
    body = await resp.json()
    assert body["error"]["code"] == "unauthenticated"


async def test_tokens_are_stored_hashed(api, db) -> None:
    async with db.session() as s:
        rows = (await s.execute(select(Token))).scalars().all()
    assert rows
    for row in rows:
        assert row.secret_hash.startswith("$argon2id$")
        assert all(row.secret_hash.find(tok.split("_", 2)[2]) < 0 for tok in api.tokens.values())


async def test_malformed_json_is_400(api) -> None:
    resp = await api.client.post("/api/v1/sites", data="{nope", headers=api.auth("prov-a"))
    assert resp.status == 400
    assert (await resp.json())["error"]["code"] == "malformed"


async def test_yaml_bodies_are_accepted(api) -> None:
    body = "apiVersion: cpn/v1\nkind: Site\nmetadata: {name: y-1}\nspec: {region: eu-west}\n"
    resp = await api.client.post("/api/v1/sites", data=body,
                                 headers={**api.auth("prov-a"), "Content-Type": "application/yaml"})
    assert resp.status == 201, await resp.text()


async def test_unknown_field_and_wrong_type_name_the_field(api) -> None:
    bad = {**SITE, "spec": {"region": "eu-central", "colour": "red"}}
    resp = await api.client.post("/api/v1/sites", json=bad, headers=api.auth("prov-a"))
    assert resp.status == 422
    err = (await resp.json())["error"]
    assert err["field"] == "spec.colour" and "unknown field" in err["message"]
    bad = {**SITE, "spec": {"region": "eu-central", "location": {"lat": "north", "lon": 1}}}
    err = (await (await api.client.post("/api/v1/sites", json=bad, headers=api.auth("prov-a"))).json())["error"]
    assert err["field"] == "spec.location.lat"


async def test_oversize_body_is_413(api) -> None:
    big = {**SITE, "metadata": {"name": "big", "labels": {"x": "y"}}, "pad": "x" * (1024 * 1024 + 10)}
    resp = await api.client.post("/api/v1/sites", json=big, headers=api.auth("prov-a"))
    assert resp.status == 413
    assert (await resp.json())["error"]["code"] == "too_large"


async def test_unknown_route_is_json_404(api) -> None:
    resp = await api.client.get("/api/v1/nothing-here", headers=api.auth("alice"))
    assert resp.status == 404
    assert (await resp.json())["error"]["code"] == "not_found"


async def test_stale_resource_version_is_409(api) -> None:
    created = await (await api.client.post("/api/v1/sites", json=SITE, headers=api.auth("prov-a"))).json()
    version = created["metadata"]["resourceVersion"]
    update = {**SITE, "metadata": {"name": "fra-1", "resourceVersion": version}, "spec": {"region": "eu-west"}}
    first = await api.client.put("/api/v1/sites/fra-1", json=update, headers=api.auth("prov-a"))
    assert first.status == 200
    assert (await first.json())["metadata"]["resourceVersion"] != version
    second = await api.client.put("/api/v1/sites/fra-1", json=update, headers=api.auth("prov-a"))
    assert second.status == 409
    assert (await second.json())["error"]["field"] == "metadata.resourceVersion"


async def test_mutations_are_audited_with_result(api, db) -> None:
    await api.client.post("/api/v1/sites", json=SITE, headers=api.auth("prov-a"))
    await api.client.post("/api/v1/sites", json=SITE, headers=api.auth("prov-a"))  # conflict
    await api.client.get("/api/v1/sites", headers=api.auth("prov-a"))  # reads are not audited
    async with db.session() as s:
        rows = (await s.execute(select(AuditRecord).order_by(AuditRecord.at))).scalars().all()
    assert [(r.account_name, r.method, r.status, r.result) for r in rows] == [
        ("prov-a", "POST", 201, "ok"), ("prov-a", "POST", 409, "already_exists")]


async def test_users_cannot_create_inventory(api) -> None:
    resp = await api.client.post("/api/v1/sites", json=SITE, headers=api.auth("alice"))
    assert resp.status == 403


async def test_kind_discovery_lists_names_and_columns(api) -> None:
    kinds = (await (await api.client.get("/api/v1/kinds")).json())["items"]
    cluster = next(k for k in kinds if k["kind"] == "Cluster")
    assert cluster["plural"] == "clusters" and "cl" in cluster["shortNames"]
    assert [c["name"] for c in cluster["columns"] if not c["wide"]][:4] == ["READY", "GPUS", "GPU MODEL", "PRICE"]


async def test_rate_limit_per_token(aiohttp_client, settings, db) -> None:
    from cpn.api.app import create_app
    from tests.conftest import make_token

    app = create_app(settings.model_copy(update={"rate_limit_per_minute": 3}), db, migrate=False)
    client = await aiohttp_client(app)
    token = await make_token(db, "eve", "user")
    codes = [(await client.get("/api/v1/sites", headers={"Authorization": f"Bearer {token}"})).status
             for _ in range(5)]
    assert codes[:3] == [200, 200, 200] and codes[-1] == 429


async def test_metrics_gauges_are_read_from_the_database_at_each_scrape(api) -> None:
    """A cluster's gauges appear once it is registered and go with it when it is deleted (no stale labels)."""
    from tests.api.test_resource import apply, cluster, site

    assert (await apply(api, "prov-a", [site("fra-1"), cluster("fra-h100", "fra-1", gpus_per_node=8, nodes=2)])).status == 200
    text = await (await api.client.get("/metrics", headers=api.auth("admin"))).text()
    assert 'cpn_cluster_gpus{cluster="fra-h100",kind="capacity",site="fra-1"} 16.0' in text, text[-1500:]
    assert "# TYPE cpn_jobs gauge" in text
    assert (await api.client.delete("/api/v1/clusters/fra-h100", headers=api.auth("prov-a"))).status in (200, 204)
    text = await (await api.client.get("/metrics", headers=api.auth("admin"))).text()
    assert 'cluster="fra-h100"' not in text
