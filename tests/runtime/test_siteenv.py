"""Site-local torchrun ranks become CPN's job-wide, site-by-site ranks."""

from __future__ import annotations

import json

from cpn.runtime.siteenv import globalise


def test_offsets_rank_and_sets_job_world() -> None:
    topo = {"sites": [{"name": "a", "ranks": 4}, {"name": "b", "ranks": 2}], "links": []}
    env = {"CPN_RANK_OFFSET": "4", "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "pod-0", "MASTER_PORT": "29400",
           "CPN_MASTER_ADDR": "site0.ns.svc", "CPN_MASTER_PORT": "29500", "CPN_TOPOLOGY": json.dumps(topo)}
    assert globalise(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"], env["MASTER_PORT"]) == ("5", "6", "site0.ns.svc",
                                                                                         "29500")


def test_leaves_a_plain_environment_alone() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "8"}
    assert not globalise(env)
    assert env == {"RANK": "3", "WORLD_SIZE": "8"}
