"""The compute model: time, WAN bytes and cost of one job on one placement with one strategy.

Per step (``global_batch_tokens`` tokens):

- compute = 6 · parameters · tokens_per_step / Σ_i gpus_i · peak_i · MFU_i. Batch shares are
  proportional to throughput, so heterogeneous GPUs finish a step together.
- communication, with the α-β model: a ring all-reduce of K bytes over N ranks costs
  2(N−1)/N · K/B + 2(N−1)·α. Inside a site B is NVLink when the site's GPUs fit in one node, else
  the slowest `inter_node_gbps` of its clusters (its fabric's rate per GPU, `Cluster.spec.fabric`:
  a cluster on InfiniBand prices them faster than one on Ethernet), and α = 10 µs. Between sites the ring's slowest hop
  sets B and its RTT sets α = RTT/2 (as in `cpn.runtime.costmodel`); a missing link is an error.

Per strategy (S sites, W_s GPUs at site s, H = inner_steps; "intra" = the slowest site's
all-reduce of the bf16 gradients, 2 B/param):

| strategy | exposed communication per step | WAN payload |
|---|---|---|
| ddp (1 site) | intra | — |
| ddp (S > 1) | flat ring over all N ranks: 2(N−1)/N·K/B_wan + 2(N−1)·α_wan | bf16 gradients |
| hierarchical | intra + 2(S−1)/S·K/B_wan + 2(S−1)·α_wan; across regions the multilevel all-reduce (below) | bf16 gradients |
| local_sgd | intra + outer/H, outer = hierarchical all-reduce of the pseudo-gradient | fp32 pseudo-gradient |
| diloco | as local_sgd; with `overlap` only max(0, outer − H·compute)/H is exposed | fp32 pseudo-gradient |
| ssp | intra + max(0, (S−1)·K/B_wan + α_wan − H·compute)/H: every H steps each site sends its parameters to every other site from background threads (as the runtime does); bounded staleness lets compute run on meanwhile | fp32 parameters |
| gossip | intra + max(0, K/B_wan + α_wan − H·compute)/H: every H steps one neighbour, in the background | fp32 parameters |
| async_ps | W_s·(S−1)/S·K/B_wan + 2α_wan: every worker pushes its gradient to and pulls parameters from servers sharded over the sites, and waits for its pull | fp32 gradients |
| ps_sync | as async_ps; the servers answer once every worker's push of the step is in, so the step waits for the slowest worker: compute = max_i c_i (below) | fp32 gradients |
| ps_backup | as async_ps; the servers answer once the first N−b pushes are in: see below | fp32 gradients |

Synchronous parameter servers (N workers, each computing an equal share of the step, as the runtime
splits it for these modes: c_i = FLOPs per step / N / worker i's effective FLOP/s; x = the exposed
communication above): ``ps_sync`` takes t_sync = max_i c_i + x per step. ``ps_backup`` applies a
step once the (N−b)-th fastest push is in, t_q = c_(N−b) + x (c sorted ascending, b =
``backupWorkers``); a worker slower than that pushes at its own pace t_i = c_i + x, its push is
dropped and counts toward the token budget all the same (the runtime counts every computed push),
so a global batch of computed tokens takes t_backup = N / Σ_i 1/max(t_i, t_q). b = 0 gives t_sync;
homogeneous workers give t_sync too; one site 2× slower of three (b = 1) gives 1.2 c + x against
2 c + x. The WAN bytes are async_ps's (every push crosses, the dropped ones too).

Replicas (``psReplicas`` = r, any PS strategy): each shard's primary forwards every update to its r
secondaries on the next sites before it answers, u · r · K/S bytes per site and step (u = 1 update
per step for ps_sync/ps_backup, N for async_ps: every push), counted on the site's ring hop and
added to the exposed communication as u · r · K/S / B_wan + r·α_wan.

Hierarchical across regions: when the placement's sites span G regions of R > 1 sites each (the
clusters' regions; equal GPUs per site, as the runtime needs), the runtime runs the ``multilevel``
all-reduce (``cpn/runtime/strategies/hierarchical.py``): metro links (between sites of one region)
carry the uncompressed gradient, the long-haul links between regions only 1/R of it, compressed.
Per step, beside intra: max(metro, long-haul) + metro of one pipeline slice, with
metro = α_m + K/R/B_m (reduce-scatter, all-to-all) + (R−1)α_m + (R−1)/R·K/B_m (ring all-gather) and
long-haul = 2(G−1)α_w + 2(G−1)/G·(K_c/R)/B_w; B_m and α_m from the slowest metro link, B_w and α_w
from the slowest long-haul link the rings use. This is ``cpn.runtime.costmodel.predict_multilevel_seconds``
(the levels overlap slice by slice) priced as this module prices the two-level ring: one α per
collective rather than per slice, no codec CPU time, no Ethernet framing (so the two stay comparable;
``tests/layers/orchestration/test_perf.py`` checks the ratio against the runtime's model). Egress is
counted on the links each level uses.

Pipeline (``predict_pipeline``): the model cut into P stages, one per site (the runtime's
``pipeline``), W GPUs per stage; per step (M + P − 1)/M · max(slowest stage compute, slowest cut's
activation transfer) + the tied token table's exchange between the first and last stage + the
slowest stage's intra-site all-reduce; ``stage_memory_gb`` is what one GPU of a stage must hold.
``comm_seconds_per_step`` is then the step less the slowest stage's compute (bubble included).
D replicas of the pipeline (``Assignment.replica``): each prices that step on T/D tokens, the slowest
bounds the step, plus each stage's ring all-reduce of its fp32 parameters over its D sites every H steps.

Knobs the job's spec leaves unset (H, compression, overlap: ``req.autotuned``) are priced as the
runtime will run them: :func:`autotuned` asks :func:`cpn.runtime.autotune.choose` for this placement.

Compression acts on the WAN leg only: the wire carries min(payload, 4 B · ratio) per parameter,
ratio 0.5 for fp16/bf16 and (1 + 4/256)/4 for int8 with one fp32 scale per 256 values. So bf16
gradients gain nothing from fp16/bf16, and a diloco pseudo-gradient halves or quarters.

Steps = ⌈tokens / tokens_per_step⌉: the runtime trains exactly the token budget whatever the strategy,
so that is what a quote prices. Strategies that average less often or with stale values reach a
worse loss on that budget; :data:`TOKEN_EFFICIENCY` says how many more tokens they would need for
ddp's loss, and the planner weighs strategies by it (:func:`steps_for`, ``Problem.evaluate``) without
pricing those tokens — one meaning, shared with the runtime's own ``auto`` choice
(``cpn.runtime.autotune.DILOCO_TOKEN_EFFICIENCY`` is diloco's entry). Total time = steps · (compute +
exposed comm) + :data:`STARTUP_SECONDS`. Every GPU is billed for the whole run; WAN bytes are counted
on the ring's hops (each site → its successor) and billed at that link's price per GB (10⁹ bytes).

Slots sharing one host (``host_cores``: local sites on one machine — ``cpn bench training``,
``cpn demo``): a synchronous step's ranks compute at once and then communicate, so while they
compute, n slots share the host's C cores (processor sharing) and the compute phase stretches by
max(1, n/C); communication and waits use no core and are not stretched. (calibrate.py used to cut
each slot's TFLOPs to C/n itself, which is the same rule; it lives here now so any caller can use it.)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import reduce
from typing import Any

import numpy as np

from cpn.runtime.costmodel import BALANCE_THRESHOLD, WIRE_BYTES_PER_VALUE
from layers.orchestration.planning import calibration
from layers.orchestration.planning.ring import Key, best_ring, hops, link_index
from layers.orchestration.planning.types import (
    PS_STRATEGIES,
    SHARDABLE_STRATEGIES,
    STRATEGIES,
    Assignment,
    ClusterOffer,
    JobRequirements,
    ModelShape,
    Prediction,
    WanLink,
)

__all__ = [
    "STARTUP_BY_DRIVER", "STARTUP_SECONDS", "TOKEN_EFFICIENCY", "TRAINING_STATE_BYTES", "flops_per_step", "predict",
    "profile_factor", "budget_steps", "host_stretch",
    "Levels", "levels_of", "multilevel_comm", "ring_allreduce_seconds", "site_comm", "steps_for", "wan_bytes_per_param",
    "wire_ratio", "worker_memory_gb", "micro_batches", "predict_pipeline", "stage_cuts", "stage_memory_gb",
    "barrier_step", "replica_inner_steps", "is_code", "cut_floats", "max_stages",
    "MemoryPlan", "activation_bytes", "memory_options", "memory_plan", "shard_gather_seconds",
    "site_memory_gb",
]

# Launching → Running before any lesson: a Kubernetes pod is scheduled, pulls its image and meets
# (minutes); a local-driver site forks processes that import torch and meet (seconds, measured by
# `cpn demo` here: 3–5 s). Finished runs replace both (learning.py).
STARTUP_BY_DRIVER: dict[str, float] = {"kubernetes": 120.0, "local": 5.0}
STARTUP_SECONDS = STARTUP_BY_DRIVER["kubernetes"]  # the cautious default, for a driver not listed
INTRA_ALPHA_SECONDS = 10e-6
# CPN's runtime reduces fp32 gradients and pseudo-gradients (bf16 autocast computes in bf16, but the
# parameters and their gradients stay fp32): 4 bytes per parameter on every link unless a WAN codec
# shrinks the WAN leg. (Was 2 for ddp/hierarchical, which halved their predicted traffic: measured
# 118 MB vs 59 MB predicted on `cpn bench training --sites 2 --workers-per-site 2 --wan-mbps 20`.)
GRADIENT_BYTES = 4


def _diloco_token_efficiency() -> float:
    """The runtime's ``auto`` weighs diloco by this too: one source."""
    from cpn.runtime.autotune import DILOCO_TOKEN_EFFICIENCY

    return DILOCO_TOKEN_EFFICIENCY


# Tokens a strategy needs for the loss ddp reaches on the budget, over the budget: a weight for comparing
# strategies, never more steps (the runtime trains exactly the budget). Rough figures from the local-SGD /
# gossip / async literature; diloco's measured here (cpn/runtime/autotune.py).
TOKEN_EFFICIENCY: dict[str, float] = {
    "ddp": 1.0, "hierarchical": 1.0, "diloco": _diloco_token_efficiency(), "local_sgd": 1.03, "ssp": 1.02,
    "gossip": 1.08, "async_ps": 1.10, "pipeline": 1.0,  # a pipeline is the same optimisation as one process
    # ps_sync: one optimiser step on the mean of every push, ddp's step; ps_backup drops up to b pushes a
    # step (+1.5 % ± 1.9 points val loss against ps_sync over five seeds, docs/benchmarks/training-notes.md)
    "ps_sync": 1.0, "ps_backup": 1.05,
}
# Memory per GPU (:func:`worker_memory_gb`, :func:`memory_plan`; docs/placement.md, "Memory"). One
# accounting on GPUs and CPUs: the runtime keeps fp32 parameters (4 B), fp32 gradients (4 B) and AdamW's
# two fp32 moments (8 B), 16 B per parameter — FSDP2's mixed precision on GPUs keeps exactly these sharded
# and computes on bf16 copies it gathers a block at a time (counted in the buffers); CPUs run fp32
# throughout. Sharded over a site's W ranks (shard "site") each GPU keeps 16/W B per parameter.
TRAINING_STATE_BYTES = 16
# Activations one token keeps per layer for the backward pass, in 16-bit, no tensor/sequence parallelism:
# 34 · hidden bytes (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
# Models", eq. 1: 34·s·b·h + 5·a·s²·b per layer; the runtime's attention is torch's SDPA, a fused kernel
# that keeps no s² score matrix, so the second term drops).
ACTIVATION_BYTES = 34
# With full activation checkpointing a block keeps only its 16-bit input (2 · hidden bytes a token) and
# recomputes the rest in the backward pass, where one block's full activations live at a time.
CHECKPOINT_BYTES = 2
# The output layer's logits, per token and vocabulary entry: bf16 logits and their fp32 copy for the loss.
LOGIT_BYTES = 6
# Recomputing every block's forward in the backward pass: forward 2 of the 6 FLOPs per parameter and
# token, so the step's compute grows by a third.
RECOMPUTE_FRACTION = 1 / 3
# Sharded: FSDP2 all-gathers a block's 16-bit parameters ahead of its use (the block computing and the
# next one prefetched) and holds one block's unsharded fp32 gradients until their reduce-scatter:
# 2 · 2 + 4 B per parameter of a block.
SHARD_BUFFER_BYTES = 2 * 2 + 4
# the all-gathered copies are 16-bit (bf16 on GPUs): forward and backward gather each block once
GATHER_BYTES = 2
# The runtime's own share of a GPU: CUDA context and kernels, NCCL/Gloo buffers, the caching allocator's
# fragmentation. An allowance, not a measurement (a CUDA context alone takes 0.3–0.5 GB).
RUNTIME_OVERHEAD_GB = 1.0
# the runtime's pipeline slice, cpn.runtime.collectives.DEFAULT_CHUNK_BYTES (that module imports torch;
# a test keeps the two equal): the multilevel levels overlap slice by slice
PIPELINE_SLICE_BYTES = 4 * 2**20
# a profiled step is never taken as less than this share compute, however much all-reduce the model expects
PROFILE_MIN_COMPUTE = 0.1


def wire_ratio(compression: str | None) -> float:
    """Wire bytes per fp32 byte on the WAN leg."""
    if compression is None:
        return 1.0
    if compression in WIRE_BYTES_PER_VALUE:
        return WIRE_BYTES_PER_VALUE[compression] / 4
    raise ValueError(f"unknown compression {compression!r}; use one of {', '.join(WIRE_BYTES_PER_VALUE)}")


def wan_bytes_per_param(strategy: str, compression: str | None) -> float:
    """Bytes per parameter each WAN exchange of `strategy` carries (every strategy sends fp32 values)."""
    return GRADIENT_BYTES * wire_ratio(compression)


def budget_steps(req: JobRequirements) -> int:
    """The steps the runtime trains: the token budget, whatever the strategy."""
    return math.ceil(req.tokens / req.global_batch_tokens)


def steps_for(req: JobRequirements, strategy: str) -> int:
    """Steps `strategy` would need for ddp's loss on the budget: what the solvers compare strategies by
    (:data:`TOKEN_EFFICIENCY`); a quote prices :func:`budget_steps`."""
    return math.ceil(req.tokens * TOKEN_EFFICIENCY[strategy] / req.global_batch_tokens)


def host_stretch(slots: int, host_cores: float | None) -> float:
    """How much longer a step's compute phase takes when `slots` slots share `host_cores` cores and
    compute at once (processor sharing); 1 when they do not share a host."""
    return 1.0 if host_cores is None else max(1.0, slots / host_cores)


def worker_memory_gb(req: JobRequirements, *, shard: int = 1, checkpointing: bool = False,
                     sequences: int = 1) -> float:
    """GB one worker (one GPU) needs to train the model: its training state (:data:`TRAINING_STATE_BYTES`
    per parameter, 1/``shard`` of it when its site's ``shard`` ranks shard the model, plus the gathered
    blocks), the activations of ``sequences`` sequences (recomputed per block with ``checkpointing``)
    and :data:`RUNTIME_OVERHEAD_GB`. The planner counts one sequence, the least a step can hold: a rank
    whose share of the batch is k sequences and that computes them in one pass holds k times the
    activations (docs/placement.md, "Memory")."""
    m = req.model
    state = m.parameters * TRAINING_STATE_BYTES / max(1, shard)
    buffers = _block_parameters(req) * SHARD_BUFFER_BYTES if shard > 1 else 0.0
    return (state + buffers + activation_bytes(req, checkpointing) * sequences) / 1e9 + RUNTIME_OVERHEAD_GB


def activation_bytes(req: JobRequirements, checkpointing: bool = False, blocks: float | None = None) -> float:
    """Activation bytes of one sequence through ``blocks`` of the model's blocks (all of them unless
    given) and its logits; what the user stated for its own code (spec.model.bytesPerUnit)."""
    m = req.model
    share = 1.0 if blocks is None else blocks
    if m.bytes_per_unit is not None or is_code(req):
        per_unit = m.bytes_per_unit if m.bytes_per_unit is not None else ACTIVATION_BYTES * m.hidden * m.layers
        return per_unit * m.seq_len * share
    layers = m.layers * share
    if checkpointing:
        kept = CHECKPOINT_BYTES * m.hidden * layers + ACTIVATION_BYTES * m.hidden * min(1.0, layers)
    else:
        kept = ACTIVATION_BYTES * m.hidden * layers
    return (kept + (LOGIT_BYTES * m.vocab if blocks is None else 0)) * m.seq_len


def _block_parameters(req: JobRequirements) -> float:
    """Parameters of one transformer block (≈ 12·h² + 13·h, at most an equal share of the model)."""
    m = req.model
    return min(12.0 * m.hidden**2 + 13.0 * m.hidden, m.parameters / max(1, m.layers))


@dataclass(frozen=True)
class MemoryPlan:
    """How a placement holds the model: ``shard`` none or site, ``checkpointing`` none or full, the GB
    its most loaded GPU needs, whether every GPU holds that, and what it costs per step."""

    shard: str
    checkpointing: str
    gb_per_gpu: float
    fits: bool
    extra_compute: float = 0.0  # seconds per step: recomputing the blocks' forward
    extra_comm: float = 0.0  # seconds per step: the sharded blocks' all-gathers inside the slowest site


def memory_options(req: JobRequirements, strategy: str) -> list[tuple[str, str]]:
    """(shard, checkpointing) pairs the planner may choose from: what the spec fixed, else every pair the
    runtime can run (a user's code is neither sharded nor checkpointed by CPN; a strategy outside
    :data:`SHARDABLE_STRATEGIES` holds whole replicas)."""
    code = is_code(req)
    shards = ["none"] if code or strategy not in SHARDABLE_STRATEGIES else ["none", "site"]
    if req.shard != "auto":
        shards = [req.shard]
    checkpoints = ["none"] if code else ["none", "full"]
    if req.activation_checkpointing != "auto":
        checkpoints = [req.activation_checkpointing]
    return [(s, c) for s in shards for c in checkpoints]


def shard_gather_seconds(req: JobRequirements, ranks: int, gbps: float) -> float:
    """The all-gathers sharding adds to a step on a site of ``ranks`` ranks: each block's 16-bit
    parameters gathered for the forward and again for the backward pass, (N−1)/N · K / B + (N−1)·α
    each (the gradients' reduce-scatter takes the place of the unsharded all-reduce, priced as before)."""
    if ranks <= 1:
        return 0.0
    k = req.model.parameters * GATHER_BYTES
    return 2 * ((ranks - 1) / ranks * k * 8 / (gbps * 1e9) + (ranks - 1) * INTRA_ALPHA_SECONDS)


def memory_plan(req: JobRequirements, strategy: str, site_gpus: Mapping[str, int], site_memory_gb: Mapping[str, float],
                intra_gbps: Mapping[str, float], compute_s: float) -> MemoryPlan:
    """The cheapest way the placement's GPUs hold the job (``site_memory_gb``: each site's smallest GPU,
    0 = not reported, taken to fit): every pair of :func:`memory_options` that fits is priced — recompute
    adds :data:`RECOMPUTE_FRACTION` of the compute, sharding :func:`shard_gather_seconds` at the slowest
    site — and the fastest kept (the simpler on a tie: no sharding, no recompute). When none fits, the
    pair needing the least, with ``fits`` False."""
    best: tuple[tuple[float, ...], MemoryPlan] | None = None
    for rank, (shard, checkpointing) in enumerate(memory_options(req, strategy)):
        need = {s: worker_memory_gb(req, shard=w if shard == "site" else 1, checkpointing=checkpointing == "full")
                for s, w in site_gpus.items()}
        fits = all(site_memory_gb.get(s, 0.0) <= 0 or need[s] <= site_memory_gb[s] for s in site_gpus)
        extra_compute = compute_s * RECOMPUTE_FRACTION if checkpointing == "full" else 0.0
        extra_comm = max(shard_gather_seconds(req, w, intra_gbps[s]) for s, w in site_gpus.items()) \
            if shard == "site" else 0.0
        plan = MemoryPlan(shard, checkpointing, max(need.values()), fits, extra_compute, extra_comm)
        key = (0.0, extra_compute + extra_comm, rank) if fits else (1.0, plan.gb_per_gpu, rank)
        if best is None or key < best[0]:
            best = (key, plan)
    assert best is not None
    return best[1]


def site_memory_gb(used: list[Assignment], offers: Mapping[str, ClusterOffer]) -> dict[str, float]:
    """Each site's smallest reported GPU memory among the placement's clusters (0: none reported)."""
    out: dict[str, float] = {}
    for a in used:
        gb = offers[a.cluster].memory_gb
        if gb > 0:
            out[a.site] = min(out.get(a.site, gb), gb)
        else:
            out.setdefault(a.site, 0.0)
    return out


def flops_per_step(req: JobRequirements) -> float:
    """6 FLOPs per parameter per unit (forward 2, backward 4), or what the user stated for its own code;
    for a profiled job, the FLOPs its measured steps correspond to (:func:`profile_factor`)."""
    per_unit = req.model.flops_per_unit if req.model.flops_per_unit is not None else 6.0 * req.model.parameters
    return per_unit * req.global_batch_tokens * profile_factor(req)


def profile_factor(req: JobRequirements) -> float:
    """Measured over modelled compute time of the job's profile run (spec.profile; 1 without one).

    The profile timed ``step_seconds`` per step on one site; less that site's modelled all-reduce
    (what :func:`site_comm` adds back for any placement), the rest is compute. Dividing by the
    modelled compute of the same step on the same GPUs gives one factor for the job's FLOPs, so
    every GPU model keeps its relative speed (:func:`calibration.effective_tflops`) and the
    profiled placement itself is predicted at exactly its measured step time."""
    p = req.profiled
    if p is None:
        return 1.0
    per_unit = req.model.flops_per_unit if req.model.flops_per_unit is not None else 6.0 * req.model.parameters
    modelled = per_unit * p.units_per_step / (p.gpus * calibration.effective_tflops(p.gpu_model, p.tflops) * 1e12)
    intra = float(ring_allreduce_seconds(req.model.parameters * GRADIENT_BYTES, p.gpus, p.intra_gbps,
                                         INTRA_ALPHA_SECONDS))
    measured = max(p.step_seconds - intra, PROFILE_MIN_COMPUTE * p.step_seconds)
    return measured / modelled


def ring_allreduce_seconds(size_bytes: float, ranks: Any, gbps: Any, alpha_s: float) -> Any:
    """2(N−1)/N · K/B + 2(N−1)·α; `ranks` may be a numpy array (0 for N ≤ 1)."""
    n = np.maximum(np.asarray(ranks, dtype=float), 1.0)
    return 2 * (n - 1) / n * size_bytes * 8 / (gbps * 1e9) + 2 * (n - 1) * alpha_s


def site_comm(req: JobRequirements, strategy: str, compute_s: Any, site_gpus: Mapping[str, Any],
              intra_gbps: Mapping[str, Any], wan_gbps: float, rtt_ms: float) -> tuple[Any, dict[str, Any]]:
    """(exposed communication seconds per step, WAN bytes each site sends its ring successor per step).

    `compute_s` and the GPU counts may be numpy arrays (one entry per candidate placement): the
    planner evaluates many GPU totals at once.
    """
    params = req.model.parameters
    sites = len(site_gpus)
    intra = _intra_seconds(req, site_gpus, intra_gbps)
    if sites == 1:
        return intra, {}
    k = params * wan_bytes_per_param(strategy, req.compression)
    alpha = rtt_ms / 2e3
    share = 2 * (sites - 1) / sites * k
    h = max(1, req.inner_steps)
    if strategy == "ddp":
        n = sum(site_gpus.values())
        return ring_allreduce_seconds(k, n, wan_gbps, alpha), dict.fromkeys(site_gpus, 2 * (n - 1) / n * k)
    if strategy == "hierarchical":
        return intra + ring_allreduce_seconds(k, sites, wan_gbps, alpha), dict.fromkeys(site_gpus, share)
    if strategy in ("diloco", "local_sgd"):
        outer = intra + ring_allreduce_seconds(k, sites, wan_gbps, alpha)
        if strategy == "diloco" and req.overlap:
            outer = np.maximum(0.0, outer - h * compute_s)
        return intra + outer / h, dict.fromkeys(site_gpus, share / h)
    if strategy in ("ssp", "gossip"):
        peers = sites - 1 if strategy == "ssp" else 1
        send = peers * k * 8 / (wan_gbps * 1e9) + alpha
        return intra + np.maximum(0.0, send - h * compute_s) / h, dict.fromkeys(site_gpus, peers * k / h)
    if strategy in PS_STRATEGIES:
        out = {s: w * (sites - 1) / sites * k for s, w in site_gpus.items()}
        seconds = reduce(np.maximum, list(out.values())) * 8 / (wan_gbps * 1e9) + 2 * alpha
        if req.ps_replicas:  # each primary forwards every update to its secondaries before it answers
            updates = sum(site_gpus.values()) if strategy == "async_ps" else 1
            forward = updates * req.ps_replicas * k / sites
            out = {s: v + forward for s, v in out.items()}
            seconds = seconds + forward * 8 / (wan_gbps * 1e9) + req.ps_replicas * alpha
        return seconds, out
    raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")


@dataclass(frozen=True)
class Levels:
    """The cross-site levels of the ``multilevel`` all-reduce on a placement spanning regions:
    regions in ring order (first appearance), each with its sites in ring order, as the runtime's
    ``Topology.level_ranks`` groups them; the slowest metro and long-haul links."""

    regions: tuple[tuple[str, ...], ...]
    metro_gbps: float
    metro_rtt_ms: float
    wan_gbps: float
    wan_rtt_ms: float

    def metro_hops(self) -> list[Key]:
        """Every ordered pair inside a region (the reduce-scatter is an all-to-all)."""
        return [(a, b) for sites in self.regions for a in sites for b in sites if a != b]

    def long_haul_hops(self) -> list[Key]:
        """For each position in a region, the ring over the regions' sites at that position."""
        return [hop for pos in range(len(self.regions[0])) for hop in hops([r[pos] for r in self.regions])]


def levels_of(ring: list[str], site_gpus: Mapping[str, int], region_of: Mapping[str, str],
              index: Mapping[Key, WanLink]) -> Levels | None:
    """The placement's levels when the runtime will run ``multilevel`` (more than one region, a region
    with more than one site, equal sites per region and GPUs per site: the runtime's condition), else
    None (today's two-level ring); None too when a link the levels need is missing."""
    grouped: dict[str, list[str]] = {}
    for site in ring:
        grouped.setdefault(region_of.get(site) or site, []).append(site)
    regions = tuple(tuple(sites) for sites in grouped.values())
    if not 1 < len(regions) < len(ring) or len({len(r) for r in regions}) > 1 or len(set(site_gpus.values())) > 1:
        return None
    shell = Levels(regions, 0.0, 0.0, 0.0, 0.0)
    metro, long_haul = shell.metro_hops(), shell.long_haul_hops()
    if any(hop not in index for hop in metro + long_haul):
        return None
    return Levels(regions, min(index[h].bandwidth_gbps for h in metro), max(index[h].rtt_ms for h in metro),
                  min(index[h].bandwidth_gbps for h in long_haul), max(index[h].rtt_ms for h in long_haul))


def multilevel_comm(req: JobRequirements, strategy: str, levels: Levels) -> tuple[float, dict[Key, float]]:
    """(cross-site seconds of one multilevel all-reduce of the gradients, bytes per link and step);
    the formula is in the module docstring."""
    r, g = len(levels.regions[0]), len(levels.regions)
    metro_k = req.model.parameters * GRADIENT_BYTES  # metro links run uncompressed
    wan_k = req.model.parameters * wan_bytes_per_param(strategy, req.compression)
    a_m, a_w = levels.metro_rtt_ms / 2e3, levels.wan_rtt_ms / 2e3
    b_m, b_w = 8 / (levels.metro_gbps * 1e9), 8 / (levels.wan_gbps * 1e9)

    def metro(x: float) -> float:  # reduce-scatter (all-to-all) + all-gather (ring) of x bytes per site
        return a_m + x / r * b_m + (r - 1) * a_m + (r - 1) / r * x * b_m

    top = 2 * (g - 1) * a_w + 2 * (g - 1) / g * (wan_k / r) * b_w
    seconds = max(metro(metro_k), top) + metro(min(metro_k, PIPELINE_SLICE_BYTES))
    sent: dict[Key, float] = {}
    for hop in levels.metro_hops():
        sent[hop] = sent.get(hop, 0.0) + metro_k / r
    for sites in levels.regions:
        for hop in hops(list(sites)):
            sent[hop] = sent.get(hop, 0.0) + (r - 1) / r * metro_k
    for hop in levels.long_haul_hops():
        sent[hop] = sent.get(hop, 0.0) + 2 * (g - 1) / g * wan_k / r
    return seconds, sent


def _intra_seconds(req: JobRequirements, site_gpus: Mapping[str, Any], intra_gbps: Mapping[str, Any]) -> Any:
    """The slowest site's all-reduce of the fp32 gradients."""
    grads = req.model.parameters * GRADIENT_BYTES
    return reduce(np.maximum, [ring_allreduce_seconds(grads, w, intra_gbps[s], INTRA_ALPHA_SECONDS)
                               for s, w in site_gpus.items()])


def intra_gbps_by_site(assignments: list[Assignment], offers: Mapping[str, ClusterOffer]) -> dict[str, float]:
    """NVLink when a site's GPUs fit in one node of one cluster, else its slowest node fabric."""
    by_site: dict[str, list[tuple[ClusterOffer, int]]] = {}
    for a in assignments:
        by_site.setdefault(a.site, []).append((offers[a.cluster], a.gpus))
    out = {}
    for site, items in by_site.items():
        if len(items) == 1 and items[0][1] <= items[0][0].gpus_per_node:
            out[site] = items[0][0].intra_node_gbps
        else:
            out[site] = min(o.inter_node_gbps for o, _ in items)
    return out


def autotuned(req: JobRequirements, strategy: str, site_gpus: Mapping[str, int], compute_s: float, wan_gbps: float,
              rtt_ms: float) -> JobRequirements:
    """``req`` with the knobs its spec left unset (H, WAN compression, overlap) chosen as the runtime's
    autotune will choose them on this placement (:func:`cpn.runtime.autotune.choose`): one rule for
    what runs and what is priced."""
    if not req.autotuned:
        return req
    from cpn.runtime.autotune import Job, Link, choose

    multi = len(site_gpus) > 1
    job = Job(parameters=req.model.parameters, sites=len(site_gpus), world=int(sum(site_gpus.values())),
              total_steps=max(1, math.ceil(req.tokens / req.global_batch_tokens)))
    unset = req.autotuned
    h, compression, overlap, _ = choose(
        strategy, job, Link(wan_gbps * 1e3 if multi else None, rtt_ms if multi else 0.0), compute_s,
        inner_steps=None if "inner_steps" in unset else req.inner_steps,
        compression="auto" if "compression" in unset else (req.compression or "none"),
        overlap=None if "overlap" in unset else req.overlap)
    return replace(req, inner_steps=h, compression=None if compression == "none" else compression, overlap=overlap)


def predict(req: JobRequirements, assignments: list[Assignment], strategy: str,
            offers: dict[str, ClusterOffer], links: list[WanLink], ring: list[str] | None = None,
            host_cores: float | None = None) -> Prediction:
    """Predict time, bytes and cost of running `req` on `assignments` with `strategy`.

    `ring` is the site order of the WAN collectives (default: :func:`ring.best_ring`). `host_cores`:
    every slot of the placement runs on one host with this many cores (:func:`host_stretch`). Raises
    ValueError for an unknown strategy, an empty placement, or two adjacent ring sites with no link.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if strategy == "pipeline":
        return predict_pipeline(req, assignments, offers, links)
    used = [a for a in assignments if a.gpus > 0]
    if not used:
        raise ValueError("empty placement: no assignment has GPUs")
    site_gpus: dict[str, int] = {}
    for a in used:
        site_gpus[a.site] = site_gpus.get(a.site, 0) + a.gpus
    if ring is None:
        ring = best_ring(list(site_gpus), links) if len(site_gpus) > 1 else list(site_gpus)
    index = link_index(links)
    wan_gbps, rtt_ms, ring_hops = _wan(ring, index)
    throughput = sum(a.gpus * calibration.effective_tflops(offers[a.cluster].gpu_model, offers[a.cluster].tflops)
                     for a in used) * 1e12
    compute = flops_per_step(req) / throughput * host_stretch(sum(site_gpus.values()), host_cores)
    if strategy == "hierarchical" and host_cores is not None:
        compute = min(compute, _idle_compute(req, used, offers, host_cores))
    req = autotuned(req, strategy, site_gpus, compute, wan_gbps, rtt_ms)
    intra_gbps = intra_gbps_by_site(used, offers)
    memory = memory_plan(req, strategy, site_gpus, site_memory_gb(used, offers), intra_gbps, compute)
    comm, sent = site_comm(req, strategy, compute, site_gpus, intra_gbps, wan_gbps, rtt_ms)
    per_step = {hop: float(sent[hop[0]]) for hop in ring_hops if sent.get(hop[0])}
    levels = levels_of(ring, site_gpus, {a.site: offers[a.cluster].region for a in used}, index) \
        if strategy == "hierarchical" else None
    if levels is not None:
        cross, per_step = multilevel_comm(req, strategy, levels)
        comm = _intra_seconds(req, site_gpus, intra_gbps) + cross
    steps = budget_steps(req)
    comm = float(comm)
    if strategy in ("ps_sync", "ps_backup"):  # the servers' barrier: the step waits for a slow worker
        backups = req.backup_workers if strategy == "ps_backup" else 0
        compute = barrier_step(_worker_compute(req, used, offers, host_cores), comm, backups) - comm
    compute, comm = compute + memory.extra_compute, comm + memory.extra_comm  # what the memory plan costs
    factor, startup = _learned(req, strategy, used, offers)
    step = (compute + comm) * factor
    total = steps * step + startup
    egress, gpu_seconds, cost = _bill(used, offers, index, per_step, steps, total)
    return Prediction(
        strategy=strategy, steps=steps, compute_seconds_per_step=compute, comm_seconds_per_step=comm,
        step_seconds=step, total_seconds=total, wan_bytes=sum(egress.values()),
        intra_bytes=_intra_bytes(req, site_gpus) * steps, gpu_seconds_by_cluster=gpu_seconds,
        egress_bytes_by_link=egress, est_cost=cost, step_factor=factor, startup_seconds=startup,
        memory_gb_per_gpu=memory.gb_per_gpu, shard=memory.shard, activation_checkpointing=memory.checkpointing,
        fits_memory=memory.fits,
    )


def _idle_compute(req: JobRequirements, used: list[Assignment], offers: Mapping[str, ClusterOffer],
                  host_cores: float) -> float:
    """A step's compute with the slowest slots idle, the balanced runtime's other split where slots share
    a host's cores (``cpn/runtime/strategies/idle.py``: it keeps whichever runs faster); inf when every
    slot is as fast (nothing to idle)."""
    rate = {a.cluster: calibration.effective_tflops(offers[a.cluster].gpu_model, offers[a.cluster].tflops)
            for a in used}
    slowest = min(rate.values())
    working = [a for a in used if rate[a.cluster] > slowest]
    if not working or max(rate.values()) <= BALANCE_THRESHOLD * slowest:  # the runtime's "equal": no trial
        return math.inf
    throughput = sum(a.gpus * rate[a.cluster] for a in working) * 1e12
    return flops_per_step(req) / throughput * host_stretch(sum(a.gpus for a in working), host_cores)


def _worker_compute(req: JobRequirements, used: list[Assignment], offers: Mapping[str, ClusterOffer],
                    host_cores: float | None) -> list[float]:
    """Each worker's compute seconds for an equal share of the step (the PS modes do not balance)."""
    n = sum(a.gpus for a in used)
    share = flops_per_step(req) / n * host_stretch(n, host_cores)
    return [share / (calibration.effective_tflops(offers[a.cluster].gpu_model, offers[a.cluster].tflops) * 1e12)
            for a in used for _ in range(a.gpus)]


def barrier_step(compute_s: list[float], comm_s: float, backups: int) -> float:
    """Seconds per global batch of computed tokens when N workers (compute ``compute_s`` each, then
    ``comm_s``) meet at parameter servers that apply a step from its first N − ``backups`` pushes:
    N / Σ_i 1/max(t_i, t_q), t_i = c_i + comm, t_q the (N − b)-th fastest t_i (b = 0: the slowest)."""
    times = sorted(c + comm_s for c in compute_s)
    quorum = times[max(0, len(times) - backups - 1)]
    return len(times) / sum(1 / max(t, quorum) for t in times)


def _learned(req: JobRequirements, strategy: str, used: list[Assignment],
             offers: dict[str, ClusterOffer]) -> tuple[float, float]:
    """(step factor, start-up seconds) that finished runs of this GPU model at this provider (the
    placement's most numerous pair), strategy and workload taught; before any, factor 1 and the
    start-up other runs on this GPU model and provider measured, else :data:`STARTUP_BY_DRIVER` of
    the placement's slowest driver. A profiled job's steps were measured (:func:`profile_factor`): its
    factor is 1, and its start-up at least what its profile run took besides the timed steps."""
    gpus: dict[tuple[str, str], int] = {}  # (GPU model, provider) → GPUs: lessons are kept per provider
    for a in used:
        key = (offers[a.cluster].gpu_model, offers[a.cluster].provider)
        gpus[key] = gpus.get(key, 0) + a.gpus
    model, provider = max(sorted(gpus), key=gpus.__getitem__)
    lesson = req.learned.lookup(model, strategy, req.workload, provider)
    if lesson is not None:
        if req.profiled is not None:
            return 1.0, _profiled_startup(req, lesson.startup_seconds)
        return lesson.step_factor, lesson.startup_seconds
    startup = req.learned.startup(model, provider)
    if startup is None:  # the slowest site to start holds up the rendezvous
        startup = max(STARTUP_BY_DRIVER.get(offers[a.cluster].driver, STARTUP_SECONDS) for a in used)
    return 1.0, _profiled_startup(req, startup)


def _profiled_startup(req: JobRequirements, startup: float) -> float:
    """A profiled job starts no faster than its profile run did (fetching its code, loading its data,
    its first step, its last evaluation), nor than the sites' own start-up."""
    measured = req.profiled.startup_seconds if req.profiled is not None else None
    return startup if measured is None else max(startup, measured)


def _wan(ring: list[str], index: dict[Key, WanLink]) -> tuple[float, float, list[Key]]:
    ring_hops = hops(ring)
    missing = [hop for hop in ring_hops if hop not in index]
    if missing:
        raise ValueError(f"no link between sites {missing[0][0]} and {missing[0][1]}")
    if not ring_hops:
        return math.inf, 0.0, []
    return (min(index[h].bandwidth_gbps for h in ring_hops), max(index[h].rtt_ms for h in ring_hops), ring_hops)


def _intra_bytes(req: JobRequirements, site_gpus: Mapping[str, int]) -> float:
    """Bytes the sites' ranks send each other per step in the bf16 gradient all-reduce."""
    grads = req.model.parameters * GRADIENT_BYTES
    return sum(2 * (w - 1) / w * grads * w for w in site_gpus.values() if w > 1)


# ---------------------------------------------------------------------------------------- pipeline
# The runtime's pipeline (cpn/runtime/strategies/pipeline.py) cuts the built-in LM's units (embedding,
# blocks, head) into P contiguous stages by parameter count, one stage per site, W workers per site
# data parallel inside the stage, micro-batches in 1F1B. Its constants, read from the runtime (one source):
ACTIVATION_VALUE_BYTES = 4  # activations and their gradients cross a cut as fp32 unless a codec shrinks them


def _runtime_pipeline() -> tuple[int, int]:
    """(micro-batches per rank and step, vocabulary of the built-in LMs) as the runtime's defaults say."""
    from cpn.runtime.config import StrategyConfig
    from cpn.runtime.presets import ModelConfig

    return int(StrategyConfig.model_fields["micro_batches"].default), ModelConfig().vocab_size


PIPELINE_MICRO_BATCHES, PIPELINE_VOCAB = _runtime_pipeline()


def is_code(req: JobRequirements) -> bool:
    """A user's own code (``spec.code``): its ``nn.Sequential`` is cut, not CPN's built-in LM."""
    return req.workload != "lm"


def _units(req: JobRequirements) -> list[float]:
    """Parameters of the model's units as the runtime cuts them. The built-in LM: embedding, ``layers``
    blocks, head (a transformer block holds ≈ 12·h² + 13·h parameters; the rest is split between the
    embedding and the head, which holds its copy of the tied token table). A user's ``nn.Sequential``
    (spec.code): its ``layers`` children, taken as equal, parameters / layers each."""
    m = req.model
    layers = max(1, m.layers)
    if is_code(req):
        return [m.parameters / layers] * layers
    block = 12.0 * m.hidden**2 + 13.0 * m.hidden
    if block * layers >= m.parameters:
        block = m.parameters / (layers + 2)
    edge = (m.parameters - block * layers) / 2
    return [edge, *([block] * layers), edge]


def max_stages(req: JobRequirements) -> int:
    """The runtime cuts at unit boundaries: at most layers + 2 stages for the built-in LM, ``layers``
    (the Sequential's children) for a user's code."""
    return max(1, req.model.layers) + (0 if is_code(req) else 2)


def cut_floats(req: JobRequirements) -> int:
    """Values one unit of the batch sends across a cut (and as many gradients back): the LM's hidden
    width per token; a user's model's stated width, spec.model.hidden × seqLen (seqLen 1 unless stated)."""
    m = req.model
    return m.hidden * m.seq_len if is_code(req) else m.hidden


def stage_cuts(req: JobRequirements, stages: int) -> list[tuple[float, float]]:
    """(parameters, share of the blocks) of each of ``stages`` stages, cut as the runtime cuts
    (:func:`cpn.runtime.partition.partition`: contiguous, the largest stage as small as possible); a
    user's model's children all count as blocks."""
    return list(_cuts(req.model, stages, is_code(req)))


@functools.lru_cache(maxsize=256)
def _cuts(model: ModelShape, stages: int, code: bool) -> tuple[tuple[float, float], ...]:
    from cpn.runtime.partition import partition

    sizes = _units(JobRequirements(model=model, tokens=1, global_batch_tokens=1, workload="code:" if code else "lm"))
    edges = 0 if code else 1  # the LM's embedding and head are no blocks
    layers = len(sizes) - 2 * edges
    out = []
    for start, end in partition([round(x) for x in sizes], stages):
        blocks = sum(1 for u in range(start, end) if edges <= u < edges + layers)
        out.append((sum(sizes[start:end]), blocks / layers))
    return tuple(out)


def micro_batches(req: JobRequirements, width: int) -> int:
    """Micro-batches one stage-0 rank splits its share of a step into: whole sequences, at most the
    runtime's default (``strategy.micro_batches``), at least one."""
    sequences = req.global_batch_tokens // max(1, req.model.seq_len) // max(1, width)
    return max(1, min(PIPELINE_MICRO_BATCHES, sequences))


def stage_memory_gb(req: JobRequirements, stages: int, stage: int, micro: int,
                    cuts: list[tuple[float, float]] | None = None) -> float:
    """GB one worker of pipeline stage ``stage`` (of ``stages``) needs at the least: its stage's
    training state (:data:`TRAINING_STATE_BYTES` per parameter, the stage whole on every GPU: a
    pipeline's stages are not sharded), the activations of its blocks for the micro-batches 1F1B keeps
    in flight there, min(P − s, M), one sequence each (:func:`activation_bytes`), and
    :data:`RUNTIME_OVERHEAD_GB`."""
    params, blocks = (cuts or stage_cuts(req, stages))[stage]
    in_flight = min(stages - stage, micro)
    acts = activation_bytes(req, blocks=blocks) * in_flight
    return (params * TRAINING_STATE_BYTES + acts) / 1e9 + RUNTIME_OVERHEAD_GB


def predict_pipeline(req: JobRequirements, assignments: list[Assignment], offers: Mapping[str, ClusterOffer],
                     links: list[WanLink]) -> Prediction:
    """Time, WAN bytes and cost of a pipeline: assignment ``stage`` s at one site each, W GPUs per stage;
    with ``replica`` set, D copies of it on disjoint sites (the runtime's replicas, ``data_replicas``).

    Per step (T tokens, M micro-batches, P stages): stage s computes c_s = FLOPs · (its share of the
    parameters) / its site's throughput; a cut carries T · hidden · 4 B of activations forward and as
    many gradient bytes back (full duplex, so one direction's time counts), ℓ = bytes / B + M·α over
    the link between the two stages' sites. 1F1B runs M micro-batches through P stages in
    (M + P − 1) slots of the slowest of them, so a step takes (M + P − 1)/M · max(max c_s, max ℓ)
    (bubble (P − 1)/(M + P − 1)), then the first and last stage exchange the tied token table's
    gradient (vocab · hidden · 4 B each way) and every stage all-reduces its gradients inside its
    site. Stage 0 also sends the targets to the last stage (1 B per token).

    A user's ``nn.Sequential`` (spec.code, :func:`is_code`): ``layers`` equal units of parameters/layers
    each, a cut carries T · hidden · seqLen · 4 B each way (:func:`cut_floats`; T in the job's units),
    no tied table; the rest as above.

    D > 1 replicas: each runs that step on T/D tokens (its compute, activations and targets scale by
    1/D, the tied table does not; M from its D·W shares of the sequences) and the slowest replica
    bounds the step; then, every H steps (:func:`replica_inner_steps`), each stage's D copies average
    its parameters (fp32, 4 B each): a ring all-reduce over the D same-stage sites in replica order,
    2(D−1)/D · K_s bytes from each site to the next, timed at the slowest link of that ring (plus its
    2(D−1) RTT/2); the slowest stage's all-reduce, over H, is added to every step."""
    used = sorted((a for a in assignments if a.gpus > 0), key=lambda a: (a.replica or 0, a.stage is None, a.stage or 0))
    if not used or any(a.stage is None for a in used):
        raise ValueError("a pipeline placement names the stage of every assignment")
    replicas = sorted({a.replica or 0 for a in used})
    if replicas != list(range(len(replicas))):
        raise ValueError(f"pipeline replicas must be 0..{len(replicas) - 1}, got {replicas}")
    d = len(replicas)
    index = link_index(links)
    parts = [_replica_step(req, [a for a in used if (a.replica or 0) == r], offers, index, d) for r in replicas]
    stages = parts[0].stages
    if any(p.stages != stages for p in parts):
        raise ValueError(f"every replica of the pipeline runs {stages} stages, got {[p.stages for p in parts]}")
    per_step: dict[Key, float] = {}
    for part in parts:
        for hop, b in part.per_step.items():
            per_step[hop] = per_step.get(hop, 0.0) + b
    cuts = stage_cuts(req, stages)
    steps = budget_steps(req)
    h = replica_inner_steps(req, stages, d, steps) if d > 1 else 0
    average_s, average_bytes = 0.0, 0.0
    for s in range(stages if d > 1 else 0):
        ring = [part.order[s] for part in parts]
        size = cuts[s][0] * REPLICA_VALUE_BYTES
        ring_hops = [(ring[i], ring[(i + 1) % d]) for i in range(d)]
        for hop in ring_hops:
            if hop not in index:
                raise ValueError(f"no link between sites {hop[0]} and {hop[1]} (replicas of stage {s} average it)")
            per_step[hop] = per_step.get(hop, 0.0) + 2 * (d - 1) / d * size / h
            average_bytes += 2 * (d - 1) / d * size / h
        gbps = min(index[hop].bandwidth_gbps for hop in ring_hops)
        alpha = max(index[hop].rtt_ms for hop in ring_hops) / 2e3
        average_s = max(average_s, float(ring_allreduce_seconds(size, d, gbps, alpha)) / h)
    slowest = max(p.slowest for p in parts)
    factor, startup = _learned(req, "pipeline", used, dict(offers))
    step = (max(p.step for p in parts) + average_s) * factor
    total = steps * step + startup
    egress, gpu_seconds, cost = _bill(used, offers, index, per_step, steps, total)
    micro = max(p.micro for p in parts)
    return Prediction(
        strategy="pipeline", steps=steps, compute_seconds_per_step=slowest * factor,
        comm_seconds_per_step=step - slowest * factor, step_seconds=step, total_seconds=total,
        wan_bytes=sum(egress.values()), intra_bytes=sum(p.intra_bytes for p in parts) * steps,
        gpu_seconds_by_cluster=gpu_seconds, egress_bytes_by_link=egress, est_cost=cost, step_factor=factor,
        startup_seconds=startup, bubble_fraction=(stages - 1) / (micro + stages - 1),
        replica_seconds_per_step=average_s * factor, replica_wan_bytes=average_bytes * steps, replica_inner_steps=h,
        memory_gb_per_gpu=max(stage_memory_gb(req, stages, s, micro, cuts) for s in range(stages)),
    )


# the replicas' averaging sends fp32 parameters (or, with H = 1, fp32 gradients): no codec
REPLICA_VALUE_BYTES = 4


def replica_inner_steps(req: JobRequirements, stages: int, replicas: int, steps: int) -> int:
    """H, the steps between two averagings of the pipeline's replicas: the spec's inner_steps (at most
    the run's steps, as the attempt's TrainConfig caps it), or unset the runtime's own rule
    (:func:`cpn.runtime.autotune.replica_inner_steps`: one source)."""
    if "inner_steps" not in req.autotuned:
        return max(1, min(req.inner_steps, steps))
    from cpn.runtime.autotune import replica_inner_steps as runtime_rule

    return runtime_rule(req.model.parameters, cut_floats(req), req.global_batch_tokens, stages, replicas,
                        max(1, steps))


@dataclass
class _ReplicaStep:
    order: list[str]  # the replica's sites, stage by stage
    stages: int
    step: float  # seconds per step before the learned factor, without the replicas' averaging
    slowest: float  # the slowest stage's compute seconds
    micro: int
    per_step: dict[Key, float]
    intra_bytes: float  # per step


def _replica_step(req: JobRequirements, used: list[Assignment], offers: Mapping[str, ClusterOffer],
                  index: Mapping[Key, WanLink], replicas: int) -> _ReplicaStep:
    """One replica of the pipeline on its 1/``replicas`` of each step's tokens (see predict_pipeline)."""
    site_of: dict[int, str] = {}
    width: dict[int, int] = {}
    tflops: dict[int, float] = {}
    for a in used:
        assert a.stage is not None
        if site_of.setdefault(a.stage, a.site) != a.site:
            raise ValueError(f"stage {a.stage} spans sites {site_of[a.stage]} and {a.site}: one site per stage")
        width[a.stage] = width.get(a.stage, 0) + a.gpus
        tflops[a.stage] = tflops.get(a.stage, 0.0) + a.gpus * calibration.effective_tflops(
            offers[a.cluster].gpu_model, offers[a.cluster].tflops)
    stages = len(site_of)
    if sorted(site_of) != list(range(stages)):
        raise ValueError(f"pipeline stages must be 0..{stages - 1}, got {sorted(site_of)}")
    order = [site_of[s] for s in range(stages)]
    cuts = stage_cuts(req, stages)
    total_params = sum(p for p, _ in cuts)
    micro = micro_batches(req, width[0] * replicas)
    tokens = req.global_batch_tokens / replicas
    flops = flops_per_step(req) / replicas
    compute = [flops * cuts[s][0] / total_params / (tflops[s] * 1e12) for s in range(stages)]
    act = tokens * cut_floats(req) * ACTIVATION_VALUE_BYTES * wire_ratio(req.compression)
    tied = 0.0 if is_code(req) else PIPELINE_VOCAB * req.model.hidden * ACTIVATION_VALUE_BYTES
    per_step: dict[Key, float] = {}
    link_s = []
    for s in range(stages - 1):
        fwd, bwd = (order[s], order[s + 1]), (order[s + 1], order[s])
        if fwd not in index:
            raise ValueError(f"no link between sites {fwd[0]} and {fwd[1]}")
        link = index[fwd]
        link_s.append(act * 8 / (link.bandwidth_gbps * 1e9) + micro * link.rtt_ms / 2e3)
        per_step[fwd] = per_step.get(fwd, 0.0) + act
        per_step[bwd] = per_step.get(bwd, 0.0) + act
    ends = (order[0], order[-1])
    if ends not in index:
        raise ValueError(f"no link between sites {ends[0]} and {ends[1]} (first and last stage share the tied "
                         "token table)")
    per_step[ends] = per_step.get(ends, 0.0) + tied + tokens
    per_step[ends[::-1]] = per_step.get(ends[::-1], 0.0) + tied
    tied_s = (tied + tokens) * 8 / (index[ends].bandwidth_gbps * 1e9) + index[ends].rtt_ms / 2e3
    intra_gbps = intra_gbps_by_site(used, offers)
    intra = max(float(ring_allreduce_seconds(cuts[s][0] * GRADIENT_BYTES, width[s], intra_gbps[order[s]],
                                             INTRA_ALPHA_SECONDS)) for s in range(stages))
    slowest = max(compute)
    schedule = (micro + stages - 1) / micro * max(slowest, *link_s)
    intra_bytes = sum(2 * (width[s] - 1) * cuts[s][0] * GRADIENT_BYTES for s in range(stages))
    return _ReplicaStep(order, stages, schedule + tied_s + intra, slowest, micro, per_step, intra_bytes)


def _bill(used: list[Assignment], offers: Mapping[str, ClusterOffer], index: Mapping[Key, WanLink],
          per_step: Mapping[Key, float], steps: int, total: float) -> tuple[dict[Key, float], dict[str, float], float]:
    """(egress bytes per hop, GPU-seconds per cluster, cost) of a run of ``steps`` steps lasting
    ``total`` seconds: every used GPU is paid for the whole run, every hop for what it carried."""
    egress = {hop: b * steps for hop, b in per_step.items()}
    gpu_seconds: dict[str, float] = {}
    for a in used:
        gpu_seconds[a.cluster] = gpu_seconds.get(a.cluster, 0.0) + a.gpus * total
    cost = sum(sec / 3600 * float(offers[c].price_per_gpu_hour) for c, sec in gpu_seconds.items())
    cost += sum(b / 1e9 * float(index[hop].price_per_gb) for hop, b in egress.items())
    return egress, gpu_seconds, cost
