"""The training runtime: runs on the sites' machines over torch.distributed.

It knows nothing of the database or the layers; it gets a job spec and a :class:`Topology` as input.
Names are loaded lazily so that the control layer can import :mod:`cpn.runtime.topology` (pydantic
only) on machines without torch.

Communication (runtime I): ``topology`` -> ``groups`` -> ``collectives`` (+ ``codecs``,
``bucketing``), ``launcher`` + ``netem`` for local multi-site runs, ``accounting`` for measured bytes,
``costmodel`` for the alpha-beta predictions.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Topology": "cpn.runtime.topology",
    "SiteSpec": "cpn.runtime.topology",
    "LinkSpec": "cpn.runtime.topology",
    "TopologyError": "cpn.runtime.topology",
    "Groups": "cpn.runtime.groups",
    "init_groups": "cpn.runtime.groups",
    "current_groups": "cpn.runtime.groups",
    "Stats": "cpn.runtime.collectives",
    "allreduce": "cpn.runtime.collectives",
    "site_allreduce": "cpn.runtime.collectives",
    "wan_allreduce": "cpn.runtime.collectives",
    "broadcast_from_site_leader": "cpn.runtime.collectives",
    "ErrorFeedback": "cpn.runtime.codecs",
    "launch": "cpn.runtime.launcher",
    "predict_seconds": "cpn.runtime.costmodel",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cpn.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
