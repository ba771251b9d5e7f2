"""Generate a deterministic, plausible world of Sites, Clusters and Links for demos and benchmarks.

Sites sit in real datacenter cities (jittered around the city for the 2nd, 3rd, … site there);
clusters carry the catalogue's GPU models at market prices; links form a connected graph — the
minimum spanning tree by great-circle distance plus each site's nearest neighbours — with
bandwidth falling and RTT rising with distance. Everything is plain dicts in manifest shape so
that 1,000 sites, 5,000 clusters and 2,000 links take a quarter of a second (link search is
O(sites²) in time, O(sites) in memory); `cpnctl apply -f` validates them.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import numpy as np

from cpn import API_VERSION
from layers.resource import gpus

PROVIDER_LABEL = "cpn.io/provider"
REGION_LABEL = "cpn.io/region"
EARTH_RADIUS_KM = 6371.0


@dataclass(frozen=True)
class City:
    code: str
    region: str
    lat: float
    lon: float


CITIES: tuple[City, ...] = (
    City("iad", "us-east", 39.04, -77.49), City("nyc", "us-east", 40.71, -74.01),
    City("atl", "us-east", 33.75, -84.39), City("cmh", "us-east", 39.96, -83.00),
    City("yyz", "us-east", 43.65, -79.38), City("mia", "us-east", 25.76, -80.19),
    City("sjc", "us-west", 37.34, -121.89), City("lax", "us-west", 34.05, -118.24),
    City("sea", "us-west", 47.61, -122.33), City("pdx", "us-west", 45.52, -122.99),
    City("phx", "us-west", 33.45, -112.07), City("slc", "us-west", 40.76, -111.89),
    City("lon", "eu-west", 51.51, -0.13), City("dub", "eu-west", 53.35, -6.26),
    City("ams", "eu-west", 52.37, 4.90), City("par", "eu-west", 48.86, 2.35),
    City("mad", "eu-west", 40.42, -3.70),
    City("fra", "eu-central", 50.11, 8.68), City("zrh", "eu-central", 47.38, 8.54),
    City("waw", "eu-central", 52.23, 21.01), City("sto", "eu-central", 59.33, 18.07),
    City("mil", "eu-central", 45.46, 9.19), City("vie", "eu-central", 48.21, 16.37),
    City("tyo", "ap-northeast", 35.68, 139.69), City("osa", "ap-northeast", 34.69, 135.50),
    City("sel", "ap-northeast", 37.57, 126.98), City("pek", "ap-northeast", 39.90, 116.40),
    City("sha", "ap-northeast", 31.23, 121.47),
    City("sin", "ap-southeast", 1.35, 103.82), City("hkg", "ap-southeast", 22.32, 114.17),
    City("jkt", "ap-southeast", -6.21, 106.85), City("syd", "ap-southeast", -33.87, 151.21),
    City("bom", "ap-southeast", 19.08, 72.88),
)
REGIONS: dict[str, tuple[float, float]] = {}
for _city in CITIES:
    REGIONS.setdefault(_city.region, (_city.lat, _city.lon))

# USD per GPU-hour, (low, high); the market in 2025-26 for on-demand / reserved capacity.
PRICE_RANGES: dict[str, tuple[float, float]] = {
    "H100": (1.9, 4.5), "A100": (1.1, 2.5), "L40S": (0.7, 1.3), "RTX4090": (0.3, 0.7),
}
MODEL_WEIGHTS: dict[str, float] = {"H100": 0.3, "A100": 0.3, "L40S": 0.2, "RTX4090": 0.2}
GPUS_PER_NODE: dict[str, tuple[int, ...]] = {"H100": (8, 8, 8, 4), "A100": (8, 8, 4), "L40S": (4, 8),
                                             "RTX4090": (2, 4, 8)}
EGRESS_RANGE = (0.01, 0.09)
# (up to km, choices of Gbps): metro fibre to intercontinental leased capacity.
BANDWIDTH_TIERS: tuple[tuple[float, tuple[int, ...]], ...] = (
    (100, (100,)), (600, (40, 100)), (2000, (10, 25, 40)), (6000, (5, 10)), (math.inf, (1, 2, 5, 10)),
)
ALL_PAIRS_UP_TO = 6
NEAREST_NEIGHBOURS = 2


def generate_world(sites: int, clusters: int, seed: int = 0, providers: int = 1,
                   links: int | None = None) -> list[dict[str, Any]]:
    """Sites, then clusters, then links, as manifest dicts; the same arguments give the same world.

    Links form a spanning tree first, so the graph is connected whenever `links` (a cap) is at
    least `sites - 1`.
    """
    if sites < 1 or clusters < 0 or providers < 1 or (links is not None and links < 0):
        raise ValueError("need sites >= 1, clusters >= 0, providers >= 1 and links >= 0")
    rng = random.Random(seed)
    site_docs = _sites(sites, providers, rng)
    cluster_docs = _clusters(site_docs, clusters, rng)
    link_docs = _links(site_docs, links, rng)
    return site_docs + cluster_docs + link_docs


def _manifest(kind: str, name: str, provider: str, spec: dict[str, Any],
              extra_labels: dict[str, str] | None = None) -> dict[str, Any]:
    labels = {PROVIDER_LABEL: provider, **(extra_labels or {})}
    return {"apiVersion": API_VERSION, "kind": kind, "metadata": {"name": name, "labels": labels}, "spec": spec}


def _sites(count: int, providers: int, rng: random.Random) -> list[dict[str, Any]]:
    order = list(CITIES)
    rng.shuffle(order)
    docs = []
    for i in range(count):
        city, nth = order[i % len(order)], i // len(order) + 1
        jitter = 0.0 if nth == 1 else 0.6
        lat = round(city.lat + rng.uniform(-jitter, jitter), 4)
        lon = round(city.lon + rng.uniform(-jitter, jitter), 4)
        spec = {"region": city.region, "location": {"lat": lat, "lon": lon}}
        docs.append(_manifest("Site", f"{city.code}-{nth}", f"provider{i % providers + 1}", spec,
                              {REGION_LABEL: city.region}))
    return docs


def _clusters(sites: list[dict[str, Any]], count: int, rng: random.Random) -> list[dict[str, Any]]:
    names: set[str] = set()
    docs = []
    models, weights = list(MODEL_WEIGHTS), list(MODEL_WEIGHTS.values())
    for j in range(count):
        site = sites[j % len(sites)]
        pools = [_pool(model, rng) for model in _pool_models(models, weights, rng)]
        base = f"{site['metadata']['name']}-{pools[0]['name']}"
        name = base if base not in names else next(f"{base}-{k}" for k in range(2, count + 2)
                                                   if f"{base}-{k}" not in names)
        names.add(name)
        info = gpus.get(pools[0]["gpu"]["model"])
        spec = {"site": site["metadata"]["name"], "driver": "local", "currency": "USD", "nodePools": pools,
                "interconnect": {"intraNodeGbps": info.intra_node_gbps, "interNodeGbps": info.inter_node_gbps}}
        docs.append(_manifest("Cluster", name, site["metadata"]["labels"][PROVIDER_LABEL], spec,
                              {REGION_LABEL: site["spec"]["region"]}))
    return docs


def _pool_models(models: list[str], weights: list[float], rng: random.Random) -> list[str]:
    first = rng.choices(models, weights)[0]
    if rng.random() < 0.2:
        second = rng.choices(models, weights)[0]
        if second != first:
            return [first, second]
    return [first]


def _pool(model: str, rng: random.Random) -> dict[str, Any]:
    info = gpus.get(model)
    memory = rng.choice(info.memory_variants_gb) if model == "A100" else info.memory_gb
    low, high = PRICE_RANGES[model]
    return {
        "name": model.lower(),
        "gpu": {"model": model, "memoryGB": memory, "tflops": info.tflops},
        "gpusPerNode": rng.choice(GPUS_PER_NODE[model]),
        "nodes": rng.choice((1, 1, 2, 2, 4, 4, 8, 16)),
        "pricePerGpuHour": _money(rng.uniform(low, high)),
    }


def _money(value: float, places: int = 4) -> str:
    return str(Decimal(repr(value)).quantize(Decimal(1).scaleb(-places)))


def _links(sites: list[dict[str, Any]], cap: int | None, rng: random.Random) -> list[dict[str, Any]]:
    coords = np.radians([[s["spec"]["location"]["lat"], s["spec"]["location"]["lon"]] for s in sites])
    docs = []
    for pair in _pairs(coords, cap):
        i, j = sorted(pair, key=lambda k: sites[k]["metadata"]["name"])
        provider = sites[i]["metadata"]["labels"][PROVIDER_LABEL]  # side a's provider owns the link
        docs.append(_link(sites[i]["metadata"]["name"], sites[j]["metadata"]["name"], _km(coords, i, j),
                          provider, rng))
    return docs


def _pairs(coords: np.ndarray, cap: int | None) -> list[tuple[int, int]]:
    """Spanning-tree edges first, then nearest neighbours rank by rank (all pairs for a few sites)."""
    n = len(coords)
    if n < 2:
        return []
    tree = _spanning_tree(coords)
    if cap is None:
        k = n - 1 if n <= ALL_PAIRS_UP_TO else min(NEAREST_NEIGHBOURS, n - 1)
    else:
        k = min(n - 1, max(1, math.ceil(2 * (cap - len(tree)) / n) + 1))
    while True:
        pairs = _dedupe(tree + _nearest_pairs(coords, k))
        if cap is None or len(pairs) >= cap or k >= n - 1:
            return pairs if cap is None else pairs[:cap]
        k = min(n - 1, 2 * k)


def _link(a: str, b: str, km: float, provider: str, rng: random.Random) -> dict[str, Any]:
    bandwidth = rng.choice(next(choices for limit, choices in BANDWIDTH_TIERS if km <= limit))
    low, high = EGRESS_RANGE
    egress = min(high, low + (high - low) * min(1.0, km / 12000) + rng.uniform(0, 0.01))
    spec = {"a": a, "b": b, "bandwidthGbps": bandwidth, "rttMs": round(km * 1.5 / 100 + 1, 1),
            "pricePerGB": _money(egress)}
    return _manifest("Link", f"{a}--{b}", provider, spec)


def _km(coords: np.ndarray, i: int, j: int) -> float:
    return float(_haversine(coords[i], coords[j : j + 1])[0])


def _haversine(point: np.ndarray, others: np.ndarray) -> np.ndarray:
    """Great-circle km from one (lat, lon) in radians to each row of `others`."""
    dlat = others[:, 0] - point[0]
    dlon = others[:, 1] - point[1]
    h = np.sin(dlat / 2) ** 2 + np.cos(point[0]) * np.cos(others[:, 0]) * np.sin(dlon / 2) ** 2
    return 2 * EARTH_RADIUS_KM * np.arcsin(np.sqrt(np.clip(h, 0.0, 1.0)))


def _spanning_tree(coords: np.ndarray) -> list[tuple[int, int]]:
    """Prim's minimum spanning tree, one distance row at a time (O(n) memory)."""
    n = len(coords)
    best = np.full(n, np.inf)
    parent = np.zeros(n, dtype=int)
    in_tree = np.zeros(n, dtype=bool)
    current, edges = 0, []
    for _ in range(n - 1):
        in_tree[current] = True
        dist = _haversine(coords[current], coords)
        closer = (dist < best) & ~in_tree
        best[closer], parent[closer] = dist[closer], current
        best[current] = np.inf
        candidates = np.where(in_tree, np.inf, best)
        current = int(np.argmin(candidates))
        edges.append((int(parent[current]), current))
    return edges


def _nearest_pairs(coords: np.ndarray, k: int) -> list[tuple[int, int]]:
    """Each site's k nearest neighbours, rank-major (everyone's nearest, then everyone's second, …)."""
    n = len(coords)
    ranked = np.empty((n, k), dtype=int)
    for i in range(n):
        dist = _haversine(coords[i], coords)
        dist[i] = np.inf
        nearest = np.argpartition(dist, k - 1)[:k] if k < n - 1 else np.flatnonzero(np.arange(n) != i)
        ranked[i] = nearest[np.argsort(dist[nearest], kind="stable")]
    return [(i, int(ranked[i, r])) for r in range(k) for i in range(n)]


def _dedupe(pairs: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    seen: set[tuple[int, int]] = set()
    out = []
    for i, j in pairs:
        key = (min(i, j), max(i, j))
        if i != j and key not in seen:
            seen.add(key)
            out.append(key)
    return out
