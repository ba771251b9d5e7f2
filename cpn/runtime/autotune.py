"""The defaults a job gets when it names no knob: which strategy (``auto``), and for it H, the outer
optimiser, WAN compression, overlap and batch balancing, from the token budget, the sites and the link.

:func:`resolve` fills every field of :class:`~cpn.runtime.config.StrategyConfig` left ``None`` (or
``"auto"``) and keeps explicit values. It runs before any worker starts (``run_local``, ``cpn train``,
``cpn bench training``) and again in each worker (a no-op when the launcher resolved already), so a
job the orchestrator hands over with some fields unset gets the same choices. :func:`explain` says
what was chosen and why, in one line. The rule and where it comes from: ``docs/runtime-training.md``
("Defaults").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cpn.runtime.config import AUTO, StrategyConfig, TrainConfig
from cpn.runtime.costmodel import CPU_SLOT_MFU, CPU_SLOT_TFLOPS, WIRE_BYTES_PER_VALUE
from cpn.runtime.presets import resolve as resolve_model
from cpn.runtime.topology import Topology

__all__ = ["Job", "Link", "choose", "explain", "link_of", "resolve", "resolve_strategy_name"]

# WAN budget: an elastic strategy moves at most this fraction of the bytes data-parallel training would
# (DiLoCo reports 500x less at H=500; 1/110 keeps the 100x of the issue with a margin for rounding).
WAN_FRACTION = 1 / 110
MIN_H = 8  # below this the exchange's fixed costs (check-in, group, codec) dominate a round
MIN_ROUNDS = 4  # at least this many outer steps per run, whatever the WAN budget says
REPLICA_FRACTION = 0.1  # pipeline replicas: averaging bytes at most this fraction of what the cuts move
SURVIVING_H = 2  # pipeline replicas: the least H by default, so that the others go on when one loses a site
MOMENTUM_ROUNDS = 50  # fewer outer steps than this: plain averaging (momentum 0.9 needs ~10 rounds to build)
DILOCO_TOKEN_EFFICIENCY = 1.15  # measured here: diloco at H=20 matches ddp's loss with ~15 % more tokens
# overlap the exchange (τ-delayed outer step) when it would cost more than this fraction of a round's
# compute: overlapping costs no measurable loss (Streaming DiLoCo, eager updates; here 2.631 vs 2.631 at
# 20 Mbit/s), so anything above measurement noise is worth hiding; an unshaped link (rate unknown) has
# nothing to hide. docs/runtime-training.md, "Defaults".
OVERLAP_HIDE = 0.01
# A CPU worker's wall-clock training rate: the planner's CPU slot (peak x MFU, 40 GFLOP per CPU-second) times
# the share of a core a worker gets where several share a machine's cores and wait on each other — measured:
# `cpn bench training --sites 2 --workers-per-site 2 --wan-mbps 20` diloco steps take 0.047 s on 2 cores, i.e.
# ~10 GFLOP/s per worker. The rule only orders choices (and sets the overlap delay tau from it: with the
# unshared 40 GFLOP/s tau became 3 there and the final val loss rose from 0.982x to 1.019x ddp's).
CPU_WORKER_WALL_SHARE = 0.25
CPU_FLOPS_PER_WORKER = CPU_SLOT_TFLOPS * 1e12 * CPU_SLOT_MFU * CPU_WORKER_WALL_SHARE
GPU_FLOPS_PER_WORKER = 50e12  # a GPU worker's (bf16 at ~35-45 % MFU)


@dataclass(frozen=True)
class Link:
    """The slowest site uplink (Mbit/s, None: unshaped / unknown) and the largest RTT (ms)."""

    mbps: float | None
    rtt_ms: float = 0.0


@dataclass(frozen=True)
class Job:
    """What the rule needs of a job and its placement, in numbers (the planner has no TrainConfig)."""

    parameters: int
    sites: int
    world: int
    total_steps: int


def link_of(topology: Topology, wan_mbps: float | None = None) -> Link:
    rates = [lk.bandwidth_mbps for lk in topology.links]
    rates += [r for r in (topology.uplink_mbps(s) for s in range(topology.num_sites)) if r]
    if wan_mbps:
        rates.append(wan_mbps)
    return Link(min(rates) if rates else None, topology.max_rtt_ms())


def _params(cfg: TrainConfig) -> int:
    return resolve_model(cfg.model).parameters


def _step_compute_seconds(cfg: TrainConfig, topology: Topology) -> float:
    """A rough step time: 6·P·tokens over the workers' throughput (only orders of magnitude matter here)."""
    import torch

    per_worker = GPU_FLOPS_PER_WORKER if cfg.device.kind != "cpu" and torch.cuda.is_available() else CPU_FLOPS_PER_WORKER
    return 6 * _params(cfg) * cfg.global_batch_tokens / (per_worker * topology.world_size)


def _job(cfg: TrainConfig, topology: Topology) -> Job:
    return Job(_params(cfg), topology.num_sites, topology.world_size, cfg.total_steps)


def _ddp_wan_bytes_per_step(job: Job) -> float:
    """What ddp's flat ring moves across site boundaries per step: 2(N−1)/N·4P on each of the S boundary hops."""
    n, s = job.world, job.sites
    return 2 * (n - 1) / n * 4 * job.parameters * s


def _wire_bytes_per_param(compression: str) -> float:
    return WIRE_BYTES_PER_VALUE[compression]


def _exchange_bytes(job: Job, compression: str) -> float:
    """One outer round: every leader sends its (coded) pseudo-gradient to the S−1 others (all-gather)."""
    return job.sites * (job.sites - 1) * _wire_bytes_per_param(compression) * job.parameters


def _exchange_seconds(cfg: TrainConfig, topology: Topology, link: Link, compression: str) -> float:
    return _round_seconds(_job(cfg, topology), link, compression)


def _round_seconds(job: Job, link: Link, compression: str) -> float:
    """One outer exchange at the link rate (each leader's share of the all-gather), plus the RTT."""
    if not link.mbps:
        return 0.0
    per_leader = _exchange_bytes(job, compression) / job.sites
    return per_leader * 8 / (link.mbps * 1e6) + link.rtt_ms / 1e3


def resolve_strategy_name(cfg: TrainConfig, topology: Topology, link: Link) -> str:
    """``auto``, as the planner decides (:mod:`layers.orchestration.planning.placement`): ddp on one
    site; across sites the faster of ``hierarchical`` (every step) and ``diloco`` (every H steps, but
    :data:`DILOCO_TOKEN_EFFICIENCY` more tokens for the same loss), by the same α-β model."""
    if topology.num_sites == 1:
        return "ddp"
    if not topology.is_uniform:
        return "diloco"
    compute = _step_compute_seconds(cfg, topology)
    s, p = topology.num_sites, _params(cfg)
    if link.mbps:
        hier = compute + 2 * (s - 1) / s * 4 * p * 8 / (link.mbps * 1e6) + 2 * (s - 1) * link.rtt_ms / 2e3
    else:
        hier = compute * 1.02  # unshaped: the WAN leg costs about what the intra-site one does
    h = _inner_steps(cfg, topology, "int8")
    diloco = DILOCO_TOKEN_EFFICIENCY * (compute + _exchange_seconds(cfg, topology, link, "int8") / h)
    return "hierarchical" if hier <= diloco else "diloco"


def _inner_steps(cfg: TrainConfig, topology: Topology, compression: str) -> int:
    return _h(_job(cfg, topology), compression)


def _h(job: Job, compression: str) -> int:
    """H: the smallest that keeps the WAN bytes within :data:`WAN_FRACTION` of ddp's, at least
    :data:`MIN_H`, and at most total_steps / :data:`MIN_ROUNDS`."""
    if job.sites == 1:
        return max(1, min(MIN_H, job.total_steps))
    budget = math.ceil(_exchange_bytes(job, compression) / (WAN_FRACTION * _ddp_wan_bytes_per_step(job)))
    return max(1, min(max(MIN_H, budget), job.total_steps // MIN_ROUNDS or 1))


def replica_inner_steps(parameters: int, hidden: int, batch_tokens: int, stages: int, replicas: int,
                        total_steps: int) -> int:
    """H between two averagings of a pipeline's replicas (the planner prices the same H: one source).

    The pipeline's cuts already move 2 · 4 B · hidden · T · (P−1) bytes a step (activations forward,
    their gradients back); one averaging of every stage over D replicas moves 2(D−1) · 4 B · parameters.
    H is the smallest that keeps the averaging within :data:`REPLICA_FRACTION` of the cuts' traffic,
    (D−1)·parameters / (f · hidden · T · (P−1)), and at most total_steps / :data:`MIN_ROUNDS`: averaging
    is cheap beside the activations, and rarer averaging cost loss here (4 sites, `tiny`: H = 18 ended
    +1.8 % above ddp, averaging every 7 steps −0.5 %; docs/benchmarks/pipeline-notes.md). At least
    :data:`SURVIVING_H` = 2 when the run has room for it (8 steps or more): averaged every step the
    replicas are one synchronous job that a lost site stops, every 2 steps a replica that loses a site
    leaves alone; 2 × 2 stages of `tiny`, 40 / 120 steps: H = 2 ended at 2.666 / 2.563 against H = 1's
    2.668 / 2.582, with half the averaging bytes."""
    if replicas <= 1:
        return 1
    cuts = max(1, stages - 1)
    h = math.ceil((replicas - 1) * parameters / (REPLICA_FRACTION * hidden * batch_tokens * cuts))
    # at least SURVIVING_H: averaged every step (H = 1) the replicas are one synchronous job that a lost
    # site stops; every 2 steps they average as local SGD and a replica that loses a site leaves alone
    return max(1, min(max(h, SURVIVING_H), total_steps // MIN_ROUNDS or 1))


def choose(name: str, job: Job, link: Link, step_seconds: float, *, inner_steps: int | None = None,
           compression: str = AUTO, overlap: bool | None = None) -> tuple[int, str, bool, int]:
    """``(H, compression, overlap, τ)`` for strategy ``name`` (not ``auto``): explicit values kept, the
    rest by the rule (``docs/runtime-training.md``, "Defaults"). :func:`resolve` uses it for a worker's
    config; the planner's compute model prices the same choice for a placement (one source)."""
    multi = job.sites > 1
    elastic_avg = name in ("diloco", "local_sgd")
    if compression == AUTO:  # int8 + error feedback on pseudo-gradients costs ~0.1 % loss here, saves 3.9x bytes
        compression = "int8" if multi and elastic_avg else "none"
    h = inner_steps
    if h is None:
        h = _h(job, compression if elastic_avg else "int8")
        if name in ("gossip", "ssp"):
            h = max(1, h // 4)
        if not elastic_avg and name not in ("gossip", "ssp"):
            h = 1
    exchange_s = _round_seconds(job, link, compression)
    if overlap is None:
        overlap = elastic_avg and multi and exchange_s > OVERLAP_HIDE * h * step_seconds
    # merge the outer update as soon as it can have arrived (Streaming DiLoCo's τ)
    tau = max(1, min(max(1, h // 2), math.ceil(exchange_s / max(step_seconds, 1e-9))))
    return h, compression, bool(overlap), tau


def resolve(cfg: TrainConfig, topology: Topology, wan_mbps: float | None = None) -> TrainConfig:
    """``cfg`` with every ``None``/``"auto"`` strategy field chosen for this job; explicit fields kept."""
    s = cfg.strategy
    if s.resolved:
        return cfg
    link = link_of(topology, wan_mbps)
    name = resolve_strategy_name(cfg, topology, link) if s.name == AUTO else s.name
    multi = topology.num_sites > 1
    step_s = _step_compute_seconds(cfg, topology)
    h, compression, overlap, tau = choose(name, _job(cfg, topology), link, step_s, inner_steps=s.inner_steps,
                                          compression=s.compression, overlap=s.overlap)
    stages, replicas = s.pipeline_shape(topology.num_sites)
    if name == "pipeline" and s.inner_steps is None and replicas > 1:
        h = replica_inner_steps(_params(cfg), resolve_model(cfg.model).d_model, cfg.global_batch_tokens, stages,
                                replicas, cfg.total_steps)
    tau = s.overlap_steps if s.overlap_steps is not None else tau
    rounds = cfg.total_steps / max(1, h)
    momentum = s.outer_momentum
    if momentum is None:
        momentum = 0.9 if rounds >= MOMENTUM_ROUNDS else 0.0
    outer_lr = s.outer_lr if s.outer_lr is not None else (0.7 if momentum > 0 else 1.0)
    nesterov = s.nesterov if s.nesterov is not None else momentum > 0
    balance = s.balance if s.balance is not None else (multi and name in ("hierarchical", "diloco", "local_sgd"))
    strategy = StrategyConfig.model_validate({
        **s.model_dump(), "name": name, "compression": compression, "inner_steps": h, "outer_lr": outer_lr,
        "outer_momentum": momentum, "nesterov": nesterov, "overlap": overlap, "overlap_steps": tau, "balance": balance,
    })
    return cfg.model_copy(update={"strategy": strategy})


def explain(cfg: TrainConfig, topology: Topology | None = None) -> str:
    """One line: what the resolved strategy does (with the topology: a pipeline's stages and replicas)."""
    s = cfg.strategy
    words = [s.name]
    if s.name in ("diloco", "local_sgd", "gossip", "ssp"):
        words.append(f"H={s.inner_steps}")
    if s.name == "pipeline" and topology is not None:
        stages, replicas = s.pipeline_shape(topology.num_sites)
        words.append(f"{stages} stages" + ("" if replicas == 1 else f" x {replicas} replicas averaged " + (
            "every step (gradients)" if s.inner_steps == 1 else f"every {s.inner_steps} steps")))
    if s.name == "diloco":
        words.append(f"outer lr {s.outer_lr:g}" + (f" Nesterov {s.outer_momentum:g}" if s.nesterov else
                                                     f" momentum {s.outer_momentum:g}"))
    if s.compression not in ("none", AUTO) and s.name in ("diloco", "local_sgd", "hierarchical"):
        words.append(s.compression)
    if s.overlap:
        words.append(f"overlap τ={s.overlap_steps}")
    if s.balance:
        words.append("balanced shares")
    return ", ".join(words)
