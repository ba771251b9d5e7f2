"""Sharded (torch.distributed.checkpoint) checkpoints through the server's blob store (issue 28,
Deliver 3): each site's job runner uploads the files its ranks wrote (rank 0's site also the save's
`.metadata` and the `latest.json` marker); the step is offered as `latest` only once every file the
marker lists is stored; a new attempt on another number of ranks downloads the step and reshards it."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from cpn.api import state
from cpn.runtime import checkpoint, jobrunner
from cpn.runtime.contract import AttemptSpec
from tests.api.billing_helpers import started
from tests.api.dcp_ranks import STEP, full_state, run_ranks
from tests.layers.orchestration.test_reconciler import _world


def _spec(contract: dict[str, Any], server: str, first_rank: int, workers: int) -> AttemptSpec:
    """The attempt's contract as the site running ranks first_rank.. (first_rank + workers - 1) holds it."""
    spec = AttemptSpec.model_validate({k: v for k, v in contract.items() if k in AttemptSpec.model_fields}
                                      | {"server": server})
    return spec.model_copy(update={"first_rank": first_rank, "workers": workers})


async def _latest(api, token: str, job: str = "dcp") -> tuple[int, dict[str, Any]]:  # type: ignore[no-untyped-def]
    resp = await api.client.get(f"/api/v1/jobs/alice%2F{job}/checkpoints/latest",
                                headers={"Authorization": f"Bearer {token}"})
    return resp.status, await resp.json()


@pytest.mark.slow
async def test_a_sharded_step_uploaded_by_two_sites_is_complete_only_with_both_and_reshards_on_one_rank(
        api, db, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    saved = tmp_path / "saved"
    await asyncio.to_thread(run_ranks, 2, tmp_path, saved, "save")
    step_dir = checkpoint.step_dir(saved, STEP)
    written = sorted(p.name for p in step_dir.iterdir())
    assert written == [".metadata", "__0_0.distcp", "__1_0.distcp"], written
    # two sites, each with its own disk: rank 0's holds the metadata and latest.json, rank 1's its shard
    site_a, site_b = tmp_path / "site-a", tmp_path / "site-b"
    for site, names in ((site_a, [".metadata", "__0_0.distcp"]), (site_b, ["__1_0.distcp"])):
        checkpoint.step_dir(site, STEP).mkdir(parents=True)
        for name in names:
            shutil.copy2(step_dir / name, checkpoint.step_dir(site, STEP) / name)
    shutil.copy2(saved / checkpoint.LATEST, site_a / checkpoint.LATEST)

    await _world(api)
    contract = await started(api, db, "dcp")
    token, server = contract["worker_token"], str(api.client.make_url("")).rstrip("/")
    sync_a = jobrunner.CheckpointSync(site_a, (a := _spec(contract, server, 0, 1)), jobrunner._client(a))
    sync_b = jobrunner.CheckpointSync(site_b, (b := _spec(contract, server, 1, 1)), jobrunner._client(b))
    assert sync_a.spec.leads_rendezvous and not sync_b.spec.leads_rendezvous

    # site B first: its shard waits (unsent) for the save's end, which only rank 0's metadata proves
    with pytest.raises(jobrunner.DcpSavePending, match="__1_0.distcp"):
        await asyncio.to_thread(sync_b.push)
    assert (await _latest(api, token))[0] == 404
    await asyncio.to_thread(sync_a.push)  # metadata, rank 0's shard, the marker: half the step
    status, body = await _latest(api, token)
    assert status == 404, body  # a half-uploaded sharded step is never offered
    await asyncio.to_thread(sync_b.push)
    status, body = await _latest(api, token)
    assert status == 200, body
    prefix = f"step-{STEP:08d}/"
    assert body == {"step": STEP, "sites": [0], "format": "dcp",
                    "files": [prefix + n for n in (".metadata", "__0_0.distcp", "__1_0.distcp")]}, body
    await asyncio.to_thread(sync_b.push)  # nothing new: nothing raised, nothing sent again

    # a re-placed attempt on one rank fetches the whole step into a fresh folder and reshards it
    fresh = tmp_path / "fresh"
    sync_new = jobrunner.CheckpointSync(fresh, (c := _spec(contract, server, 0, 1)), jobrunner._client(c))
    assert await asyncio.to_thread(sync_new.fetch) == STEP
    assert json.loads((fresh / checkpoint.LATEST).read_text())["format"] == "dcp"
    assert checkpoint.is_sharded_checkpoint(fresh)
    for name in written:
        assert (checkpoint.step_dir(fresh, STEP) / name).read_bytes() == (step_dir / name).read_bytes(), name
    got = await asyncio.to_thread(run_ranks, 1, tmp_path, fresh, "load")
    assert got is not None and got["step"] == STEP
    for k, v in full_state().items():
        assert torch.equal(got["state"][k], v), k


@pytest.mark.parametrize("file", ["..metadata", "metadata", "__0_0.distcp.tmp", "___0_0.distcp", "__a_0.distcp",
                                  "__0_0.pt", ".metadata.tmp", "__1234567_0.distcp"])
async def test_only_the_names_dcp_writes_are_taken(api, db, file: str) -> None:  # type: ignore[no-untyped-def]
    await _world(api)
    contract = await started(api, db, "names")
    headers = {"Authorization": f"Bearer {contract['worker_token']}"}
    base = "/api/v1/jobs/alice%2Fnames/checkpoints/step-00000001"
    resp = await api.client.put(f"{base}/{file}", data=b"x", headers=headers)
    assert resp.status in (404, 422), (file, resp.status, await resp.text())
    for good in (".metadata", "__0_0.distcp", "__12_3.distcp"):
        resp = await api.client.put(f"{base}/{good}", data=b"x", headers=headers)
        assert resp.status == 201, (good, await resp.text())
        resp = await api.client.get(f"{base}/{good}", headers=headers)
        assert resp.status == 200 and await resp.read() == b"x", good


async def test_a_marker_listing_files_dcp_never_writes_is_no_checkpoint(api, db) -> None:  # type: ignore[no-untyped-def]
    """A marker is the workers' word: one naming a path outside the step (or no metadata) is skipped."""
    await _world(api)
    contract = await started(api, db, "dcp")
    headers = {"Authorization": f"Bearer {contract['worker_token']}"}
    base = "/api/v1/jobs/alice%2Fdcp/checkpoints"
    for step, files in ((1, [".metadata", "__0_0.distcp"]), (2, [".metadata", "../step-00000001/__0_0.distcp"]),
                        (3, ["__0_0.distcp"])):
        for name in files[:1] if step > 1 else files:
            resp = await api.client.put(f"{base}/step-{step:08d}/{name}", data=b"x", headers=headers)
            assert resp.status == 201, await resp.text()
        marker = json.dumps({"step": step, "sites": [0], "format": "dcp", "files": files}).encode()
        resp = await api.client.put(f"{base}/step-{step:08d}/latest.json", data=marker, headers=headers)
        assert resp.status == 201, await resp.text()
    status, body = await _latest(api, contract["worker_token"])
    assert (status, body["step"], body["files"]) == (200, 1, ["step-00000001/.metadata", "step-00000001/__0_0.distcp"])


async def test_retention_keeps_or_drops_a_sharded_step_whole_and_never_offers_a_half_one(api, db) -> None:  # type: ignore[no-untyped-def]
    """Two sites' uploads of sharded steps (keep 2): a committed step is kept or removed with all its
    files; the newest step, committed while site 1's shard is still on its way, is not `latest` until
    the shard arrives, and the step before it stays as the resume point meanwhile."""
    await _world(api)
    contract = await started(api, db, "kept")
    headers = {"Authorization": f"Bearer {contract['worker_token']}"}
    base = "/api/v1/jobs/alice%2Fkept/checkpoints"
    files = [".metadata", "__0_0.distcp", "__1_0.distcp"]

    async def put(step: int, name: str, body: bytes = b"x") -> None:
        resp = await api.client.put(f"{base}/step-{step:08d}/{name}", data=body, headers=headers)
        assert resp.status == 201, await resp.text()

    async def latest_step() -> int | None:
        status, body = await _latest(api, contract["worker_token"], "kept")
        return body["step"] if status == 200 else None

    for step in (1, 2, 3, 4):  # rank 0's site: metadata, its shard, the marker; then site 1's shard
        for name in files[:2]:
            await put(step, name)
        await put(step, "latest.json", json.dumps({"step": step, "sites": [0], "format": "dcp", "files": files}).encode())
        assert await latest_step() == (step - 1 if step > 1 else None)
        if step < 4:
            await put(step, "__1_0.distcp")
            assert await latest_step() == step
    store = api.client.server.app[state.BLOBS]
    uid = (await (await api.client.get("/api/v1/jobs/kept", headers=api.auth("alice"))).json())["metadata"]["uid"]
    held: dict[str, list[str]] = {}
    for k in store.list(f"{uid}/checkpoints"):
        step_name, name = k.rsplit("/", 2)[1:]
        held.setdefault(step_name, []).append(name)
    whole = sorted(["dcp.metadata", "dcp-0-0.distcp", "dcp-1-0.distcp", "latest.json"])
    assert held == {"step-00000003": whole, "step-00000004": sorted(set(whole) - {"dcp-1-0.distcp"})}, held
    await put(4, "__1_0.distcp")
    assert await latest_step() == 4


async def test_a_shard_whose_save_never_ended_is_left_behind_once_old(api, db, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Rank 0's site died in the save: its metadata never reaches the server. Site 1's shard is not
    uploaded (it may be half written); while young the push says it waits (the run's end retries it),
    once older than DCP_SAVE_WAIT_SECONDS it is left on the site's disk and the push ends."""
    await _world(api)
    contract = await started(api, db, "dead")
    server = str(api.client.make_url("")).rstrip("/")
    shard = checkpoint.step_dir(tmp_path, STEP) / "__1_0.distcp"
    shard.parent.mkdir(parents=True)
    shard.write_bytes(b"half")
    sync = jobrunner.CheckpointSync(tmp_path, (b := _spec(contract, server, 1, 1)), jobrunner._client(b))
    with pytest.raises(jobrunner.DcpSavePending):
        await asyncio.to_thread(sync.push)
    old = shard.stat().st_mtime - jobrunner.DCP_SAVE_WAIT_SECONDS - 1
    os.utime(shard, (old, old))
    await asyncio.to_thread(sync.push)
    assert sync.sent == {}
    resp = await api.client.get(f"/api/v1/jobs/alice%2Fdead/checkpoints/step-{STEP:08d}/__1_0.distcp",
                                headers={"Authorization": f"Bearer {contract['worker_token']}"})
    assert resp.status == 404
