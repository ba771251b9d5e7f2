"""Site-local launchers (torchrun in a Kubernetes Indexed Job) number ranks within their site.
CPN numbers them site by site across the whole job; this turns the first into the second.

The kubernetes driver sets ``CPN_RANK_OFFSET`` (ranks of the sites before this one) and
``CPN_MASTER_ADDR``/``CPN_MASTER_PORT`` (the job-wide rendezvous), which torchrun leaves alone
while it overwrites ``RANK``/``WORLD_SIZE``/``MASTER_*`` with per-site values.
"""

from __future__ import annotations

import json
import os
from collections.abc import MutableMapping

ENV_RANK_OFFSET = "CPN_RANK_OFFSET"


def globalise(environ: MutableMapping[str, str] | None = None) -> bool:
    """Rewrite RANK, WORLD_SIZE and MASTER_ADDR/PORT to the job-wide values; False when not needed."""
    env = os.environ if environ is None else environ
    offset = env.get(ENV_RANK_OFFSET)
    if offset is None:
        return False
    topology = json.loads(env["CPN_TOPOLOGY"])
    env["RANK"] = str(int(offset) + int(env.get("RANK", "0")))
    env["WORLD_SIZE"] = str(sum(int(site["ranks"]) for site in topology["sites"]))
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if f"CPN_{name}" in env:
            env[name] = env[f"CPN_{name}"]
    return True
