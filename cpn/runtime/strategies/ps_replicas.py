"""Replicas of a parameter shard (seed 001): a primary and ``ps_replicas`` secondaries on other sites.

Shard k's primary is the server :func:`~cpn.runtime.strategies.async_ps.server_ranks` places; its
secondaries sit on the leaders of the next ``r`` sites (site order, wrapping), so one site's loss
never takes two copies. Every change the primary makes -- an optimiser step with its gradient and
learning rate, or a worker leaving -- is sent to each secondary in replica order *before* any
worker sees its result, over a two-rank Gloo pair per (upstream, downstream) replica; a secondary
replays it with the same optimiser, so it holds the same parameters and optimiser state.

Fail-over needs no coordinator: replica j serves once every replica before it (its upstream pairs)
is gone. It first re-sends the last change it received to the replicas after it (a primary that
died mid-forward reached a prefix of its secondaries; duplicates are skipped by version), then
serves. Workers whose call to a replica fails move to the next one and repeat the call; what a dead
primary had applied but not yet forwarded is the only update lost (it was in flight).

Forward message: ``[payload..., kind, lr, version after, worker]``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from cpn.runtime.config import ENV_RUN_DIR, TrainConfig
from cpn.runtime.topology import Topology

if TYPE_CHECKING:
    from cpn.runtime.strategies.async_ps import Server

FWD_UPDATE, FWD_LEAVE = 0.0, 1.0
HEADER = 4  # kind, lr, version, worker
FAILOVER = "cpn/ps/failover"
RELEASED = "cpn/ps/released"
STORE_HOST = 0  # rank 0 hosts the job's TCPStore: its process cannot be the one a fault kills


def replica_ranks(topology: Topology, primary: int, replicas: int) -> list[int]:
    """The primary, then the leaders of the ``replicas`` sites after its own."""
    site, sites = topology.site_of(primary), topology.num_sites
    return [primary] + [topology.leaders[(site + j) % sites] for j in range(1, replicas + 1)]


def check(config: TrainConfig, topology: Topology, primaries: list[int], ps_names: tuple[str, ...]) -> None:
    """What a worker would find wrong with the replicas or the PS kill, found before any starts."""
    s, kill = config.strategy, config.faults.kill_ps
    sites = topology.num_sites
    if s.ps_replicas and s.name not in ps_names:
        raise ValueError(f"strategy.ps_replicas is for {', '.join(ps_names)}, not {s.name!r}: drop --ps-replicas")
    if s.ps_replicas >= sites:
        raise ValueError(f"strategy.ps_replicas {s.ps_replicas} needs {s.ps_replicas + 1} sites (a primary and each "
                         f"secondary on its own site), the job has {sites}: use at most {sites - 1}")
    if kill is None:
        return
    if s.name not in ps_names:
        raise ValueError(f"faults.kill_ps is for {', '.join(ps_names)}, not {s.name!r}: use --kill-site")
    if kill >= s.ps:
        raise ValueError(f"faults.kill_ps {kill} is not one of the {s.ps} shards (0..{s.ps - 1})")
    if not s.ps_replicas:
        raise ValueError(f"faults.kill_ps {kill} leaves shard {kill} without a copy: add --ps-replicas 1")
    if primaries[kill] == STORE_HOST:
        raise ValueError(f"faults.kill_ps {kill}: shard {kill}'s primary runs in rank {STORE_HOST}, which hosts the "
                         f"job's store; kill another shard (1..{s.ps - 1}, with --ps 2 or more)")


def dump(server: Server, what: str) -> Path | None:
    """Save a replica's shard and version under the run directory (what the fail-over test compares)."""
    run_dir = os.environ.get(ENV_RUN_DIR)
    if not run_dir:
        return None
    path = Path(run_dir) / "ps" / f"shard{server.shard}-{what}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"param": server.param.detach().clone(), "version": server.version}, path)
    return path


def record_failover(server: Server, rank: int) -> bool:
    """Note the promotion on the job's store; False once the job is released (its end, not a failure)."""
    store = server.ctx.store
    try:
        if store.check([RELEASED]):
            return False
        store.set(f"{FAILOVER}/{server.shard}", json.dumps({"shard": server.shard, "replica": server.index,
                                                             "rank": rank, "version": server.version}))
    except Exception:  # noqa: BLE001 - the store's host is gone: the job is over
        return False
    return True


def failovers(store: dist.Store, shards: int) -> list[dict]:
    out = []
    for k in range(shards):
        key = f"{FAILOVER}/{k}"
        if store.check([key]):
            out.append(json.loads(store.get(key)))
    return out


__all__ = ["FWD_LEAVE", "FWD_UPDATE", "HEADER", "RELEASED", "check", "dump", "failovers", "record_failover",
           "replica_ranks"]
