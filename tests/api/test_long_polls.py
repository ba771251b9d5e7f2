"""A token holds at most MAX_PER_TOKEN long polls (watches, log follows) on one target at once (issue 35, M3)."""

from __future__ import annotations

import asyncio

from cpn.api.longpolls import MAX_PER_TOKEN
from tests.layers.orchestration.test_reconciler import _job, _world


async def test_the_next_follow_past_the_limit_is_429_and_others_are_not_held(api) -> None:  # type: ignore[no-untyped-def]
    await _world(api)
    resp = await api.client.post("/api/v1/jobs", json=_job("quoted"), headers=api.auth("alice"))
    assert resp.status == 201, await resp.text()
    url = "/api/v1/jobs/quoted/logs?follow=1"
    held = [await api.client.get(url, headers=api.auth("alice")) for _ in range(MAX_PER_TOKEN)]
    assert all(r.status == 200 for r in held)
    over = await api.client.get(url, headers=api.auth("alice"))
    assert over.status == 429, await over.text()
    error = (await over.json())["error"]
    assert error["code"] == "rate_limited" and str(MAX_PER_TOKEN) in error["message"]
    # another token is not held by alice's follows, and a provider's watches count per cluster: its
    # agents serving many clusters with one token are never refused
    watches = [await api.client.get(f"/api/v1/subtasks?cluster={c}&watch=true&timeoutSeconds=1",
                                    headers=api.auth("prov-a")) for c in ("fra-1-cpu", "ams-1-cpu")]
    assert [w.status for w in watches] == [200, 200], [await w.text() for w in watches]
    held.pop().close()  # the reader left: its slot is free again
    for _ in range(50):
        again = await api.client.get(url, headers=api.auth("alice"))
        if again.status != 429:
            break
        await asyncio.sleep(0.1)
    assert again.status == 200, await again.text()
    for r in [*held, again]:
        r.close()
