"""Outer-step checkpoints: atomic, per site, resumable.

Layout under the checkpoint directory::

    step-00000400/site0.pt    # each site leader: its site's model, optimiser, strategy state
    step-00000400/site1.pt
    step-00000400/global.pt   # rank 0: the state all sites share (e.g. DiLoCo's outer params)
    latest.json               # {"step": 400, "sites": [0, 1]} -- written last, by rank 0

Every file is written to a temporary name and renamed, so a crash leaves either the old checkpoint
or the new one. ``latest.json`` moves only after every live site leader has reported its file
written (through the job's store), so it never points at a half-written step. A site missing from
the latest step (it had died) rejoins from ``global.pt``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

LATEST = "latest.json"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def atomic_save(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def atomic_write_json(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def latest(root: str | Path) -> dict[str, Any] | None:
    """``{"step", "sites"}`` of the newest complete checkpoint, or None."""
    path = Path(root) / LATEST
    return json.loads(path.read_text()) if path.exists() else None


def save(root: Path, step: int, *, site: int, is_leader: bool, is_rank0: bool, site_state: dict[str, Any],
         global_state: dict[str, Any], store: dist.Store, live_sites: list[int], timeout: float = 120.0) -> None:
    """Called on every rank at a checkpoint step; leaders write, rank 0 commits ``latest.json``."""
    directory = step_dir(root, step)
    if is_leader:
        atomic_save(site_state, directory / f"site{site}.pt")
        store.set(f"cpn/ckpt/{step}/site{site}", "1")
    if not is_rank0:
        return
    atomic_save(global_state, directory / "global.pt")
    deadline = time.monotonic() + timeout
    written = []
    for s in live_sites:
        key = f"cpn/ckpt/{step}/site{s}"
        while not store.check([key]) and time.monotonic() < deadline:
            time.sleep(0.01)
        if store.check([key]):
            written.append(s)
    atomic_write_json({"step": step, "sites": written}, root / LATEST)


def load(root: str | Path, site: int) -> tuple[int, dict[str, Any] | None, dict[str, Any]] | None:
    """(step, this site's state or None if it has none, global state) of the latest checkpoint.

    Loaded to the host (a run may resume on other devices); the strategies move it to theirs."""
    info = latest(root)
    if info is None:
        return None
    directory = step_dir(Path(root), info["step"])
    site_file = directory / f"site{site}.pt"
    site_state = (torch.load(site_file, weights_only=False, map_location="cpu")
                  if site in info["sites"] and site_file.exists() else None)
    return info["step"], site_state, torch.load(directory / "global.pt", weights_only=False, map_location="cpu")
