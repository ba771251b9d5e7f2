"""Tables of the inventory: sites, clusters, links."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import DateTime, ForeignKey, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from cpn.core.db import Base
from cpn.core.store import ResourceRow


class SiteRow(ResourceRow, Base):
    __tablename__ = "sites"

    region: Mapped[str] = mapped_column(String(63), index=True, nullable=False)


class ClusterRow(ResourceRow, Base):
    __tablename__ = "clusters"

    site_id: Mapped[str] = mapped_column(ForeignKey("sites.id", ondelete="RESTRICT"), index=True)
    driver: Mapped[str] = mapped_column(String(16), nullable=False)
    capacity_gpus: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    allocatable_gpus: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    last_heartbeat_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class LinkRow(ResourceRow, Base):
    __tablename__ = "links"

    site_a_id: Mapped[str] = mapped_column(ForeignKey("sites.id", ondelete="RESTRICT"), index=True)
    site_b_id: Mapped[str] = mapped_column(ForeignKey("sites.id", ondelete="RESTRICT"), index=True)
    pair_key: Mapped[str] = mapped_column(String(130), unique=True, nullable=False)
