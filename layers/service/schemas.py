"""Wire schemas of the trade: TrainingJob, quotes, accept, invoices."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from cpn.core.manifest import CamelModel, ManifestBase, Money

Strategy = Literal["auto", "ddp", "hierarchical", "local_sgd", "diloco", "gossip", "ssp", "async_ps"]
DURATION_RE = re.compile(r"^(\d+(?:\.\d+)?)(s|m|h|d)$")
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}

# Named model sizes. The first five are the runtime's presets (byte-level transformer LMs that really
# train here); the large ones are for pricing real clusters.
MODEL_PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"parameters": 132_864, "layers": 2, "hidden": 64, "seqLen": 128},
    "small": {"parameters": 891_648, "layers": 4, "hidden": 128, "seqLen": 128},
    "medium": {"parameters": 4_935_680, "layers": 6, "hidden": 256, "seqLen": 256},
    "base": {"parameters": 25_875_456, "layers": 8, "hidden": 512, "seqLen": 512},
    "large": {"parameters": 100_214_784, "layers": 14, "hidden": 768, "seqLen": 1024},
    "gpt2-xl": {"parameters": 1_500_000_000, "layers": 48, "hidden": 1600, "seqLen": 1024},
    "llama-7b": {"parameters": 6_700_000_000, "layers": 32, "hidden": 4096, "seqLen": 4096},
    "llama-13b": {"parameters": 13_000_000_000, "layers": 40, "hidden": 5120, "seqLen": 4096},
    "llama-70b": {"parameters": 70_000_000_000, "layers": 80, "hidden": 8192, "seqLen": 4096},
}
RUNNABLE_PRESETS = frozenset({"tiny", "small", "medium", "base", "large"})


class ModelSpec(CamelModel):
    preset: str | None = None
    parameters: int | None = Field(default=None, gt=0)
    layers: int | None = Field(default=None, gt=0)
    hidden: int | None = Field(default=None, gt=0)
    seq_len: int | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _complete(self) -> ModelSpec:
        if self.preset is not None:
            if self.preset not in MODEL_PRESETS:
                raise ValueError(f"unknown preset {self.preset!r}; one of {sorted(MODEL_PRESETS)}")
        elif None in (self.parameters, self.layers, self.hidden, self.seq_len):
            raise ValueError("give a preset or all of parameters, layers, hidden, seqLen")
        return self

    def shape(self) -> dict[str, int]:
        if self.preset:
            return dict(MODEL_PRESETS[self.preset])
        return {"parameters": self.parameters, "layers": self.layers, "hidden": self.hidden,  # type: ignore[dict-item]
                "seqLen": self.seq_len}


class GpuRequest(CamelModel):
    min: int = Field(default=1, ge=1)
    max: int | None = Field(default=None, ge=1)
    models: list[str] = Field(default_factory=list)


class SiteRequest(CamelModel):
    min: int = Field(default=1, ge=1)
    max: int | None = Field(default=None, ge=1)


class PlacementRequest(CamelModel):
    regions: list[str] = Field(default_factory=list)
    sites: list[str] = Field(default_factory=list)
    exclude_sites: list[str] = Field(default_factory=list)


class ObjectiveSpec(CamelModel):
    cost: float = Field(default=0.5, ge=0)
    time: float = Field(default=0.5, ge=0)


class TrainingJobSpec(CamelModel):
    model: ModelSpec | str
    dataset: str = Field(default="pystdlib", min_length=1, max_length=200)
    tokens: int = Field(gt=0, le=10**15)
    global_batch_tokens: int = Field(default=65536, gt=0)
    strategy: Strategy = "auto"
    inner_steps: int = Field(default=100, ge=1, le=100_000)
    compression: Literal["none", "fp16", "bf16", "int8"] = "none"
    overlap: bool = True
    staleness: int = Field(default=4, ge=0, le=1000)
    gpus: GpuRequest = Field(default_factory=GpuRequest)
    sites: SiteRequest = Field(default_factory=SiteRequest)
    placement: PlacementRequest = Field(default_factory=PlacementRequest)
    deadline: str | None = Field(default=None, description="ISO-8601 time or a duration like 90m, 4h, 2d")
    budget: Money | None = None
    currency: str = Field(default="USD", pattern=r"^[A-Z]{3}$")
    objective: ObjectiveSpec = Field(default_factory=ObjectiveSpec)

    @field_validator("model", mode="before")
    @classmethod
    def _preset(cls, v: Any) -> Any:
        return {"preset": v} if isinstance(v, str) else v

    @field_validator("deadline")
    @classmethod
    def _deadline(cls, v: str | None) -> str | None:
        if v is not None:
            deadline_seconds(v, datetime.now(UTC))
        return v


def deadline_seconds(value: str, now: datetime) -> float:
    """Seconds from `now` until the deadline (a duration like 4h, or an absolute ISO time)."""
    match = DURATION_RE.match(value.strip())
    if match:
        return float(match.group(1)) * UNITS[match.group(2)]
    try:
        at = datetime.fromisoformat(value)
    except ValueError as exc:
        raise ValueError("deadline must be an ISO-8601 time or a duration like 90m, 4h, 2d") from exc
    if at.tzinfo is None:
        at = at.replace(tzinfo=UTC)
    return (at - now).total_seconds()


class TrainingJobManifest(ManifestBase):
    kind: Literal["TrainingJob"] = "TrainingJob"
    spec: TrainingJobSpec
    status: dict[str, Any] | None = None


class AcceptRequest(CamelModel):
    quote: str = Field(min_length=1, description="A quote id or label: cheapest | fastest | balanced")


class PlacementLine(CamelModel):
    cluster: str
    site: str
    gpus: int
    gpu_model: str


class PriceLine(CamelModel):
    provider: str
    cluster: str
    item: Literal["gpu-hours", "egress"]
    quantity: Money
    unit_price: Money
    amount: Money


class Price(CamelModel):
    total: Money
    currency: str
    lines: list[PriceLine]


class QuotePublic(CamelModel):
    id: str
    label: str
    placement: list[PlacementLine]
    strategy: str
    predicted_seconds: float
    wan_gb: float
    price: Price
    expires_at: datetime
    state: str


def ttl(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)
