"""Quotes that learn: finished runs correct the compute model, and no single run can poison them.

The compute model (:mod:`layers.orchestration.planning.perf`) predicts a step from textbook FLOPs,
MFU and α-β communication, plus a fixed start-up. On real machines that misses by 2-3x. Every job
that **succeeds on its first attempt** (a re-placed run measures the failure, not the model) now
teaches, for its placement's most numerous (GPU model, provider) pair, its strategy and its workload
(CPN's LM, or one bundle of the user's own code), one :class:`Observation`:

- ``factor``: the run's measured **step** time over the model's own prediction for a step, before
  any factor. The step time is the slowest rank's slope between its first report and the first
  report of its last step (Δ wall seconds / Δ steps, from the reports the workers sent), extrapolated
  to its last step, so what runs once per attempt — loading data, the first step's warm-up, the
  last validation, the final upload — is not divided by the steps. A run whose ranks reported fewer
  than two distinct steps falls back on its wall time (Running → Succeeded) over the steps' prediction.
- ``startup``: Launching → Running (claims, process start, rendezvous), plus the rest of Running →
  Succeeded that the steps do not explain (at the measured step time; in the fallback, at the
  lesson's factor so far, if any): quotes price ``startup + steps × step``, so a fixed cost is
  learned as a fixed cost.
- ``evidence`` in (0, 1]: the steps the run timed over :data:`FULL_STEPS` (a one-step run tells
  almost nothing about a step; a wall-time fallback counts its steps the same way).

Each lesson is folded in **log space** (factors are ratios): ``log f += clamp(w · (log r − log f),
± log BOUND)`` with ``w = evidence · max(1/(E + 1), ALPHA)``, ``E`` the evidence gathered so far
(``evidence`` column). So the first full runs count fully and later ones keep following a drifting
machine, a one-step run moves a factor by at most ``1/FULL_STEPS`` of its (log) miss, and no run
moves it by more than ×/÷ :data:`BOUND`. The exception is a new lesson's first *full, step-timed*
run (evidence 1, its factor from the reports' step times, while the lesson holds less than one full
run's evidence): the factor it replaces (the textbook's 1, or the unscoped lesson a provider's first
own lesson starts from) is not this lesson's evidence, so that run is taken as measured — one run of the README's world (CPU slots
declared as H100, ×44,691) corrects its quotes at once instead of after fifteen doublings. A new
lesson's first short or wall-timed run is weighed and bounded like any other. Start-up is folded the
same way (evidence 1: it is measured whole), and a new lesson's first start-up is taken as measured
(the drivers' defaults are guesses).

Lessons are kept **per provider** (the sites' ``spec.provider``): one provider's "H100" may be a CPU
slot (the README's world with ``cpn agent --local``), and its runs must not price anyone else's H100.
Quotes read the provider's own lesson, else the unscoped one (provider ``''``: learned before
migration 0015). Quotes priced afterwards use them — time and therefore price — and say so
(``stepFactor``, ``startupSeconds`` in the quote's prediction).
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, literal, select
from sqlalchemy.ext.asyncio import AsyncSession

from cpn.core.db import as_utc
from layers.control.capacity import offer_cluster
from layers.orchestration.lifecycle.models import CalibrationRow, MetricRow
from layers.orchestration.planning.types import Learned, Lesson, workload_of
from layers.resource.models import ClusterRow, SiteRow
from layers.service.models import JobRow, QuoteRow

ALPHA = 0.3  # weight of the newest full run once the lesson holds more than 1/ALPHA runs' evidence
MIN_SECONDS = 1.0  # runs shorter than this (in training) teach nothing: timer noise
FULL_STEPS = 20  # steps a run must time to count as one full observation of a step
BOUND = 2.0  # one run moves a factor (or a start-up) by at most ×/÷ this
MIN_STARTUP = 0.1  # start-up seconds are averaged in log space: never below this


async def load(session: AsyncSession) -> Learned:
    rows = (await session.execute(select(CalibrationRow))).scalars()
    return Learned(tuple(Lesson(r.gpu_model, r.strategy, r.workload, r.step_factor, r.startup_seconds, r.samples,
                                r.provider) for r in rows))


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


@dataclass(frozen=True)
class Observation:
    """What one finished run says (see the module's docstring)."""

    factor: float  # measured step time over the model's unfactored prediction of a step
    startup: float  # seconds: Launching → Running, plus the fixed part of Running → Succeeded when known
    evidence: float  # (0, 1]: how much the run can tell about a step
    steps_timed: bool  # the factor came from the reports' step times (False: the wall-time fallback)


def damped(old: float, new: float, weight: float) -> float:
    """``old`` moved toward ``new`` by ``weight`` in log space, by at most ×/÷ :data:`BOUND`."""
    step = weight * (math.log(new) - math.log(old))
    bound = math.log(BOUND)
    return old * math.exp(max(-bound, min(bound, step)))


def step_rate(reports: list[tuple[int, int, float]]) -> tuple[float, int, int] | None:
    """(seconds per step, steps timed, last step) of the slowest rank, from ``(rank, step, wall
    seconds when the rank first reported that step)``; None when no rank reported two distinct steps."""
    by_rank: dict[int, list[tuple[int, float]]] = defaultdict(list)
    for rank, step, wall in reports:
        if step >= 1:  # step 0 is rank 0's first validation, before any training: the warm-up would count
            by_rank[rank].append((step, wall))
    rates = []
    for points in by_rank.values():
        (s0, w0), (s1, w1) = min(points), max(points)
        if s1 > s0 and w1 > w0:
            rates.append(((w1 - w0) / (s1 - s0), s1 - s0, s1))
    return max(rates) if rates else None


def observe(*, raw_step: float, steps: int, startup: float, train: float,
            rate: tuple[float, int, int] | None, known: float | None = None) -> Observation:
    """One run's :class:`Observation`: ``raw_step`` the model's unfactored step seconds, ``steps`` the
    steps it priced, ``startup``/``train`` the measured phases, ``rate`` :func:`step_rate` (None: none),
    ``known`` the lesson's factor so far (None: no lesson yet)."""
    if rate is None:
        fixed = 0.0 if known is None else max(0.0, train - known * raw_step * steps)
        return Observation(train / (raw_step * steps), startup + fixed, min(1.0, steps / FULL_STEPS), False)
    per_step, timed, last = rate
    # the steps' share of Running → Succeeded: the slowest rank's rate over all its steps (a rank's
    # count, whatever the strategy calls a step, so it is set against the prediction for all `steps`)
    stepping = min(train, max(per_step * last, 1e-9))
    return Observation(stepping / (raw_step * steps), startup + train - stepping, min(1.0, timed / FULL_STEPS), True)


def fold(row: CalibrationRow, seen: Observation) -> None:
    """Fold one observation into its lesson (the rule in the module's docstring)."""
    gathered = row.evidence or 0.0
    if gathered < 1.0 and seen.evidence >= 1.0 and seen.steps_timed:  # the first full run replaces the guess
        row.step_factor = seen.factor
    else:
        row.step_factor = damped(row.step_factor, seen.factor, seen.evidence * max(1.0 / (gathered + 1.0), ALPHA))
    startup = max(MIN_STARTUP, seen.startup)
    row.startup_seconds = startup if not row.samples else damped(max(MIN_STARTUP, row.startup_seconds), startup,
                                                                  max(1.0 / (row.samples + 1), ALPHA))
    row.evidence = gathered + seen.evidence
    row.samples = (row.samples or 0) + 1
    row.last_observed = round(seen.factor, 6)


def _dominant(placement: list[dict], providers: dict[str, str]) -> tuple[str, str] | None:
    """The placement's most numerous (GPU model, provider) pair, as the planner reads lessons (perf.py)."""
    gpus: dict[tuple[str, str], int] = {}
    for line in placement:
        key = (line.get("gpuModel") or "", providers.get(_cluster(line), ""))
        gpus[key] = gpus.get(key, 0) + int(line.get("gpus") or 0)
    return max(sorted(gpus), key=gpus.__getitem__) if gpus else None


def _cluster(line: dict) -> str:
    """A placement line's cluster: ``cluster/pool`` when the cluster has several node pools."""
    return offer_cluster(line.get("cluster") or "")


async def _providers(session: AsyncSession, clusters: set[str]) -> dict[str, str]:
    rows = await session.execute(select(ClusterRow.name, SiteRow.spec).join(SiteRow, SiteRow.id == ClusterRow.site_id)
                                 .where(ClusterRow.name.in_(clusters)))
    return {name: (spec or {}).get("provider") or "" for name, spec in rows.all()}


async def _reports(session: AsyncSession, job: str, attempt: int) -> list[tuple[int, int, float]]:
    """(rank, step, wall seconds at the step's first report) of one attempt."""
    rows = await session.execute(select(MetricRow.rank, MetricRow.step, func.min(MetricRow.wall_seconds))
                                 .where(MetricRow.job == job, MetricRow.attempt == attempt)
                                 .group_by(MetricRow.rank, MetricRow.step))
    return [(int(r), int(s), float(w)) for r, s, w in rows.all()]


async def learn(session: AsyncSession, job: JobRow) -> CalibrationRow | None:
    """Fold a finished job's measured times into its calibration row (None: the job teaches nothing)."""
    status = job.status or {}
    if job.phase != "Succeeded" or status.get("attempt", 1) != 1 or not status.get("quote"):
        return None
    times = status.get("phaseTimes", {})
    startup, train = _seconds(times, "Launching", "Running"), _seconds(times, "Running", "Succeeded")
    quote = await session.get(QuoteRow, status["quote"])
    placement = status.get("placement") or []
    key = _dominant(placement, await _providers(session, {_cluster(line) for line in placement}))
    if quote is None or key is None or startup is None or train is None or train < MIN_SECONDS:
        return None
    pred = quote.prediction or {}
    steps, raw_step = int(pred.get("steps", 0)), pred.get("stepSeconds", 0.0) / (pred.get("stepFactor") or 1.0)
    if steps <= 0 or raw_step <= 0:
        return None
    model, provider = key
    workload = workload_of(((job.spec or {}).get("code") or {}).get("digest"))
    row = await session.get(CalibrationRow, (model, quote.strategy, workload, provider))
    # a provider's first own lesson starts where its quotes stood: the unscoped lesson, if any (else the textbook)
    prior = None if row is not None or not provider else await session.get(
        CalibrationRow, (model, quote.strategy, workload, ""))
    known = row.step_factor if row is not None else (prior.step_factor if prior is not None else None)
    seen = observe(raw_step=raw_step, steps=steps, startup=startup, train=train,
                   rate=step_rate(await _reports(session, job.name, 1)), known=known)
    if row is None:  # its first start-up is taken as measured; its evidence starts at 0 (the prior is not its own)
        row = CalibrationRow(gpu_model=model, strategy=quote.strategy, workload=workload, provider=provider,
                             step_factor=known or 1.0, startup_seconds=startup, samples=0, evidence=0.0)
        session.add(row)
    fold(row, seen)
    row.last_ratio = round((startup + train) / quote.predicted_seconds, 4) if quote.predicted_seconds else None
    return row


def view(row: CalibrationRow) -> dict:
    """The API's item for ``GET /api/v1/calibrations``."""
    return {"gpuModel": row.gpu_model, "strategy": row.strategy, "workload": row.workload,
            "stepFactor": round(row.step_factor, 4), "startupSeconds": round(row.startup_seconds, 2),
            "samples": row.samples, "lastRatio": row.last_ratio, "updatedAt": row.updated_at.isoformat(),
            "provider": row.provider, "evidence": round(row.evidence or 0.0, 3), "lastObserved": row.last_observed}


async def listing(session: AsyncSession, account_id: str | None = None) -> list[dict]:
    """Every row for an admin (``account_id`` None); for anyone else the built-in model's rows and those of
    the code bundles their own jobs ran: another tenant's workload digests are theirs (issue 35, L1)."""
    stmt = select(CalibrationRow).order_by(
        CalibrationRow.gpu_model, CalibrationRow.strategy, CalibrationRow.workload, CalibrationRow.provider)
    if account_id is not None:
        specs = (await session.execute(select(JobRow.spec).where(JobRow.owner_id == account_id))).scalars()
        own = {workload_of(((spec or {}).get("code") or {}).get("digest")) for spec in specs} | {"lm"}
        stmt = stmt.where(CalibrationRow.workload.in_(sorted(own)))
    return [view(r) for r in (await session.execute(stmt)).scalars()]
