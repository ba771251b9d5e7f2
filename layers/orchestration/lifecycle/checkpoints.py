"""A job's checkpoints in the server's blob store. Every site's job runner uploads its files;
rank 0's site uploads `step-N/latest.json` last. A step is complete when that marker and every
file it names are present; a new attempt resumes from the newest complete step, or starts cleanly.

A sharded step (``"format": "dcp"``, torch.distributed.checkpoint) is one job-wide save: rank 0's
``.metadata`` and one ``__<rank>_<i>.distcp`` per rank, each uploaded by the site that wrote it; its
marker lists them (``files``), and it is complete only when every listed file is stored. The blob
store takes no name that starts with ``.`` or ``_``, so those are stored as ``dcp.metadata`` and
``dcp-<rank>-<i>.distcp``; the API speaks the names DCP wrote."""

from __future__ import annotations

import json
import re
from typing import Any

from cpn.core import errors
from layers.resource.blobs import BlobStore

STEP_PATTERN = r"step-\d{8}"  # a step's folder (the API's {step}); its files (the API's {file}):
DCP_FORMAT = "dcp"
DCP_FILE_PATTERN = r"\.metadata|__\d{1,6}_\d{1,4}\.distcp"
FILE_PATTERN = rf"site\d+\.pt|global\.pt|latest\.json|{DCP_FILE_PATTERN}"
NAME_RE = re.compile(rf"^{STEP_PATTERN}/({FILE_PATTERN})$")
DCP_FILE_RE = re.compile(rf"^({DCP_FILE_PATTERN})$")
MAX_DCP_FILES = 100_001  # .metadata and up to 100,000 ranks' files: a marker listing more is not a checkpoint


def _stored_name(file: str) -> str:
    """The blob name of a checkpoint file: DCP's `.metadata` and `__R_I.distcp` renamed (see above)."""
    if file == ".metadata":
        return "dcp.metadata"
    if DCP_FILE_RE.match(file):
        rank, index = file.removeprefix("__").removesuffix(".distcp").split("_")
        return f"dcp-{rank}-{index}.distcp"
    return file


def key(job: str, name: str) -> str:
    """`job` is the job's uid, not its name: a deleted job's name may be taken again, its checkpoints not."""
    if not NAME_RE.match(name):
        raise errors.InvalidInput(f"checkpoint file {name!r} is not valid: expected step-NNNNNNNN/"
                                  "(siteK.pt|global.pt|latest.json|.metadata|__R_I.distcp)", field="name")
    step, file = name.split("/")
    return f"{job}/checkpoints/{step}/{_stored_name(file)}"


def _dcp_files(info: dict[str, Any]) -> list[str] | None:
    """The files a sharded step's marker lists (`.metadata` among them, every name one DCP writes), or None."""
    files = info.get("files")
    if not isinstance(files, list) or not 0 < len(files) <= MAX_DCP_FILES or ".metadata" not in files:
        return None
    if not all(isinstance(f, str) and DCP_FILE_RE.match(f) for f in files):
        return None
    return sorted(set(files))


def _complete(store: BlobStore, job: str, step_name: str, info: dict[str, Any]) -> dict[str, Any] | None:
    """The API's description of the step behind marker `info` when every file it needs is stored."""
    sites = info.get("sites", [])
    if info.get("format") == DCP_FORMAT:
        names = _dcp_files(info)
        if names is None:
            return None
        extra = {"format": DCP_FORMAT}
    else:
        names = ["global.pt", *(f"site{i}.pt" for i in sites)]
        extra = {}
    files = [f"{step_name}/{n}" for n in names]
    if not all(store.exists(key(job, f)) for f in files):
        return None
    return {"step": int(info["step"]), "sites": sites, **extra, "files": files}


def latest(store: BlobStore, job: str) -> dict[str, Any] | None:
    """{"step", "sites", "files"} of the newest complete checkpoint (and "format": "dcp" for a
    sharded one), or None. `files` are the names to fetch (`step-N/<file>`)."""
    markers = [k for k in store.list(f"{job}/checkpoints") if k.endswith("/latest.json")]
    for marker in sorted(markers, reverse=True):
        step_name = marker.rsplit("/", 2)[1]
        try:
            info = json.loads(store.read_text(marker))
            found = _complete(store, job, step_name, info) if isinstance(info, dict) else None
        except (ValueError, TypeError, KeyError, OSError, errors.InvalidInput):
            continue
        if found is not None:
            return found
    return None
