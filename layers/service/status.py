"""The typed status of a TrainingJob: every key any layer may write, with its type.

A job's status is stored as JSON on its row; `update_status`/`set_phase` (layers/service/jobs.py) are
its only writers and validate every change against `JobStatus`, so an unknown key or a wrong type is
a programming error caught where it is written, not a surprise for a reader three layers away.
Readers use `status_of(row)` for typed access.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from cpn.core.manifest import CamelModel


class Progress(CamelModel):
    percent: float = 0.0
    tokens: int = 0
    loss: float | None = None
    val_loss: float | None = None
    train_loss: float | None = None
    tokens_per_second: float = 0.0
    eta_seconds: float | None = 0.0  # None once the job has ended (no "ETA 0 s" for a cancelled job)
    updated_at: str | None = None


class Amount(CamelModel):
    total: str
    currency: str


class Measured(CamelModel):
    wall_seconds: float
    predicted_seconds: float
    ratio: float | None = None


class ProfileStatus(CamelModel):
    """The job's profile run (spec.profile): where it ran, its budget, and what it measured."""

    site: str
    cluster: str
    gpus: int
    gpu_model: str
    digest: str | None = None  # the code bundle timed (spec.code.digest; None: CPN's built-in LM)
    tflops: float  # peak per GPU of the profiled cluster: the compute model scales other GPU models from it
    intra_gbps: float
    units_per_step: int
    steps: int
    max_seconds: float
    measured_step_seconds: float | None = None
    measured_steps: int = 0
    units_per_second: float | None = None
    startup_seconds: float | None = None  # the run besides its timed steps (None: stopped at the cap)
    note: str | None = None


class MemoryPlanStatus(CamelModel):
    """How the accepted placement holds the model (the quote's perf.memory_plan); the runtime's
    TrainConfig.shard and activation_checkpointing (layers/orchestration/lifecycle/plan.py)."""

    shard: Literal["none", "site"] = "none"
    activation_checkpointing: Literal["none", "full"] = "none"


class JobStatus(CamelModel):
    """`phase` itself lives in its own column (`JobRow.phase`, a `JobPhase`); views add it on read."""

    conditions: list[dict[str, Any]] = Field(default_factory=list)
    phase_times: dict[str, str] = Field(default_factory=dict)
    message: str | None = None
    # spec.profile: the timed run before quoting (layers/orchestration/jobs/profile.py)
    profile: ProfileStatus | None = None
    # the accepted quote (layers/service/contracts.py)
    contract: str | None = None
    quote: str | None = None
    strategy: str | None = None
    placement: list[dict[str, Any]] = Field(default_factory=list)
    ring: list[str] = Field(default_factory=list)
    predicted_seconds: float | None = None
    quote_lines: list[dict[str, Any]] = Field(default_factory=list)
    price: Amount | None = None
    memory: MemoryPlanStatus | None = None  # its memory plan; a re-placement writes its own (replan.py)
    # the current attempt (layers/orchestration/lifecycle/reconciler.py)
    attempt: int = 0
    topology: dict[str, Any] | None = None
    train: dict[str, Any] | None = None
    # the attempt goes on without a lost site (lifecycle/plan.survives_site_loss); None: by strategy name
    elastic: bool | None = None
    checkpoint_every: int = 0
    sites: str | None = None
    failed_sites: list[dict[str, Any]] = Field(default_factory=list)
    # unit prices of clusters the quote did not price, at their list price when a re-placement put the
    # job on them (layers/orchestration/lifecycle/replan.py; billed by metering._price_lines)
    repriced_lines: list[dict[str, Any]] = Field(default_factory=list)
    cancel_requested: bool = False
    measured: Measured | None = None
    # metering (layers/orchestration/lifecycle/metering.py)
    meter: dict[str, Any] = Field(default_factory=dict)
    since_checkpoint: dict[str, float] = Field(default_factory=dict)
    billed: dict[str, Any] = Field(default_factory=dict)
    progress: Progress | None = None
    cost: Amount | None = None


def validated(status: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """`status` with `changes` applied; the changes are checked against JobStatus (an unknown key or a
    wrong type raises) and keep their wire (camelCase) form. Keys already stored are left as they are."""
    checked = JobStatus.model_validate(changes).model_dump(mode="json", by_alias=True, exclude_unset=True)
    return {**status, **checked}


def status_of(row: Any) -> JobStatus:
    return JobStatus.model_validate(row.status or {})
