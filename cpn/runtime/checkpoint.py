"""Outer-step checkpoints: atomic, per site, resumable.

Layout under the checkpoint directory::

    step-00000400/site0.pt    # each site leader: its site's model, optimiser, strategy state
    step-00000400/site1.pt
    step-00000400/global.pt   # rank 0: the state all sites share (e.g. DiLoCo's outer params)
    latest.json               # {"step": 400, "sites": [0, 1]} -- written last, by rank 0

Every file is written to a temporary name and renamed, so a crash leaves either the old checkpoint
or the new one. ``latest.json`` moves only after every live site leader has reported its file
written (through the job's store), so it never points at a half-written step. Rank 0 waits for the
files only ``COMMIT_GRACE_SECONDS`` in the step; a step still incomplete then is committed between
later steps (:class:`PendingCommit`), so a site that died before writing costs the others no more;
after ``COMMIT_TIMEOUT_SECONDS`` the step is committed with the sites that wrote. A site missing from the latest step (it had died) rejoins from
``global.pt``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where a tensor is saved or loaded: the job runner (which only reads and
    import torch  # prunes the folders) starts without it, 1-2 s sooner per sub-task
    import torch.distributed as dist

LATEST = "latest.json"
COMMIT_TIMEOUT_SECONDS = 120.0  # how long a checkpoint step waits for a site's file before committing without it
COMMIT_GRACE_SECONDS = 5.0  # how long rank 0 waits for the files in the step itself (the rest is polled)


ENV_CHECKPOINT_KEEP = "CPN_CHECKPOINT_KEEP"  # the server's setting of the same name: steps kept per job
DEFAULT_KEEP = 2


def keep_from_env(env: Mapping[str, str] | None = None) -> int:
    """How many checkpoint steps a site keeps (``CPN_CHECKPOINT_KEEP``, default 2)."""
    raw = (os.environ if env is None else env).get(ENV_CHECKPOINT_KEEP, "").strip()
    if not raw:
        return DEFAULT_KEEP
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{ENV_CHECKPOINT_KEEP}={raw!r} is not valid: set it to how many checkpoint steps to "
                         f"keep, a whole number of at least 1 (default {DEFAULT_KEEP})")
    return int(raw)


def prune(root: str | Path, keep: int, *, uploaded: Callable[[Path], bool] | None = None) -> list[Path]:
    """Remove the checkpoint steps under ``root`` beyond the newest ``keep``; the step ``latest.json``
    names (what a resumed run loads) always stays, and so does any step with a file ``uploaded`` does
    not confirm (``None``: no server to wait for), a half-written one included. A step is a folder
    (per-site files, or a sharded DCP save) or a single file. The paths removed."""
    entries: dict[int, Path] = {}
    for entry in Path(root).glob("step-*"):
        with contextlib.suppress(ValueError):
            entries[int(entry.name.removeprefix("step-"))] = entry
    kept = set(sorted(entries)[-keep:])
    info = latest(root) if Path(root, LATEST).exists() else None
    if info is not None:
        kept.add(int(info["step"]))
    removed = []
    for step, entry in sorted(entries.items()):
        files = [entry] if entry.is_file() else [p for p in entry.rglob("*") if p.is_file()]
        if step in kept or (uploaded is not None and not all(uploaded(f) for f in files)):
            continue
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def atomic_save(obj: Any, path: Path) -> None:
    import torch

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


def leave(store: dist.Store, site: int) -> None:
    """Site ``site`` writes no more checkpoints in this run (a pipeline replica that left it): the
    pending commits stop waiting for its files."""
    store.set(_left_key(site), "1")


def _left_key(site: int) -> str:
    return f"cpn/ckpt/left/site{site}"


@dataclass
class PendingCommit:
    """Rank 0's ``latest.json`` for one checkpoint step, written once every expected site leader has
    reported its file, or at ``deadline`` with the sites that did (a site that died before writing
    rejoins from ``global.pt``). :func:`save` waits ``COMMIT_GRACE_SECONDS`` for the files (the usual
    case: committed there, as before); a step still incomplete then is polled by the training loop
    between steps (:func:`poll_commits`), so a dead site's missing file never holds the live ranks."""

    root: Path
    step: int
    sites: list[int]
    deadline: float

    def written(self, store: dist.Store) -> list[int]:
        return [s for s in self.sites if store.check([_key(self.step, s)])]

    def due(self, store: dist.Store) -> bool:
        awaited = [s for s in self.sites if not store.check([_left_key(s)])]
        return all(store.check([_key(self.step, s)]) for s in awaited) or time.monotonic() >= self.deadline

    def wait(self, store: dist.Store, until: float) -> bool:
        """Wait until the commit is due or ``until`` (monotonic); whether it is due."""
        while not self.due(store):
            if time.monotonic() >= until:
                return False
            time.sleep(0.01)
        return True

    def commit(self, store: dist.Store) -> None:
        atomic_write_json({"step": self.step, "sites": self.written(store)}, self.root / LATEST)


def poll_commits(pending: list[PendingCommit], store: dist.Store, *, wait: bool = False) -> None:
    """Commit the newest due checkpoint of ``pending`` (oldest first) and drop it and the older ones
    (a newer step supersedes them: ``latest.json`` never moves back within a run); ``wait``: the newest
    one, waiting for it up to its deadline. Mutates ``pending``."""
    for k in reversed(range(len(pending))):
        last = k == len(pending) - 1
        if pending[k].due(store) or (wait and last and pending[k].wait(store, pending[k].deadline)):
            pending[k].commit(store)
            del pending[: k + 1]
            return


def _key(step: int, site: int) -> str:
    return f"cpn/ckpt/{step}/site{site}"


def save(root: Path, step: int, *, site: int, is_leader: bool, is_rank0: bool, site_state: dict[str, Any],
         global_state: dict[str, Any], store: dist.Store, live_sites: list[int],
         timeout: float = COMMIT_TIMEOUT_SECONDS) -> PendingCommit | None:
    """Called on every rank at a checkpoint step; leaders write, rank 0 returns the step's commit of
    ``latest.json`` after a short grace for the sites' files, for :func:`poll_commits` to write."""
    directory = step_dir(root, step)
    if is_leader:
        atomic_save(site_state, directory / f"site{site}.pt")
        store.set(_key(step, site), "1")
    if not is_rank0:
        return None
    atomic_save(global_state, directory / "global.pt")
    commit = PendingCommit(Path(root), step, list(live_sites), time.monotonic() + timeout)
    commit.wait(store, time.monotonic() + min(COMMIT_GRACE_SECONDS, timeout))
    return commit


def load(root: str | Path, site: int, stand_in: Callable[[int], bool] | None = None,
         ) -> tuple[int, dict[str, Any] | None, dict[str, Any]] | None:
    """(step, this site's state or None if it has none, global state) of the latest checkpoint; without
    a file of its own, the first listed site's for which ``stand_in(site)`` holds (a pipeline stage's
    copy in another replica).

    Loaded to the host (a run may resume on other devices); the strategies move it to theirs."""
    info = latest(root)
    if info is None:
        return None
    directory = step_dir(Path(root), info["step"])
    candidates = [site, *(s for s in info["sites"] if s != site and stand_in is not None and stand_in(s))]
    found = next((directory / f"site{s}.pt" for s in candidates
                  if s in info["sites"] and (directory / f"site{s}.pt").exists()), None)
    import torch  # noqa: PLC0415 - see the module's imports

    site_state = torch.load(found, weights_only=False, map_location="cpu") if found is not None else None
    return info["step"], site_state, torch.load(directory / "global.pt", weights_only=False, map_location="cpu")


# ----------------------------------------------------------------------------- sharded (shard="site")
# A sharded run's checkpoint is one torch.distributed.checkpoint (DCP) save over the whole job, in
# the step's folder: ``step-N/.metadata`` and ``step-N/__<rank>_<i>.distcp``. Each site's ranks write
# their shards of the site's model and optimiser under ``site<K>/``, site 0's ranks also the state
# all sites share under ``global/`` (DiLoCo's outer parameters and momentum); ``latest.json`` says
# ``"format": "dcp"`` and lists the files. DCP records every tensor's global shape and each shard's
# offsets, so a run on another number of ranks per site (or of sites: a site not in the checkpoint
# starts from site 0's) loads it: each rank reads the parts of the tensors it now holds.
DCP_FORMAT = "dcp"


def is_sharded_checkpoint(root: str | Path) -> bool:
    info = latest(root)
    return bool(info) and info.get("format") == DCP_FORMAT


def save_sharded(root: Path, step: int, state: dict[str, Any], *, group: dist.ProcessGroup, is_rank0: bool,
                 sites: list[int]) -> None:
    """Every rank of the job: write ``state`` (this rank's DTensor shards, under ``site<K>/`` and
    ``global/``) with DCP; rank 0 then moves ``latest.json`` (the save ends with rank 0 writing the
    metadata after every rank's files, so it never points at a half-written step)."""
    import torch.distributed.checkpoint as dcp

    directory = step_dir(Path(root), step)
    directory.mkdir(parents=True, exist_ok=True)
    dcp.save(state, checkpoint_id=str(directory), process_group=group)
    if is_rank0:  # the files this save wrote (a folder left by an abandoned run may hold more)
        metadata = dcp.FileSystemReader(str(directory)).read_metadata()
        files = sorted({".metadata", *(item.relative_path for item in metadata.storage_data.values())})
        atomic_write_json({"step": step, "sites": sites, "format": DCP_FORMAT, "files": files}, Path(root) / LATEST)


def load_sharded(root: str | Path, template: Callable[[list[int]], dict[str, Any]], *,
                 group: dist.ProcessGroup) -> tuple[int, dict[str, Any]] | None:
    """(step, state) of the latest sharded checkpoint, read into ``template(sites)`` (the tensors
    this rank holds now, as DTensors, keyed as they were saved; filled in place), or None."""
    import torch.distributed.checkpoint as dcp

    info = latest(root)
    if info is None:
        return None
    if info.get("format") != DCP_FORMAT:
        raise ValueError(f"the checkpoint under {root} is not sharded: resume it with shard='none' (--shard none)")
    state = template(list(info["sites"]))
    dcp.load(state, checkpoint_id=str(step_dir(Path(root), info["step"])), process_group=group)
    return info["step"], state


def full_model_state(model: torch.nn.Module) -> dict[str, Any]:
    """The whole model's state dict on the host (a collective over the model's site: every rank of
    it calls; all get it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
