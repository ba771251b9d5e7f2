"""Sub-tasks (one replica group per cluster and attempt) and the metric reports of a job."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, DateTime, Float, Index, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from cpn.core.db import Base, JSONType, Tracked, new_uid, utcnow
from cpn.core.store import KEY_LEN, LAUNCH_KEY_LEN, SUBTASK_LEN


class SubtaskRow(Tracked, Base):
    __tablename__ = "subtasks"

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_uid)
    job: Mapped[str] = mapped_column(String(KEY_LEN), index=True, nullable=False)
    name: Mapped[str] = mapped_column(String(SUBTASK_LEN), nullable=False)
    attempt: Mapped[int] = mapped_column(Integer, nullable=False)
    launch_key: Mapped[str] = mapped_column(String(LAUNCH_KEY_LEN), unique=True, nullable=False)
    cluster: Mapped[str] = mapped_column(String(63), nullable=False, index=True)
    site: Mapped[str] = mapped_column(String(63), nullable=False)
    site_index: Mapped[int] = mapped_column(Integer, nullable=False)
    gpus: Mapped[int] = mapped_column(Integer, nullable=False)
    driver: Mapped[str] = mapped_column(String(16), nullable=False)
    phase: Mapped[str] = mapped_column(String(16), nullable=False, default="Pending")
    handle: Mapped[dict[str, Any]] = mapped_column(JSONType, nullable=False, default=dict)
    launches: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    launched_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    message: Mapped[str | None] = mapped_column(Text, nullable=True)
    # desired state, written by the reconciler; reported state (phase, exit codes), written by the agent
    desired: Mapped[str] = mapped_column(String(8), nullable=False, default="Run")
    reported: Mapped[str | None] = mapped_column(String(16), nullable=True)
    first_rank: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    rendezvous: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    exit_codes: Mapped[dict[str, Any]] = mapped_column(JSONType, nullable=False, default=dict)
    claimed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    reported_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class LogRow(Tracked, Base):
    """Worker output shipped by the site agents, line by line, so logs outlive sites and replicas."""

    __tablename__ = "subtask_logs"
    __table_args__ = (Index("ix_subtask_logs_job_attempt", "job", "attempt", "id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job: Mapped[str] = mapped_column(String(KEY_LEN), nullable=False)
    attempt: Mapped[int] = mapped_column(Integer, nullable=False)
    subtask: Mapped[str] = mapped_column(String(SUBTASK_LEN), nullable=False)
    site: Mapped[str] = mapped_column(String(63), nullable=False)
    rank: Mapped[int] = mapped_column(Integer, nullable=False)
    line: Mapped[str] = mapped_column(Text, nullable=False)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, nullable=False)


class MetricRow(Tracked, Base):
    __tablename__ = "job_metrics"

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_uid)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)
    job: Mapped[str] = mapped_column(String(KEY_LEN), index=True, nullable=False)
    attempt: Mapped[int] = mapped_column(Integer, nullable=False)
    rank: Mapped[int] = mapped_column(Integer, nullable=False)
    site: Mapped[int] = mapped_column(Integer, nullable=False)
    step: Mapped[int] = mapped_column(BigInteger, nullable=False)
    tokens: Mapped[int] = mapped_column(BigInteger, nullable=False)  # cumulative: past 2**31 in large jobs
    train_loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    val_loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    tokens_per_second: Mapped[float] = mapped_column(Float, nullable=False, default=0.0)
    wall_seconds: Mapped[float] = mapped_column(Float, nullable=False, default=0.0)
    wan_bytes: Mapped[float] = mapped_column(Float, nullable=False, default=0.0)
    extra: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)  # the user's own (cpn.train)


class MetricBatchRow(Tracked, Base):
    """A metric batch already stored (its sender's id): a batch re-sent after a lost answer is
    answered from here instead of being stored twice."""

    __tablename__ = "metric_batches"

    job: Mapped[str] = mapped_column(String(KEY_LEN), primary_key=True)
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    accepted: Mapped[int] = mapped_column(Integer, nullable=False)


class CalibrationRow(Tracked, Base):
    """What finished runs taught the compute model (see :mod:`layers.orchestration.lifecycle.learning`)."""

    __tablename__ = "calibrations"

    gpu_model: Mapped[str] = mapped_column(String(64), primary_key=True)
    strategy: Mapped[str] = mapped_column(String(16), primary_key=True)
    workload: Mapped[str] = mapped_column(String(32), primary_key=True)  # lm | code:<digest prefix>
    # the sites' provider (a provider's "H100" may be another's CPU slot); '' = unscoped (rows before 0015)
    provider: Mapped[str] = mapped_column(String(64), primary_key=True, default="", server_default="")
    step_factor: Mapped[float] = mapped_column(Float, nullable=False)
    startup_seconds: Mapped[float] = mapped_column(Float, nullable=False)
    samples: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    last_ratio: Mapped[float | None] = mapped_column(Float, nullable=True)  # measured / predicted, last run
    # Σ of the runs' evidence (0-1 each: how many steps a run measured); what the averaging weight follows
    evidence: Mapped[float] = mapped_column(Float, nullable=False, default=0.0, server_default="0")
    last_observed: Mapped[float | None] = mapped_column(Float, nullable=True)  # last run's own factor, undamped
