"""Topology: rank arithmetic, catalogue parsing, env transport, and validators that say how to fix."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cpn.runtime.topology import ENV_TOPOLOGY, SiteSpec, Topology, TopologyError

CATALOGUE = """
apiVersion: cpn/v1
kind: Site
metadata: {name: beijing}
spec: {uplinkGbps: 0.2}
---
kind: Site
metadata: {name: shanghai}
---
kind: Site
metadata: {name: guangzhou}
---
kind: Cluster
metadata: {name: bj-a}
spec: {site: beijing}
---
kind: Cluster
metadata: {name: bj-b}
spec: {site: beijing}
---
kind: Cluster
metadata: {name: sh-a}
spec: {site: shanghai, workers: 3}
---
kind: Link
metadata: {name: bj-sh}
spec: {a: beijing, b: shanghai, bandwidthGbps: 0.1, rttMs: 28}
---
kind: Link
metadata: {name: sh-gz}
spec: {a: shanghai, b: guangzhou, bandwidthGbps: 0.05, rttMs: 30}
"""


def test_uniform_numbers_ranks_site_by_site() -> None:
    t = Topology.uniform(3, 2, wan_mbps=100, rtt_ms=20)
    assert t.world_size == 6 and t.num_sites == 3 and t.workers_per_site == 2
    assert [t.site_of(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [t.local_rank(r) for r in range(6)] == [0, 1, 0, 1, 0, 1]
    assert t.ranks_of(2) == [4, 5] and t.leaders == [0, 2, 4]
    assert len(t.links) == 3 and t.link("site2", "site0").rtt_ms == 20
    assert t.uplink_mbps(1) == 100


def test_unequal_sites_and_leaders() -> None:
    t = Topology(sites=[SiteSpec(name="a", ranks=1), SiteSpec(name="b", ranks=3, leader=2)])
    assert t.leaders == [0, 3] and t.site_of(3) == 1 and t.local_rank(3) == 2
    assert not t.is_uniform
    with pytest.raises(TopologyError, match="use the `leader` algorithm"):
        _ = t.workers_per_site
    with pytest.raises(TopologyError, match="outside"):
        t.site_of(4)


def test_catalogue_yaml(tmp_path) -> None:
    path = tmp_path / "catalogue.yaml"
    path.write_text(CATALOGUE)
    t = Topology.from_catalog(path)
    assert [(s.name, s.ranks) for s in t.sites] == [("beijing", 2), ("shanghai", 3), ("guangzhou", 1)]
    assert t.sites[0].uplink_mbps == 200
    assert t.link("shanghai", "beijing").bandwidth_mbps == 100 and t.max_rtt_ms() == 30
    assert Topology.from_catalog(tmp_path, workers_per_site=2).workers_per_site == 2


def test_env_roundtrip() -> None:
    t = Topology.uniform(2, 3, wan_mbps=50)
    env = t.to_env()
    assert Topology.from_env(env) == t
    assert Topology.from_env({}) is None
    with pytest.raises(TopologyError, match=ENV_TOPOLOGY):
        Topology.from_env({ENV_TOPOLOGY: "{not json"})


@pytest.mark.parametrize(
    ("kwargs", "hint"),
    [
        ({"sites": [{"name": "a", "ranks": 2, "leader": 2}]}, "pick a leader in 0..1"),
        ({"sites": [{"name": "a", "ranks": 1}, {"name": "a", "ranks": 1}]}, "rename the sites"),
        (
            {"sites": [{"name": "a", "ranks": 1}], "links": [{"a": "a", "b": "z", "bandwidth_mbps": 1}]},
            "known sites",
        ),
        ({"sites": [{"name": "a", "ranks": 1}], "surprise": 1}, "Extra inputs are not permitted"),
    ],
)
def test_validators_say_how_to_fix(kwargs: dict, hint: str) -> None:
    with pytest.raises(ValidationError, match=hint):
        Topology.model_validate(kwargs)


def test_catalogue_errors_name_the_fix() -> None:
    with pytest.raises(TopologyError, match="add one per site"):
        Topology.from_catalog([{"kind": "Link"}])
    with pytest.raises(TopologyError, match="unknown site"):
        Topology.from_catalog(
            [
                {"kind": "Site", "metadata": {"name": "a"}},
                {"kind": "Cluster", "metadata": {"name": "c"}, "spec": {"site": "b"}},
            ]
        )
    with pytest.raises(TopologyError, match="does not exist"):
        Topology.from_catalog("/nonexistent/catalogue.yaml")
    with pytest.raises(TopologyError, match="at least one site"):
        Topology.uniform(0, 2)
