"""Tables of the trade: training jobs, quotes, contracts and the append-only ledger."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import DateTime, Float, ForeignKey, Numeric, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from cpn.core.db import Base, JSONType, Tracked, new_uid, utcnow
from cpn.core.store import KEY_LEN, ResourceRow

MONEY = Numeric(18, 6)


class JobRow(ResourceRow, Base):
    __tablename__ = "jobs"
    __table_args__ = (UniqueConstraint("owner_id", "idempotency_key", name="uq_jobs_owner_idem"),)

    name: Mapped[str] = mapped_column(String(KEY_LEN), unique=True, nullable=False)  # "<owner>/<name>"
    phase: Mapped[str] = mapped_column(String(16), nullable=False, default="Pending", index=True)
    idempotency_key: Mapped[str | None] = mapped_column(String(200), nullable=True)


class QuoteRow(Tracked, Base):
    __tablename__ = "quotes"

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_uid)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    label: Mapped[str] = mapped_column(String(16), nullable=False)
    strategy: Mapped[str] = mapped_column(String(16), nullable=False)
    placement: Mapped[list[dict[str, Any]]] = mapped_column(JSONType, nullable=False)
    ring: Mapped[list[str]] = mapped_column(JSONType, nullable=False, default=list)
    prediction: Mapped[dict[str, Any]] = mapped_column(JSONType, nullable=False, default=dict)
    predicted_seconds: Mapped[float] = mapped_column(Float, nullable=False)
    wan_gb: Mapped[float] = mapped_column(Float, nullable=False)
    total: Mapped[Decimal] = mapped_column(MONEY, nullable=False)
    currency: Mapped[str] = mapped_column(String(3), nullable=False)
    lines: Mapped[list[dict[str, Any]]] = mapped_column(JSONType, nullable=False)
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    state: Mapped[str] = mapped_column(String(16), nullable=False, default="open")  # open|accepted|superseded


class ContractRow(Tracked, Base):
    __tablename__ = "contracts"

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_uid)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    job: Mapped[str] = mapped_column(String(KEY_LEN), nullable=False)
    quote_id: Mapped[str] = mapped_column(ForeignKey("quotes.id", ondelete="RESTRICT"), nullable=False)
    account_id: Mapped[str] = mapped_column(String(36), nullable=False, index=True)
    quoted_total: Mapped[Decimal] = mapped_column(MONEY, nullable=False)
    currency: Mapped[str] = mapped_column(String(3), nullable=False)
    state: Mapped[str] = mapped_column(String(16), nullable=False, default="active")


class LedgerEntry(Tracked, Base):
    """Append-only: corrections are new entries (credits), never updates."""

    __tablename__ = "ledger_entries"

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_uid)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)
    contract_id: Mapped[str] = mapped_column(ForeignKey("contracts.id", ondelete="RESTRICT"), index=True)
    job: Mapped[str] = mapped_column(String(KEY_LEN), nullable=False, index=True)
    account_id: Mapped[str] = mapped_column(String(36), nullable=False, index=True)
    provider: Mapped[str] = mapped_column(String(63), nullable=False)
    provider_account_id: Mapped[str] = mapped_column(String(36), nullable=False, index=True)
    cluster: Mapped[str] = mapped_column(String(63), nullable=False)
    item: Mapped[str] = mapped_column(String(16), nullable=False)  # gpu-hours | egress
    quantity: Mapped[Decimal] = mapped_column(MONEY, nullable=False)
    unit_price: Mapped[Decimal] = mapped_column(MONEY, nullable=False)
    amount: Mapped[Decimal] = mapped_column(MONEY, nullable=False)
    currency: Mapped[str] = mapped_column(String(3), nullable=False)
    kind: Mapped[str] = mapped_column(String(16), nullable=False, default="charge")  # charge | credit
    note: Mapped[str | None] = mapped_column(String(200), nullable=True)
