"""A site's checkpoint folder keeps only the newest K steps (issue 36, item 6: 4.5 GB of site run
folders after about 25 tiny jobs), never the step latest.json names, nor one the server does not hold yet."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import httpx
import pytest
import torch

from cpn.runtime import checkpoint, jobrunner
from tests.runtime.test_jobrunner import spec_of


def _save_step(root: Path, step: int, *, sharded: bool = False) -> None:
    """A step as the workers write it: per-site files, or a DCP save's folder (metadata and shards)."""
    state = {"w": torch.randn(64, 64)}
    folder = checkpoint.step_dir(root, step)
    if sharded:
        checkpoint.atomic_save(state, folder / "__0_0.distcp")
        checkpoint.atomic_save({}, folder / ".metadata")
    else:
        checkpoint.atomic_save(state, folder / "site0.pt")
        checkpoint.atomic_save(state, folder / "global.pt")
    checkpoint.atomic_write_json({"step": step, "sites": [0]}, root / checkpoint.LATEST)


def _steps(root: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step-")) for p in root.glob("step-*"))


def test_only_the_newest_k_steps_stay_files_folders_and_sharded_saves_alike(tmp_path: Path) -> None:
    for step in range(50, 801, 50):
        _save_step(tmp_path, step, sharded=step % 100 == 0)
    (tmp_path / "step-00000001").write_bytes(b"an old single-file step")
    removed = checkpoint.prune(tmp_path, 2)
    assert _steps(tmp_path) == [750, 800] and len(removed) == 15
    assert (tmp_path / "step-00000800" / ".metadata").exists() and (tmp_path / checkpoint.LATEST).exists()
    assert checkpoint.prune(tmp_path, 2) == []


def test_the_step_latest_json_names_and_steps_not_yet_uploaded_stay(tmp_path: Path) -> None:
    for step in (10, 20, 30, 40, 50):
        _save_step(tmp_path, step)
    checkpoint.atomic_write_json({"step": 20, "sites": [0]}, tmp_path / checkpoint.LATEST)  # resumed from 20
    (tmp_path / "step-00000030" / ".site0.pt.77.tmp").write_bytes(b"half written")
    checkpoint.prune(tmp_path, 1, uploaded=lambda p: not p.name.endswith(".tmp"))
    assert _steps(tmp_path) == [20, 30, 50]


def test_the_runner_prunes_only_what_the_server_confirmed(tmp_path: Path) -> None:
    """The real CheckpointSync pushes to a server that refuses one step's file: that step stays on
    the site's disk; the others beyond K go once uploaded."""
    stored: list[str] = []
    refused = {"step-00000020/site0.pt"}

    def server(request: httpx.Request) -> httpx.Response:
        name = request.url.path.split("/checkpoints/", 1)[1]
        if name in refused:
            return httpx.Response(503, json={"error": {"code": "unavailable", "message": "disk full"}})
        stored.append(name)
        return httpx.Response(201, json={})

    spec = spec_of()
    sync = jobrunner.CheckpointSync(tmp_path, spec, httpx.Client(base_url="http://api.test",
                                                                  transport=httpx.MockTransport(server)))
    for step in (10, 20, 30, 40):
        _save_step(tmp_path, step)
        with contextlib.suppress(httpx.HTTPStatusError):  # as the run loop does; step 20's file keeps failing
            sync.push()
        jobrunner._retain(sync, 2)
    assert "step-00000010/site0.pt" in stored and "step-00000020/site0.pt" not in stored
    assert _steps(tmp_path) == [20, 30, 40]  # 10 uploaded and pruned; 20 never confirmed
    assert json.loads((tmp_path / checkpoint.LATEST).read_text())["step"] == 40
    refused.clear()  # the server has room again: 20 is uploaded, then pruned
    sync.push()
    jobrunner._retain(sync, 2)
    assert "step-00000020/site0.pt" in stored and _steps(tmp_path) == [30, 40]


def test_keep_comes_from_the_same_variable_as_the_servers_setting() -> None:
    assert checkpoint.keep_from_env({}) == 2
    assert checkpoint.keep_from_env({"CPN_CHECKPOINT_KEEP": "5"}) == 5
    for bad in ("0", "-1", "two"):
        with pytest.raises(ValueError, match="CPN_CHECKPOINT_KEEP"):
            checkpoint.keep_from_env({"CPN_CHECKPOINT_KEEP": bad})
