"""A claim waits for devices that a run being stopped still holds (a cancelled job's workers take a
moment to exit while the server has already leased their GPUs to the next job): seen when a job was
submitted right after another was cancelled, and the new one failed with "its leased GPUs are not there"."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cpn.agent import work
from cpn.agent.devices import DevicePool
from cpn.agent.work import Run, WorkLoop


def _loop(slots: int) -> WorkLoop:
    loop = WorkLoop.__new__(WorkLoop)  # the claim rule only: no server, no driver
    loop.devices = DevicePool("slot", [str(i) for i in range(slots)])
    loop.runs, loop.desired, loop.waiting = {}, {}, {}
    return loop


def _hold(loop: WorkLoop, uid: str, *, stopping: bool) -> None:
    loop.devices.held[uid] = loop.devices.free()[:1]
    loop.runs[uid] = Run(uid, SimpleNamespace(), {})  # type: ignore[arg-type]
    loop.desired[uid] = "Stop" if stopping else "Run"


ITEM = {"spec": {"gpus": 1}, "metadata": {"name": "alice/next-ams"}}


def test_a_claim_waits_while_a_stopping_run_holds_its_devices_and_goes_once_they_free() -> None:
    loop = _loop(1)
    _hold(loop, "old", stopping=True)
    assert loop._held_by_stopping_runs("new", ITEM)
    del loop.devices.held["old"], loop.runs["old"]  # the cancelled run exited: its device is free
    assert not loop._held_by_stopping_runs("new", ITEM) and "new" not in loop.waiting


def test_devices_held_by_a_running_run_fail_the_claim_at_once_as_before() -> None:
    loop = _loop(1)
    _hold(loop, "busy", stopping=False)
    assert not loop._held_by_stopping_runs("new", ITEM)  # nothing will free them: the launch reports why


def test_the_wait_ends_after_the_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    loop = _loop(1)
    _hold(loop, "old", stopping=True)
    assert loop._held_by_stopping_runs("new", ITEM)
    monkeypatch.setattr(work, "STOPPING_GRACE_SECONDS", -1.0)
    assert not loop._held_by_stopping_runs("new", ITEM)  # a run that never exits does not hold the claim for ever


def test_enough_free_devices_never_wait() -> None:
    loop = _loop(2)
    _hold(loop, "old", stopping=True)
    assert not loop._held_by_stopping_runs("new", ITEM)


class _EndedRunDriver:
    """A site whose only run (from the agent's earlier life) ended while the agent was away."""

    def __init__(self, spec: SimpleNamespace):
        self.spec = spec

    async def adopt(self) -> list:
        return [(self.spec, {})]

    async def poll(self, spec: object, handle: object) -> SimpleNamespace:
        return SimpleNamespace(phase="Succeeded")

    async def cleanup(self, spec: object, handle: object) -> bool:
        return True


async def test_a_run_that_ended_while_the_agent_was_away_frees_its_devices() -> None:
    """Restored at adoption (held until the run has ended), they were never given back when it had already
    ended: after an agent restart the site refused every launch for GPUs no run held."""
    loop = _loop(1)
    spec = SimpleNamespace(job="alice/done", job_uid=None, attempt=1, subtask="alice/done-ams", workers=1,
                           devices=SimpleNamespace(ids=["0"]))
    loop.driver, loop.adopted, loop.orphans, loop.cluster = _EndedRunDriver(spec), False, [], "ams-cpu"

    async def call(*_: object, **__: object) -> dict:
        return {"items": []}  # the server expects nothing of it any more

    loop._call = call  # type: ignore[method-assign]
    await loop.adopt()
    assert loop.adopted and loop.devices.free() == ["0"] and not loop.orphans
