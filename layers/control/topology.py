"""The communication topology a placed job's runtime uses: site ring, ranks, leaders, regions, link rates."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from cpn.runtime.topology import LinkSpec, SiteSpec, Topology
from layers.resource.capacity import LinkView


def derive(ring: Sequence[str], ranks_per_site: dict[str, int], links: Sequence[LinkView],
           wan_mbps: float | None = None, regions: Mapping[str, str] | None = None) -> Topology:
    """Sites in `ring` order (the planner's order minimising the slowest hop), leader = local rank 0,
    each site's catalogue region (`regions`: site → `spec.region`; a site without one is a region of
    its own, as in :meth:`Topology.from_catalog`), and the links among the chosen sites with their
    rates in Mbit/s. The regions let a hierarchical job run the ``multilevel`` all-reduce
    (:meth:`Topology.level_ranks`): metro links inside a region, long-haul between."""
    chosen = set(ring)
    regions = regions or {}
    sites = [SiteSpec(name=s, ranks=max(1, ranks_per_site[s]), region=regions.get(s) or None) for s in ring]
    specs = [LinkSpec(a=ln.a, b=ln.b, bandwidth_mbps=ln.bandwidth_gbps * 1000.0, rtt_ms=ln.rtt_ms)
             for ln in links if ln.a in chosen and ln.b in chosen]
    return Topology(sites=sites, links=specs, wan_mbps=wan_mbps)
