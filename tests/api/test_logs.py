"""`GET /api/v1/jobs/{name}/logs` as `kubectl logs`: every line of an attempt (however many), filtered by
site, rank and attempt, cut to the last N; `follow` streams every attempt from before the first one
exists until the job ends, and then ends."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from sqlalchemy import select

from layers.orchestration.lifecycle import agents
from layers.orchestration.lifecycle import logs as job_logs
from layers.orchestration.lifecycle.models import SubtaskRow
from tests.layers.orchestration.test_reconciler import _accept, _reconciler, _world

PROVIDER_OF = {"fra-1": "prov-a", "ams-1": "prov-a", "nyc-1": "prov-b"}  # the demo world's sites


async def _subtasks(db, name: str, attempt: int) -> list[SubtaskRow]:  # type: ignore[no-untyped-def]
    async with db.session() as s:
        return list((await s.execute(select(SubtaskRow).where(SubtaskRow.job == f"alice/{name}",
                                                              SubtaskRow.attempt == attempt)
                                     .order_by(SubtaskRow.site_index))).scalars())


async def _ship(api, t: SubtaskRow, lines: list[tuple[int, str]]) -> None:  # type: ignore[no-untyped-def]
    """What an agent does: POST its workers' output with its provider's token."""
    for start in range(0, len(lines), 5000):
        body = {"lines": [{"rank": r, "line": text} for r, text in lines[start:start + 5000]]}
        resp = await api.client.post(f"/api/v1/subtasks/{t.id}/logs", json=body, headers=api.auth(PROVIDER_OF[t.site]))
        assert resp.status == 200, await resp.text()


async def _logs(api, name: str, **params: object) -> str:  # type: ignore[no-untyped-def]
    resp = await api.client.get(f"/api/v1/jobs/{name}/logs", params={k: str(v) for k, v in params.items()},
                                headers=api.auth("alice"))
    assert resp.status == 200, await resp.text()
    return await resp.text()


async def _two_sites(api, db, name: str) -> list[SubtaskRow]:  # type: ignore[no-untyped-def]
    await _accept(api, name, gpus={"min": 2, "max": 2}, sites={"min": 2, "max": 2})
    await _reconciler(db, 3600).reconcile_once()
    subtasks = await _subtasks(db, name, 1)
    assert len(subtasks) == 2 and subtasks[0].site != subtasks[1].site, subtasks
    return subtasks


async def test_filters_site_rank_attempt_and_tail(api, db) -> None:  # type: ignore[no-untyped-def]
    await _world(api)
    first, second = await _two_sites(api, db, "filtered")
    await _ship(api, first, [(0, "a0-1"), (0, "a0-2")])
    await _ship(api, second, [(1, "b1-1"), (1, "b1-2"), (1, "b1-3")])
    everything = (await _logs(api, "filtered")).splitlines()
    assert everything == [f"[{first.site} rank0] a0-1", f"[{first.site} rank0] a0-2", f"[{second.site} rank1] b1-1",
                          f"[{second.site} rank1] b1-2", f"[{second.site} rank1] b1-3"]
    assert (await _logs(api, "filtered", site=second.site)).splitlines() == everything[2:]
    assert (await _logs(api, "filtered", site=first.cluster)).splitlines() == everything[:2]  # a cluster names a site
    assert (await _logs(api, "filtered", rank=0)).splitlines() == everything[:2]
    assert (await _logs(api, "filtered", tail=2)).splitlines() == everything[-2:]
    assert (await _logs(api, "filtered", tail=2, rank=0)).splitlines() == everything[:2]
    assert await _logs(api, "filtered", tail=0) == ""
    assert (await _logs(api, "filtered", attempt=1)).splitlines() == everything
    resp = await api.client.get("/api/v1/jobs/filtered/logs", params={"site": "mars-1"}, headers=api.auth("alice"))
    assert resp.status == 404 and (await resp.json())["error"]["field"] == "site"
    resp = await api.client.get("/api/v1/jobs/filtered/logs", params={"attempt": "2"}, headers=api.auth("alice"))
    assert resp.status == 404 and "no attempt 2" in (await resp.json())["error"]["message"]
    resp = await api.client.get("/api/v1/jobs/filtered/logs", params={"rank": "7"}, headers=api.auth("alice"))
    err = (await resp.json())["error"]
    assert resp.status == 404 and err["field"] == "rank" and "no rank 7 (its ranks: 0-1)" in err["message"], err
    resp = await api.client.get("/api/v1/jobs/filtered/logs", headers=api.auth("bob"))
    assert resp.status == 404  # another user's job


async def test_a_long_log_comes_whole_page_by_page(api, db) -> None:  # type: ignore[no-untyped-def]
    await _world(api)
    await _accept(api, "chatty", strategy="ddp")
    await _reconciler(db, 3600).reconcile_once()
    (t,) = await _subtasks(db, "chatty", 1)
    count = agents.LOG_PAGE * 2 + 7
    await _ship(api, t, [(0, f"line {i}") for i in range(count)])
    lines = (await _logs(api, "chatty")).splitlines()
    assert len(lines) == count and lines[0].endswith("line 0") and lines[-1].endswith(f"line {count - 1}")
    tail = (await _logs(api, "chatty", tail=agents.LOG_PAGE + 3)).splitlines()
    assert tail == lines[-(agents.LOG_PAGE + 3):]


async def test_earlier_attempts_stay_readable(api, db) -> None:  # type: ignore[no-untyped-def]
    await _world(api)
    await _accept(api, "retried", maxPricePerGpuHour="100")  # may move to a dearer cluster
    reconciler = _reconciler(db, 0)  # no agent claims in time: each pass re-places the job
    await reconciler.reconcile_once()
    (one,) = await _subtasks(db, "retried", 1)
    await _ship(api, one, [(0, "first try")])
    await reconciler.reconcile_once()
    (two,) = await _subtasks(db, "retried", 2)
    await _ship(api, two, [(0, "second try")])
    assert await _logs(api, "retried") == f"[{two.site} rank0] second try\n"  # the current attempt
    assert await _logs(api, "retried", attempt=1) == f"[{one.site} rank0] first try\n"


@pytest.fixture
def quick_drain(monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setattr(job_logs, "DRAIN_GRACE", timedelta(seconds=0.3))
    monkeypatch.setattr(job_logs, "FOLLOW_POLL", timedelta(seconds=0.05))


async def _until(predicate, what: str, seconds: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    for _ in range(int(seconds / 0.05)):
        if await predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def test_follow_from_before_the_first_attempt_through_a_retry_to_the_end(api, db, quick_drain) -> None:  # type: ignore[no-untyped-def]
    """Started right after accept (no attempt yet), it shows attempt 1, then attempt 2 when the job is
    re-placed, and ends by itself once the job is cancelled and drained."""
    await _world(api)
    await _accept(api, "followed", maxPricePerGpuHour="100")  # may move to a dearer cluster
    resp = await api.client.get("/api/v1/jobs/followed/logs", params={"follow": "1"}, headers=api.auth("alice"))
    assert resp.status == 200
    got: list[str] = []

    async def read() -> None:
        async for raw in resp.content:
            got.append(raw.decode().rstrip("\n"))

    reader = asyncio.create_task(read())
    reconciler = _reconciler(db, 0)
    await reconciler.reconcile_once()
    (one,) = await _subtasks(db, "followed", 1)
    await _ship(api, one, [(0, "first try")])
    await _until(lambda: _has(got, "first try"), "attempt 1's line")
    await reconciler.reconcile_once()  # unclaimed: re-placed as attempt 2
    (two,) = await _subtasks(db, "followed", 2)
    await _until(lambda: _has(got, "--- attempt 2 ---"), "attempt 2's header")  # announced before any line
    await _ship(api, two, [(0, "second try"), (0, "still going")])
    await _until(lambda: _has(got, "still going"), "attempt 2's lines")
    assert not reader.done()  # the job still runs: the stream stays open
    cancel = await api.client.post("/api/v1/jobs/followed/cancel", headers=api.auth("alice"))
    assert cancel.status == 200, await cancel.text()
    await asyncio.wait_for(reader, timeout=10)  # ends by itself once the job has ended
    assert got == ["--- attempt 1 ---", f"[{one.site} rank0] first try", "--- attempt 2 ---",
                   f"[{two.site} rank0] second try", f"[{two.site} rank0] still going"]


async def _has(got: list[str], text: str) -> bool:
    return any(text in line for line in got)


async def test_follow_waits_for_lines_shipped_after_the_end(api, db, quick_drain) -> None:  # type: ignore[no-untyped-def]
    """An agent ships a run's last lines just after the job ended: a follow still shows them."""
    await _world(api)
    await _accept(api, "late-lines")
    await _reconciler(db, 3600).reconcile_once()
    (t,) = await _subtasks(db, "late-lines", 1)
    await _ship(api, t, [(0, "before")])
    cancel = await api.client.post("/api/v1/jobs/late-lines/cancel", headers=api.auth("alice"))
    assert cancel.status == 200, await cancel.text()
    follow = asyncio.create_task(_logs(api, "late-lines", follow=1, site=t.site))
    await asyncio.sleep(0.1)
    await _ship(api, t, [(0, "after the end")])
    text = await asyncio.wait_for(follow, timeout=10)
    assert text == f"--- attempt 1 ---\n[{t.site} rank0] before\n[{t.site} rank0] after the end\n"
    # a finished job's follow ends at once with everything
    assert await asyncio.wait_for(_logs(api, "late-lines", follow=1, rank=0), timeout=5) == text
