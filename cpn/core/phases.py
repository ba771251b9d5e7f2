"""The phases of a TrainingJob and of its sub-tasks: one enum each, shared by the server, the agents
and the CLI (the wire carries their string values)."""

from __future__ import annotations

from enum import StrEnum


class JobPhase(StrEnum):
    PENDING = "Pending"
    PROFILING = "Profiling"  # spec.profile: a short timed run at one site before the job is quoted
    QUOTED = "Quoted"
    ACCEPTED = "Accepted"
    RESERVED = "Reserved"
    LAUNCHING = "Launching"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    CANCELLED = "Cancelled"

    @property
    def terminal(self) -> bool:
        return self in JOB_TERMINAL


class SubtaskPhase(StrEnum):
    PENDING = "Pending"
    LAUNCHING = "Launching"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    CANCELLED = "Cancelled"
    LOST = "Lost"


JOB_TERMINAL = frozenset({JobPhase.SUCCEEDED, JobPhase.FAILED, JobPhase.CANCELLED})
JOB_DRAFT = frozenset({JobPhase.PENDING, JobPhase.QUOTED})  # before a quote is accepted: the spec may change
JOB_ACTIVE = (JobPhase.RESERVED, JobPhase.LAUNCHING, JobPhase.RUNNING)  # the reconciler drives these
PROFILE_ATTEMPT = 0  # the attempt number of a job's profile run (spec.profile); real attempts count from 1
SUBTASK_DONE = frozenset({SubtaskPhase.SUCCEEDED, SubtaskPhase.FAILED, SubtaskPhase.CANCELLED, SubtaskPhase.LOST})
SUBTASK_FAILED = frozenset({SubtaskPhase.FAILED, SubtaskPhase.LOST})

# Exit-code keys of a sub-task whose workers never started: no agent claimed it in time, or its site
# could not launch it. The world of that attempt never met, so no strategy can go on without it.
NEVER_CLAIMED, NOT_LAUNCHED = "claim", "launch"
NEVER_STARTED = frozenset({NEVER_CLAIMED, NOT_LAUNCHED})
