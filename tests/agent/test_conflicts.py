"""Conflicts on a cluster's row (issue 36, item 3): writes that name no resourceVersion are retried by the
server, and an agent whose heartbeat still gets a 409 sends it again instead of exiting."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path

import pytest
from aiohttp import web

from cpn.agent import heartbeat
from cpn.agent.heartbeat import AgentConfig, Registration, run_agent
from cpn.core import errors
from cpn.core.db import Database
from cpn.core.settings import Settings
from tests.conftest import Api, make_token

SITE = {"apiVersion": "cpn/v1", "kind": "Site", "metadata": {"name": "fra-1"}, "spec": {"region": "eu-central"}}
CLUSTER = {"apiVersion": "cpn/v1", "kind": "Cluster", "metadata": {"name": "fra-h100"}, "spec": {
    "site": "fra-1", "nodePools": [{"name": "main", "gpu": {"model": "H100", "memoryGB": 80, "tflops": 989},
                                    "gpusPerNode": 8, "nodes": 2, "pricePerGpuHour": "2.45"}]}}
BEAT = {"allocatableGpus": 12, "conditions": [{"type": "Ready", "status": "True"}]}


async def _world(api: Api) -> None:
    resp = await api.client.post("/api/v1/apply", json={"items": [SITE, CLUSTER]}, headers=api.auth("prov-a"))
    assert resp.status == 200, await resp.text()


async def test_concurrent_label_patches_all_land(api: Api) -> None:
    """Three merge PATCHes of one cluster's labels at once: each is merged onto the others' result
    (before: one 200 and two 409 "the object was changed by someone else")."""
    await _world(api)

    async def label(i: int) -> tuple[int, str]:
        resp = await api.client.patch("/api/v1/clusters/fra-h100", json={"metadata": {"labels": {f"k{i}": str(i)}}},
                                      headers=api.auth("prov-a"))
        return resp.status, await resp.text()

    for round_ in range(3):  # a few rounds: one burst may happen to run one after another
        results = await asyncio.gather(*(label(10 * round_ + i) for i in range(3)))
        assert [status for status, _ in results] == [200, 200, 200], results
    got = await (await api.client.get("/api/v1/clusters/fra-h100", headers=api.auth("prov-a"))).json()
    assert got["metadata"]["labels"] == {f"k{10 * r + i}": str(10 * r + i) for r in range(3) for i in range(3)}


async def test_heartbeats_and_patches_of_one_cluster_at_once_all_land(api: Api) -> None:
    """Heartbeats (no resourceVersion) interleaved with label PATCHes: none is answered 409."""
    await _world(api)

    async def beat() -> tuple[int, str]:
        resp = await api.client.post("/api/v1/clusters/fra-h100/heartbeat", json=BEAT, headers=api.auth("prov-a"))
        return resp.status, await resp.text()

    async def label(i: int) -> tuple[int, str]:
        resp = await api.client.patch("/api/v1/clusters/fra-h100", json={"metadata": {"labels": {"n": str(i)}}},
                                      headers=api.auth("prov-a"))
        return resp.status, await resp.text()

    results = await asyncio.gather(*(call for i in range(6) for call in (beat(), label(i))))
    assert all(status == 200 for status, _ in results), [r for r in results if r[0] != 200]
    got = await (await api.client.get("/api/v1/clusters/fra-h100", headers=api.auth("prov-a"))).json()
    assert got["status"]["allocatable"]["gpus"] == 12 and got["metadata"]["labels"]["n"] in {str(i) for i in range(6)}


async def test_a_patch_naming_a_stale_resource_version_is_still_refused(api: Api) -> None:
    """The server retries only writes that name no version: the user's stale resourceVersion stays a 409."""
    await _world(api)
    got = await (await api.client.get("/api/v1/clusters/fra-h100", headers=api.auth("prov-a"))).json()
    stale = got["metadata"]["resourceVersion"]
    resp = await api.client.patch("/api/v1/clusters/fra-h100", json={"metadata": {"labels": {"a": "1"}}},
                                  headers=api.auth("prov-a"))
    assert resp.status == 200, await resp.text()
    resp = await api.client.patch("/api/v1/clusters/fra-h100",
                                  json={"metadata": {"labels": {"b": "2"}, "resourceVersion": stale}},
                                  headers=api.auth("prov-a"))
    assert resp.status == 409 and (await resp.json())["error"]["code"] == "stale"


class Refusals:
    """A middleware of the real server that answers the first `count` heartbeats with the server's own
    409 (what a concurrent writer caused before the server retried), then lets them through."""

    def __init__(self, count: int):
        self.left, self.refused, self.passed = count, 0, 0

    def middleware(self):  # type: ignore[no-untyped-def]
        @web.middleware
        async def refuse(request: web.Request, handler) -> web.StreamResponse:  # type: ignore[no-untyped-def]
            if request.method != "POST" or not request.path.endswith("/heartbeat"):
                return await handler(request)
            if self.left > 0:
                self.left -= 1
                self.refused += 1
                raise errors.StaleVersion("the object was changed by someone else; re-read it and retry",
                                          field="metadata.resourceVersion")
            response = await handler(request)
            self.passed += response.status == 200
            return response

        return refuse


async def _conflicting_api(aiohttp_client, settings: Settings, db: Database, refusals: Refusals) -> Api:  # type: ignore[no-untyped-def]
    from cpn.api.app import create_app

    app = create_app(settings, db, migrate=False)
    app.middlewares.append(refusals.middleware())  # innermost: after authentication, mapped to HTTP by errors_middleware
    client = await aiohttp_client(app)
    return Api(client=client, tokens={"prov-a": await make_token(db, "prov-a", "provider")})


def _agent(api: Api, tmp_path: Path, **kw: object) -> AgentConfig:
    return AgentConfig(cluster="lab-cpu", server=str(api.client.make_url("")).rstrip("/"), token=api.tokens["prov-a"],
                       local=True, gpus=2, state_dir=tmp_path / "agent", work=False,
                       register=Registration(site="lab-1", region="eu-west", price_per_gpu_hour="0.10"), **kw)


async def test_an_agent_sends_a_conflicting_heartbeat_again(aiohttp_client, settings: Settings, db: Database,  # type: ignore[no-untyped-def]
                                                           tmp_path: Path) -> None:
    """`cpn agent --once` whose heartbeat meets two 409s: it repeats it and succeeds (it raised before)."""
    refusals = Refusals(2)
    api = await _conflicting_api(aiohttp_client, settings, db, refusals)
    await run_agent(_agent(api, tmp_path, once=True))
    assert refusals.refused == 2 and refusals.passed == 1
    resp = await api.client.get("/api/v1/clusters/lab-cpu", headers=api.auth("prov-a"))
    got = await resp.json()
    assert got["status"]["ready"] == "True" and got["status"]["allocatable"]["gpus"] == 2


async def test_an_agent_outlives_conflicts_longer_than_its_repeats(aiohttp_client, settings: Settings,  # type: ignore[no-untyped-def]
                                                                 db: Database, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """More 409s than one round's repeats: the running agent goes on to its next round instead of exiting,
    and its heartbeats land once the conflicts stop."""
    monkeypatch.setattr(heartbeat, "CONFLICT_BACKOFF", 0.01)
    refusals = Refusals(2 * (heartbeat.CONFLICT_RETRIES + 1) + 1)  # two whole rounds refused, and one more
    api = await _conflicting_api(aiohttp_client, settings, db, refusals)
    agent = asyncio.create_task(run_agent(_agent(api, tmp_path, interval=timedelta(seconds=0.2))))
    try:
        for _ in range(300):
            if refusals.passed >= 2 or agent.done():
                break
            await asyncio.sleep(0.05)
        assert not agent.done(), agent.exception()
        assert refusals.left == 0 and refusals.passed >= 2
    finally:
        agent.cancel()
        with pytest.raises(asyncio.CancelledError):
            await agent
