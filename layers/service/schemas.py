"""Wire schemas of the trade: TrainingJob, quotes, accept, invoices."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, WithJsonSchema, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from cpn.core import errors
from cpn.core.manifest import CamelModel, ManifestBase, Money
from cpn.runtime import presets
from cpn.runtime.config import (
    PS_STRATEGIES,
    SHARDABLE_STRATEGIES,
    STRATEGIES,
    UNSHARDABLE_REASONS,
    StrategyConfig,
)
from layers.resource.schemas import IMAGE_RE  # an OCI image reference

Strategy = Literal.__getitem__(("auto", *STRATEGIES))  # the runtime's strategies (one source) and "auto"
LAYERS_MAX = 1024  # a model's units: far above any transformer's blocks; the planner's stage cuts grow with them
OBJECTIVE_MAX = 1e6  # weights above overflow the planner's scores (1e308 x a cost is inf, inf x 0 NaN)
DURATION_RE = re.compile(r"^(\d+(?:\.\d+)?)(s|m|h|d)$")
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}

# Named model sizes (one table, cpn/runtime/presets.py): every one is a model the runtime builds and
# trains, from CPN's CPU-sized byte LMs to the published Llama shapes (and the names earlier releases
# priced, aliases of those).
MODEL_PRESETS: dict[str, dict[str, int]] = presets.shapes()
RUNNABLE_PRESETS = frozenset(presets.PRESETS)  # all of them: nothing is priced for reference only
# a custom shape of the built-in model: spec.model's keys (presets.CUSTOM_KEYS), the ones it must give
SHAPE_KEYS = tuple(presets.CUSTOM_KEYS)
SHAPE_REQUIRED = ("layers", "hidden", "heads", "vocab", "seqLen")
_SHAPE_ONLY = ("heads", "kvHeads", "ffnHidden", "vocab", "tieEmbeddings", "ropeTheta")  # no code's description has them


# what an unset spec.backupWorkers runs with: the runtime's default (cpn/runtime/config.py, one source)
BACKUP_WORKERS = int(StrategyConfig.model_fields["backup_workers"].default)


class ModelSpec(CamelModel):
    """CPN's built-in model by ``preset`` name or by its shape (``layers, hidden, heads, vocab, seqLen``
    and optionally ``kvHeads, ffnHidden, tieEmbeddings, ropeTheta``: a Llama-style decoder), or, with
    spec.code, the user's own model described by ``parameters`` (and ``layers, hidden, seqLen``)."""

    model_config = {**CamelModel.model_config, "json_schema_extra": {  # what _complete checks, published
        "anyOf": [{"required": ["preset"]}, {"required": ["parameters"]}, {"required": list(SHAPE_REQUIRED)}]}}

    preset: str | None = Field(default=None, json_schema_extra={"enum": [*MODEL_PRESETS, None]})
    parameters: int | None = Field(default=None, gt=0, description=(
        "With spec.code: your model's parameter count (CPN counts a preset's or a shape's itself)"))
    layers: int | None = Field(default=None, gt=0, le=LAYERS_MAX, description=(
        "A transformer's blocks; with spec.code and the pipeline strategy, the nn.Sequential's children (the "
        "units it is cut between)"))
    hidden: int | None = Field(default=None, gt=0, description=(
        "A transformer's width; with spec.code and the pipeline strategy, the width of the activation a cut "
        "carries (hidden x seqLen values per unit)"))
    heads: int | None = Field(default=None, gt=0, description="The built-in model's attention heads")
    kv_heads: int | None = Field(default=None, gt=0, description=(
        "Key/value heads (grouped-query attention; heads must be a multiple); unset: heads"))
    ffn_hidden: int | None = Field(default=None, gt=0, description=(
        "The SwiGLU MLP's width; unset: Llama's 8/3 x hidden rounded up to 256"))
    vocab: int | None = Field(default=None, gt=0, description="The built-in model's vocabulary size")
    tie_embeddings: bool | None = Field(default=None, description="Share the input and output embedding; unset: no")
    rope_theta: float | None = Field(default=None, gt=0, description="Rotary embeddings' base; unset: 10000")
    seq_len: int | None = Field(default=None, gt=0)
    flops_per_unit: float | None = Field(default=None, gt=0, le=1e18, description=(
        "FLOPs one unit (token, sample …) costs in training, forward and backward; default 6 × parameters"))
    bytes_per_unit: float | None = Field(default=None, gt=0, le=1e12, description=(
        "Activation memory one unit holds during training, in bytes; with seqLen units per sequence it "
        "sizes the GPU memory a worker needs (default: a transformer's 34 × hidden × layers)"))

    @model_validator(mode="before")
    @classmethod
    def _shape(cls, data: Any) -> Any:
        """A custom shape is built by the runtime: checked here as the runtime will check it, the error
        at the key to fix (spec.model.heads …)."""
        if not isinstance(data, dict) or data.get("preset") is not None or not _is_shape(data):
            return data
        if data.get("parameters") is not None:
            raise _shape_error("parameters", data, "a shape's parameters are counted by CPN: drop "
                               "spec.model.parameters (it describes your own code, with spec.code)")
        missing = [k for k in SHAPE_REQUIRED if data.get(k) is None]
        if missing:
            raise _shape_error(missing[0], data, f"is missing: CPN's built-in model is built from its shape, "
                               f"{', '.join(SHAPE_REQUIRED)} (kvHeads and ffnHidden optional); add {missing[0]}, "
                               "or name a preset")
        try:
            presets.resolve({k: data[k] for k in SHAPE_KEYS if data.get(k) is not None})
        except ValueError as exc:
            message = str(exc)
            key = next((k for k in sorted(SHAPE_KEYS, key=message.find) if k in message), "layers")
            raise _shape_error(key, data, message) from exc
        return data

    @model_validator(mode="after")
    def _complete(self) -> ModelSpec:
        if self.preset is not None:
            if self.preset not in MODEL_PRESETS:
                raise ValueError(f"unknown model preset {self.preset!r}; valid presets: {', '.join(MODEL_PRESETS)}, "
                                 f"or give a shape {{{', '.join(SHAPE_REQUIRED)}}}")
        elif self.parameters is None and not self.is_shape:
            raise ValueError(f"give a preset, or the built-in model's shape {{{', '.join(SHAPE_REQUIRED)}}}, or "
                             "with spec.code parameters (your model's parameter count)")
        return self

    @property
    def is_shape(self) -> bool:
        """A custom shape of CPN's built-in model (not a preset, not a user's code)."""
        return self.preset is None and self.heads is not None

    @property
    def runnable(self) -> bool:
        """Whether CPN's runtime builds this model: a preset or a shape (a user's code builds its own)."""
        return self.preset in RUNNABLE_PRESETS or self.is_shape

    def runtime_model(self) -> str | dict[str, Any]:
        """What the runtime builds (TrainConfig.model): the preset's name, or the shape's keys."""
        if self.preset is not None:
            return self.preset
        return {k: v for k, v in self.model_dump(by_alias=True).items() if k in SHAPE_KEYS and v is not None}

    def config(self) -> presets.ModelConfig | None:
        """The built-in model's configuration (None: a user's code)."""
        if self.preset is not None:
            return presets.PRESETS[self.preset]
        return presets.resolve(self.runtime_model()) if self.is_shape else None

    def shape(self) -> dict[str, Any]:
        cfg = self.config()
        if self.preset:
            return {**MODEL_PRESETS[self.preset], "vocab": cfg.vocab_size if cfg else 0}
        if cfg is not None:
            return {**presets.shape_of(cfg, self.seq_len), "vocab": cfg.vocab_size}
        # parameters alone (a user's own model, spec.code): 6 FLOPs per parameter per unit, no attention
        # term, unless the user states flopsPerUnit (and bytesPerUnit for the memory check)
        return {"parameters": self.parameters, "layers": self.layers or 1, "hidden": self.hidden or 1,
                "seqLen": self.seq_len or 1, "flopsPerUnit": self.flops_per_unit, "bytesPerUnit": self.bytes_per_unit}


def _is_shape(data: dict[str, Any]) -> bool:
    """A model written as the built-in model's shape: a key only shapes have, or no parameters."""
    return any(data.get(k) is not None for k in _SHAPE_ONLY) or data.get("parameters") is None and any(
        data.get(k) is not None for k in SHAPE_KEYS)


def _shape_error(key: str, data: dict[str, Any], message: str) -> ValidationError:
    return ValidationError.from_exception_data("ModelSpec", [InitErrorDetails(
        type=PydanticCustomError("model_shape", message), loc=(key,), input=data.get(key))])


def _range_only(what: str, example: str) -> Any:
    """A bare number where a range is expected gets an explanation instead of pydantic's type error."""

    def check(cls: type, v: Any) -> Any:
        if isinstance(v, int | float) and not isinstance(v, bool):
            n = int(v)
            raise ValueError(f"{what} is a range, not a number: write `{example.format(n=n)}` for exactly {n}, "
                             f"or give only min (at least) or max (at most)")
        return v

    return model_validator(mode="before")(classmethod(check))  # type: ignore[arg-type]


class GpuRequest(CamelModel):
    min: int = Field(default=1, ge=1)
    max: int | None = Field(default=None, ge=1)
    models: list[str] = Field(default_factory=list)

    _number = _range_only("gpus", "gpus: {{min: {n}, max: {n}}}")


class SiteRequest(CamelModel):
    min: int = Field(default=1, ge=1)
    max: int | None = Field(default=None, ge=1)

    _number = _range_only("sites", "sites: {{min: {n}, max: {n}}}")


class PlacementRequest(CamelModel):
    regions: list[str] = Field(default_factory=list)
    sites: list[str] = Field(default_factory=list)
    exclude_sites: list[str] = Field(default_factory=list)


class ObjectiveSpec(CamelModel):
    """Relative weights of cost and time in choosing the balanced quote (only their ratio matters)."""

    cost: float = Field(default=0.5, ge=0, le=OBJECTIVE_MAX, allow_inf_nan=False)
    time: float = Field(default=0.5, ge=0, le=OBJECTIVE_MAX, allow_inf_nan=False)


class ParallelismSpec(CamelModel):
    """How the model is split: ``pipelineStages`` contiguous stages, one per site (the pipeline
    strategy), times ``dataReplicas`` copies of that pipeline; whether each site's ranks shard the model
    (``shard``) and recompute activations (``activationCheckpointing``). Unset: the planner chooses."""

    pipeline_stages: int | None = Field(default=None, ge=2, le=64, description=(
        "Cut the model into exactly this many pipeline stages, one per site (strategy pipeline)"))
    data_replicas: int = Field(default=1, ge=1, le=64, description=(
        "Replicas of the whole pipeline, each on its own sites (dataReplicas x stages sites), each training "
        "1/dataReplicas of every step's sequences; a stage's replicas average every innerSteps steps "
        "(strategy pipeline or auto; with spec.code, spec.model.layers and hidden describe the cut)"))
    shard: Literal["auto", "none", "site"] = Field(default="auto", description=(
        "site: parameters, gradients and optimizer state sharded over the GPUs of each site (FSDP2), so a model "
        "too big for one GPU trains; none: every GPU holds the whole model; auto: site only where the whole "
        f"model does not fit. Strategies {', '.join(SHARDABLE_STRATEGIES)} run sharded"))
    activation_checkpointing: Literal["auto", "none", "full"] = Field(default="auto", description=(
        "full: every block recomputes its activations in the backward pass (about a third more compute, far "
        "less activation memory); auto: only where activations would not fit"))


ENTRYPOINT_PATTERN = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"
errors.PATTERN_HINTS[ENTRYPOINT_PATTERN] = "module:function inside the bundle (e.g. train:main)"


class CodeSpec(CamelModel):
    """The user's own training code: a bundle packed from ``path`` by ``cpnctl apply`` (which fills in
    ``digest``); the workers call ``entrypoint`` (``module:function``) with ``args`` as ``job.config``."""

    path: str | None = Field(default=None, max_length=4096, description="Local directory cpnctl packs (client side)")
    entrypoint: str = Field(pattern=ENTRYPOINT_PATTERN, max_length=200, description="module:function inside the bundle")
    args: dict[str, Any] = Field(default_factory=dict, description="Free JSON handed to cpn.train's job.config")
    digest: str | None = Field(default=None, pattern=r"^sha256:[0-9a-f]{64}$",
                               description="The uploaded bundle (PUT /api/v1/bundles/{sha256}); cpnctl sets it")


class TrainingJobSpec(CamelModel):
    model: ModelSpec | Annotated[str, WithJsonSchema({"type": "string", "enum": list(MODEL_PRESETS),
                                                       "description": "A preset name"})]
    dataset: str = Field(default="pystdlib", min_length=1, max_length=200)
    tokens: int = Field(gt=0, le=10**15)
    global_batch_tokens: int = Field(default=65536, gt=0)
    strategy: Strategy = "auto"
    # unset (None): the runtime's autotune chooses, as for `cpn train` (docs/runtime-training.md, "Defaults")
    inner_steps: int | None = Field(default=None, ge=1, le=100_000)
    compression: Literal["none", "fp16", "bf16", "int8", "int4", "topk"] | None = None
    overlap: bool | None = None
    staleness: int = Field(default=4, ge=0, le=1000)
    backup_workers: int | None = Field(default=None, ge=0, le=1024, description=(
        "ps_backup: pushes of a step the parameter servers do not wait for (the b slowest of the N workers'; "
        f"dropped, their workers go on with the next step); below the job's workers; unset: {BACKUP_WORKERS}"))
    ps_replicas: int | None = Field(default=None, ge=0, le=16, description=(
        "async_ps, ps_sync, ps_backup: secondaries of each parameter shard, each on another site (the job "
        "then spans at least psReplicas + 1 sites); unset: 0"))
    gpus: GpuRequest = Field(default_factory=GpuRequest)
    sites: SiteRequest = Field(default_factory=SiteRequest)
    placement: PlacementRequest = Field(default_factory=PlacementRequest)
    deadline: str | None = Field(default=None, description="ISO-8601 time or a duration like 90m, 4h, 2d")
    budget: Money | None = None
    max_price_per_gpu_hour: Money | None = Field(default=None, description=(
        "The most a GPU-hour may cost if the job is re-placed after a site is lost; unset: the accepted "
        "quote's dearest GPU-hour (a re-placement that would cost more fails the job instead)"))
    currency: str = Field(default="USD", pattern=r"^[A-Z]{3}$")
    objective: ObjectiveSpec = Field(default_factory=ObjectiveSpec)
    code: CodeSpec | None = Field(default=None, description="The user's own training code (see docs/byo.md)")
    parallelism: ParallelismSpec | None = Field(default=None, description=(
        "Pipeline stages and replicas, sharding and activation checkpointing; unset, CPN shards a model inside "
        "a site or cuts it into stages only when no GPU holds it whole (or a pipeline is predicted faster)"))
    profile: bool = Field(default=False, strict=True, description=(
        "Before quoting, run a short timed profile of the job at one candidate site; the quotes then use the "
        "measured step time (basis: profiled). See docs/byo.md"))
    image: str | None = Field(default=None, max_length=255, json_schema_extra={"pattern": IMAGE_RE}, description=(
        "Container image the workers run in on Kubernetes clusters (it needs Python with CPN installed; the "
        "code bundle is fetched into it at start); default: the site agent's image. Local sites ignore it"))

    @model_validator(mode="before")
    @classmethod
    def _code_size(cls, data: Any) -> Any:
        """Your own code needs its size stated: said at spec.model.parameters, not as a bare 'required'."""
        if not isinstance(data, dict) or data.get("code") is None:
            return data
        model = data.get("model")
        preset = model if isinstance(model, str) else model.get("preset") if isinstance(model, dict) else None
        if preset is not None:
            raise _error_at(("model", "preset"), "code_preset", data, (
                f"{preset!r}: presets describe CPN's built-in models, but with spec.code your code builds its own: "
                "describe it instead with spec.model.parameters (its parameter count), and optionally "
                "flopsPerUnit and bytesPerUnit"))
        if model is None or isinstance(model, dict) and model.get("parameters") is None:
            raise _error_at(("model", "parameters"), "code_size", data, (
                "required with spec.code: CPN cannot price your code without knowing its size. Give the "
                "model's parameter count (e.g. sum(p.numel() for p in model.parameters())); the compute "
                "model counts 6 FLOPs per parameter per unit unless you state spec.model.flopsPerUnit"))
        return data

    @model_validator(mode="before")
    @classmethod
    def _builtin(cls, data: Any) -> Any:
        """Without spec.code CPN builds the model: a preset or a shape, never a bare parameter count."""
        if not isinstance(data, dict) or data.get("code") is not None:
            return data
        model = data.get("model")
        if isinstance(model, dict) and model.get("preset") is None and _is_int(model.get("parameters")):
            raise _error_at(("model", "parameters"), "builtin_parameters", data, (
                "describes your own code (spec.code): without it CPN trains its built-in model, so give a preset "
                f"or the shape CPN builds, {{{', '.join(SHAPE_REQUIRED)}}} (kvHeads, ffnHidden optional), and CPN "
                "counts its parameters"))
        return data

    @model_validator(mode="before")
    @classmethod
    def _shard(cls, data: Any) -> Any:
        """shard site and activation checkpointing: CPN's built-in model only, and (shard) the strategies
        that run sharded (cpn.runtime.config.SHARDABLE_STRATEGIES, one source)."""
        if not isinstance(data, dict) or not isinstance(data.get("parallelism"), dict):
            return data
        parallelism, strategy = data["parallelism"], data.get("strategy", "auto")
        for key, value in (("shard", "site"), ("activationCheckpointing", "full")):
            if parallelism.get(key) == value and data.get("code") is not None:
                raise _error_at(("parallelism", key), "shard_code", data, (
                    f"{value}: CPN shards and checkpoints its built-in model; your code (spec.code) builds and "
                    f"holds its own model: drop {key}, or set it to none"))
        if parallelism.get("shard") != "site":
            return data
        if strategy in UNSHARDABLE_REASONS:
            raise _error_at(("parallelism", "shard"), "shard_strategy", data, (
                f"site with strategy {strategy!r}: {UNSHARDABLE_REASONS[strategy]}; use strategy "
                f"{', '.join(SHARDABLE_STRATEGIES)} (or auto), or set shard to none or auto"))
        if parallelism.get("pipelineStages") is not None:
            raise _error_at(("parallelism", "shard"), "shard_strategy", data, (
                f"site with pipelineStages: {UNSHARDABLE_REASONS['pipeline']}; drop pipelineStages, or set shard "
                "to none or auto"))
        return data

    @model_validator(mode="before")
    @classmethod
    def _stages(cls, data: Any) -> Any:
        """pipelineStages cuts the model and dataReplicas copies the cut pipeline: only with strategy pipeline
        (or auto, which they then mean)."""
        if not isinstance(data, dict) or not isinstance(data.get("parallelism"), dict):
            return data
        stages, strategy = data["parallelism"].get("pipelineStages"), data.get("strategy", "auto")
        if stages is not None and strategy not in ("auto", "pipeline"):
            raise _error_at(("parallelism", "pipelineStages"), "stages_strategy", data, (
                f"{stages} pipeline stages with strategy {strategy!r}: stages are for the pipeline strategy; "
                "set strategy to pipeline (or auto), or drop pipelineStages"))
        replicas = data["parallelism"].get("dataReplicas")
        if isinstance(replicas, int) and replicas > 1 and strategy not in ("auto", "pipeline"):
            raise _error_at(("parallelism", "dataReplicas"), "replicas_strategy", data, (
                f"{replicas} replicas of a pipeline with strategy {strategy!r}: dataReplicas copies the pipeline "
                "strategy's stages; set strategy to pipeline (or auto), or drop dataReplicas (a data-parallel "
                "strategy already uses every GPU as a replica)"))
        return data

    @model_validator(mode="before")
    @classmethod
    def _code_stages(cls, data: Any) -> Any:
        """A pipeline of your own code (strategy pipeline, pipelineStages, dataReplicas > 1) cuts its
        nn.Sequential between children: spec.model.layers counts them (at least the stages asked, and
        2), spec.model.hidden is what one unit sends across a cut."""
        if not isinstance(data, dict) or data.get("code") is None or not isinstance(data.get("model"), dict):
            return data
        model, parallelism = data["model"], data.get("parallelism")
        parallelism = parallelism if isinstance(parallelism, dict) else {}
        stages, replicas = parallelism.get("pipelineStages"), parallelism.get("dataReplicas")
        stages = stages if _is_int(stages) else None
        if model.get("parameters") is None or not (data.get("strategy") == "pipeline" or stages is not None
                                                   or _is_int(replicas) and replicas > 1):
            return data
        least, layers = max(2, stages or 2), model.get("layers")
        cut = ("the pipeline cuts your code's nn.Sequential between its children (stage 0 feeds the inputs, "
               "the last stage computes the loss)")
        if layers is None or _is_int(layers) and layers < least:
            given, do = ("is missing", "add") if layers is None else (f"is {layers}", "set")
            raise _error_at(("model", "layers"), "code_layers", data, (
                f"{given}: {cut}, so CPN needs their number to cut and price it: {do} spec.model.layers to the "
                f"number of the Sequential's children (len(model)), at least {least}"
                + (f" for {stages} pipeline stages" if stages else "") + ", and spec.model.hidden"))
        if model.get("hidden") is None:
            raise _error_at(("model", "hidden"), "code_hidden", data, (
                f"is missing: {cut}, and its activations cross the WAN at every cut: add spec.model.hidden, the "
                "width of the activation a cut carries (CPN prices hidden x seqLen x 4 bytes per unit of the batch "
                "each way; spec.model.seqLen defaults to 1, set it for a sequence model)"))
        return data

    @model_validator(mode="before")
    @classmethod
    def _ps_knobs(cls, data: Any) -> Any:
        """backupWorkers and psReplicas: only with the strategies that read them, and within the GPUs and
        sites the job allows (a placement needs more workers than backups, a site per shard copy)."""
        if not isinstance(data, dict):
            return data
        strategy = data.get("strategy", "auto")
        for key, names in (("backupWorkers", ("ps_backup",)), ("psReplicas", PS_STRATEGIES)):
            if data.get(key) is not None and strategy not in names:
                raise _error_at((key,), "ps_strategy", data, (
                    f"{key} is for strategy {' or '.join(names)}, not {strategy!r}: set strategy to "
                    f"{names[-1]}, or drop {key}"))
        backups, most = _count(data.get("backupWorkers"), BACKUP_WORKERS), _at_most(data, "gpus")
        if strategy == "ps_backup" and most is not None and backups >= most:
            unset = " (unset: the default)" if data.get("backupWorkers") is None else ""
            raise _error_at(("backupWorkers",), "backup_workers", data, (
                f"{backups} backup workers{unset} with at most {most} GPUs (spec.gpus.max): the servers wait for "
                f"the first N−b pushes of N workers, so b must be below the job's workers; use at most "
                f"{most - 1}, or raise spec.gpus.max"))
        replicas, sites = data.get("psReplicas"), _at_most(data, "sites")
        if sites is not None and isinstance(replicas, int) and replicas >= sites:
            raise _error_at(("psReplicas",), "ps_replicas", data, (
                f"{replicas} replicas of each parameter shard need {replicas + 1} sites (a primary and each "
                f"secondary on a site of its own), spec.sites.max is {sites}: use at most {sites - 1}, or raise "
                "spec.sites.max"))
        return data

    @model_validator(mode="after")
    def _code(self) -> TrainingJobSpec:
        if self.code is not None and self.code.digest is None:
            raise ValueError("spec.code.digest is missing: `cpnctl apply -f job.yaml` packs spec.code.path, "
                             "uploads it and fills in the digest")
        return self

    @field_validator("image")
    @classmethod
    def _image(cls, v: str | None) -> str | None:
        if v is not None and not re.match(IMAGE_RE, v):
            raise ValueError(f"{v[:80]!r} is not an image reference: write [registry[:port]/]name[:tag][@sha256:digest], "
                             "e.g. ghcr.io/you/trainer:v1")
        return v

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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count(value: Any, default: int) -> int:
    """A knob's value as the before-validator sees it: its default when unset, 0 when not yet a number
    (field validation then says what is wrong with it)."""
    if value is None:
        return default
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _at_most(data: dict[str, Any], key: str) -> int | None:
    """spec.<key>.max as written (None when unset or not yet valid)."""
    limit = data.get(key)
    value = limit.get("max") if isinstance(limit, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def strategy_knobs(spec: TrainingJobSpec, strategy: str) -> dict[str, int]:
    """The parameter-server knobs `strategy` runs with (TrainConfig.strategy's names): backup workers
    for ps_backup, shard replicas for the three PS strategies; the runtime's defaults when unset."""
    knobs: dict[str, int] = {}
    if strategy == "ps_backup":
        knobs["backup_workers"] = BACKUP_WORKERS if spec.backup_workers is None else spec.backup_workers
    if strategy in PS_STRATEGIES and spec.ps_replicas:
        knobs["ps_replicas"] = spec.ps_replicas
    return knobs


def _error_at(loc: tuple[str, ...], kind: str, data: Any, message: str) -> ValidationError:
    """A validation error at `loc` inside the validated object (raised from a model validator, pydantic
    keeps the location, so the API names the user's field)."""
    return ValidationError.from_exception_data("TrainingJobSpec", [InitErrorDetails(
        type=PydanticCustomError(kind, message), loc=loc, input=data.get(loc[0]))])


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
    stage: int | None = Field(default=None, description="The pipeline stage these GPUs run (null: data parallel)")
    region: str | None = Field(default=None, description="The site's region")


class PriceLine(CamelModel):
    provider: str
    cluster: str
    item: Literal["gpu-hours", "egress", "data-transfer"]
    quantity: Money
    unit_price: Money
    amount: Money


class Price(CamelModel):
    total: Money
    currency: str
    lines: list[PriceLine]


QuoteBasis = Literal["modelled", "profiled"]


class ProfileFigure(CamelModel):
    """What a profiled quote's time rests on: the job's own timed steps at one site (spec.profile)."""

    site: str
    cluster: str
    gpus: int
    gpu_model: str
    measured_step_seconds: float = Field(description="Measured seconds per step of the profile run")
    units_per_step: int
    units_per_second: float
    startup_seconds: float | None = Field(default=None, description=(
        "The profile run besides its timed steps (claim to end): a floor for the quote's start-up"))
    steps: int = Field(description="Steps the quoted placement runs")
    step_seconds: float = Field(description="Predicted seconds per step on the quoted placement")


class QuoteModelFactors(CamelModel):
    """What finished runs taught the compute model (GET /api/v1/calibrations; factor 1: nothing yet), and
    the quote's memory plan: what each GPU holds and how (docs/placement.md, "Memory")."""

    step_factor: float
    startup_seconds: float
    memory_gb_per_gpu: float | None = Field(default=None, alias="memoryGBPerGpu", description=(
        "GB the most loaded GPU needs: training state, activations, buffers, the runtime's share"))
    shard: Literal["none", "site"] | None = Field(default=None, description=(
        "site: the model's state sharded over each site's GPUs; none: every GPU holds it whole"))
    activation_checkpointing: Literal["none", "full"] | None = Field(default=None, description=(
        "full: blocks recompute their activations in the backward pass"))


class QuotaCheck(CamelModel):
    """One limit of one quota against one quote: `used` + `requested` must stay within `limit`."""

    quota: str = Field(description="The Quota's name")
    bound_to: str = Field(description="account/NAME or team/NAME")
    resource: Literal["maxGpus", "maxJobs", "gpuHoursPerMonth", "spendPerMonth"]
    unit: str = Field(description="GPUs, jobs, GPU-hours, or the currency of spendPerMonth")
    used: str = Field(description="Decimal text: held now (GPUs, jobs) or counted this month (GPU-hours, spend)")
    requested: str = Field(description="What accepting this quote adds")
    limit: str
    fits: bool


class QuoteQuota(CamelModel):
    """How a quote stands against the quotas that bind the job's account (its own and its teams')."""

    fits: bool = Field(description="Every check fits: accepting it is not refused for a quota")
    checks: list[QuotaCheck]


class QuotePublic(CamelModel):
    id: str
    label: str
    placement: list[PlacementLine]
    strategy: str
    basis: QuoteBasis = Field(default="modelled", description=(
        "modelled: the compute model's estimate; profiled: from the job's own measured step time (spec.profile)"))
    profile: ProfileFigure | None = None
    predicted_seconds: float
    wan_gb: float = Field(alias="wanGB")
    price: Price
    expires_at: datetime
    state: str
    ring: list[str] = Field(default_factory=list, description="The sites in ring order")
    trains: dict[str, Any] | None = Field(default=None, description="What the quoted run trains")
    model: QuoteModelFactors | None = None
    # how the CLI and the portal show it (layers/service/quotes.py views)
    metadata: dict[str, str] = Field(default_factory=dict, description="{name: the label}")
    chosen: str = Field(default="", description="* when this is the job's chosen quote")
    placement_summary: str = ""
    gpus: int = 0
    same_as: str | None = Field(default=None, description="The label of an earlier identical offer")
    recommended: bool = False
    times_cheapest: float = 1.0
    confirm: bool = Field(default=False, description="Accepting it asks for confirmation (far above the cheapest)")
    note: str = ""
    predicted_duration: str = ""
    quota: QuoteQuota | None = Field(default=None, description=(
        "An open quote: how it stands against the quotas binding the job's account (absent: none binds)"))


def ttl(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)
