"""Checkpoint retention in the server's blob store: a job keeps its newest `keep` committed steps
(a step is committed when rank 0's site has uploaded its `latest.json`), never the step a new attempt
would resume from (the newest complete one, which may be older when a newer step still lacks a
site's file), nor any step newer than the newest committed one (its files may still be arriving).
Everything older goes. Final weights are not checkpoints and are never touched.

Without it a job of 800 steps checkpointing every 50 left 16 steps behind (issue 36, item 6: 3.3 GB
of blobs after about 25 tiny jobs). It runs whenever a step is committed, so a late file of a step
already pruned is removed at the next commit."""

from __future__ import annotations

import re

from layers.orchestration.lifecycle import checkpoints
from layers.resource.blobs import BlobStore

STEP_RE = re.compile(r"/checkpoints/(step-(\d{8}))/")


def doomed(keys: list[str], keep: int, resume_step: int | None) -> list[str]:
    """The keys of `keys` (one job's checkpoint blobs) that retention removes."""
    steps: dict[int, list[str]] = {}
    committed: set[int] = set()
    for key in keys:
        found = STEP_RE.search(key)
        if found is None:
            continue
        step = int(found.group(2))
        steps.setdefault(step, []).append(key)
        if key.endswith("/latest.json"):
            committed.add(step)
    if not committed:
        return []
    kept = set(sorted(committed)[-keep:])
    if resume_step is not None:
        kept.add(resume_step)
    newest = max(committed)
    return sorted(k for step, ks in steps.items() if step not in kept and step < newest for k in ks)


def prune(store: BlobStore, job: str, keep: int) -> list[str]:
    """Remove job `job`'s (uid) checkpoint steps that retention does not keep; the keys removed."""
    latest = checkpoints.latest(store, job)
    gone = doomed(store.list(f"{job}/checkpoints"), keep, latest["step"] if latest else None)
    store.delete(gone)
    return gone
