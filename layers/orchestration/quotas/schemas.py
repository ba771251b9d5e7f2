"""Wire schemas of Team and Quota."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from cpn.core.manifest import CamelModel, ManifestBase, Money, Name

MEMBERS_MAX = 1000
LIMIT_MAX = 10**6  # GPUs or jobs: far above any network's
GPU_HOURS_MAX = 1e9
RESOURCES = ("maxGpus", "maxJobs", "gpuHoursPerMonth", "spendPerMonth")


class TeamSpec(CamelModel):
    members: list[Name] = Field(default_factory=list, max_length=MEMBERS_MAX,
                                description="Account names; a quota bound to the team counts all of their jobs")

    @field_validator("members")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        seen = {m for m in v if v.count(m) > 1}
        if seen:
            raise ValueError(f"{sorted(seen)[0]!r} is listed twice: list each account once")
        return v


class TeamStatus(CamelModel):
    quotas: list[str] = Field(default_factory=list, description="The quotas bound to the team")


class TeamManifest(ManifestBase):
    kind: Literal["Team"] = "Team"
    spec: TeamSpec
    # read-only, ignored on input as every kind's status is (cpn/core/store.py): typed loosely here so that the
    # published request schema does not promise to check it; TeamStatus documents its shape
    status: dict[str, Any] | None = None


class QuotaSpec(CamelModel):
    """Limits for one account (spec.account) or one team (spec.team: all its members' jobs together).
    Unset limits do not limit. GPUs and jobs are what is held now; GPU-hours and spend count the calendar
    month (UTC): what was metered this month plus the rest of the accepted quotes of active jobs."""

    model_config = {**CamelModel.model_config, "json_schema_extra": {  # what QuotaStore.prepare checks, published
        "oneOf": [{"required": ["account"]}, {"required": ["team"]}],
        "anyOf": [{"required": [r]} for r in RESOURCES]}}

    account: Name | None = Field(default=None, description="The account bound (give this or team)")
    team: Name | None = Field(default=None, description="The team bound (give this or account)")
    max_gpus: int | None = Field(default=None, ge=0, le=LIMIT_MAX, description="GPUs leased at once")
    max_jobs: int | None = Field(default=None, ge=0, le=LIMIT_MAX,
                                 description="Jobs active at once (Accepted, Reserved, Launching, Running)")
    gpu_hours_per_month: float | None = Field(default=None, ge=0, le=GPU_HOURS_MAX, allow_inf_nan=False,
                                              description="GPU-hours in a calendar month (UTC)")
    spend_per_month: Money | None = Field(default=None, description="Money in a calendar month (UTC), in currency")
    currency: str = Field(default="USD", pattern=r"^[A-Z]{3}$",
                          description="What spendPerMonth counts: charges and quotes in this currency")


class QuotaUsed(CamelModel):
    gpus: int = Field(description="GPUs leased now")
    jobs: int = Field(description="Jobs active now")
    gpu_hours: str = Field(description="GPU-hours this month: metered, plus the rest of active jobs' quotes")
    spend: str = Field(description="Spend this month in currency: charged, plus the rest of active jobs' quotes")


class QuotaStatus(CamelModel):
    bound_to: str = Field(description="account/NAME or team/NAME")
    accounts: list[str] = Field(default_factory=list, description="The accounts whose jobs count")
    month: str = Field(description="The calendar month GPU-hours and spend count (YYYY-MM, UTC)")
    used: QuotaUsed
    used_of_limit: dict[str, str] = Field(default_factory=dict, description=(
        "What `cpnctl get quotas` shows: \"used/limit\" for each limit the quota sets (gpus, jobs, gpuHours, spend)"))


class QuotaManifest(ManifestBase):
    kind: Literal["Quota"] = "Quota"
    spec: QuotaSpec
    status: dict[str, Any] | None = None  # read-only (see TeamManifest.status); QuotaStatus documents its shape
