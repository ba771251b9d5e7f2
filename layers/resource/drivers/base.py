"""The driver interface. A site agent hands each sub-task it claims to its cluster's driver, which
starts the workers (local processes, or an Indexed Job on the site's own Kubernetes), reports their
state, stops them, finds them again after an agent restart and reads their output.

Launches are idempotent: the attempt contract's (job, attempt, sub-task) names the launch, and
launching it again returns the first one. Drivers run at the site, never in the API server.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from cpn.core.errors import CPNError
from cpn.runtime.contract import AttemptSpec


class DriverError(CPNError):
    status, code = 502, "driver_error"


@dataclass
class SubtaskState:
    phase: str  # Launching | Running | Succeeded | Failed | Cancelled | Lost
    message: str = ""
    exit_codes: dict[str, Any] = field(default_factory=dict)
    pids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class LogLine:
    rank: int
    line: str


class SiteDriver(Protocol):
    name: str

    async def launch(self, spec: AttemptSpec) -> dict[str, Any]:
        """Start the sub-task's workers (idempotently); return a JSON handle."""
        ...

    async def poll(self, spec: AttemptSpec, handle: dict[str, Any]) -> SubtaskState: ...

    async def cancel(self, spec: AttemptSpec, handle: dict[str, Any]) -> None: ...

    async def adopt(self) -> list[tuple[AttemptSpec, dict[str, Any]]]:
        """The launches this driver made before (a restarted agent re-adopts them)."""
        ...

    async def logs(self, spec: AttemptSpec, handle: dict[str, Any],
                   cursor: dict[str, Any]) -> tuple[list[LogLine], dict[str, Any]]:
        """Output lines since `cursor`, and the cursor to pass next time."""
        ...
