"""Who is calling: the authenticated principal every layer function receives."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Role(StrEnum):
    ADMIN = "admin"
    PROVIDER = "provider"
    USER = "user"
    WORKER = "worker"  # a per-job token that may only report metrics for its job


@dataclass(frozen=True)
class Principal:
    account_id: str
    name: str
    role: Role
    token_id: str | None = None
    job: str | None = None  # set for worker tokens
    subtask: str | None = None  # a worker token's sub-task (its attempt, site and ranks); None: minted before 0016

    @property
    def is_admin(self) -> bool:
        return self.role is Role.ADMIN

    def owns(self, owner_id: str | None) -> bool:
        return self.is_admin or owner_id == self.account_id


SYSTEM = Principal(account_id="system", name="system", role=Role.ADMIN)
