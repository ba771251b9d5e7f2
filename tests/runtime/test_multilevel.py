"""The ``multilevel`` all-reduce (site -> region -> world) against torch's all-reduce, on real Gloo
processes, for 1, 2 and 3 levels, odd sizes, sum and mean, per-level compression.

One forked launch per topology runs every case (starting processes dominates the cost).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cpn.runtime.collectives import allreduce, level_codecs, parse_algorithm
from cpn.runtime.groups import current_groups, init_groups, shutdown
from cpn.runtime.launcher import launch
from cpn.runtime.topology import SiteSpec, Topology, TopologyError

SHAPES = [[1], [7, 13, 1], [1001, 0, 3, 257, (5, 9)]]
TOL = {None: 1e-5, "int8": 3e-2, "fp16/int8": 3e-2, "none/fp16": 4e-3}


def _tensors(shapes: list, seed: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s if isinstance(s, tuple) else (s,), generator=gen).to(dtype) for s in shapes]


def _reference(shapes: list, op: str) -> list[torch.Tensor]:
    expected = _tensors(shapes, seed=500 + dist.get_rank())
    for t in expected:
        dist.all_reduce(t)
        if op == "avg":
            t.div_(dist.get_world_size())
    return expected


def _check(comp: str | None, shapes: list, op: str, bucket: int, chunk: int) -> str | None:
    want = _reference(shapes, op)
    got = _tensors(shapes, seed=500 + dist.get_rank())
    allreduce(got, algorithm="multilevel", compression=comp, op=op, bucket_bytes=bucket, chunk_bytes=chunk)
    for g, w in zip(got, want, strict=True):
        scale = max(w.abs().max().item(), 1.0) if w.numel() else 1.0
        if g.shape != w.shape or not torch.allclose(g, w, rtol=TOL[comp], atol=TOL[comp] * scale):
            err = (g - w).abs().max().item() if g.shape == w.shape else "shape"
            return f"multilevel+{comp} shapes={shapes} op={op} bucket={bucket} chunk={chunk}: max error {err}"
    return None


def _check_bytes() -> str | None:
    """The algorithm's byte count per level for a payload divisible everywhere."""
    g = current_groups()
    w, r, regions = g.topology.level_sizes()
    n = 256 * w * r * regions
    k = 4 * n
    stats = allreduce(torch.ones(n), algorithm="multilevel", chunk_bytes=k)
    want_intra = 2 * (w - 1) * k // w
    want_metro = 2 * (r - 1) * (k // w) // r
    want_long = 2 * (regions - 1) * (k // (w * r)) // regions
    got = (stats.intra_bytes, stats.metro_bytes, stats.wan_bytes - stats.metro_bytes)
    if got != (want_intra, want_metro, want_long):
        return f"byte count {got}, expected {(want_intra, want_metro, want_long)}"
    if r == 1 and w > 1 and g.S > 1:
        hier = allreduce(torch.ones(n), algorithm="hierarchical", chunk_bytes=k)
        if (hier.intra_bytes, hier.wan_bytes) != (stats.intra_bytes, stats.wan_bytes):
            return f"one site per region should move what hierarchical moves: {hier} vs {stats}"
    return None


def multilevel_worker(topology_json: str) -> list[str]:
    init_groups(Topology.model_validate_json(topology_json))
    failures = []
    for comp in (None, "int8", "fp16/int8", "none/fp16"):
        for shapes in SHAPES:
            failures.append(_check(comp, shapes, "sum", 25 * 2**20, 4 * 2**20))
        failures.append(_check(comp, SHAPES[-1], "sum", 1024, 300))  # many buckets and slices
        failures.append(_check(comp, [1001, 3], "avg", 2048, 1000))
    failures.append(_check_bytes())
    ints = [torch.arange(11, dtype=torch.int64) * (dist.get_rank() + 1)]
    allreduce(ints, algorithm="multilevel+fp16/int8", chunk_bytes=24)
    ws = dist.get_world_size()
    if not torch.equal(ints[0], torch.arange(11) * ws * (ws + 1) // 2):
        failures.append(f"int64 tensors must bypass compression and sum exactly, got {ints[0].tolist()}")
    shutdown()
    return [f for f in failures if f]


TOPOLOGIES = {
    # 1 level: one site
    "1 site x3": Topology.regional(1, 1, 3),
    # 2 levels: site + metro (one region), site + long-haul (every site its own region), metro + long-haul
    "1 region x2 sites x2": Topology.regional(1, 2, 2),
    "3 sites x2, no regions": Topology.uniform(3, 2),
    "3 regions x2 sites x1": Topology.regional(3, 2, 1),
    # 3 levels
    "2 regions x2 sites x2": Topology.regional(2, 2, 2),
}


@pytest.mark.parametrize("name", list(TOPOLOGIES))
def test_multilevel_matches_torch(name: str) -> None:
    topo = TOPOLOGIES[name]
    results = launch(
        topo,
        multilevel_worker,
        (topo.model_dump_json(),),
        capture_output=True,
        timeout=180,
        failure_grace=5,
        start_method="forkserver",
    )
    failures = sorted({f for r in results for f in r.result})
    assert not failures, "\n".join(failures)


# ------------------------------------------------------------------ in-process
def test_regions_default_to_one_per_site_and_old_json_still_parses() -> None:
    old = '{"sites": [{"name": "a", "ranks": 2}, {"name": "b", "ranks": 2}], "links": [], "wan_mbps": 40.0}'
    topo = Topology.model_validate_json(old)
    assert topo.region_names == ["a", "b"]
    assert topo.level_sizes() == (2, 1, 2)
    assert topo.level_ranks(3) == [[2, 3], [3], [1, 3]]
    assert topo.link_class(0, 1) == "wan"


def test_regional_topology_levels_and_link_classes() -> None:
    topo = Topology.regional(2, 2, 2, metro_mbps=400, wan_mbps=40)
    assert topo.region_names == ["region0", "region1"]
    assert topo.level_sizes() == (2, 2, 2)
    # rank 5 = site2 (region1, first site) local 1
    assert topo.level_ranks(5) == [[4, 5], [5, 7], [1, 5]]
    assert [topo.link_class(0, b) for b in range(4)] == ["site", "metro", "wan", "wan"]
    rates = {(lk.a, lk.b): lk.bandwidth_mbps for lk in topo.links}
    assert rates[("site0", "site1")] == 400 and rates[("site0", "site2")] == 40 and len(rates) == 6
    again = Topology.model_validate_json(topo.model_dump_json())
    assert again == topo


def test_irregular_regions_are_refused_with_the_fix() -> None:
    topo = Topology(
        sites=[SiteSpec(name=n, ranks=1, region=r) for n, r in [("a", "x"), ("b", "x"), ("c", "y")]]
    )
    assert not topo.is_regular
    with pytest.raises(TopologyError, match="sites per region"):
        topo.level_sizes()


def test_catalog_sites_carry_their_region() -> None:
    docs = [
        {"kind": "Site", "metadata": {"name": n}, "spec": {"region": r}}
        for n, r in [("fra", "eu-central"), ("ams", "eu-central"), ("iad", "us-east"), ("nyc", "us-east")]
    ]
    topo = Topology.from_catalog(docs, workers_per_site=1)
    assert topo.region_names == ["eu-central", "us-east"]
    assert topo.level_sizes() == (1, 2, 2)


def test_level_compression_spec() -> None:
    assert parse_algorithm("multilevel+fp16/int8") == ("multilevel", "fp16/int8")
    codecs = level_codecs("none/int8")
    assert codecs["metro"] is None and codecs["wan"].name == "int8"
    assert level_codecs("int8")["top"].name == "int8"
    with pytest.raises(ValueError, match="metro/long-haul"):
        parse_algorithm("multilevel+fp16/int8/int8")
    with pytest.raises(ValueError, match="unknown compression"):
        parse_algorithm("multilevel+none/zip")
    with pytest.raises(ValueError, match="unknown compression"):
        parse_algorithm("hierarchical+fp16/int8")


def test_regional_wan_shapes_metro_and_long_haul_pairs(root) -> None:
    import subprocess

    from cpn.runtime.netem import WanEmulator

    topo = Topology.regional(2, 2, 1, metro_mbps=400, wan_mbps=40)
    with WanEmulator(topo) as wan:
        rates = wan.pair_rates()
        assert rates[(0, 1)] == 400 and rates[(2, 3)] == 400
        assert rates[(0, 2)] == rates[(1, 3)] == rates[(3, 0)] == 40
        s0 = wan.sites[0]
        classes = subprocess.run(
            ["tc", "-n", s0.netns, "class", "show", "dev", s0.veth_ns], capture_output=True, text=True, check=True
        ).stdout
        assert classes.count("rate 40Mbit") == 2 and classes.count("rate 400Mbit") == 1
        assert "tbf" not in subprocess.run(
            ["tc", "qdisc", "show", "dev", s0.veth_host], capture_output=True, text=True, check=True
        ).stdout  # no uplink cap: the pair classes alone set the rates
