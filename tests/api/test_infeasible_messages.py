"""A job that cannot be placed says why in the user's terms: no Ready cluster yet (before any agent
heartbeat), no cluster in the job's currency, a deadline already past or too short in readable units."""

from __future__ import annotations

from tests.api.test_jobs import job, register_world, submit, world


async def _error(api, body: dict) -> dict:
    resp = await submit(api, body)
    assert resp.status == 422, await resp.text()
    return (await resp.json())["error"]


async def test_before_any_heartbeat_says_no_cluster_is_ready_not_gpu_models(api) -> None:
    a, b = world()
    for who, items in (("prov-a", a), ("prov-b", b)):
        assert (await api.client.post("/api/v1/apply", json={"items": items}, headers=api.auth(who))).status == 200
    err = await _error(api, job("early"))
    assert err["message"] == ("no Ready cluster has free GPUs (3 registered: 0 ready; their agents report "
                              "them by heartbeat)"), err
    assert "gpus.models" not in err["message"] and err["field"] is None


async def test_no_cluster_in_the_jobs_currency_names_spec_currency(api) -> None:
    await register_world(api)
    err = await _error(api, job("euro", currency="EUR"))
    assert err["field"] == "spec.currency", err
    assert err["message"] == "spec.currency: no cluster with free GPUs prices in EUR (offered: USD)", err


async def test_a_past_deadline_says_so(api) -> None:
    await register_world(api)
    err = await _error(api, job("late", deadline="2026-01-01T00:00:00Z"))
    assert err["field"] == "spec.deadline"
    assert err["message"] == "spec.deadline: 2026-01-01T00:00:00Z is in the past", err


async def test_a_short_deadline_reads_in_seconds_not_fractions_of_hours(api) -> None:
    await register_world(api)
    err = await _error(api, job("rush", deadline="1s"))
    assert err["field"] == "spec.deadline"
    assert err["message"].endswith("the deadline allows 1 s"), err
    assert " h," not in err["message"] and "0.000278" not in err["message"], err
