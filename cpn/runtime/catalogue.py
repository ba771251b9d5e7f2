"""The strategy catalogue: what the orchestrator must know about each training strategy, without torch.

The API server plans, re-places and recovers jobs by these facts (does a strategy go on without a lost
site? can it run with sharded sites? which class runs it?); the runtime reads the same table, so the
server never imports torch to learn them (``tests/core/test_imports.py`` checks that it does not).
``cpn.runtime.strategies`` looks each class up here, and a test checks every class's own flags agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from cpn.runtime.config import SHARDABLE_STRATEGIES, TrainConfig
from cpn.runtime.topology import Topology

__all__ = ["CATALOGUE", "ELASTIC", "StrategyInfo", "survives", "survives_site_loss"]


@dataclass(frozen=True, kw_only=True)
class StrategyInfo:
    name: str
    runs: str  # "module:Class" of the runtime's implementation
    elastic: bool  # the live sites finish the job when one is lost (pipeline: see survives_site_loss)
    wan: str  # what crosses the WAN, and when
    barrier: str

    @property
    def shardable(self) -> bool:
        """Runs with parameters sharded over each site's ranks (``shard: site``)."""
        return self.name in SHARDABLE_STRATEGIES


def _info(name: str, runs: str, elastic: bool, wan: str, barrier: str) -> StrategyInfo:
    return StrategyInfo(name=name, runs=f"cpn.runtime.strategies.{runs}", elastic=elastic, wan=wan, barrier=barrier)


CATALOGUE: dict[str, StrategyInfo] = {i.name: i for i in (
    _info("ddp", "ddp:DDP", False, "gradients, every step, flat ring over all ranks", "every step"),
    _info("hierarchical", "hierarchical:Hierarchical", False,
          "gradients, every step, 2D-torus all-reduce (opt. int8)", "every step"),
    _info("local_sgd", "local_sgd:LocalSGD", True, "parameters, every H steps, between site leaders", "every H"),
    _info("diloco", "diloco:DiLoCo", True, "pseudo-gradients every H steps, outer Nesterov", "every H"),
    _info("gossip", "gossip:Gossip", True, "parameters, to 1-2 neighbours on a time-varying graph", "none"),
    _info("ssp", "ssp:SSP", True, "parameters to all sites; a site may lead by <= s steps", "bounded"),
    _info("async_ps", "async_ps:AsyncPS", True, "gradients to sharded parameter servers, fresh params back",
          "none"),
    _info("ps_sync", "sync_ps:SyncPS", False, "the same; servers apply the mean of every worker's push",
          "every step"),
    _info("ps_backup", "sync_ps:BackupPS", False, "the same; servers apply the first N-b pushes", "first N-b"),
    _info("pipeline", "pipeline:Pipeline", False,
          "activations forward, their gradients back, between consecutive stages", "every step"),
)}

# strategies whose attempt goes on without a lost site, whatever their configuration
ELASTIC: frozenset[str] = frozenset(name for name, info in CATALOGUE.items() if info.elastic)


def survives(cfg: TrainConfig, topology: Topology) -> bool:
    """Whether a job of ``cfg`` (as autotune resolved it) on ``topology`` goes on when a site is lost. A
    pipeline of D >= 2 replicas averaged every H > 1 steps does: a replica that loses a site stops, the
    others go on; one replica, or H = 1, restarts from the last checkpoint."""
    if cfg.strategy.name == "pipeline":
        _, replicas = cfg.strategy.pipeline_shape(topology.num_sites)
        return replicas > 1 and (cfg.strategy.inner_steps or 1) > 1
    return CATALOGUE[cfg.strategy.name].elastic


def survives_site_loss(cfg: TrainConfig, topology: Topology) -> bool:
    """:func:`survives` for a job's config as submitted (its strategy resolved by autotune first);
    False: the attempt stops and restarts from its latest checkpoint."""
    from cpn.runtime.autotune import resolve

    return survives(resolve(cfg, topology), topology)
