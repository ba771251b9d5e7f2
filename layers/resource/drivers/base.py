"""The driver interface. A driver launches the sub-tasks of one job attempt that sit on clusters
of its kind, reports their state, cancels them and serves their logs. Launches are idempotent:
the key job/sub-task/attempt names the launch, and launching it again returns the first one."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from cpn.core.errors import CPNError


class DriverError(CPNError):
    status, code = 502, "driver_error"


@dataclass(frozen=True)
class SubtaskLaunch:
    subtask: str
    cluster: str
    site_index: int  # index of the sub-task's site in the topology's ring
    ranks: int
    key: str  # job/subtask/attempt
    cluster_spec: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class JobLaunch:
    """One attempt of a job: the runtime's inputs plus where to report."""

    job: str
    attempt: int
    topology: dict[str, Any]  # cpn.runtime.topology.Topology as JSON
    train: dict[str, Any]  # cpn.runtime.config.TrainConfig as JSON
    master_port: int
    metrics_url: str | None
    metrics_token: str | None
    run_root: Path
    elastic: bool
    wan_emulation: bool = False
    image: str = "cpn:latest"


@dataclass
class SubtaskState:
    phase: str  # Launching | Running | Succeeded | Failed | Cancelled | Lost
    message: str = ""
    exit_codes: dict[str, Any] = field(default_factory=dict)
    pids: list[int] = field(default_factory=list)


class SiteDriver(Protocol):
    name: str

    async def launch(self, job: JobLaunch, subtasks: list[SubtaskLaunch]) -> dict[str, dict[str, Any]]:
        """Start the sub-tasks (idempotently); return a handle per sub-task to store."""
        ...

    async def poll(self, job: JobLaunch, handles: dict[str, dict[str, Any]]) -> dict[str, SubtaskState]: ...

    async def cancel(self, job: JobLaunch, handles: dict[str, dict[str, Any]]) -> None: ...

    def logs(self, handle: dict[str, Any], follow: bool = False) -> AsyncIterator[str]: ...
