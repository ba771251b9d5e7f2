"""From a reserved job to what its runtime needs: sub-tasks, topology, training config."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cpn.runtime.catalogue import ELASTIC
from cpn.runtime.config import PS_STRATEGIES
from layers.control.topology import derive
from layers.resource.capacity import LinkView
from layers.service.schemas import MODEL_PRESETS, TrainingJobSpec, strategy_knobs


def survives_site_loss(topo: dict[str, Any], train: dict[str, Any]) -> bool:
    """Whether the attempt goes on when a site is lost, as the runtime decides it for this config on
    this topology (a pipeline with D ≥ 2 replicas averaged every H > 1 steps does; one source)."""
    from cpn.runtime.catalogue import survives_site_loss as runtime_rule
    from cpn.runtime.config import TrainConfig
    from cpn.runtime.topology import Topology

    try:
        return runtime_rule(TrainConfig.model_validate(train), Topology.model_validate(topo))
    except ValueError:  # the runtime's preflight refuses what it cannot run (attempt_plan said so first)
        return False


def elastic(status: dict[str, Any]) -> bool:
    """The job's attempt goes on without a lost site (``status.elastic``, written when the attempt was
    prepared; a job prepared before it was: by its strategy's name)."""
    stated = status.get("elastic")
    return bool(stated) if stated is not None else status.get("strategy") in ELASTIC
CODE_UNIT = 8  # spec.code jobs: the global batch is whole multiples of this many units per worker


def topology_for(placement: list[dict[str, Any]], ring: list[str], links: list[LinkView]) -> dict[str, Any]:
    """Placement lines carry their site's region (placements written before they did: none, so the
    job's sites are each a region of their own and hierarchical runs its two-level all-reduce). A
    pipeline's lines name their stage, and with D > 1 replicas their replica: its sites go replica-major,
    stage-minor, so site index d·P + s runs stage s of replica d (the runtime's order)."""
    ranks: dict[str, int] = {}
    regions: dict[str, str] = {}
    for p in placement:
        ranks[p["site"]] = ranks.get(p["site"], 0) + int(p["gpus"])
        if p.get("region"):
            regions[p["site"]] = p["region"]
    order = [s for s in ring if s in ranks] + [s for s in ranks if s not in ring]
    stage = {p["site"]: (int(p.get("replica") or 0), int(p["stage"])) for p in placement if p.get("stage") is not None}
    if stage:
        order.sort(key=lambda s: stage.get(s, (len(order), len(order))))
    return derive(order, ranks, links, regions=regions).model_dump(mode="json")


def rank_offsets(topology: dict[str, Any], placement: list[dict[str, Any]]) -> dict[str, int]:
    """Global rank of each placed cluster's first worker: sites in ring order, clusters of one site
    in placement order."""
    first: dict[str, int] = {}
    start = 0
    for site in topology["sites"]:
        at = start
        for p in placement:
            if p["site"] == site["name"]:
                first[p["cluster"]] = at
                at += int(p["gpus"])
        start += int(site["ranks"])
    return first


def memory_of(prediction: Mapping[str, Any] | None) -> dict[str, str] | None:
    """The memory plan a quote's prediction chose (perf.memory_plan), as the job's status keeps it;
    None for a quote priced before plans stated one (the runtime's defaults: whole replicas)."""
    if not prediction or "shard" not in prediction:
        return None
    return {"shard": prediction["shard"], "activationCheckpointing": prediction.get("activationCheckpointing", "none")}


def train_config(spec: TrainingJobSpec, strategy: str, workers: int, resume: str | None,
                 sites: int = 1, stages: int | None = None, memory: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The runtime's TrainConfig (as JSON) for this job. The run trains exactly ``spec.tokens``: whole
    global batches, then a last step trimmed to what is left (the runtime does it, see
    ``TrainConfig.step_tokens``), so `Succeeded` means 100 % of what was asked. The global batch is
    rounded up to whole sequences, at least one per worker (ranks take ⌊B/N⌋ or ⌈B/N⌉ of them); the
    quote and the job's events say so when it differs from the spec (`budget_note`).

    Strategy knobs the spec leaves unset stay unset (None): the runtime's autotune chooses them from
    the budget, the sites and the link (``cpn.runtime.autotune``), as for ``cpn train``. The
    parameter-server strategies get one server per site (``ps = sites``), the layout the compute
    model prices (``layers.orchestration.planning.perf``), and the spec's backupWorkers and
    psReplicas (``schemas.strategy_knobs``). A pipeline runs ``stages`` stages (default: one per site;
    fewer: sites / stages replicas of it, the runtime's ``strategy.stages``). ``memory`` (the accepted
    quote's plan, :func:`memory_of`) sets ``shard`` and ``activation_checkpointing``."""
    model: str | dict[str, Any]
    if spec.code is not None:  # the user's code builds its model; the runtime's config only counts units
        model, seq_len = "tiny", CODE_UNIT
    else:  # a preset's name, or a custom shape the runtime builds (spec.model's keys)
        model = spec.model.runtime_model()  # type: ignore[union-attr]
        seq_len = MODEL_PRESETS[model]["seqLen"] if isinstance(model, str) else int(model["seqLen"])
    batch = max(seq_len * workers, -(-spec.global_batch_tokens // seq_len) * seq_len)
    steps = -(-spec.tokens // batch)
    knobs = {"inner_steps": None if spec.inner_steps is None else max(1, min(spec.inner_steps, steps)),
             "compression": spec.compression or "auto", "overlap": spec.overlap}
    if knobs["overlap"] and strategy not in ("diloco", "local_sgd"):
        knobs["overlap"] = False
    cfg: dict[str, Any] = {
        "model": model, "tokens": spec.tokens, "global_batch_tokens": batch, "seq_len": seq_len,
        "strategy": {"name": strategy, **knobs, "staleness": spec.staleness,
                     **({"ps": min(sites, workers)} if strategy in PS_STRATEGIES else {}),
                     **strategy_knobs(spec, strategy),
                     **({"stages": stages or sites} if strategy == "pipeline" else {})},
        "val_every": max(1, steps // 10), "seed": 0,
        # elastic strategies: often (a lost site rejoins from the latest); diloco rounds up to outer steps
        "checkpoint_every": (knobs["inner_steps"] or max(1, steps // 20)) if strategy in ELASTIC else max(1, steps // 5),
    }
    if resume:
        cfg["resume"] = resume
    if memory is not None:
        cfg["shard"] = memory.get("shard", "none")
        cfg["activation_checkpointing"] = memory.get("activationCheckpointing", "none")
    return cfg


def attempt_plan(spec: TrainingJobSpec, strategy: str, placement: list[dict[str, Any]], ring: list[str],
                 links: list[LinkView], resume: str | None = None,
                 memory: Mapping[str, str] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The attempt's topology and TrainConfig, checked by the runtime's own validation and preflight:
    what a worker would refuse is refused here, at accept and again before any agent claims work.
    ``memory``: the plan's shard and activation checkpointing (:func:`memory_of`). Raises ValueError
    with the runtime's reason."""
    from cpn.runtime.config import TrainConfig
    from cpn.runtime.topology import Topology
    from cpn.runtime.train import preflight

    topo = topology_for(placement, ring, links)
    workers = sum(site["ranks"] for site in topo["sites"])
    stages = len({int(p["stage"]) for p in placement if p.get("stage") is not None}) or None
    train = train_config(spec, strategy, workers, resume, sites=len(topo["sites"]), stages=stages, memory=memory)
    config = TrainConfig.model_validate(train)
    config.sequences_per_worker(workers)
    preflight(config, Topology.model_validate(topo), builtin_model=spec.code is None)
    return topo, train


def budget_note(spec: TrainingJobSpec, train: dict[str, Any]) -> str | None:
    """What the run trains, said in the user's terms when its batch is not what the spec asked."""
    batch, tokens = int(train["global_batch_tokens"]), int(train["tokens"])
    if batch == spec.global_batch_tokens and tokens == spec.tokens:
        return None
    full, last = divmod(tokens, batch)
    steps = f"{full:,} steps × {batch:,}" + (f" and a last step of {last:,}" if last else "")
    if batch != spec.global_batch_tokens:
        steps += f" (batch of whole {train['seq_len']}-token sequences, at least one per worker)"
    return f"trains {tokens:,} tokens: {steps}"
