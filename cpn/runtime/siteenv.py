"""Site-local launchers (torchrun in a Kubernetes Indexed Job) number ranks within their site.
CPN numbers them site by site across the whole job; this turns the first into the second.

The kubernetes driver sets ``CPN_RANK_OFFSET`` (ranks of the sites before this one) and
``CPN_MASTER_ADDR``/``CPN_MASTER_PORT`` (the job-wide rendezvous), which torchrun leaves alone
while it overwrites ``RANK``/``WORLD_SIZE``/``MASTER_*`` with per-site values. torchrun's own
store (``TORCHELASTIC_USE_AGENT_STORE``) serves only the site's pods, so the job-wide rank 0 must
host the job's store itself: that flag is turned off whenever the master is rewritten.
"""

from __future__ import annotations

import json
import os
from collections.abc import MutableMapping

from cpn.runtime.topology import ENV_TOPOLOGY

ENV_RANK_OFFSET = "CPN_RANK_OFFSET"
ENV_MASTER_ADDR = "CPN_MASTER_ADDR"  # the job-wide rendezvous, which torchrun leaves alone
ENV_MASTER_PORT = "CPN_MASTER_PORT"
AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"


def globalise(environ: MutableMapping[str, str] | None = None) -> bool:
    """Rewrite RANK, WORLD_SIZE and MASTER_ADDR/PORT to the job-wide values; False when not needed."""
    env = os.environ if environ is None else environ
    offset = env.get(ENV_RANK_OFFSET)
    if offset is None:
        return False
    topology = json.loads(env[ENV_TOPOLOGY])
    env["RANK"] = str(int(offset) + int(env.get("RANK", "0")))
    env["WORLD_SIZE"] = str(sum(int(site["ranks"]) for site in topology["sites"]))
    for name, job_wide in (("MASTER_ADDR", ENV_MASTER_ADDR), ("MASTER_PORT", ENV_MASTER_PORT)):
        if job_wide in env:
            env[name] = env[job_wide]
            env[AGENT_STORE] = str(False)
    return True
