"""Checkpoint retention in the server's blob store (issue 36, item 6: 3.3 GB of blobs after about
25 tiny jobs). Checkpoints are pushed through the endpoint the job runners use, with the jobs' own
worker tokens; the test counts what the blob store holds."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from cpn.api import state
from layers.orchestration.lifecycle.retention import doomed
from layers.resource.blobs import BlobStore
from tests.api.billing_helpers import report, started
from tests.layers.orchestration.test_reconciler import _reconciler, _world

STEPS, EVERY = 800, 50


async def _put(api, contract: dict[str, Any], name: str, body: bytes) -> None:  # type: ignore[no-untyped-def]
    path = f"/api/v1/jobs/{contract['job'].replace('/', '%2F')}/{name}"
    resp = await api.client.put(path, data=body, headers={"Authorization": f"Bearer {contract['worker_token']}"})
    assert resp.status == 201, await resp.text()


async def _push_step(api, contract: dict[str, Any], step: int, *, marker: bool = True) -> None:  # type: ignore[no-untyped-def]
    """What a one-site runner uploads for a checkpoint step: the site's file, rank 0's global file,
    then the marker that commits the step."""
    folder = f"step-{step:08d}"
    await _put(api, contract, f"checkpoints/{folder}/site{contract['site_index']}.pt", os.urandom(2048))
    await _put(api, contract, f"checkpoints/{folder}/global.pt", os.urandom(512))
    if marker:
        await _put(api, contract, f"checkpoints/{folder}/latest.json",
                   json.dumps({"step": step, "sites": [contract["site_index"]]}).encode())


def _steps(store: BlobStore, uid: str) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for key in store.list(f"{uid}/checkpoints"):
        step, file = key.split("/")[-2:]
        out.setdefault(int(step.removeprefix("step-")), set()).add(file)
    return out


async def _uid(api, name: str) -> str:  # type: ignore[no-untyped-def]
    resp = await api.client.get(f"/api/v1/jobs/{name}", headers=api.auth("alice"))
    return (await resp.json())["metadata"]["uid"]


@pytest.mark.slow
async def test_25_jobs_of_800_steps_leave_only_the_retained_checkpoints_and_finals(api, db) -> None:  # type: ignore[no-untyped-def]
    await _world(api)
    store: BlobStore = api.client.server.app[state.BLOBS]
    keep = api.client.server.app[state.SETTINGS].checkpoint_keep
    assert keep == 2  # the default
    uids = []
    for j in range(25):
        contract = await started(api, db, f"ret{j}")
        for step in range(EVERY, STEPS + 1, EVERY):
            await _push_step(api, contract, step)
        await _put(api, contract, "final", os.urandom(1024))
        await report(api, contract, "Succeeded")
        await _reconciler(db, 3600).reconcile_once()  # the job ends and frees its slot for the next
        uids.append(await _uid(api, f"ret{j}"))
        resp = await api.client.get(f"/api/v1/jobs/ret{j}/checkpoints/latest", headers=api.auth("alice"))
        assert resp.status == 200 and (await resp.json())["step"] == STEPS, await resp.text()
    for uid in uids:
        assert _steps(store, uid) == {s: {"site0.pt", "global.pt", "latest.json"} for s in (STEPS - EVERY, STEPS)}
    blobs = [k for uid in uids for k in store.list(uid)]
    finals = [k for k in blobs if "/checkpoints/" not in k]
    assert len(finals) == 25, finals  # every job's final weights stay
    assert len(blobs) == 25 * (keep * 3 + 1), len(blobs)  # 16 steps pushed per job, 2 kept
    assert store.root is not None
    leftovers = [p for p in store.root.rglob("step-*") if p.is_dir()]
    assert len(leftovers) == 25 * keep, len(leftovers)  # pruned steps leave no empty folders


async def test_the_resume_point_and_steps_still_uploading_are_never_pruned(api, db) -> None:  # type: ignore[no-untyped-def]
    """A committed step whose other site's file never came is not one to resume from: the newest
    complete step stays however old; a step without its marker yet (still being uploaded) stays."""
    await _world(api)
    store: BlobStore = api.client.server.app[state.BLOBS]
    contract = await started(api, db, "safe")
    uid = await _uid(api, "safe")
    await _push_step(api, contract, 100)
    for step in (200, 300, 400):  # committed by rank 0's site, but site 1's file never arrived
        folder = f"step-{step:08d}"
        await _put(api, contract, f"checkpoints/{folder}/global.pt", b"g")
        await _put(api, contract, f"checkpoints/{folder}/latest.json", json.dumps({"step": step, "sites": [0, 1]}).encode())
    await _push_step(api, contract, 500, marker=False)  # in flight
    steps = _steps(store, uid)
    assert sorted(steps) == [100, 300, 400, 500], steps  # 200 pruned; 100 is where a new attempt resumes
    resp = await api.client.get("/api/v1/jobs/safe/checkpoints/latest", headers=api.auth("alice"))
    assert (await resp.json())["step"] == 100


def test_retention_keeps_the_newest_k_committed_steps() -> None:
    keys = [f"u/checkpoints/step-{s:08d}/{f}" for s in (1, 2, 3, 4) for f in ("global.pt", "latest.json")]
    keys += ["u/checkpoints/step-00000005/global.pt", "u/final.pt"]
    assert doomed(keys, 2, 4) == [f"u/checkpoints/step-{s:08d}/{f}" for s in (1, 2) for f in ("global.pt", "latest.json")]
    assert doomed(keys, 1, 2) == [f"u/checkpoints/step-{s:08d}/{f}" for s in (1, 3) for f in ("global.pt", "latest.json")]
    assert doomed(keys, 10, None) == [] and doomed(keys[-2:], 1, None) == []


async def test_a_job_keeps_its_steps_when_another_job_commits(api, db) -> None:  # type: ignore[no-untyped-def]
    """Retention is per job: one job's commits never prune another's checkpoints."""
    await _world(api)
    store: BlobStore = api.client.server.app[state.BLOBS]
    one, two = await started(api, db, "one"), await started(api, db, "two")
    for step in (10, 20, 30):
        await _push_step(api, one, step)
    for step in (10, 20, 30, 40, 50):
        await _push_step(api, two, step)
    assert sorted(_steps(store, await _uid(api, "one"))) == [20, 30]
    assert sorted(_steps(store, await _uid(api, "two"))) == [40, 50]
