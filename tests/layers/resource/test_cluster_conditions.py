"""A cluster's conditions say when they took their value: the same time on every read (a probe saw
lastTransitionTime move to "now" on each GET), the moment a heartbeat went stale, the heartbeat that
brought it back."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest

from cpn.core import errors
from cpn.core.principal import Principal, Role
from layers.resource.capacity import _record
from layers.resource.schemas import HeartbeatRequest
from layers.resource.stores import cluster_status

T0 = datetime(2026, 11, 27, 12, 0, tzinfo=UTC)
TIMEOUT = timedelta(seconds=30)
PROVIDER = Principal(account_id="p1", name="prov", role=Role.PROVIDER)


def _cluster() -> SimpleNamespace:
    return SimpleNamespace(status={}, last_heartbeat_at=None, created_at=T0, owner_id="p1", capacity_gpus=4,
                           allocatable_gpus=0, spec={"nodePools": []})


def _beat(row: SimpleNamespace, at: datetime, ready: bool = True) -> None:
    body = HeartbeatRequest.model_validate({"allocatableGpus": 4, "conditions": [
        {"type": "Ready", "status": "True" if ready else "False"}]})
    _record(PROVIDER, "c", row, body, at, TIMEOUT)  # type: ignore[arg-type]


def _cond(row: SimpleNamespace, kind: str, at: datetime) -> dict:
    conditions = cluster_status(row, TIMEOUT, at)["conditions"]  # type: ignore[arg-type]
    return next(c for c in conditions if c["type"] == kind)


def test_transition_times_hold_across_reads_and_move_only_on_a_change() -> None:
    row = _cluster()
    assert _cond(row, "Ready", T0 + timedelta(seconds=5))["lastTransitionTime"] == T0.isoformat()  # never heard
    _beat(row, T0 + timedelta(seconds=10))
    first = T0 + timedelta(seconds=10)
    for read in (11, 17, 29):  # reads do not move it
        ready = _cond(row, "Ready", T0 + timedelta(seconds=read))
        assert ready["status"] == "True" and ready["lastTransitionTime"] == first.isoformat(), ready
    _beat(row, T0 + timedelta(seconds=20))  # a heartbeat that changes nothing does not either
    assert _cond(row, "Ready", T0 + timedelta(seconds=21))["lastTransitionTime"] == first.isoformat()
    stale = _cond(row, "Ready", T0 + timedelta(seconds=70))  # last heartbeat at 20 s, timeout 30 s
    assert stale["status"] == "False" and stale["reason"] == "HeartbeatTimeout"
    assert stale["lastTransitionTime"] == (T0 + timedelta(seconds=50)).isoformat()
    _beat(row, T0 + timedelta(seconds=80))  # back: the heartbeat that revived it
    assert _cond(row, "Ready", T0 + timedelta(seconds=85))["lastTransitionTime"] == (T0 + timedelta(seconds=80)).isoformat()
    _beat(row, T0 + timedelta(seconds=90), ready=False)  # the agent reports not ready
    down = _cond(row, "Ready", T0 + timedelta(seconds=95))
    assert down["status"] == "False" and down["lastTransitionTime"] == (T0 + timedelta(seconds=90)).isoformat()
    heard = _cond(row, "Heartbeat", T0 + timedelta(seconds=95))
    assert heard["status"] == "True" and heard["lastTransitionTime"] == first.isoformat()


def test_a_user_token_heartbeating_is_told_heartbeats_are_a_providers() -> None:
    user = Principal(account_id="u1", name="alice", role=Role.USER)
    body = HeartbeatRequest.model_validate({"allocatableGpus": 4})
    with pytest.raises(errors.Forbidden, match="this token is a user's"):
        _record(user, "c", _cluster(), body, T0, TIMEOUT)  # type: ignore[arg-type]
    other = Principal(account_id="p2", name="prov2", role=Role.PROVIDER)
    with pytest.raises(errors.Forbidden, match="belongs to another provider"):
        _record(other, "c", _cluster(), body, T0, TIMEOUT)  # type: ignore[arg-type]
