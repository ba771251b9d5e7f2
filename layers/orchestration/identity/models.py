"""Tables: accounts, tokens, audit_records, rate_buckets."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Boolean, DateTime, Float, ForeignKey, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from cpn.core.db import Base, Tracked, new_uid, utcnow
from cpn.core.store import KEY_LEN


class Account(Tracked, Base):
    __tablename__ = "accounts"

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_uid)
    name: Mapped[str] = mapped_column(String(63), unique=True, nullable=False)
    role: Mapped[str] = mapped_column(String(16), nullable=False)
    disabled: Mapped[bool] = mapped_column(Boolean, default=False, nullable=False)


class Token(Tracked, Base):
    __tablename__ = "tokens"

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_uid)
    account_id: Mapped[str] = mapped_column(ForeignKey("accounts.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(63), nullable=False)
    lookup: Mapped[str] = mapped_column(String(32), unique=True, nullable=False)
    secret_hash: Mapped[str] = mapped_column(Text, nullable=False)
    job: Mapped[str | None] = mapped_column(String(KEY_LEN), nullable=True, index=True)
    subtask: Mapped[str | None] = mapped_column(String(36), nullable=True, index=True)  # a worker's: its sub-task id
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    revoked: Mapped[bool] = mapped_column(Boolean, default=False, nullable=False)


class AuditRecord(Tracked, Base):
    __tablename__ = "audit_records"

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_uid)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)
    account_id: Mapped[str | None] = mapped_column(String(36), nullable=True, index=True)
    account_name: Mapped[str | None] = mapped_column(String(63), nullable=True)
    method: Mapped[str] = mapped_column(String(8), nullable=False)
    path: Mapped[str] = mapped_column(String(512), nullable=False)
    status: Mapped[int] = mapped_column(Integer, nullable=False)
    result: Mapped[str] = mapped_column(String(32), nullable=False)
    request_id: Mapped[str | None] = mapped_column(String(36), nullable=True)


class RateBucket(Tracked, Base):
    """One rate-limit bucket per token, shared by every replica (PostgreSQL): GCRA's theoretical
    arrival time, so a request is one conditional upsert (see identity/ratelimit.py)."""

    __tablename__ = "rate_buckets"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    tat: Mapped[float] = mapped_column(Float, nullable=False)  # seconds since the epoch, the database's clock
