"""A job's checkpoints in the server's blob store. Every site's job runner uploads its files;
rank 0's site uploads `step-N/latest.json` last. A step is complete when that marker and every
file it names are present; a new attempt resumes from the newest complete step, or starts cleanly."""

from __future__ import annotations

import json
import re
from typing import Any

from cpn.core import errors
from layers.resource.blobs import BlobStore

STEP_PATTERN = r"step-\d{8}"  # a step's folder (the API's {step}); its files (the API's {file}):
FILE_PATTERN = r"site\d+\.pt|global\.pt|latest\.json"
NAME_RE = re.compile(rf"^{STEP_PATTERN}/({FILE_PATTERN})$")


def key(job: str, name: str) -> str:
    """`job` is the job's uid, not its name: a deleted job's name may be taken again, its checkpoints not."""
    if not NAME_RE.match(name):
        raise errors.InvalidInput(f"checkpoint file {name!r} is not valid: expected step-NNNNNNNN/"
                                  "(siteK.pt|global.pt|latest.json)", field="name")
    return f"{job}/checkpoints/{name}"


def latest(store: BlobStore, job: str) -> dict[str, Any] | None:
    """{"step", "sites", "files"} of the newest complete checkpoint, or None."""
    markers = [k for k in store.list(f"{job}/checkpoints") if k.endswith("/latest.json")]
    for marker in sorted(markers, reverse=True):
        step_dir = marker.rsplit("/", 1)[0]
        try:
            info = json.loads(store.read_text(marker))
        except (ValueError, OSError):
            continue
        files = [f"{step_dir}/global.pt", *(f"{step_dir}/site{i}.pt" for i in info.get("sites", []))]
        if all(store.exists(f) for f in files):
            prefix = f"{job}/checkpoints/"
            return {"step": int(info["step"]), "sites": info.get("sites", []),
                    "files": [f.removeprefix(prefix) for f in files]}
    return None
