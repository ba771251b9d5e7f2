"""The training job's configuration: one typed, nested pydantic model.

The orchestrator hands it to every worker as JSON in ``CPN_TRAIN_CONFIG``; ``cpn train`` builds it
from flags. Validation errors name the field and say how to fix it.
"""

from __future__ import annotations

import json
import os
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

ENV_TRAIN_CONFIG = "CPN_TRAIN_CONFIG"
ENV_METRICS_URL = "CPN_METRICS_URL"
ENV_METRICS_TOKEN = "CPN_METRICS_TOKEN"
ENV_CHECKPOINT_DIR = "CPN_CHECKPOINT_DIR"
ENV_RUN_DIR = "CPN_RUN_DIR"
ENV_REJOIN = "CPN_REJOIN"
FINAL_MODEL = "final_model.pt"  # rank 0 writes the final weights in the run directory; the job runner uploads them

StrategyName = Literal["ddp", "hierarchical", "local_sgd", "diloco", "gossip", "ssp", "async_ps", "ps_sync",
                       "ps_backup", "pipeline"]
STRATEGIES: tuple[str, ...] = get_args(StrategyName)  # one source: the job schema and the planner take these
PS_STRATEGIES = ("async_ps", "ps_sync", "ps_backup")  # the parameter-server family: the servers own the optimiser
Sampling = Literal["shard", "whole"]
# Strategies that drop some workers' gradients by arrival order: a slow worker's own shard would be
# under-represented, so by default their workers draw from the whole training split (StrategyConfig.data_sampling).
WHOLE_SPLIT_STRATEGIES = ("ps_backup",)
Compression = Literal["none", "fp16", "bf16", "int8", "int4", "topk"]
AUTO = "auto"
DeviceKind = Literal["auto", "cuda", "cpu"]
Precision = Literal["auto", "bf16", "fp32"]
Shard = Literal["none", "site"]
ActivationCheckpointing = Literal["none", "full"]
# strategies that run on a model sharded over each site's ranks (shard="site", FSDP2): the site's
# reduce-scatter happens in backward, then ddp/hierarchical all-reduce each gradient shard with the
# same-index rank of every other site, diloco/local_sgd exchange each rank's own shard of the
# pseudo-gradient. One torch-free source: the planner offers only these pairs.
SHARDABLE_STRATEGIES: tuple[str, ...] = ("ddp", "hierarchical", "local_sgd", "diloco")
# why each other strategy is refused with shard="site" (one line each, shown as is)
UNSHARDABLE_REASONS: dict[str, str] = {
    "gossip": "gossip averages whole models with neighbour sites at its own pace",
    "ssp": "ssp exchanges whole models between sites at their own pace",
    "async_ps": "the parameter servers hold the whole model and its optimiser",
    "ps_sync": "the parameter servers hold the whole model and its optimiser",
    "ps_backup": "the parameter servers hold the whole model and its optimiser",
    "pipeline": "a pipeline stage is not sharded over its site's ranks yet",
}


REAL_SHAPE_PARAMETERS = 500_000_000  # from here on a model is a "real shape": `auto` shards it and recomputes


def auto_shard(model: str | dict[str, Any], workers_per_site: int) -> tuple[str, str]:
    """``cpn train``'s ``--shard auto`` / ``--activation-checkpointing auto`` as (shard, activation
    checkpointing): ``site`` + ``full`` for a model of at least :data:`REAL_SHAPE_PARAMETERS` (a Llama
    real shape: its state does not fit one device) when a site has more than one worker, else
    ``none``/``none``. Jobs get the memory-aware choice from the planner instead."""
    from cpn.runtime.presets import resolve

    try:
        real = resolve(model).parameters >= REAL_SHAPE_PARAMETERS
    except ValueError:  # an unknown model: TrainConfig says so
        real = False
    return ("site" if real and workers_per_site > 1 else "none"), ("full" if real else "none")


def trim_shares(tokens: int, shares: list[int], seq_len: int) -> list[int]:
    """A trimmed step's ``tokens`` over the ranks, as tokens per rank: whole sequences in proportion to
    the ranks' ``shares`` of a full step (largest remainder; a rank may get none), and the partial
    sequence that is left to the rank with the fewest."""
    seqs, tail = divmod(tokens, seq_len)
    total = sum(shares)
    raw = [seqs * s / total for s in shares]
    out = [int(r) for r in raw]
    for i in sorted(range(len(out)), key=lambda k: out[k] - raw[k])[: seqs - sum(out)]:
        out[i] += 1
    per_rank = [n * seq_len for n in out]
    if tail:
        per_rank[min(range(len(out)), key=lambda k: out[k])] += tail
    return per_rank


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StrategyConfig(_Model):
    """Knobs of the cross-site strategy; each strategy reads the ones it needs.

    ``None`` (and ``"auto"`` for ``name`` and ``compression``) means *chosen for this job*: before any
    worker starts, :func:`cpn.runtime.autotune.resolve` fills them from the token budget, the sites and
    the link rate (the rule is in ``docs/runtime-training.md``). Explicit values are kept as given.
    """

    name: StrategyName | Literal["auto"] = "ddp"
    inner_steps: int | None = Field(None, ge=1, description="H: inner steps between outer syncs (diloco, local_sgd, gossip; "
                                                        "pipeline replicas: steps between averages, 1 = every step's gradients)")
    outer_lr: float | None = Field(None, gt=0)
    outer_momentum: float | None = Field(None, ge=0, lt=1)
    nesterov: bool | None = None
    compression: Compression | Literal["auto"] = "auto"
    overlap: bool | None = None
    overlap_steps: int | None = Field(
        None, ge=1, description="diloco/local_sgd overlap: inner steps the outer exchange may take before it is merged")
    balance: bool | None = Field(
        None, description="give each site a share of the global batch in proportion to its measured throughput "
                          "(hierarchical, local_sgd, diloco; ddp keeps equal shares)")
    staleness: int = Field(4, ge=0, description="ssp: max steps a site may run ahead of the slowest")
    ps: int = Field(1, ge=1, description="async_ps, ps_sync, ps_backup: number of parameter-server shards")
    backup_workers: int = Field(1, ge=0, description="ps_backup: pushes of a step the servers do not wait for")
    ps_replicas: int = Field(0, ge=0, description="async_ps, ps_sync, ps_backup: secondaries of each shard, each on "
                                                 "another site; the primary forwards every update to them")
    ps_damping: bool = Field(True, description="async_ps: scale a push's learning rate by min(1, N/(1+staleness))")
    grad_hooks: bool = Field(
        True, description="hierarchical: all-reduce gradient buckets as backward produces them (torch DDP's "
                          "overlap); false: one all-reduce after the whole backward pass")
    gossip_neighbours: int = Field(1, ge=1, le=2)
    stages: int | None = Field(
        None, ge=1, description="pipeline: stages the model is cut into, one per site (None: the number of sites; "
                          "fewer: sites / stages replicas of the pipeline)")
    micro_batches: int = Field(
        8, ge=1, description="pipeline: micro-batches each rank's share of a step is split into (1F1B schedule)")
    wan_timeout_seconds: float = Field(60.0, gt=0, description="a WAN exchange slower than this marks a site dead")
    sampling: Sampling | None = Field(
        None, description="where a worker's batches come from: 'shard' — its own contiguous 1/N of the training "
                          "split; 'whole' — all of it, seeded by (seed, rank, step). None: 'whole' for ps_backup "
                          "(it drops the late pushes of every step, mostly a slow worker's, whose shard would then "
                          "be under-represented), 'shard' for the others")

    @model_validator(mode="after")
    def _check(self) -> StrategyConfig:
        if self.overlap and self.name not in ("diloco", "local_sgd", AUTO):
            raise ValueError(f"overlap is only for diloco/local_sgd, not {self.name!r}: drop --overlap")
        if self.stages is not None and self.name not in ("pipeline", AUTO):
            raise ValueError(f"stages is only for the pipeline strategy, not {self.name!r}: drop stages")
        if self.sampling == "whole" and self.name == "pipeline":
            raise ValueError("the pipeline feeds its stages from the feeder's shard: drop sampling='whole'")
        if self.nesterov and self.outer_momentum == 0:
            raise ValueError("nesterov needs outer_momentum > 0: set outer_momentum or nesterov=false")
        return self

    @property
    def data_sampling(self) -> Sampling:
        """``sampling``, or this strategy's default when unset.

        Why ps_backup draws from the whole split: its servers apply the first N−b pushes of a step and
        drop the rest, and under a persistent straggler most dropped pushes are the same worker's (the
        PS straggler benchmark: 39–92 % of the slow site's pushes). With one contiguous shard per
        worker, that shard -- a third of the corpus on 3 sites -- then made 5–35 % of the applied
        gradients, by the luck of the timing. Chen et al.'s backup workers assume every worker samples
        i.i.d. from the whole data set, so a dropped gradient is just a smaller batch of the same
        distribution; drawing from the whole split makes that true whatever the drop pattern (a shard
        rotating with the step would still skew the mix whenever drops follow the step's phase, and
        the workers' own step counts drift apart under ps_backup). It cost nothing measurable, nor did
        it move that benchmark's loss (docs/benchmarks/training-notes.md, "Data order under
        ps_backup"). The other strategies apply every worker's gradient, so their shards cost nothing
        and keep the data order the tests and benchmarks were recorded with."""
        if self.sampling is not None:
            return self.sampling
        return "whole" if self.name in WHOLE_SPLIT_STRATEGIES else "shard"

    def pipeline_shape(self, sites: int) -> tuple[int, int]:
        """(P stages, D replicas) of a pipeline on ``sites`` sites: unset ``stages`` is one per site."""
        stages = self.stages or sites
        return stages, sites // stages

    @property
    def resolved(self) -> bool:
        return self.name != AUTO and None not in (self.inner_steps, self.outer_lr, self.outer_momentum, self.nesterov,
                                                  self.overlap, self.overlap_steps, self.balance) \
            and self.compression != AUTO


class FaultConfig(_Model):
    slow_site: int | None = Field(None, ge=0)
    slowdown: float = Field(1.0, ge=1.0, description="the slow site computes this many times slower")
    kill_site: int | None = Field(None, ge=0)
    kill_ps: int | None = Field(None, ge=0, description="kill the process serving this parameter shard's primary")
    kill_at_step: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _check(self) -> FaultConfig:
        if self.kill_site is not None and self.kill_ps is not None:
            raise ValueError("kill_site and kill_ps are two faults: give one of --kill-site K, --kill-ps K")
        if self.kill_ps is not None and self.kill_at_step is None:
            raise ValueError("kill_ps and kill_at_step go together: give both --kill-ps K --at-step N")
        if (self.kill_site is None) != (self.kill_at_step is None) and self.kill_ps is None:
            raise ValueError("kill_site and kill_at_step go together: give both --kill-site K --at-step N")
        if self.slowdown > 1 and self.slow_site is None:
            raise ValueError("slowdown without slow_site: add --slow-site K")
        return self


class DeviceConfig(_Model):
    """Where a worker computes and how its groups talk (see ``docs/gpus.md``)."""

    kind: DeviceKind = Field("auto", description="auto: cuda:LOCAL_RANK when the machine has a GPU per local rank, else cpu")
    precision: Precision = Field("auto", description="auto: bf16 autocast on GPUs that support it, fp32 elsewhere")
    outer_on_host: bool | None = Field(
        None, description="diloco/local_sgd: keep the anchor and outer optimiser in host memory (None: when GPU memory is short)")
    wan_backend: Literal["gloo", "nccl"] = Field(
        "gloo", description="backend of groups that cross sites; nccl only where the sites' network carries it")


DataFormat = Literal["bytes", "tokens"]


def token_dtype(vocab: int) -> str:
    """The element type of a token file of ``vocab`` ids (what nanoGPT and torchtitan write)."""
    return "uint16" if vocab <= 65_536 else "uint32"


class DataConfig(_Model):
    """What the built-in model trains on: ``bytes``, the built-in corpus (the standard library's sources,
    vocabulary 256); ``tokens``, a flat little-endian uint16 (``vocab`` <= 65536) or uint32 file of token
    ids, memory-mapped; the model's vocabulary is then ``vocab``."""

    format: DataFormat = "bytes"
    vocab: int | None = Field(None, ge=2, le=2**32, description="tokens: the number of token ids (ids < vocab)")
    path: str | None = Field(None, description="tokens: the file (a path or file: URI); in a job, the site's replica")

    @model_validator(mode="before")
    @classmethod
    def _infer_format(cls, data: Any) -> Any:
        """A token file given without a format is one (``cpn train --data FILE --vocab N``)."""
        if isinstance(data, dict) and data.get("path") is not None and data.get("format") is None:
            return {**data, "format": "tokens"}
        return data

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if self.format == "tokens" and self.vocab is None:
            raise ValueError("data.format 'tokens' needs data.vocab, the number of token ids: set --vocab")
        if self.format == "bytes" and (self.vocab is not None or self.path is not None):
            raise ValueError("data.vocab and data.path are for data.format 'tokens' (the byte corpus has 256): "
                             "set format='tokens' or drop them")
        return self


class TrainConfig(_Model):
    model: str | dict[str, Any] = Field("small", description="a preset's name, or a custom llama shape {layers, hidden, "
                                                          "heads, kvHeads, ffnHidden, vocab, seqLen}")
    tokens: int = Field(2_000_000, gt=0, description="token budget over all workers")
    global_batch_tokens: int = Field(16_384, gt=0)
    seq_len: int = Field(128, ge=8)
    lr: float = Field(3e-3, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    warmup_fraction: float = Field(0.05, ge=0, lt=1)
    optimizer: Literal["adamw", "sgd"] = "adamw"
    strategy: StrategyConfig = StrategyConfig()
    faults: FaultConfig = FaultConfig()
    device: DeviceConfig = DeviceConfig()
    val_every: int = Field(50, ge=1, description="evaluate every N steps (rank 0)")
    val_batches: int = Field(8, ge=1)
    seed: int = 0
    corpus_bytes: int = Field(8_000_000, ge=1_000_000)
    checkpoint_every: int = Field(0, ge=0, description="steps between checkpoints (0 = off); diloco rounds up to outer steps")
    checkpoint_dir: str | None = None
    resume: str | None = None
    stop_at_step: int | None = Field(None, ge=1, description="stop early (simulates an interrupted run)")
    shard: Shard = Field("none", description="site: parameters, gradients and optimiser state sharded over the "
                                             "ranks of each site (FSDP2, one unit per block); none: every rank "
                                             "holds the whole model")
    activation_checkpointing: ActivationCheckpointing = Field(
        "none", description="full: recompute each block's activations in backward (about one more forward)")
    data: DataConfig = Field(DataConfig(), description="the built-in model's data: the byte corpus or a token file")

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        from cpn.runtime.presets import resolve

        resolve(self.model)  # an unknown preset or a bad shape: its ValueError names the key and the fix
        if self.global_batch_tokens % self.seq_len:
            raise ValueError(
                f"global_batch_tokens {self.global_batch_tokens} is not a multiple of seq_len {self.seq_len}: "
                f"use {self.global_batch_tokens // self.seq_len * self.seq_len or self.seq_len}"
            )
        if self.shard == "site":
            name = self.strategy.name
            if name not in (*SHARDABLE_STRATEGIES, AUTO):
                raise ValueError(f"strategy {name!r} cannot run with shard='site' ({UNSHARDABLE_REASONS[name]}): "
                                 f"use shard='none' or one of {', '.join(SHARDABLE_STRATEGIES)}")
        return self

    @property
    def global_sequences(self) -> int:
        return self.global_batch_tokens // self.seq_len

    def sequences_per_worker(self, workers: int) -> int:
        """The largest share of the global batch over ``workers``: ranks take its floor or ceiling."""
        seqs = self.global_sequences
        if seqs < workers:
            raise ValueError(
                f"global batch of {seqs} sequences leaves some of the {workers} workers without one: "
                f"raise global_batch_tokens to at least {workers * self.seq_len}"
            )
        return -(-seqs // workers)

    def shares(self, workers: int) -> list[int]:
        """Sequences per rank: the first ``B mod N`` ranks take one more than the rest."""
        self.sequences_per_worker(workers)
        seqs = self.global_sequences
        return [seqs // workers + (1 if r < seqs % workers else 0) for r in range(workers)]

    @property
    def total_steps(self) -> int:
        """Optimiser steps: whole global batches, then one trimmed step for what is left of the budget
        (the run trains exactly ``tokens``, never more)."""
        return -(-self.tokens // self.global_batch_tokens)

    def tokens_through(self, steps: int) -> int:
        """Tokens the job has trained after ``steps`` global steps."""
        return min(self.tokens, max(0, steps) * self.global_batch_tokens)

    def step_tokens(self, step: int) -> int:
        """Tokens of global step ``step`` (0-based): a global batch, less for the trimmed last step."""
        return self.tokens_through(step + 1) - self.tokens_through(step)

    def to_env(self) -> dict[str, str]:
        return {ENV_TRAIN_CONFIG: self.model_dump_json()}

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> TrainConfig:
        env = os.environ if environ is None else environ
        raw = env.get(ENV_TRAIN_CONFIG)
        if not raw:
            raise ValueError(f"{ENV_TRAIN_CONFIG} is not set: export the training config as JSON")
        return cls.model_validate(json.loads(raw))
