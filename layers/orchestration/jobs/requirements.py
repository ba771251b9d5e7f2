"""Turn a TrainingJob spec into the planner's typed requirements, and offers into planner inputs."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from cpn.core.errors import Infeasible
from layers.control.capacity import OfferSet, PoolOffer
from layers.orchestration.planning.types import (
    ClusterOffer,
    JobRequirements,
    ModelShape,
    Objective,
    WanLink,
    workload_of,
)
from layers.resource.capacity import LinkView
from layers.service.schemas import TrainingJobSpec, deadline_seconds, strategy_knobs


def requirements(spec: TrainingJobSpec, now: datetime | None = None) -> JobRequirements:
    """The planner's view of `spec`. dataReplicas > 1 asks for replicas of a pipeline, so with strategy
    auto it means the pipeline (as pipelineStages does, placement.pipeline_mode)."""
    shape = spec.model.shape()  # type: ignore[union-attr]
    deadline = deadline_seconds(spec.deadline, now or datetime.now(UTC)) if spec.deadline else None
    if deadline is not None and deadline <= 0:
        raise Infeasible(f"{spec.deadline} is in the past" if deadline < 0 else f"{spec.deadline} leaves no time",
                         field="spec.deadline")
    replicas = spec.parallelism.data_replicas if spec.parallelism else 1
    strategy = "pipeline" if replicas > 1 and spec.strategy == "auto" else spec.strategy
    return JobRequirements(
        model=ModelShape(parameters=shape["parameters"], layers=shape["layers"], hidden=shape["hidden"],
                         seq_len=shape["seqLen"], flops_per_unit=shape.get("flopsPerUnit"),
                         bytes_per_unit=shape.get("bytesPerUnit"), vocab=shape.get("vocab") or 0),
        tokens=spec.tokens, global_batch_tokens=spec.global_batch_tokens, strategy=strategy,
        compression=None if spec.compression in (None, "none") else spec.compression, staleness=spec.staleness,
        **_ps(spec), gpus_max=spec.gpus.max,
        **{k: v for k, v in (("inner_steps", spec.inner_steps), ("overlap", spec.overlap)) if v is not None},
        autotuned=frozenset(k for k in ("inner_steps", "compression", "overlap") if getattr(spec, k) is None),
        gpu_models=frozenset(spec.gpus.models) or None, sites_max=spec.sites.max,
        regions=frozenset(spec.placement.regions) or None, sites=frozenset(spec.placement.sites) or None,
        exclude_sites=frozenset(spec.placement.exclude_sites), deadline_seconds=deadline,
        budget=Decimal(spec.budget) if spec.budget is not None else None, currency=spec.currency,
        workload=workload_of(spec.code.digest if spec.code is not None else None),
        stages=spec.parallelism.pipeline_stages if spec.parallelism else None,
        data_replicas=replicas,
        shard=spec.parallelism.shard if spec.parallelism else "auto",
        activation_checkpointing=spec.parallelism.activation_checkpointing if spec.parallelism else "auto")


def _ps(spec: TrainingJobSpec) -> dict[str, int]:
    """The parameter-server knobs, and the least GPUs and sites they need: more workers than backup
    workers, a site for each copy of a shard (schemas.py refuses a spec whose maxima cannot)."""
    knobs = strategy_knobs(spec, spec.strategy)
    backups, replicas = knobs.get("backup_workers", 0), knobs.get("ps_replicas", 0)
    return {"backup_workers": backups, "ps_replicas": replicas, "gpus_min": max(spec.gpus.min, backups + 1),
            "sites_min": max(spec.sites.min, replicas + 1)}


def objective(spec: TrainingJobSpec) -> Objective:
    o = spec.objective
    if o.cost == 0 and o.time == 0:
        return Objective(0.5, 0.5)
    return Objective(cost=o.cost, time=o.time)


def planner_inputs(offers: list[PoolOffer], links: list[LinkView], currency: str
                   ) -> tuple[list[ClusterOffer], list[WanLink]]:
    cluster_offers = [ClusterOffer(
        name=o.offer, site=o.site, region=o.region, provider=o.provider, gpu_model=o.gpu_model, tflops=o.tflops,
        memory_gb=o.memory_gb, free_gpus=o.free_gpus, price_per_gpu_hour=o.price_per_gpu_hour, currency=o.currency,
        intra_node_gbps=o.intra_node_gbps, inter_node_gbps=o.inter_node_gbps, gpus_per_node=o.gpus_per_node,
        driver=o.driver)
        for o in offers if o.currency == currency and o.free_gpus > 0]
    wan = [WanLink(a=ln.a, b=ln.b, bandwidth_gbps=ln.bandwidth_gbps, rtt_ms=ln.rtt_ms,
                   price_per_gb=Decimal(ln.price_per_gb)) for ln in links]
    return cluster_offers, wan


class Frozen(tuple):  # type: ignore[type-arg]
    """A tuple that hashes its items once: an offer set's planner inputs are a key of the plan memo on
    every quote, and hashing ~200 offers each time cost more than looking the plans up."""

    def __hash__(self) -> int:
        try:
            return self.__dict__["_hash"]
        except KeyError:
            self.__dict__["_hash"] = h = super().__hash__()
            return h


def planner_inputs_of(found: OfferSet, currency: str) -> tuple[tuple[ClusterOffer, ...], tuple[WanLink, ...]]:
    """`planner_inputs` of an offer set, computed once per (offer set, currency) and shared: the
    same objects on every call while the offer set stands (read-only: frozen values)."""
    key = ("planner_inputs", currency)
    held = found.derived.get(key)
    if held is None:
        offers, wan = planner_inputs(list(found.offers), list(found.links), currency)
        if not offers:
            raise nothing_to_place_on(found, currency)
        held = found.derived[key] = (Frozen(offers), Frozen(wan))
    return held


def nothing_to_place_on(found: OfferSet, currency: str) -> Infeasible:
    """Why an offer set leaves the planner nothing: no Ready cluster with free GPUs (before the first
    agent heartbeat, or all leased), or none priced in the job's currency. Said here, where the
    clusters are known, because the planner given no offers could only blame the spec's GPU models."""
    free = [o for o in found.offers if o.free_gpus > 0]
    if free:
        offered = ", ".join(sorted({o.currency for o in free}))
        return Infeasible(f"no cluster with free GPUs prices in {currency} (offered: {offered})",
                          field="spec.currency")
    ready = [c for c in found.clusters if c.ready]
    if not found.clusters:
        why = "none registered; providers apply Cluster manifests"
    elif not ready:
        why = f"{len(found.clusters)} registered: 0 ready; their agents report them by heartbeat"
    else:
        why = f"{len(found.clusters)} registered: {len(ready)} ready, their GPUs all leased or unreported"
    return Infeasible(f"no Ready cluster has free GPUs ({why})")


def prediction_dict(pred: Any) -> dict[str, Any]:
    """The quote's prediction; replicas of a pipeline add their averaging (already in the step and in
    wanBytes): its seconds per step, its WAN bytes over the run and its period H in steps."""
    replicas = {"replicaSecondsPerStep": pred.replica_seconds_per_step, "replicaWanBytes": pred.replica_wan_bytes,
                "replicaInnerSteps": pred.replica_inner_steps} if getattr(pred, "replica_inner_steps", 0) else {}
    return {**replicas, "steps": pred.steps, "computeSecondsPerStep": pred.compute_seconds_per_step,
            "commSecondsPerStep": pred.comm_seconds_per_step, "stepSeconds": pred.step_seconds,
            "totalSeconds": pred.total_seconds, "wanBytes": pred.wan_bytes, "intraBytes": pred.intra_bytes,
            "gpuSecondsByCluster": pred.gpu_seconds_by_cluster, "stepFactor": pred.step_factor,
            "startupSeconds": pred.startup_seconds, "memoryGBPerGpu": pred.memory_gb_per_gpu, "shard": pred.shard,
            "activationCheckpointing": pred.activation_checkpointing}
