"""Driving one job through the agents' real protocol for the billing and worker-token tests: its
provider claims the sub-task over HTTP (and gets the attempt contract with the workers' token), and
the test moves the server's clock for that sub-task by writing when it was claimed."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any
from urllib.parse import quote

from sqlalchemy import select

from layers.orchestration.lifecycle.models import SubtaskRow
from layers.resource.models import ClusterRow
from tests.layers.orchestration.test_reconciler import _accept, _job_of, _reconciler

OWNER = {"fra-1-cpu": "prov-a", "ams-1-cpu": "prov-a", "nyc-1-cpu": "prov-b"}


async def claim(api, db, name: str, *, attempt: int = 1, ago: float = 0.0, rank: int = 0) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """The provider's agent claims the sub-task of `attempt` holding global `rank`; the server then
    saw it claimed `ago` seconds ago. Returns the contract with `uid` and `cluster` added."""
    async with db.session() as s:
        t = (await s.execute(select(SubtaskRow).where(SubtaskRow.job == f"alice/{name}", SubtaskRow.attempt == attempt,
                                                      SubtaskRow.first_rank == rank))).scalar_one()
        uid, cluster = t.id, t.cluster
    resp = await api.client.post(f"/api/v1/subtasks/{uid}/claim", headers=api.auth(OWNER[cluster]),
                                 json={"rendezvous": {"host": "127.0.0.1", "port": 29500}} if rank == 0 else {})
    assert resp.status == 200, await resp.text()
    async with db.session() as s:
        t = (await s.execute(select(SubtaskRow).where(SubtaskRow.id == uid))).scalar_one()
        t.claimed_at = t.launched_at = datetime.now(UTC) - timedelta(seconds=ago)
        t.phase = t.reported = "Running"
    return {**await resp.json(), "uid": uid, "cluster": cluster}


async def started(api, db, name: str, *, ago: float = 0.0, **spec: object) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """A one-site ddp job accepted, its attempt written, and its sub-task claimed `ago` seconds ago."""
    await _accept(api, name, strategy="ddp", **spec)
    await _reconciler(db, 3600).reconcile_once()
    return await claim(api, db, name, ago=ago)


async def post_metrics(api, token: str, name: str, reports: list[dict[str, Any]]):  # type: ignore[no-untyped-def]
    """As the runtime's relay sends them: JSON as Python writes it (NaN and Infinity included)."""
    return await api.client.post(f"/api/v1/jobs/{quote(f'alice/{name}', safe='')}/metrics",
                                 data=json.dumps({"reports": reports}),
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})


async def report(api, contract: dict[str, Any], phase: str, code: int = 0) -> None:  # type: ignore[no-untyped-def]
    resp = await api.client.post(f"/api/v1/subtasks/{contract['uid']}/status", headers=api.auth(OWNER[contract["cluster"]]),
                                 json={"phase": phase, "exitCodes": {"0": code}})
    assert resp.status == 200, await resp.text()


async def invoice(api, name: str) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    resp = await api.client.get(f"/api/v1/invoices?job={name}", headers=api.auth("alice"))
    assert resp.status == 200, await resp.text()
    (item,) = (await resp.json())["items"]
    return item["status"]


async def events(api, name: str) -> list[dict[str, Any]]:  # type: ignore[no-untyped-def]
    resp = await api.client.get(f"/api/v1/events?job={name}", headers=api.auth("alice"))
    assert resp.status == 200, await resp.text()
    return (await resp.json())["items"]


async def list_price(db, cluster: str) -> Decimal:  # type: ignore[no-untyped-def]
    async with db.session() as s:
        row = (await s.execute(select(ClusterRow).where(ClusterRow.name == cluster))).scalar_one()
    return Decimal(str(row.spec["nodePools"][0]["pricePerGpuHour"]))


async def silence(db, cluster: str) -> None:  # type: ignore[no-untyped-def]
    """The cluster's agent stopped heartbeating ten minutes ago."""
    async with db.session() as s:
        row = (await s.execute(select(ClusterRow).where(ClusterRow.name == cluster))).scalar_one()
        row.last_heartbeat_at = datetime.now(UTC) - timedelta(minutes=10)


__all__ = ["OWNER", "_job_of", "claim", "events", "invoice", "list_price", "post_metrics", "report", "silence",
           "started"]
