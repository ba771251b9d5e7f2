"""Process groups for WAN-aware collectives, built from a torchrun-compatible environment.

Every rank must create every group in the same order (``torch.distributed.new_group`` is itself a
collective over the default group), so :func:`init_groups` walks one fixed plan on every rank and
keeps the handles this rank belongs to:

- ``world``: all ranks (torch's default group);
- ``intra``: one group per site (fast network, NCCL on GPU / Gloo on CPU);
- ``leaders``: the site leaders, one per site (the ``leader`` algorithm's WAN group);
- ``cross``: for each local index j, the j-th rank of every site (the ``hierarchical`` algorithm's W
  parallel WAN groups).  With unequal sites, index j exists only at sites with more than j ranks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

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
    device: torch.device
    world: ProcessGroup
    intra: ProcessGroup
    intra_groups: list[ProcessGroup] = field(repr=False)
    leaders: ProcessGroup | None
    cross: ProcessGroup | None
    cross_groups: list[ProcessGroup] = field(repr=False)

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


def _default_backend() -> str:
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def _init_default(backend: str, timeout: timedelta) -> None:
    if dist.is_initialized():
        return
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise TopologyError(f"{name} is not set; start workers with torchrun or `cpn.runtime.launcher`")
    dist.init_process_group(
        backend=backend, rank=_env_int("RANK"), world_size=_env_int("WORLD_SIZE"), timeout=timeout
    )


def _device(backend: str) -> torch.device:
    if backend == "nccl":
        local = _env_int("LOCAL_RANK", 0)
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def _new_group(ranks: list[int], backend: str, timeout: timedelta) -> ProcessGroup:
    return dist.new_group(ranks=ranks, backend=backend, timeout=timeout)


def init_groups(
    topology: Topology | None = None,
    backend: str | None = None,
    timeout: timedelta = timedelta(minutes=5),
) -> Groups:
    """Join the job and build the site-aware groups.

    The topology comes from the argument, else ``CPN_TOPOLOGY``, else one site holding every rank
    (a plain torchrun job).  Its world size must match ``WORLD_SIZE``.
    """
    backend = backend or _default_backend()
    _init_default(backend, timeout)
    world = dist.get_world_size()
    topo = topology or Topology.from_env() or Topology.single_site(world)
    if topo.world_size != world:
        raise TopologyError(
            f"the topology has {topo.world_size} ranks but WORLD_SIZE is {world}; "
            "launch sites x workers-per-site processes"
        )
    rank = dist.get_rank()
    site = topo.site_of(rank)
    intra_groups = [_new_group(topo.ranks_of(s), backend, timeout) for s in range(topo.num_sites)]
    leaders_ranks = topo.leaders
    leaders = _new_group(leaders_ranks, backend, timeout)
    max_w = max(s.ranks for s in topo.sites)
    cross_groups = []
    for j in range(max_w):
        ranks = [topo.global_rank(s, j) for s in range(topo.num_sites) if topo.sites[s].ranks > j]
        cross_groups.append(leaders if ranks == leaders_ranks else _new_group(ranks, backend, timeout))
    local = topo.local_rank(rank)
    global _CURRENT
    _CURRENT = Groups(
        topology=topo,
        rank=rank,
        site=site,
        local_rank=local,
        backend=backend,
        device=_device(backend),
        world=dist.group.WORLD,
        intra=intra_groups[site],
        intra_groups=intra_groups,
        leaders=leaders if rank in leaders_ranks else None,
        cross=cross_groups[local],
        cross_groups=cross_groups,
    )
    return _CURRENT


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
