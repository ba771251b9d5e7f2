"""Leases: GPUs reserved at a cluster for a job; active leases are what makes capacity unavailable."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import DateTime, ForeignKey, Index, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from cpn.core.db import Base, Tracked, new_uid
from cpn.core.store import KEY_LEN, SUBTASK_LEN


class LeaseRow(Tracked, Base):
    __tablename__ = "leases"
    __table_args__ = (Index("ix_leases_cluster_state", "cluster_id", "state"),)

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_uid)
    job: Mapped[str] = mapped_column(String(KEY_LEN), index=True, nullable=False)
    subtask: Mapped[str] = mapped_column(String(SUBTASK_LEN), nullable=False)
    contract_id: Mapped[str | None] = mapped_column(String(36), nullable=True, index=True)
    cluster_id: Mapped[str] = mapped_column(ForeignKey("clusters.id", ondelete="RESTRICT"), nullable=False)
    cluster: Mapped[str] = mapped_column(String(63), nullable=False)
    owner_id: Mapped[str] = mapped_column(String(36), nullable=False, index=True)
    gpus: Mapped[int] = mapped_column(Integer, nullable=False)
    state: Mapped[str] = mapped_column(String(16), nullable=False, default="active")  # active|released|expired
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    released_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    reason: Mapped[str | None] = mapped_column(String(200), nullable=True)
