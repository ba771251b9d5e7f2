"""The agent's work loop against the real API (in-process, over real HTTP) and the real reconciler:
a site whose driver cannot launch one job fails that job alone, with the driver's reason, and keeps
running the others; an agent that died between a claim and a launch does not claim again (a sub-task's
worker token is minted once): the claim timeout re-places it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
from sqlalchemy import func, select

from cpn.agent.work import WorkLoop
from cpn.runtime.contract import AttemptSpec
from layers.orchestration.identity.models import Token
from layers.orchestration.lifecycle.models import SubtaskRow
from layers.orchestration.lifecycle.reconciler import Reconciler, ReconcilerConfig
from layers.resource.drivers.base import DriverError, LogLine, SubtaskState
from tests.layers.orchestration.test_reconciler import _accept, _job, _job_of, _world

CLUSTERS = {"fra-1-cpu": "prov-a", "ams-1-cpu": "prov-a", "nyc-1-cpu": "prov-b"}


class Site:
    """A site's driver as the agent sees it: launches succeed and finish after a few polls, except
    for jobs whose name contains `refuse`, which the site cannot start (an image pull, a quota...)."""

    name = "local"

    def __init__(self, refuse: str = "\0"):
        self.refuse = refuse
        self.launched: list[tuple[str, int]] = []

    async def launch(self, spec: AttemptSpec) -> dict[str, Any]:
        if self.refuse in spec.job:
            raise DriverError("the site's container runtime refused the workers: quota exceeded")
        self.launched.append((spec.subtask, spec.attempt))
        return {"polls": 0}

    async def poll(self, spec: AttemptSpec, handle: dict[str, Any]) -> SubtaskState:
        handle["polls"] += 1
        done = handle["polls"] > 2
        if done and not handle.get("trained"):  # its workers report what they trained, as the runtime's do
            handle["trained"] = True
            await _trained(spec)
        return SubtaskState("Succeeded" if done else "Running",
                            exit_codes={str(r): 0 if done else None for r in spec.ranks})

    async def cancel(self, spec: AttemptSpec, handle: dict[str, Any]) -> None:
        handle["polls"] = 99

    async def adopt(self) -> list[tuple[AttemptSpec, dict[str, Any]]]:
        return []

    async def logs(self, spec: AttemptSpec, handle: dict[str, Any],
                   cursor: dict[str, Any]) -> tuple[list[LogLine], dict[str, Any]]:
        return [], cursor


async def _trained(spec: AttemptSpec) -> None:
    """One metric report per rank with the sub-task's own worker token (a job that reported no
    trained token does not succeed)."""
    assert spec.server and spec.worker_token
    async with httpx.AsyncClient(base_url=spec.server) as client:
        await client.post(f"{spec.job_path}/metrics", headers={"Authorization": f"Bearer {spec.worker_token}"},
                          json={"reports": [{"rank": r, "site": spec.site_index, "step": 1, "tokens": 64}
                                            for r in spec.ranks]})


def _url(api) -> str:  # type: ignore[no-untyped-def]
    return str(api.client.make_url("")).rstrip("/")


def _agents(api, site: Site) -> list[WorkLoop]:  # type: ignore[no-untyped-def]
    return [WorkLoop(_url(api), api.tokens[owner], cluster, site, advertise="127.0.0.1")
            for cluster, owner in CLUSTERS.items()]


async def _pass(reconciler: Reconciler, agents: list[WorkLoop]) -> None:
    await reconciler.reconcile_once()
    for agent in agents:
        agent.version = None  # list now rather than long-poll for a change
        await agent.watch_once()
        await agent.monitor_once()


async def test_a_site_that_cannot_launch_fails_that_job_alone_and_the_good_one_succeeds(api, db) -> None:  # type: ignore[no-untyped-def]
    await _world(api)
    resp = await api.client.post("/api/v1/jobs", json=_job("too-big", model="llama-7b"), headers=api.auth("alice"))
    assert resp.status == 422, await resp.text()  # offered nowhere: no CPU slot holds a 7B model
    await _accept(api, "refused", maxPricePerGpuHour="100")  # may move to a dearer cluster
    await _accept(api, "good")
    site = Site(refuse="refused")
    agents = _agents(api, site)
    reconciler = Reconciler(db, ReconcilerConfig(heartbeat_timeout=timedelta(seconds=60),
                                                 lease_ttl=timedelta(hours=1), claim_timeout=timedelta(hours=1)))
    try:
        for _ in range(8):
            await _pass(reconciler, agents)
    finally:
        for agent in agents:
            agent.close()

    good = await _job_of(db, "good")
    assert good.phase == "Succeeded", good.status
    assert good.status["attempt"] == 1
    assert [x for x in site.launched if x[0].startswith("alice/good-")] == [(f"alice/good-{good.status['placement'][0]['cluster']}", 1)]
    refused = await _job_of(db, "refused")
    assert refused.phase == "Failed", refused.status
    assert "could not launch the workers" in refused.status["message"], refused.status["message"]
    assert "quota exceeded" in refused.status["message"]
    resp = await api.client.get("/api/v1/events?job=refused", headers=api.auth("alice"))
    reasons = [e["reason"] for e in (await resp.json())["items"]]
    assert "SiteFailed" in reasons and "Failed" in reasons, reasons
    resp = await api.client.get("/api/v1/reservations?job=refused", headers=api.auth("alice"))
    assert all(r["status"]["state"] != "active" for r in (await resp.json())["items"])


async def test_a_claim_whose_agent_died_before_launching_is_re_placed_not_claimed_again(api, db) -> None:  # type: ignore[no-untyped-def]
    """Before: the restarted agent claimed again and got a fresh worker token (any holder of the
    provider's token could collect them, issue 35). Now the claim is refused; the claim timeout
    fails the sub-task as its site's fault and the job runs on another cluster."""
    await _world(api)
    await _accept(api, "orphan", maxPricePerGpuHour="100")
    reconciler = Reconciler(db, ReconcilerConfig(heartbeat_timeout=timedelta(seconds=60),
                                                 lease_ttl=timedelta(hours=1), claim_timeout=timedelta(hours=1)))
    await reconciler.reconcile_once()
    job = await _job_of(db, "orphan")
    cluster = job.status["placement"][0]["cluster"]
    listing = await api.client.get(f"/api/v1/subtasks?cluster={cluster}", headers=api.auth(CLUSTERS[cluster]))
    (uid,) = [t["metadata"]["uid"] for t in (await listing.json())["items"]]
    # an earlier life of the agent claimed the sub-task, then died before its driver launched anything
    resp = await api.client.post(f"/api/v1/subtasks/{uid}/claim", headers=api.auth(CLUSTERS[cluster]),
                                 json={"rendezvous": {"host": "127.0.0.1", "port": 29500}})
    assert resp.status == 200, await resp.text()
    site = Site()
    agent = WorkLoop(_url(api), api.tokens[CLUSTERS[cluster]], cluster, site, advertise="127.0.0.1")
    try:
        await agent.adopt()
        for _ in range(3):
            await _pass(reconciler, [agent])
    finally:
        agent.close()
    assert site.launched == []  # the claim was refused: no second token, nothing launched
    async with db.session() as s:
        assert (await s.execute(select(func.count()).select_from(Token).where(Token.job == "alice/orphan"))).scalar() == 1
        row = (await s.execute(select(SubtaskRow).where(SubtaskRow.id == uid))).scalar_one()
        row.claimed_at = datetime.now(UTC) - timedelta(minutes=10)
    timeout = Reconciler(db, ReconcilerConfig(heartbeat_timeout=timedelta(seconds=60), lease_ttl=timedelta(hours=1),
                                              claim_timeout=timedelta(seconds=60)))
    agents = _agents(api, site)
    try:
        for _ in range(8):
            await _pass(timeout, agents)
    finally:
        for each in agents:
            each.close()
    job = await _job_of(db, "orphan")
    assert (job.phase, job.status["attempt"]) == ("Succeeded", 2), job.status
    assert [x[1] for x in site.launched] == [2] and cluster not in site.launched[0][0]


class KilledSite(Site):
    """A site whose workers were SIGKILLed before the server's Stop reached its agent."""

    def __init__(self) -> None:
        super().__init__()
        self.cancelled = 0

    async def poll(self, spec: AttemptSpec, handle: dict[str, Any]) -> SubtaskState:
        if self.cancelled:
            return SubtaskState("Cancelled", exit_codes={"0": -15})
        return SubtaskState("Failed", message="rank 0 exited -9", exit_codes={"0": -9})

    async def cancel(self, spec: AttemptSpec, handle: dict[str, Any]) -> None:
        self.cancelled += 1


async def test_a_stop_that_overtakes_a_killed_sites_failure_does_not_hide_it() -> None:
    """CI (e2e, ddp re-placed after a site's workers are killed): the surviving site failed first, the
    server stopped the attempt's other site, and its agent cancelled a run that had already ended --
    reporting Cancelled, so no site counted as lost and the job failed instead of restarting."""
    from cpn.agent.work import Run

    site = KilledSite()
    agent = WorkLoop("http://127.0.0.1:9", "t", "fra-1-cpu", site, advertise="127.0.0.1")
    posted: list[tuple[str, dict]] = []

    async def call(method: str, path: str, **kw: Any) -> Any:
        posted.append((path, kw.get("json") or {}))

    agent._call = call  # type: ignore[method-assign]
    spec = AttemptSpec.model_construct(subtask="alice/sync-fra-1-cpu", attempt=1, ranks=[0], job="alice/sync")
    agent.runs["u1"] = Run("u1", spec, {})
    agent.desired["u1"] = "Stop"
    try:
        await agent.monitor_once()
    finally:
        agent.close()
    assert site.cancelled == 0
    [(path, body)] = [p for p in posted if p[0].endswith("/status")]
    assert body["phase"] == "Failed" and body["exitCodes"] == {"0": -9}, body
