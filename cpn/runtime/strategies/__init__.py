"""Training strategies, one module each, looked up by name (``--strategy``).

=============  ==========================================================  =======  =========
name           what crosses the WAN, and when                              elastic  barrier
=============  ==========================================================  =======  =========
ddp            gradients, every step, flat ring over all ranks             no       every step
hierarchical   gradients, every step, 2D-torus all-reduce (opt. int8)      no       every step
local_sgd      parameters, every H steps, between site leaders             yes      every H
diloco         pseudo-gradients every H steps, outer Nesterov (opt. int8,  yes      every H
               overlapped one round late)
gossip         parameters, to 1-2 neighbours on a time-varying graph       yes      none
ssp            parameters to all sites; a site may lead by <= s steps      no       bounded
async_ps       gradients to sharded parameter servers, fresh params back   yes      none
ps_sync        the same; servers apply the mean of every worker's push     no       every step
ps_backup      the same; servers apply the first N-b pushes, drop the rest no       first N-b
pipeline       activations forward, their gradients back, between          no (1)   every step
               consecutive stages (one per site, 1F1B micro-batches)
=============  ==========================================================  =======  =========

(1) With D >= 2 replicas averaged every H > 1 steps, a replica that loses a site stops and the others
    go on (:meth:`Strategy.survives`); one replica, or H = 1, restarts from the last checkpoint.
"""

from __future__ import annotations

import importlib

from cpn.runtime.catalogue import CATALOGUE, survives_site_loss
from cpn.runtime.strategies.base import Context, Strategy

__all__ = ["STRATEGIES", "Context", "Strategy", "build_strategy", "strategy_class", "survives_site_loss"]

# name -> "module:Class", from the torch-free catalogue the orchestrator reads too (one source)
STRATEGIES: dict[str, str] = {name: info.runs for name, info in CATALOGUE.items()}


def strategy_class(name: str) -> type[Strategy]:
    try:
        module, cls = STRATEGIES[name].split(":")
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}") from None
    return getattr(importlib.import_module(module), cls)


def build_strategy(ctx: Context) -> Strategy:
    return strategy_class(ctx.cfg.strategy.name)(ctx)


