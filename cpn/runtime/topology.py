"""The communication topology a training job runs on: sites in ring order, ranks per site, WAN links.

The control layer produces a :class:`Topology` for a placed job; local runs build one with
:meth:`Topology.uniform` (``--sites S --workers-per-site W``) or :meth:`Topology.from_catalog`
(a catalogue YAML of ``Site``/``Cluster``/``Link`` manifests).  It travels to every worker as JSON
in the ``CPN_TOPOLOGY`` environment variable, next to torchrun's ``RANK``/``WORLD_SIZE``.

Ranks are numbered site by site: site 0 holds ranks ``0..W0-1``, site 1 the next ``W1`` and so on,
so a rank's site and local index follow from the topology alone.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cpn.core.yamlload import ManifestLoader

ENV_TOPOLOGY = "CPN_TOPOLOGY"

__all__ = ["ENV_TOPOLOGY", "LinkSpec", "SiteSpec", "Topology", "TopologyError"]


class TopologyError(ValueError):
    """A topology that cannot run the requested job; the message says how to fix it."""


class TopologySite(BaseModel):
    """One site: how many worker ranks it runs, which of them leads, its WAN uplink rate."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    ranks: int = Field(ge=1, description="worker processes (GPUs) at this site")
    leader: int = Field(default=0, ge=0, description="local index of the rank that talks for the site")
    uplink_mbps: float | None = Field(default=None, gt=0, description="site uplink in Mbit/s")
    region: str | None = Field(
        default=None,
        min_length=1,
        description="region label (sites of one region share metro links); None: a region of its own",
    )

    @property
    def region_name(self) -> str:
        """The site's region; a site without a label is a region of its own (named after the site)."""
        return self.region or self.name

    @model_validator(mode="after")
    def _leader_in_range(self) -> SiteSpec:
        if self.leader >= self.ranks:
            raise ValueError(
                f"site {self.name!r}: leader {self.leader} is not a local rank of a {self.ranks}-rank site; "
                f"pick a leader in 0..{self.ranks - 1}"
            )
        return self


class TopologyLink(BaseModel):
    """A WAN link between two sites (symmetric): its bandwidth and round-trip time."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    a: str
    b: str
    bandwidth_mbps: float = Field(gt=0)
    rtt_ms: float = Field(default=0.0, ge=0)

    def joins(self, x: str, y: str) -> bool:
        return {self.a, self.b} == {x, y}


# the names the runtime's callers use; the classes carry distinct names so the API's OpenAPI document
# does not confuse them with the resource layer's SiteSpec/LinkSpec
SiteSpec = TopologySite
LinkSpec = TopologyLink


class Topology(BaseModel):
    """Sites in ring order with their ranks, plus the links between them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sites: list[SiteSpec] = Field(min_length=1)
    links: list[LinkSpec] = Field(default_factory=list)
    wan_mbps: float | None = Field(default=None, gt=0, description="default per-site WAN rate, Mbit/s")

    @field_validator("sites")
    @classmethod
    def _unique_names(cls, sites: list[SiteSpec]) -> list[SiteSpec]:
        names = [s.name for s in sites]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"site names must be unique, {dup} repeat; rename the sites")
        return sites

    @model_validator(mode="after")
    def _links_name_sites(self) -> Topology:
        names = {s.name for s in self.sites}
        for link in self.links:
            unknown = {link.a, link.b} - names
            if unknown:
                raise ValueError(
                    f"link {link.a}<->{link.b} names unknown site(s) {sorted(unknown)}; "
                    f"known sites are {sorted(names)}"
                )
            if link.a == link.b:
                raise ValueError(f"link {link.a}<->{link.b} joins a site to itself; drop it")
        return self

    # ----------------------------------------------------------------- constructors
    @classmethod
    def uniform(
        cls, sites: int, workers_per_site: int, wan_mbps: float | None = None, rtt_ms: float = 0.0
    ) -> Topology:
        """S sites of W ranks each, a ring of equal links: the shape of ``--sites S --workers-per-site W``."""
        if sites < 1 or workers_per_site < 1:
            raise TopologyError(
                f"need at least one site and one worker per site, got sites={sites} "
                f"workers_per_site={workers_per_site}"
            )
        specs = [SiteSpec(name=f"site{i}", ranks=workers_per_site) for i in range(sites)]
        links = []
        if wan_mbps is not None:
            links = [
                LinkSpec(a=specs[i].name, b=specs[j].name, bandwidth_mbps=wan_mbps, rtt_ms=rtt_ms)
                for i in range(sites)
                for j in range(i + 1, sites)
            ]
        return cls(sites=specs, links=links, wan_mbps=wan_mbps)

    @classmethod
    def regional(
        cls,
        regions: int,
        sites_per_region: int,
        workers_per_site: int,
        metro_mbps: float | None = None,
        wan_mbps: float | None = None,
        metro_rtt_ms: float = 0.0,
        wan_rtt_ms: float = 0.0,
    ) -> Topology:
        """``regions`` x ``sites_per_region`` sites of W ranks, region by region in ring order.

        With rates it lists a link for every pair of sites: ``metro_mbps`` inside a region,
        ``wan_mbps`` (long-haul) between regions.  No site uplink is set, so each pair runs at its
        link's rate (what :class:`cpn.runtime.netem.WanEmulator` shapes with per-pair htb classes).
        """
        if regions < 1 or sites_per_region < 1 or workers_per_site < 1:
            raise TopologyError(
                f"need at least one region, site per region and worker per site, got regions={regions} "
                f"sites_per_region={sites_per_region} workers_per_site={workers_per_site}"
            )
        specs = [
            SiteSpec(name=f"site{r * sites_per_region + i}", ranks=workers_per_site, region=f"region{r}")
            for r in range(regions)
            for i in range(sites_per_region)
        ]
        links = []
        for i, a in enumerate(specs):
            for b in specs[i + 1 :]:
                metro = a.region == b.region
                rate = metro_mbps if metro else wan_mbps
                if rate is not None:
                    rtt = metro_rtt_ms if metro else wan_rtt_ms
                    links.append(LinkSpec(a=a.name, b=b.name, bandwidth_mbps=rate, rtt_ms=rtt))
        return cls(sites=specs, links=links)

    @classmethod
    def from_catalog(
        cls,
        source: str | Path | Iterable[Mapping[str, Any]],
        workers_per_site: int | None = None,
        wan_mbps: float | None = None,
    ) -> Topology:
        """Build from CPN manifests (a YAML file, a directory of them, or parsed documents).

        ``kind: Site`` gives the sites in file order (the ring order); ``kind: Cluster`` with
        ``spec.site`` counts ranks per site unless ``workers_per_site`` overrides it (a cluster may say
        ``spec.workers``); ``kind: Link`` gives ``spec.a``, ``spec.b``, ``spec.bandwidthGbps``, ``spec.rttMs``.
        """
        docs = list(_load_docs(source) if isinstance(source, str | Path) else source)
        site_docs = [d for d in docs if d.get("kind") == "Site"]
        if not site_docs:
            raise TopologyError("the catalogue has no `kind: Site` documents; add one per site")
        names = [_name(d) for d in site_docs]
        ranks = {n: 0 for n in names}
        for d in docs:
            if d.get("kind") == "Cluster":
                site = (d.get("spec") or {}).get("site")
                if site not in ranks:
                    raise TopologyError(f"cluster {_name(d)!r} names unknown site {site!r}; known: {names}")
                ranks[site] += int((d.get("spec") or {}).get("workers", 1))
        sites = [
            SiteSpec(
                name=n,
                ranks=workers_per_site or max(ranks[n], 1),
                uplink_mbps=_uplink_mbps(d),
                region=(d.get("spec") or {}).get("region") or None,
            )
            for n, d in zip(names, site_docs, strict=True)
        ]
        links = [_link(d) for d in docs if d.get("kind") == "Link"]
        return cls(sites=sites, links=links, wan_mbps=wan_mbps)

    # ----------------------------------------------------------------- rank arithmetic
    @property
    def world_size(self) -> int:
        return sum(s.ranks for s in self.sites)

    @property
    def num_sites(self) -> int:
        return len(self.sites)

    @property
    def is_uniform(self) -> bool:
        """Every site runs the same number of ranks (what hierarchical all-reduce needs)."""
        return len({s.ranks for s in self.sites}) == 1

    @property
    def workers_per_site(self) -> int:
        if not self.is_uniform:
            raise TopologyError(
                f"sites run unequal rank counts {[s.ranks for s in self.sites]}; "
                "give every site the same number of workers or use the `leader` algorithm"
            )
        return self.sites[0].ranks

    def site_start(self, site: int) -> int:
        return sum(s.ranks for s in self.sites[:site])

    def ranks_of(self, site: int) -> list[int]:
        start = self.site_start(site)
        return list(range(start, start + self.sites[site].ranks))

    def site_of(self, rank: int) -> int:
        self._check_rank(rank)
        for i, s in enumerate(self.sites):
            rank -= s.ranks
            if rank < 0:
                return i
        raise AssertionError("unreachable")

    def local_rank(self, rank: int) -> int:
        return rank - self.site_start(self.site_of(rank))

    def global_rank(self, site: int, local: int) -> int:
        return self.site_start(site) + local

    def leader_rank(self, site: int) -> int:
        return self.site_start(site) + self.sites[site].leader

    @property
    def leaders(self) -> list[int]:
        return [self.leader_rank(i) for i in range(self.num_sites)]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank} is outside this topology's world of {self.world_size} ranks")

    # ----------------------------------------------------------------- regions
    @property
    def region_names(self) -> list[str]:
        """Regions in order of first appearance in the ring (each unlabelled site is its own)."""
        return list(dict.fromkeys(s.region_name for s in self.sites))

    @property
    def num_regions(self) -> int:
        return len(self.region_names)

    def region_of(self, site: int) -> int:
        """Index (into :attr:`region_names`) of a site's region."""
        return self.region_names.index(self.sites[site].region_name)

    def sites_in_region(self, region: int) -> list[int]:
        name = self.region_names[region]
        return [i for i, s in enumerate(self.sites) if s.region_name == name]

    @property
    def is_regular(self) -> bool:
        """Every site has the same ranks and every region the same number of sites (what the
        ``multilevel`` all-reduce needs)."""
        return self.is_uniform and len({len(self.sites_in_region(r)) for r in range(self.num_regions)}) == 1

    def level_sizes(self) -> tuple[int, int, int]:
        """(workers per site W, sites per region R, regions G) of a regular topology."""
        if not self.is_regular:
            per_region = [len(self.sites_in_region(r)) for r in range(self.num_regions)]
            raise TopologyError(
                f"a multi-level all-reduce needs equal sites: ranks per site {[s.ranks for s in self.sites]}, "
                f"sites per region {per_region}; even them out or use the `leader` algorithm"
            )
        return self.sites[0].ranks, len(self.sites_in_region(0)), self.num_regions

    def level_ranks(self, rank: int) -> list[list[int]]:
        """The three groups ``rank`` belongs to in a multi-level all-reduce, in ring order:
        its site's ranks; the ranks of the same local index at the sites of its region; the ranks
        of the same local index and the same position-in-region in every region."""
        site = self.site_of(rank)
        local = self.local_rank(rank)
        region = self.region_of(site)
        members = self.sites_in_region(region)
        pos = members.index(site)
        metro = [self.global_rank(s, local) for s in members]
        wan = [self.global_rank(self.sites_in_region(r)[pos], local) for r in range(self.num_regions)]
        return [self.ranks_of(site), metro, wan]

    def link_class(self, a: int, b: int) -> str:
        """``site`` (same site), ``metro`` (same region) or ``wan`` (between regions) for site indices."""
        if a == b:
            return "site"
        return "metro" if self.region_of(a) == self.region_of(b) else "wan"

    # ----------------------------------------------------------------- links
    def link(self, a: str, b: str) -> LinkSpec | None:
        return next((lk for lk in self.links if lk.joins(a, b)), None)

    def uplink_mbps(self, site: int) -> float | None:
        """A site's uplink: its own figure, else the topology's WAN rate."""
        return self.sites[site].uplink_mbps or self.wan_mbps

    def max_rtt_ms(self) -> float:
        return max((lk.rtt_ms for lk in self.links), default=0.0)

    # ----------------------------------------------------------------- env transport
    def to_env(self) -> dict[str, str]:
        return {ENV_TOPOLOGY: self.model_dump_json()}

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Topology | None:
        """The topology in ``CPN_TOPOLOGY``, or None when unset."""
        raw = (os.environ if env is None else env).get(ENV_TOPOLOGY)
        if not raw:
            return None
        try:
            return cls.model_validate_json(raw)
        except ValueError as exc:
            raise TopologyError(
                f"{ENV_TOPOLOGY} is not a valid topology JSON ({exc}); unset or regenerate it"
            ) from exc

    @classmethod
    def single_site(cls, world_size: int) -> Topology:
        """What a plain torchrun job without ``CPN_TOPOLOGY`` looks like: one site holding every rank."""
        return cls(sites=[SiteSpec(name="site0", ranks=world_size)])


def _load_docs(source: str | Path) -> Iterable[dict[str, Any]]:
    path = Path(source)
    if not path.exists():
        raise TopologyError(f"catalogue {path} does not exist; pass a YAML file or a directory of them")
    files = sorted(path.glob("*.y*ml")) if path.is_dir() else [path]
    for f in files:
        for doc in yaml.load_all(f.read_text(), Loader=ManifestLoader):  # noqa: S506 - a SafeLoader, no aliases
            if isinstance(doc, dict):
                yield doc


def _name(doc: Mapping[str, Any]) -> str:
    name = (doc.get("metadata") or {}).get("name")
    if not name:
        raise TopologyError(f"a `kind: {doc.get('kind')}` document has no metadata.name; name it")
    return str(name)


def _uplink_mbps(doc: Mapping[str, Any]) -> float | None:
    gbps = (doc.get("spec") or {}).get("uplinkGbps")
    return float(gbps) * 1000.0 if gbps else None


def _link(doc: Mapping[str, Any]) -> LinkSpec:
    spec = doc.get("spec") or {}
    try:
        return LinkSpec(
            a=spec["a"],
            b=spec["b"],
            bandwidth_mbps=float(spec["bandwidthGbps"]) * 1000.0,
            rtt_ms=float(spec.get("rttMs", 0.0)),
        )
    except KeyError as exc:
        raise TopologyError(
            f"link {_name(doc)!r} lacks spec.{exc.args[0]}; a Link needs a, b, bandwidthGbps"
        ) from exc
