"""Plain typed values the planner works on (no database, no HTTP): offers, links, requirements, plans."""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal

# the runtime's strategies, one source (pipeline: the model cut into one contiguous stage per site,
# planning/pipeline.py; the others are data parallel; PS_STRATEGIES: parameter servers, one shard per site;
# SHARDABLE_STRATEGIES: those that run with each site's ranks sharding the model, spec.parallelism.shard site)
from cpn.runtime.config import PS_STRATEGIES as PS_STRATEGIES
from cpn.runtime.config import SHARDABLE_STRATEGIES as SHARDABLE_STRATEGIES
from cpn.runtime.config import STRATEGIES as STRATEGIES


@dataclass(frozen=True)
class ClusterOffer:
    """One cluster as the planner sees it: GPUs free right now and what they cost."""

    name: str
    site: str
    region: str
    provider: str
    gpu_model: str
    tflops: float  # peak dense bf16 per GPU
    memory_gb: float
    free_gpus: int
    price_per_gpu_hour: Decimal
    currency: str = "USD"
    intra_node_gbps: float = 600.0
    inter_node_gbps: float = 100.0
    gpus_per_node: int = 8
    driver: str = "kubernetes"  # how the site starts work: start-up time differs (perf.STARTUP_BY_DRIVER)


@dataclass(frozen=True)
class WanLink:
    a: str  # site names
    b: str
    bandwidth_gbps: float
    rtt_ms: float
    price_per_gb: Decimal


@dataclass(frozen=True)
class ModelShape:
    parameters: int
    layers: int
    hidden: int
    seq_len: int
    flops_per_unit: float | None = None  # a user's statement for its own code (spec.model.flopsPerUnit)
    bytes_per_unit: float | None = None  # activation bytes one unit holds (spec.model.bytesPerUnit)
    vocab: int = 0  # the built-in model's vocabulary: its logits' memory (0: not known, not counted)


@dataclass(frozen=True)
class Lesson:
    """What finished runs taught the compute model for one (GPU model, strategy, workload, provider):
    their measured step time over the model's prediction, and their measured start-up time
    (layers/orchestration/lifecycle/learning.py says how runs are weighed)."""

    gpu_model: str
    strategy: str
    workload: str  # see workload_of
    step_factor: float
    startup_seconds: float
    samples: int
    provider: str = ""  # the sites' provider; "" = unscoped (taught before lessons were kept per provider)


@dataclass(frozen=True)
class Learned:
    lessons: tuple[Lesson, ...] = ()

    def lookup(self, gpu_model: str, strategy: str, workload: str, provider: str = "") -> Lesson | None:
        """The provider's own lesson, else the unscoped one: another provider's "H100" (perhaps a CPU
        slot) never prices this provider's."""
        found = {x.provider: x for x in self.lessons if (x.gpu_model, x.strategy, x.workload) == (gpu_model, strategy,
                                                                                                  workload)}
        return found.get(provider) or found.get("")

    def startup(self, gpu_model: str, provider: str = "") -> float | None:
        """Start-up depends on the sites (driver, image, rendezvous), not on the model: any run on this
        GPU model at this provider (or unscoped) says it, weighted by how many runs each lesson holds."""
        runs = [(x.startup_seconds, x.samples) for x in self.lessons
                if x.gpu_model == gpu_model and x.provider in (provider, "") and x.samples > 0]
        total = sum(n for _, n in runs)
        return sum(s * n for s, n in runs) / total if total else None


def workload_of(code_digest: str | None) -> str:
    """What a job runs, as far as its speed goes: ``lm`` (CPN's built-in model) or ``code:<digest>``
    (a user's own code: one bundle's steps say nothing about another's)."""
    return f"code:{code_digest.removeprefix('sha256:')[:16]}" if code_digest else "lm"


@dataclass(frozen=True)
class DataNeed:
    """A job's Dataset as placement sees it: how big, where replicas live, where it may be processed."""

    name: str
    size_gb: float
    replicas: frozenset[str]  # sites holding a replica
    regions: frozenset[str] | None = None  # residency: None anywhere


@dataclass(frozen=True)
class DataMove:
    """One placed site's copy of the dataset: from which replica, how many GB, at what price per GB."""

    source: str | None  # the replica's site (None: no link path, priced at data.DEFAULT_PRICE_PER_GB)
    gb: float
    price_per_gb: Decimal
    seconds: float


@dataclass(frozen=True)
class Profiled:
    """The job's own steps, timed at one site before quoting (spec.profile): ``step_seconds`` per step
    of ``units_per_step`` units on ``gpus`` GPUs of ``gpu_model`` (peak ``tflops`` each, one site whose
    GPUs all-reduce at ``intra_gbps``); ``startup_seconds``: the rest of that run, from the agent's
    claim to its end less the timed steps (None when it was stopped at the cap)."""

    gpu_model: str
    tflops: float
    gpus: int
    intra_gbps: float
    units_per_step: int
    step_seconds: float
    startup_seconds: float | None = None  # the rest of the profile run: claim to end less its timed steps


@dataclass(frozen=True)
class JobRequirements:
    model: ModelShape
    tokens: int
    global_batch_tokens: int
    strategy: str = "auto"  # "auto" or one of STRATEGIES
    inner_steps: int = 100
    compression: str | None = None  # None | "fp16" | "bf16" | "int8"
    overlap: bool = True
    staleness: int = 4
    # ps_backup: the b late pushes of a step the servers drop (jobs/requirements.py fills it from
    # spec.backupWorkers, or the runtime's default when unset)
    backup_workers: int = 0
    ps_replicas: int = 0  # PS strategies: secondaries of each shard, each on another site (spec.psReplicas)
    gpus_min: int = 1
    gpus_max: int | None = None
    gpu_models: frozenset[str] | None = None
    sites_min: int = 1
    sites_max: int | None = None
    regions: frozenset[str] | None = None
    sites: frozenset[str] | None = None
    exclude_sites: frozenset[str] = frozenset()
    deadline_seconds: float | None = None
    budget: Decimal | None = None
    currency: str = "USD"
    workload: str = "lm"  # workload_of(spec.code.digest): learned factors are kept per workload
    # knobs the spec left unset: the runtime's autotune chooses them per placement, and so does perf.predict
    autotuned: frozenset[str] = frozenset()
    learned: Learned = Learned()
    data: DataNeed | None = None  # spec.dataset when it names a Dataset (planning/data.py)
    profiled: Profiled | None = None  # spec.profile, once measured: compute is priced from it (perf.py)
    stages: int | None = None  # spec.parallelism.pipelineStages: a pipeline of exactly this many stages
    # spec.parallelism.dataReplicas: D copies of the pipeline on D disjoint chains of sites (planning/pipeline.py)
    data_replicas: int = 1
    # spec.parallelism.shard and activationCheckpointing: "auto" lets the planner choose per placement
    # (perf.memory_plan); the others are kept as asked
    shard: str = "auto"
    activation_checkpointing: str = "auto"


@dataclass(frozen=True)
class Objective:
    cost: float = 0.5
    time: float = 0.5


@dataclass(frozen=True)
class Assignment:
    cluster: str
    site: str
    gpus: int
    gpu_model: str
    stage: int | None = None  # pipeline stage the cluster's GPUs run (None: data parallel)
    replica: int | None = None  # which of D > 1 replicas of the pipeline (None: one pipeline, or data parallel)


@dataclass
class Prediction:
    """What the compute model predicts for one placement and strategy."""

    strategy: str
    steps: int
    compute_seconds_per_step: float
    comm_seconds_per_step: float  # exposed (not hidden by overlap) communication per step
    step_seconds: float
    total_seconds: float
    wan_bytes: float
    intra_bytes: float
    gpu_seconds_by_cluster: dict[str, float] = field(default_factory=dict)
    egress_bytes_by_link: dict[tuple[str, str], float] = field(default_factory=dict)  # (from_site, to_site)
    est_cost: float = 0.0  # in the offers' currency; the service prices exactly with Decimals
    step_factor: float = 1.0  # learned from finished runs (1: none yet); already in step/total seconds
    startup_seconds: float = 0.0
    data_seconds: float = 0.0  # waiting for the dataset's copies (planning/data.py); already in total_seconds
    data_moves: dict[str, DataMove] = field(default_factory=dict)  # placed site → its copy of the dataset
    bubble_fraction: float = 0.0  # pipeline: the idle share of a step on free links, (P−1)/(M+P−1)
    # pipeline replicas (D > 1): the stages' cross-replica averaging every H steps, per step (already in
    # comm/step seconds) and in WAN bytes over the run (already in wan_bytes); H the averaging period
    replica_seconds_per_step: float = 0.0
    replica_wan_bytes: float = 0.0
    replica_inner_steps: int = 0
    # the memory plan (perf.memory_plan): what the most loaded GPU holds, whether the sites' ranks shard
    # the model ("site") and whether blocks recompute their activations ("full"); fits_memory False: the
    # placement's GPUs cannot hold it (the planner drops such plans)
    memory_gb_per_gpu: float = 0.0
    shard: str = "none"
    activation_checkpointing: str = "none"
    fits_memory: bool = True


@dataclass
class Plan:
    assignments: list[Assignment]
    prediction: Prediction
    objective_value: float
    solver: str
    ring: list[str] = field(default_factory=list)  # site order the topology should use

    @property
    def strategy(self) -> str:
        return self.prediction.strategy
