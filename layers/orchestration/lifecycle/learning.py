"""Quotes that learn: finished runs correct the compute model.

The compute model (:mod:`layers.orchestration.planning.perf`) predicts a step from textbook FLOPs,
MFU and α-β communication, plus a fixed start-up. On real machines that misses by 2-3x. Every job
that **succeeds on its first attempt** (a re-placed run measures the failure, not the model) now
teaches, for its placement's most numerous GPU model, its strategy and its workload (CPN's LM, or
one bundle of the user's own code):

- ``step_factor``: measured training time (Running → Succeeded) over the model's own prediction
  for the same steps, before any factor;
- ``startup_seconds``: measured start-up (Launching → Running: claims, process start, rendezvous).

Both are exponentially weighted averages (weight ``max(1/n, ALPHA)`` for the n-th run: the first runs
count fully, later ones keep following a drifting machine). Quotes priced afterwards use them — time
and therefore price — and say so (``stepFactor``, ``startupSeconds`` in the quote's prediction).
"""

from __future__ import annotations

import functools
from datetime import datetime
from typing import Any

from sqlalchemy import func, literal, select
from sqlalchemy.ext.asyncio import AsyncSession

from cpn.core.db import as_utc
from layers.orchestration.lifecycle.models import CalibrationRow
from layers.orchestration.planning.types import Learned, Lesson, workload_of
from layers.service.models import JobRow, QuoteRow

ALPHA = 0.3  # weight of the newest run once there are more than 1/ALPHA runs
MIN_SECONDS = 1.0  # runs shorter than this (in training) teach nothing: timer noise


async def load(session: AsyncSession) -> Learned:
    rows = (await session.execute(select(CalibrationRow))).scalars()
    return Learned(tuple(Lesson(r.gpu_model, r.strategy, r.workload, r.step_factor, r.startup_seconds, r.samples)
                         for r in rows))


STAMP_TAG = "calibrations"


@functools.cache  # one statement object, so the stamp query it joins is built once
def stamp() -> Any:
    """The calibrations' stamp (count, latest `updated_at`, sum of versions: every write moves one) in
    the shape of the catalogue's stamp rows, so a quote reads it in the catalogue's round trip."""
    return select(literal(STAMP_TAG), func.count(), func.max(CalibrationRow.updated_at),
                  func.coalesce(func.sum(CalibrationRow.resource_version), 0))


_loaded: dict[str, tuple[tuple[Any, ...], Learned]] = {}  # database URL → (stamp, what was loaded under it)


async def load_at(session: AsyncSession, stamped: Any) -> Learned:
    """`load`, from this process's copy while the stamp row `stamped` (of :func:`stamp`) is unchanged."""
    key = (int(stamped[1]), as_utc(stamped[2]), int(stamped[3]))
    where = str(session.get_bind().url)
    held = _loaded.get(where)
    if held is not None and held[0] == key:
        return held[1]
    learned = await load(session)
    _loaded[where] = (key, learned)
    return learned


def _seconds(times: dict[str, str], a: str, b: str) -> float | None:
    if not (times.get(a) and times.get(b)):
        return None
    return (datetime.fromisoformat(times[b]) - datetime.fromisoformat(times[a])).total_seconds()


def _dominant_model(placement: list[dict]) -> str | None:
    gpus: dict[str, int] = {}
    for line in placement:
        gpus[line.get("gpuModel") or ""] = gpus.get(line.get("gpuModel") or "", 0) + int(line.get("gpus") or 0)
    return max(sorted(gpus), key=gpus.__getitem__) if gpus else None


async def learn(session: AsyncSession, job: JobRow) -> CalibrationRow | None:
    """Fold a finished job's measured times into its calibration row (None: the job teaches nothing)."""
    status = job.status or {}
    if job.phase != "Succeeded" or status.get("attempt", 1) != 1 or not status.get("quote"):
        return None
    times = status.get("phaseTimes", {})
    startup, train = _seconds(times, "Launching", "Running"), _seconds(times, "Running", "Succeeded")
    quote = await session.get(QuoteRow, status["quote"])
    model = _dominant_model(status.get("placement") or [])
    if quote is None or model is None or startup is None or train is None or train < MIN_SECONDS:
        return None
    pred = quote.prediction or {}
    raw = pred.get("steps", 0) * pred.get("stepSeconds", 0.0) / (pred.get("stepFactor") or 1.0)
    if raw <= 0:
        return None
    workload = workload_of(((job.spec or {}).get("code") or {}).get("digest"))
    key = (model, quote.strategy, workload)
    row = await session.get(CalibrationRow, key)
    if row is None:
        row = CalibrationRow(gpu_model=model, strategy=quote.strategy, workload=workload, step_factor=train / raw,
                             startup_seconds=startup, samples=1)
        session.add(row)
    else:
        weight = max(1.0 / (row.samples + 1), ALPHA)
        row.step_factor += weight * (train / raw - row.step_factor)
        row.startup_seconds += weight * (startup - row.startup_seconds)
        row.samples += 1
    row.last_ratio = round((startup + train) / quote.predicted_seconds, 4) if quote.predicted_seconds else None
    return row


def view(row: CalibrationRow) -> dict:
    """The API's item for ``GET /api/v1/calibrations``."""
    return {"gpuModel": row.gpu_model, "strategy": row.strategy, "workload": row.workload,
            "stepFactor": round(row.step_factor, 4), "startupSeconds": round(row.startup_seconds, 2),
            "samples": row.samples, "lastRatio": row.last_ratio, "updatedAt": row.updated_at.isoformat()}


async def listing(session: AsyncSession) -> list[dict]:
    rows = (await session.execute(select(CalibrationRow).order_by(
        CalibrationRow.gpu_model, CalibrationRow.strategy, CalibrationRow.workload))).scalars()
    return [view(r) for r in rows]
