"""Tables: teams, their members, quotas."""

from __future__ import annotations

from sqlalchemy import ForeignKey, String
from sqlalchemy.orm import Mapped, mapped_column

from cpn.core.db import Base, Tracked
from cpn.core.store import ResourceRow


class TeamRow(ResourceRow, Base):
    __tablename__ = "teams"


class TeamMemberRow(Tracked, Base):
    """One member of a team (spec.members, kept as rows so that "the teams of an account" is one query
    and the quotas binding it can be locked with it)."""

    __tablename__ = "team_members"

    team_id: Mapped[str] = mapped_column(ForeignKey("teams.id", ondelete="CASCADE"), primary_key=True)
    account: Mapped[str] = mapped_column(String(63), primary_key=True, index=True)


class QuotaRow(ResourceRow, Base):
    __tablename__ = "quotas"

    account: Mapped[str | None] = mapped_column(String(63), nullable=True, index=True)  # spec.account
    team: Mapped[str | None] = mapped_column(String(63), nullable=True, index=True)  # spec.team
