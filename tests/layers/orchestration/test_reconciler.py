"""One bad job must never stop the others: jobs that fail at every stage of the reconciler's work
sit next to a good job; each fails alone with its reason, and the good one goes on in the same pass."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import select

from cpn.cli.demo import consents, world
from layers.orchestration.lifecycle.models import SubtaskRow
from layers.orchestration.lifecycle.reconciler import Reconciler, ReconcilerConfig
from layers.service.models import JobRow

PROVIDERS = {"prov-a": "alpha-cloud", "prov-b": "beta-dc"}


def _job(name: str, **spec: object) -> dict:
    return {"apiVersion": "cpn/v1", "kind": "TrainingJob", "metadata": {"name": name},
            "spec": {"model": "tiny", "tokens": 120_000, "globalBatchTokens": 3 * 128 * 8, "strategy": "diloco",
                     "innerSteps": 10, "gpus": {"min": 1, "max": 1}, "sites": {"min": 1, "max": 1}, **spec}}


async def _world(api) -> None:  # type: ignore[no-untyped-def]
    for token in ("prov-b", "prov-a"):  # alpha links to beta's site
        resp = await api.client.post("/api/v1/apply", json={"items": world(PROVIDERS[token])},
                                     headers=api.auth(token))
        assert resp.status == 200, await resp.text()
    resp = await api.client.post("/api/v1/apply", json={"items": consents("beta-dc")}, headers=api.auth("prov-b"))
    assert resp.status == 200, await resp.text()  # beta's consent to alpha's links to nyc-1 (issue 35 M4)
    for token, sites in (("prov-a", ["fra-1", "ams-1"]), ("prov-b", ["nyc-1"])):
        for site in sites:
            resp = await api.client.post(f"/api/v1/clusters/{site}-cpu/heartbeat", headers=api.auth(token),
                                         json={"allocatableGpus": 1, "capacityGpus": 1,
                                               "conditions": [{"type": "Ready", "status": "True"}]})
            assert resp.status == 200, await resp.text()


async def _accept(api, name: str, **spec: object) -> None:  # type: ignore[no-untyped-def]
    resp = await api.client.post("/api/v1/jobs", json=_job(name, **spec), headers=api.auth("alice"))
    assert resp.status in (200, 201), await resp.text()
    resp = await api.client.post(f"/api/v1/jobs/{name}/accept", json={"quote": "cheapest"}, headers=api.auth("alice"))
    assert resp.status == 200, await resp.text()


async def _mutate(db, name: str, **status: object) -> None:  # type: ignore[no-untyped-def]
    async with db.session() as s:
        job = (await s.execute(select(JobRow).where(JobRow.name == f"alice/{name}"))).scalar_one()
        new = dict(job.status)
        for key, value in status.items():
            if value is None:
                new.pop(key, None)
            else:
                new[key] = value
        job.status = new


async def _job_of(db, name: str) -> JobRow:  # type: ignore[no-untyped-def]
    async with db.session() as s:
        return (await s.execute(select(JobRow).where(JobRow.name == f"alice/{name}"))).scalar_one()


async def test_poison_jobs_fail_alone_and_the_good_job_goes_on(api, db) -> None:  # type: ignore[no-untyped-def]
    await _world(api)
    await _accept(api, "broken-status")        # the reported fault: a job the reconciler cannot read
    await _accept(api, "bad-knobs")            # strategy knobs the runtime refuses
    await _accept(api, "good")
    await _mutate(db, "broken-status", topology=None, placement=None)
    await _mutate(db, "bad-knobs", strategy="warp-drive")
    reconciler = Reconciler(db, ReconcilerConfig(heartbeat_timeout=timedelta(seconds=60),
                                                 lease_ttl=timedelta(hours=1), claim_timeout=timedelta(hours=1)))
    for _ in range(3):  # a pass that raises is retried; the third strike fails the job alone
        await reconciler.reconcile_once()

    good = await _job_of(db, "good")
    assert good.phase == "Launching", good.status.get("message")  # from the first pass on
    async with db.session() as s:
        subtasks = list((await s.execute(select(SubtaskRow).where(SubtaskRow.job == "alice/good"))).scalars())
    assert len(subtasks) == 1 and subtasks[0].desired == "Run" and subtasks[0].phase == "Pending"
    for name, reason, words in (("broken-status", "ReconcileError", "placement"),
                                ("bad-knobs", "NotRunnable", "warp-drive")):
        job = await _job_of(db, name)
        assert job.phase == "Failed", (name, job.status)
        cond = job.status["conditions"][-1]
        assert cond["reason"] == reason and words in cond["message"], cond
        resp = await api.client.get(f"/api/v1/events?job={name}", headers=api.auth("alice"))
        assert any(e["reason"] == "Failed" for e in (await resp.json())["items"])
        resp = await api.client.get(f"/api/v1/reservations?job={name}", headers=api.auth("alice"))
        assert all(r["status"]["state"] != "active" for r in (await resp.json())["items"])


def _reconciler(db, claim_seconds: float) -> Reconciler:  # type: ignore[no-untyped-def]
    return Reconciler(db, ReconcilerConfig(heartbeat_timeout=timedelta(seconds=60), lease_ttl=timedelta(hours=1),
                                           claim_timeout=timedelta(seconds=claim_seconds)))


async def test_a_site_whose_workers_crash_fails_the_job_with_their_cause(api, db) -> None:  # type: ignore[no-untyped-def]
    await _world(api)
    await _accept(api, "crashes", strategy="ddp")
    reconciler = _reconciler(db, 3600)
    await reconciler.reconcile_once()
    async with db.session() as s:  # its agent claimed it, then a worker crashed (no site was lost)
        row = (await s.execute(select(SubtaskRow).where(SubtaskRow.job == "alice/crashes"))).scalar_one()
        row.phase, row.reported = "Running", "Failed"
        row.exit_codes, row.handle = {"0": 1}, {"message": "rank 0 exited 1: ValueError: bad batch"}
    await reconciler.reconcile_once()
    crashed = await _job_of(db, "crashes")
    assert crashed.phase == "Failed" and "ValueError: bad batch" in crashed.status["message"], crashed.status
    assert crashed.status["conditions"][-1]["reason"] == "WorkersFailed"
    assert crashed.status["attempt"] == 1  # a retry would fail the same way: none was made


async def test_a_subtask_no_agent_claims_is_re_placed_then_fails_with_the_reason(api, db) -> None:  # type: ignore[no-untyped-def]
    await _world(api)
    await _accept(api, "never-claimed", maxPricePerGpuHour="100")  # may move to a dearer cluster
    await _accept(api, "good")
    reconciler = _reconciler(db, 0)
    for _ in range(4):
        await reconciler.reconcile_once()
    unclaimed = await _job_of(db, "never-claimed")
    assert unclaimed.phase == "Failed" and "claimed" in unclaimed.status["message"], unclaimed.status
    assert unclaimed.status["attempt"] >= 2  # re-placed on another site before giving up
    resp = await api.client.get("/api/v1/events?job=never-claimed", headers=api.auth("alice"))
    assert any(e["reason"] == "Restarting" for e in (await resp.json())["items"])


async def test_a_claimed_subtask_its_agent_never_reports_fails_after_the_claim_timeout(api, db) -> None:  # type: ignore[no-untyped-def]
    await _world(api)
    await _accept(api, "silent")
    reconciler = _reconciler(db, 60)
    await reconciler.reconcile_once()
    async with db.session() as s:  # claimed ten minutes ago by an agent that then said nothing at all
        row = (await s.execute(select(SubtaskRow).where(SubtaskRow.job == "alice/silent"))).scalar_one()
        row.phase, row.claimed_at = "Launching", datetime.now(UTC) - timedelta(minutes=10)
    await reconciler.reconcile_once()
    async with db.session() as s:
        row = (await s.execute(select(SubtaskRow).where(SubtaskRow.job == "alice/silent",
                                                        SubtaskRow.attempt == 1))).scalar_one()
    assert row.phase == "Failed" and "reported nothing" in (row.message or ""), row.message
    assert row.desired == "Stop"


async def test_a_restarted_server_does_not_blame_sites_for_its_own_silence(api, db) -> None:  # type: ignore[no-untyped-def]
    """The API server was down for longer than the heartbeat timeout, so every cluster's last heartbeat
    is stale: a reconciler that has only just started listening waits a heartbeat timeout before it
    calls a site lost (the agents could not reach it); after that, silence is the site's."""
    from layers.resource.models import ClusterRow

    await _world(api)
    await _accept(api, "outlives-restart")
    reconciler = _reconciler(db, 3600)
    await reconciler.reconcile_once()
    async with db.session() as s:
        row = (await s.execute(select(SubtaskRow).where(SubtaskRow.job == "alice/outlives-restart"))).scalar_one()
        row.phase, row.reported, row.claimed_at = "Running", "Running", datetime.now(UTC)
        for cluster in (await s.execute(select(ClusterRow))).scalars():
            cluster.last_heartbeat_at = datetime.now(UTC) - timedelta(minutes=5)
    restarted = _reconciler(db, 3600)
    restarted.listening_since = datetime.now(UTC)  # what run_forever sets when it takes the lead
    await restarted.reconcile_once()
    job = await _job_of(db, "outlives-restart")
    assert job.phase == "Running" and job.status["attempt"] == 1, job.status
    restarted.listening_since = datetime.now(UTC) - timedelta(minutes=2)  # listening longer than the timeout
    await restarted.reconcile_once()
    async with db.session() as s:
        row = (await s.execute(select(SubtaskRow).where(SubtaskRow.job == "alice/outlives-restart",
                                                        SubtaskRow.attempt == 1))).scalar_one()
    assert row.phase == "Lost" and "stopped heartbeating" in (row.message or ""), (row.phase, row.message)


async def test_a_job_waiting_on_a_silent_site_says_so_and_running_counts_stay_current(api, db) -> None:  # type: ignore[no-untyped-def]
    from layers.resource.models import ClusterRow

    await _world(api)
    await _accept(api, "waits", strategy="ddp")
    reconciler = _reconciler(db, 3600)
    await reconciler.reconcile_once()
    async with db.session() as s:  # its site stops heartbeating before the agent claims the sub-task
        task = (await s.execute(select(SubtaskRow).where(SubtaskRow.job == "alice/waits"))).scalar_one()
        cluster = (await s.execute(select(ClusterRow).where(ClusterRow.name == task.cluster))).scalar_one()
        cluster.last_heartbeat_at = datetime.now(UTC) - timedelta(minutes=5)
    await reconciler.reconcile_once()
    job = await _job_of(db, "waits")
    launching = next(c for c in job.status["conditions"] if c["type"] == "Launching")
    assert job.phase == "Launching" and f"{task.cluster} is not Ready (last heartbeat" in launching["message"], launching
    assert "re-placed elsewhere if it has not claimed its sub-task in" in job.status["message"], job.status
    phase_time = job.status["phaseTimes"]["Launching"]

    async with db.session() as s:  # the site comes back, claims and runs it
        cluster = (await s.execute(select(ClusterRow).where(ClusterRow.name == task.cluster))).scalar_one()
        cluster.last_heartbeat_at = datetime.now(UTC)
        row = (await s.execute(select(SubtaskRow).where(SubtaskRow.job == "alice/waits"))).scalar_one()
        row.phase, row.reported, row.claimed_at = "Running", "Running", datetime.now(UTC)
    await reconciler.reconcile_once()
    job = await _job_of(db, "waits")
    assert job.phase == "Running" and job.status["message"] == "1 of 1 sub-tasks running", job.status
    assert job.status["phaseTimes"]["Launching"] == phase_time  # rewording is not a transition
