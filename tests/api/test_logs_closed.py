"""A sub-task's log closes a grace period after it ended (issue 35, L2): its runner's last lines still
land, but nobody appends to a finished job's log later."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import update

from layers.orchestration.lifecycle import agents
from layers.orchestration.lifecycle.models import SubtaskRow
from tests.api.test_logs import PROVIDER_OF, _logs, _subtasks
from tests.layers.orchestration.test_reconciler import _accept, _reconciler, _world


async def _post(api, t: SubtaskRow, text: str) -> int:  # type: ignore[no-untyped-def]
    resp = await api.client.post(f"/api/v1/subtasks/{t.id}/logs", json={"lines": [{"rank": 0, "line": text}]},
                                 headers=api.auth(PROVIDER_OF[t.site]))
    assert resp.status == 200, await resp.text()
    return (await resp.json())["accepted"]


async def test_lines_after_the_grace_period_are_refused(api, db) -> None:  # type: ignore[no-untyped-def]
    await _world(api)
    await _accept(api, "closed-log")
    await _reconciler(db, 3600).reconcile_once()
    (t,) = await _subtasks(db, "closed-log", 1)
    assert await _post(api, t, "while running") == 1
    cancel = await api.client.post("/api/v1/jobs/closed-log/cancel", headers=api.auth("alice"))
    assert cancel.status == 200, await cancel.text()
    async with db.session() as s:  # the sub-task ended just now: its last lines still land
        await s.execute(update(SubtaskRow).where(SubtaskRow.id == t.id).values(finished_at=datetime.now(UTC)))
    assert await _post(api, t, "just after the end") == 1
    async with db.session() as s:  # ... and long ago: the log is closed
        ended = datetime.now(UTC) - agents.LOG_GRACE * 2
        await s.execute(update(SubtaskRow).where(SubtaskRow.id == t.id).values(finished_at=ended))
    assert await _post(api, t, "forged later") == 0
    text = await _logs(api, "closed-log")
    assert "just after the end" in text and "forged later" not in text
