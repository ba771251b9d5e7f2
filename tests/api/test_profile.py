"""spec.profile through the API and the reconciler, with the site agent's protocol spoken over HTTP
(claim, the runner's metric reports with the contract's worker token, the agent's status report):
a profiled job is quoted from its measured step — on the profiled GPU model exactly, on another
scaled by the compute model's per-GPU factors; a profile that fails fails the job with its reason;
a non-boolean spec.profile is refused naming the field. The real processes run in
tests/e2e/test_profile.py."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from urllib.parse import quote

import pytest

from layers.orchestration.jobs.profile import PROFILE_STEPS
from layers.orchestration.lifecycle.reconciler import Reconciler, ReconcilerConfig
from layers.orchestration.planning.calibration import effective_tflops
from tests.api.test_jobs import job, quotes, register_world, submit

STEP = 0.5  # the seconds per step the profile "measures" here
OWNER = {"fra-h100": "prov-a", "ams-a100": "prov-a", "nyc-h100": "prov-b"}


def _profiled(name: str, **spec) -> dict:  # type: ignore[no-untyped-def]
    # tiny: CPN's own LM (no bundle needed); 100 steps of 8 sequences; one GPU anywhere
    return job(name, **{"model": "tiny", "tokens": 100 * 1024, "globalBatchTokens": 1024, "strategy": "ddp",
                        "gpus": {"min": 1, "max": 1}, "profile": True, **spec})


def _reconciler(db) -> Reconciler:  # type: ignore[no-untyped-def]
    return Reconciler(db, ReconcilerConfig(heartbeat_timeout=timedelta(seconds=60), lease_ttl=timedelta(hours=1),
                                           claim_timeout=timedelta(hours=1)))


async def _get(api, path: str, who: str = "alice") -> dict:  # type: ignore[no-untyped-def]
    resp = await api.client.get(path, headers=api.auth(who))
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def _claim(api, cluster: str) -> dict:  # type: ignore[no-untyped-def]
    """What the site's agent does: find its pending sub-task and claim it (rank 0: it serves the rendezvous)."""
    listing = await _get(api, f"/api/v1/subtasks?cluster={cluster}", OWNER[cluster])
    (item,) = listing["items"]
    resp = await api.client.post(f"/api/v1/subtasks/{item['metadata']['uid']}/claim", headers=api.auth(OWNER[cluster]),
                                 json={"rendezvous": {"host": "127.0.0.1", "port": 29500}})
    assert resp.status == 200, await resp.text()
    return {"uid": item["metadata"]["uid"], **await resp.json()}


async def _report(api, cluster: str, uid: str, phase: str, message: str = "") -> None:  # type: ignore[no-untyped-def]
    resp = await api.client.post(f"/api/v1/subtasks/{uid}/status", headers=api.auth(OWNER[cluster]),
                                 json={"phase": phase, "message": message, "exitCodes": {"0": 0 if phase == "Succeeded" else 1}})
    assert resp.status == 200, await resp.text()


async def _steps(api, contract: dict, steps: int) -> None:  # type: ignore[no-untyped-def]
    """What the job runner relays: rank 0's report after each step (wall clock from its start)."""
    reports = [{"rank": 0, "site": 0, "step": s, "tokens": 1024 * s, "trainLoss": 5.0 - 0.1 * s,
                "wallSeconds": 3.0 + STEP * (s - 1), "gpuSeconds": 4.0 + STEP * (s - 1)} for s in range(1, steps + 1)]
    resp = await api.client.post(f"/api/v1/jobs/{quote(contract['job'], safe='')}/metrics", json={"reports": reports},
                                 headers={"Authorization": f"Bearer {contract['worker_token']}"})
    assert resp.status == 200 and (await resp.json())["accepted"] == steps, await resp.text()


async def test_a_profiled_job_is_quoted_from_its_measured_step(api, db) -> None:  # type: ignore[no-untyped-def]
    await register_world(api)
    resp = await submit(api, _profiled("prof"))
    assert resp.status == 201, await resp.text()
    body = await resp.json()
    assert body["status"]["phase"] == "Profiling", body["status"]
    probe = body["status"]["profile"]
    assert (probe["cluster"], probe["gpus"], probe["gpuModel"], probe["steps"]) == ("ams-a100", 1, "A100", PROFILE_STEPS)
    assert await quotes(api, "prof") == []
    leases = (await _get(api, "/api/v1/reservations?job=prof"))["items"]
    assert [(x["spec"]["cluster"], x["spec"]["gpus"], x["status"]["state"]) for x in leases] == [("ams-a100", 1, "active")]

    contract = await _claim(api, "ams-a100")
    assert contract["attempt"] == 0 and contract["train"]["tokens"] == PROFILE_STEPS * 1024, contract["train"]
    assert contract["train"]["checkpoint_every"] == 0 and contract["train"]["strategy"]["name"] == "ddp"
    await _report(api, "ams-a100", contract["uid"], "Running")
    await _steps(api, contract, PROFILE_STEPS)
    await _report(api, "ams-a100", contract["uid"], "Succeeded")
    await _reconciler(db).reconcile_once()

    got = await _get(api, "/api/v1/jobs/prof")
    assert got["status"]["phase"] == "Quoted", got["status"]
    probe = got["status"]["profile"]
    assert probe["measuredStepSeconds"] == pytest.approx(STEP) and probe["measuredSteps"] == PROFILE_STEPS - 1
    leases = (await _get(api, "/api/v1/reservations?job=prof"))["items"]
    assert [x["status"]["state"] for x in leases] == ["released"]  # the profile's GPUs are back
    items = await quotes(api, "prof")
    assert items and {q["basis"] for q in items} == {"profiled"}
    ratio = effective_tflops("A100", 312) / effective_tflops("H100", 989)  # one H100 step over one A100 step
    for q in items:
        (line,) = q["placement"]
        expected = STEP * (1.0 if line["gpuModel"] == "A100" else ratio)
        assert q["profile"]["stepSeconds"] == pytest.approx(expected, rel=1e-9), (line, q["profile"])
        assert q["predictedSeconds"] == pytest.approx(100 * expected + q["model"]["startupSeconds"], abs=1e-3)
    # profiled on the modelled-cheapest A100, whose measured step makes the faster H100s cheaper now
    assert {q["placement"][0]["gpuModel"] for q in items} == {"H100"}

    for on, basis in ((True, "profiled"), (False, "modelled"), (True, "profiled")):  # re-applied: re-quoted
        resp = await api.client.post("/api/v1/apply", json={"items": [_profiled("prof", profile=on)]},
                                     headers=api.auth("alice"))
        assert resp.status == 200, await resp.text()
        assert {q["basis"] for q in await quotes(api, "prof")} == {basis}

    resp = await api.client.post("/api/v1/jobs/prof/accept", json={"quote": "cheapest"}, headers=api.auth("alice"))
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["status"]["phase"] == "Reserved"


async def test_a_failed_profile_fails_the_job_with_its_reason_and_frees_the_gpus(api, db) -> None:  # type: ignore[no-untyped-def]
    await register_world(api)
    assert (await submit(api, _profiled("broken"))).status == 201
    contract = await _claim(api, "ams-a100")
    await _report(api, "ams-a100", contract["uid"], "Failed", "rank 0 exited 1: ValueError: my model is broken")
    await _reconciler(db).reconcile_once()
    got = await _get(api, "/api/v1/jobs/broken")
    assert got["status"]["phase"] == "Failed", got["status"]
    assert "profile" in got["status"]["message"] and "my model is broken" in got["status"]["message"]
    leases = (await _get(api, "/api/v1/reservations?job=broken"))["items"]
    assert [x["status"]["state"] for x in leases] == ["released"]
    reasons = [e["reason"] for e in (await _get(api, "/api/v1/events?job=broken"))["items"]]
    assert "Profiling" in reasons and "Failed" in reasons, reasons


async def test_a_profile_without_timed_steps_fails_the_job(api, db) -> None:  # type: ignore[no-untyped-def]
    await register_world(api)
    assert (await submit(api, _profiled("silent"))).status == 201
    contract = await _claim(api, "ams-a100")
    await _steps(api, contract, 1)  # one step reported: nothing to time
    await _report(api, "ams-a100", contract["uid"], "Succeeded")
    await _reconciler(db).reconcile_once()
    got = await _get(api, "/api/v1/jobs/silent")
    assert got["status"]["phase"] == "Failed" and "timed fewer than 2 steps" in got["status"]["message"], got


async def test_profile_must_be_a_boolean_and_a_dry_run_is_modelled(api) -> None:  # type: ignore[no-untyped-def]
    await register_world(api)
    for value in ("maybe", 1, "true"):
        resp = await submit(api, job("bad", profile=value))
        error = (await resp.json())["error"]
        assert resp.status == 422 and error["field"] == "spec.profile", error
    resp = await api.client.post("/api/v1/jobs?dryRun=true", json=_profiled("dry"), headers=api.auth("alice"))
    assert resp.status == 200, await resp.text()
    assert {q["basis"] for q in (await resp.json())["status"]["quotes"]} == {"modelled"}
    resp = await submit(api, _profiled("short", tokens=2 * 1024))  # two steps: the profile would be the run
    error = (await resp.json())["error"]
    assert resp.status == 422 and error["field"] == "spec.profile", error


async def test_a_profile_at_its_time_cap_is_stopped_and_measured_from_its_steps_so_far(api, db) -> None:  # type: ignore[no-untyped-def]
    from sqlalchemy import update

    from layers.orchestration.jobs.profile import PROFILE_MAX_SECONDS
    from layers.orchestration.lifecycle.models import SubtaskRow

    await register_world(api)
    assert (await submit(api, _profiled("slow"))).status == 201
    contract = await _claim(api, "ams-a100")
    await _report(api, "ams-a100", contract["uid"], "Running")
    await _steps(api, contract, 4)  # 4 of 8 steps when the cap comes
    async with db.session() as s:
        await s.execute(update(SubtaskRow).where(SubtaskRow.id == contract["uid"]).values(
            claimed_at=datetime.now(UTC) - timedelta(seconds=PROFILE_MAX_SECONDS + 1)))
    await _reconciler(db).reconcile_once()
    got = await _get(api, "/api/v1/jobs/slow")
    assert got["status"]["phase"] == "Quoted", got["status"]
    probe = got["status"]["profile"]
    assert probe["measuredStepSeconds"] == pytest.approx(STEP) and probe["measuredSteps"] == 3
    assert "cap" in probe["note"] and probe["startupSeconds"] is None, probe
    listing = await _get(api, "/api/v1/subtasks?cluster=ams-a100", OWNER["ams-a100"])
    assert [t["spec"]["desired"] for t in listing["items"]] == ["Stop"]  # its agent stops the run


async def test_a_profiling_job_can_be_cancelled(api, db) -> None:  # type: ignore[no-untyped-def]
    await register_world(api)
    assert (await submit(api, _profiled("nevermind"))).status == 201
    resp = await api.client.post("/api/v1/jobs/nevermind/cancel", headers=api.auth("alice"))
    assert resp.status == 200 and (await resp.json())["status"]["phase"] == "Cancelled", await resp.text()
    listing = await _get(api, "/api/v1/subtasks?cluster=ams-a100", OWNER["ams-a100"])
    assert [(t["spec"]["desired"], t["status"]["phase"]) for t in listing["items"]] == [("Stop", "Cancelled")]
    leases = (await _get(api, "/api/v1/reservations?job=nevermind"))["items"]
    assert [x["status"]["state"] for x in leases] == ["released"]
