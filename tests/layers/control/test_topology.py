"""An orchestrated job's Topology carries the catalogue's site regions, so the runtime sees its levels."""

from __future__ import annotations

from cpn.runtime.topology import Topology
from layers.control.topology import derive
from layers.orchestration.lifecycle.plan import topology_for
from layers.resource.capacity import LinkView


def link(a: str, b: str, gbps: float) -> LinkView:
    return LinkView(name=f"{a}-{b}", a=a, b=b, bandwidth_gbps=gbps, rtt_ms=1.0, price_per_gb="0.01", owner_id="o")


SITES = ["fra", "ams", "nyc", "bos"]
REGIONS = {"fra": "eu-central", "ams": "eu-central", "nyc": "us-east", "bos": "us-east"}
LINKS = [link("fra", "ams", 100.0), link("nyc", "bos", 100.0), link("fra", "nyc", 1.0), link("ams", "bos", 1.0)]


def test_derive_carries_regions_into_the_levels() -> None:
    topo = derive(SITES, dict.fromkeys(SITES, 2), LINKS, regions=REGIONS)
    assert [s.region for s in topo.sites] == ["eu-central", "eu-central", "us-east", "us-east"]
    assert topo.region_names == ["eu-central", "us-east"] and topo.is_regular
    # rank 1 = fra's second worker: its site, ams's second worker (metro), nyc's second worker (long-haul)
    assert topo.level_ranks(1) == [[0, 1], [1, 3], [1, 5]]
    assert topo.link_class(0, 1) == "metro" and topo.link_class(1, 2) == "wan"


def test_derive_without_regions_makes_each_site_its_own_region() -> None:
    topo = derive(SITES, dict.fromkeys(SITES, 1), LINKS)
    assert [s.region for s in topo.sites] == [None] * 4 and topo.num_regions == 4


def test_placement_lines_hand_their_regions_to_the_runtime() -> None:
    placement = [{"cluster": f"{s}-c", "site": s, "gpus": 1, "gpuModel": "H100", "region": REGIONS[s]} for s in SITES]
    topo = Topology.model_validate(topology_for(placement, ["fra", "ams", "bos", "nyc"], LINKS))
    assert topo.num_regions == 2 and topo.level_sizes() == (1, 2, 2)
    old = [{k: v for k, v in p.items() if k != "region"} for p in placement]  # a placement stored before regions
    assert Topology.model_validate(topology_for(old, SITES, LINKS)).num_regions == 4
