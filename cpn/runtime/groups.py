"""Process groups for WAN-aware collectives, built from a torchrun-compatible environment.

Every rank must create every group in the same order (``torch.distributed.new_group`` is itself a
collective over the default group), so :func:`init_groups` walks one fixed plan on every rank and
keeps the handles this rank belongs to:

- ``world``: all ranks (torch's default group);
- ``intra``: one group per site (fast network);
- ``leaders``: the site leaders, one per site (the ``leader`` algorithm's WAN group);
- ``cross``: for each local index j, the j-th rank of every site (the ``hierarchical`` algorithm's W
  parallel WAN groups).  With unequal sites, index j exists only at sites with more than j ranks.
- ``metro`` / ``regional``: the ``multilevel`` algorithm's levels above the site, for topologies with
  equal sites and regions (:meth:`Topology.level_ranks`): the same-local-rank ranks of the sites of
  one region (metro links), and the same-local-rank, same-position ranks of every region (long-haul).
  Groups of one rank are not created (``None``), and a rank list equal to an existing group reuses it,
  so a topology without region labels builds no extra group.

Backends by link: a group inside a site is ``cpu:gloo,cuda:nccl`` when the ranks compute on CUDA
(NCCL moves the device tensors, Gloo the few host scalars) and plain Gloo on the CPU; a group that
crosses sites (``world`` with several sites, ``leaders``, ``cross``) is Gloo, whose CUDA tensors the
collectives stage through pinned host memory, unless ``wan_backend="nccl"`` says the sites' network
carries NCCL.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from cpn.runtime.device import HostStage, select_device
from cpn.runtime.topology import Topology, TopologyError

__all__ = ["Groups", "current_groups", "init_groups", "shutdown"]

ProcessGroup = dist.ProcessGroup
_CURRENT: Groups | None = None


@dataclass(frozen=True)
class Groups:
    """This rank's view of the process groups; ``None`` where the rank is not a member."""

    topology: Topology
    rank: int
    site: int
    local_rank: int
    backend: str
    """What moves this rank's device tensors inside the site: ``nccl`` or ``gloo``."""
    device: torch.device
    world: ProcessGroup
    intra: ProcessGroup
    intra_groups: list[ProcessGroup] = field(repr=False)
    leaders: ProcessGroup | None
    cross: ProcessGroup | None
    cross_groups: list[ProcessGroup] = field(repr=False)
    wan_backend: str = "gloo"
    """What moves tensors between sites (``world`` with several sites, ``leaders``, ``cross``)."""
    stage: HostStage | None = field(default=None, repr=False)
    metro: ProcessGroup | None = field(default=None, repr=False)
    """This rank's group among the sites of its region (None: one site per region, or irregular)."""
    regional: ProcessGroup | None = field(default=None, repr=False)
    """This rank's group across regions (None: one region, or irregular)."""

    def levels(self) -> list[tuple[str, ProcessGroup, int]]:
        """The multi-level all-reduce's levels with more than one rank, fastest first:
        (``site``/``metro``/``wan``, group, size)."""
        w, r, g = self.topology.level_sizes()
        named = [("site", self.intra, w), ("metro", self.metro, r), ("wan", self.regional, g)]
        return [(name, grp, n) for name, grp, n in named if n > 1 and grp is not None]

    @property
    def wan_staged(self) -> bool:
        """Device tensors must pass through host memory to cross the WAN (CUDA over Gloo)."""
        return self.device.type == "cuda" and self.wan_backend == "gloo"

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def S(self) -> int:  # noqa: N802 - the paper's symbol
        return self.topology.num_sites

    @property
    def W(self) -> int | None:  # noqa: N802
        """Workers per site, or None when sites are unequal."""
        return self.topology.sites[0].ranks if self.topology.is_uniform else None

    @property
    def site_size(self) -> int:
        return self.topology.sites[self.site].ranks

    @property
    def is_leader(self) -> bool:
        return self.rank == self.topology.leader_rank(self.site)

    @property
    def leader_rank(self) -> int:
        """Global rank of this site's leader."""
        return self.topology.leader_rank(self.site)

    @property
    def cross_ranks(self) -> list[int]:
        """Global ranks of this rank's same-local-rank group, in site order."""
        t = self.topology
        return [
            t.global_rank(s, self.local_rank)
            for s in range(t.num_sites)
            if t.sites[s].ranks > self.local_rank
        ]


def _env_int(name: str, default: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None:
        if default is None:
            raise TopologyError(f"{name} is not set; start workers with torchrun or `cpn.runtime.launcher`")
        return default
    return int(raw)


MIXED = "cpu:gloo,cuda:nccl"


def _backend_strings(device: torch.device, wan_backend: str, override: str | None) -> tuple[str, str]:
    """(intra, WAN) backend strings for ``new_group``; NCCL only when the tensors are on CUDA."""
    nccl = device.type == "cuda" and dist.is_nccl_available()
    if override is not None:
        return (MIXED, MIXED) if override == "nccl" and nccl else ("gloo", "gloo")
    intra = MIXED if nccl else "gloo"
    return intra, MIXED if nccl and wan_backend == "nccl" else "gloo"


def _name(backend: str) -> str:
    return "nccl" if backend == MIXED else "gloo"


def _init_default(backend: str, timeout: timedelta) -> None:
    if dist.is_initialized():
        return
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise TopologyError(f"{name} is not set; start workers with torchrun or `cpn.runtime.launcher`")
    dist.init_process_group(
        backend=backend, rank=_env_int("RANK"), world_size=_env_int("WORLD_SIZE"), timeout=timeout
    )


def _new_group(ranks: list[int], backend: str, timeout: timedelta) -> ProcessGroup:
    return dist.new_group(ranks=ranks, backend=backend, timeout=timeout)


def init_groups(
    topology: Topology | None = None,
    backend: str | None = None,
    timeout: timedelta = timedelta(minutes=5),
    device: torch.device | None = None,
    wan_backend: str = "gloo",
) -> Groups:
    """Join the job and build the site-aware groups.

    The topology comes from the argument, else ``CPN_TOPOLOGY``, else one site holding every rank
    (a plain torchrun job).  Its world size must match ``WORLD_SIZE``.  ``device`` defaults to
    :func:`select_device`; ``backend`` (``gloo``/``nccl``) forces one backend for every level.
    """
    device = device or select_device("auto")
    intra_backend, wan = _backend_strings(device, wan_backend, backend)
    topo = topology or Topology.from_env()
    single_site = topo is not None and topo.num_sites == 1
    _init_default(intra_backend if single_site else wan, timeout)
    world = dist.get_world_size()
    topo = topo or Topology.single_site(world)
    if topo.world_size != world:
        raise TopologyError(
            f"the topology has {topo.world_size} ranks but WORLD_SIZE is {world}; "
            "launch sites x workers-per-site processes"
        )
    rank = dist.get_rank()
    site = topo.site_of(rank)
    intra_groups = [_new_group(topo.ranks_of(s), intra_backend, timeout) for s in range(topo.num_sites)]
    leaders_ranks = topo.leaders
    leaders = _new_group(leaders_ranks, wan, timeout)
    max_w = max(s.ranks for s in topo.sites)
    cross_groups = []
    built = {tuple(topo.ranks_of(s)): grp for s, grp in enumerate(intra_groups)}
    built.setdefault(tuple(leaders_ranks), leaders)
    for j in range(max_w):
        ranks = [topo.global_rank(s, j) for s in range(topo.num_sites) if topo.sites[s].ranks > j]
        cross_groups.append(leaders if ranks == leaders_ranks else _new_group(ranks, wan, timeout))
        built.setdefault(tuple(ranks), cross_groups[-1])
    metro, regional = _level_groups(topo, rank, wan, timeout, built)
    local = topo.local_rank(rank)
    global _CURRENT
    _CURRENT = Groups(
        topology=topo,
        rank=rank,
        site=site,
        local_rank=local,
        backend=_name(intra_backend),
        device=device,
        world=dist.group.WORLD,
        intra=intra_groups[site],
        intra_groups=intra_groups,
        leaders=leaders if rank in leaders_ranks else None,
        cross=cross_groups[local],
        cross_groups=cross_groups,
        wan_backend=_name(wan if topo.num_sites > 1 else intra_backend),
        stage=HostStage(device),
        metro=metro,
        regional=regional,
    )
    return _CURRENT


def _level_groups(
    topo: Topology, rank: int, backend: str, timeout: timedelta, known: dict[tuple[int, ...], ProcessGroup]
) -> tuple[ProcessGroup | None, ProcessGroup | None]:
    """Every rank walks the same plan: the metro groups, then the cross-region groups, skipping
    one-rank groups and reusing ``known`` groups (keyed by their ascending ranks)."""
    if not topo.is_regular:
        return None, None
    plans = [topo.level_ranks(r) for r in range(topo.world_size)]
    mine: list[ProcessGroup | None] = [None, None]
    for level in (1, 2):
        for ranks in dict.fromkeys(tuple(sorted(p[level])) for p in plans):
            if len(ranks) < 2:
                continue
            if ranks not in known:
                known[ranks] = _new_group(list(ranks), backend, timeout)
            if rank in ranks:
                mine[level - 1] = known[ranks]
    return mine[0], mine[1]


def current_groups() -> Groups:
    """The groups of the last :func:`init_groups` call in this process (the collectives' default)."""
    if _CURRENT is None:
        raise TopologyError("no process groups yet; call cpn.runtime.groups.init_groups() first")
    return _CURRENT


def shutdown() -> None:
    """Leave the job cleanly (a process that exits with live Gloo groups may abort)."""
    global _CURRENT
    _CURRENT = None
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
