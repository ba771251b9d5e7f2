"""The generated world: deterministic, consistent, connected, priced within the market."""

from __future__ import annotations

import math
from collections import Counter
from decimal import Decimal

import pytest

from layers.resource import gpus
from layers.resource.catalog import EGRESS_RANGE, PRICE_RANGES, PROVIDER_LABEL, generate_world


def _kinds(world: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {"Site": [], "Cluster": [], "Link": []}
    for doc in world:
        out[doc["kind"]].append(doc)
    return out


def _connected(sites: list[str], links: list[dict]) -> bool:
    neighbours: dict[str, set[str]] = {s: set() for s in sites}
    for link in links:
        neighbours[link["spec"]["a"]].add(link["spec"]["b"])
        neighbours[link["spec"]["b"]].add(link["spec"]["a"])
    seen, todo = {sites[0]}, [sites[0]]
    while todo:
        for nxt in neighbours[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return len(seen) == len(sites)


def _places(text: str) -> int:
    return max(0, -Decimal(text).as_tuple().exponent)


def test_same_seed_same_world_other_seed_other_world() -> None:
    assert generate_world(8, 20, seed=3, providers=2) == generate_world(8, 20, seed=3, providers=2)
    assert generate_world(8, 20, seed=3, providers=2) != generate_world(8, 20, seed=4, providers=2)


@pytest.mark.parametrize(("sites", "clusters"), [(1, 1), (4, 9), (40, 100)])
def test_sizes_names_and_references(sites: int, clusters: int) -> None:
    kinds = _kinds(generate_world(sites, clusters, seed=1))
    site_names = [s["metadata"]["name"] for s in kinds["Site"]]

    assert len(site_names) == len(set(site_names)) == sites
    assert len(kinds["Cluster"]) == len({c["metadata"]["name"] for c in kinds["Cluster"]}) == clusters
    assert all(c["spec"]["site"] in site_names for c in kinds["Cluster"])
    assert all(c["metadata"]["name"].startswith(c["spec"]["site"]) for c in kinds["Cluster"])
    assert all(len(doc["metadata"]["name"]) <= 63 for kind in kinds.values() for doc in kind)


@pytest.mark.parametrize("sites", [2, 5, 6, 7, 60])
def test_links_connect_every_site_without_self_or_duplicate_links(sites: int) -> None:
    kinds = _kinds(generate_world(sites, sites, seed=2))
    links = kinds["Link"]
    pairs = [frozenset((link["spec"]["a"], link["spec"]["b"])) for link in links]

    assert all(len(p) == 2 for p in pairs)
    assert len(set(pairs)) == len(pairs)
    assert all(link["metadata"]["name"] == f"{link['spec']['a']}--{link['spec']['b']}" for link in links)
    assert _connected([s["metadata"]["name"] for s in kinds["Site"]], links)
    if sites <= 6:
        assert len(links) == sites * (sites - 1) // 2


def test_link_cap_is_honoured_and_keeps_the_tree() -> None:
    kinds = _kinds(generate_world(50, 60, seed=5, links=120))
    assert len(kinds["Link"]) == 120
    assert _connected([s["metadata"]["name"] for s in kinds["Site"]], kinds["Link"])
    assert len(_kinds(generate_world(50, 60, seed=5, links=10))["Link"]) == 10


def test_prices_models_and_link_physics_are_plausible() -> None:
    kinds = _kinds(generate_world(30, 200, seed=9))
    for cluster in kinds["Cluster"]:
        for pool in cluster["spec"]["nodePools"]:
            info = gpus.get(pool["gpu"]["model"])
            low, high = PRICE_RANGES[info.model]
            assert low <= Decimal(pool["pricePerGpuHour"]) <= high
            assert _places(pool["pricePerGpuHour"]) <= 6
            assert pool["gpu"]["tflops"] == info.tflops and pool["gpu"]["memoryGB"] in info.memory_variants_gb
            assert pool["gpusPerNode"] >= 1 and pool["nodes"] >= 1
    assert {p["gpu"]["model"] for c in kinds["Cluster"] for p in c["spec"]["nodePools"]} == set(gpus.models())
    by_rtt = sorted(kinds["Link"], key=lambda link: link["spec"]["rttMs"])
    for link in by_rtt:
        assert EGRESS_RANGE[0] <= float(link["spec"]["pricePerGB"]) <= EGRESS_RANGE[1]
        assert _places(link["spec"]["pricePerGB"]) <= 6
        assert 1 <= link["spec"]["bandwidthGbps"] <= 100 and link["spec"]["rttMs"] >= 1
    assert by_rtt[0]["spec"]["bandwidthGbps"] >= by_rtt[-1]["spec"]["bandwidthGbps"]


def test_site_coordinates_and_regions() -> None:
    for site in _kinds(generate_world(80, 0, seed=4))["Site"]:
        loc = site["spec"]["location"]
        assert -90 <= loc["lat"] <= 90 and -180 <= loc["lon"] <= 180
        assert site["spec"]["region"] in {"us-east", "us-west", "eu-west", "eu-central", "ap-northeast",
                                          "ap-southeast"}
        assert math.isfinite(loc["lat"])


def test_every_object_is_labelled_with_its_provider() -> None:
    world = generate_world(9, 18, seed=6, providers=3)
    providers = Counter(doc["metadata"]["labels"][PROVIDER_LABEL] for doc in world)
    assert set(providers) == {"provider1", "provider2", "provider3"}
    site_provider = {d["metadata"]["name"]: d["metadata"]["labels"][PROVIDER_LABEL]
                     for d in world if d["kind"] == "Site"}
    for doc in world:
        owner = doc["spec"].get("site") or doc["spec"].get("a")
        if owner:
            assert doc["metadata"]["labels"][PROVIDER_LABEL] == site_provider[owner]


def test_invalid_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="sites >= 1"):
        generate_world(0, 1, seed=1)


def test_world_validates_against_the_manifest_schemas() -> None:
    from layers.resource.schemas import ClusterManifest, LinkManifest, SiteManifest

    schemas = {"Site": SiteManifest, "Cluster": ClusterManifest, "Link": LinkManifest}
    for doc in generate_world(20, 50, seed=11, providers=2):
        schemas[doc["kind"]].model_validate(doc)


def test_benchmark_sized_world_is_quick_to_build() -> None:
    kinds = _kinds(generate_world(1000, 5000, seed=1, providers=4, links=2000))
    assert (len(kinds["Site"]), len(kinds["Cluster"]), len(kinds["Link"])) == (1000, 5000, 2000)
    assert _connected([s["metadata"]["name"] for s in kinds["Site"]], kinds["Link"])


def test_cli_prints_multi_document_yaml(tmp_path) -> None:
    import yaml
    from click.testing import CliRunner

    from cpn.cli.catalog import catalog_generate_cmd

    result = CliRunner().invoke(catalog_generate_cmd, ["--sites", "5", "--clusters", "8", "--seed", "3",
                                                       "--providers", "2", "--links", "6"])
    assert result.exit_code == 0, result.output
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    assert docs == generate_world(5, 8, seed=3, providers=2, links=6)
    assert "5 sites, 8 clusters, 6 links" in result.stderr


async def test_two_providers_apply_their_share_of_the_world(api) -> None:  # type: ignore[no-untyped-def]
    world = generate_world(8, 16, seed=12, providers=2)
    share = {"provider1": "prov-a", "provider2": "prov-b"}
    for kinds in (("Site", "Cluster"), ("Link",)):  # links may join the other provider's sites
        for provider, who in share.items():
            items = [d for d in world if d["kind"] in kinds and d["metadata"]["labels"][PROVIDER_LABEL] == provider]
            resp = await api.client.post("/api/v1/apply", json={"items": items},
                                         headers={"Authorization": f"Bearer {api.tokens[who]}"})
            assert resp.status == 200, await resp.text()
    resp = await api.client.get("/api/v1/links", headers={"Authorization": f"Bearer {api.tokens['alice']}"})
    assert len((await resp.json())["items"]) == sum(1 for d in world if d["kind"] == "Link")
