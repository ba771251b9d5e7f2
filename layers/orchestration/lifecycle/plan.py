"""From a reserved job to what its runtime needs: sub-tasks, topology, training config."""

from __future__ import annotations

from typing import Any

from layers.control.topology import derive
from layers.resource.capacity import LinkView
from layers.service.schemas import MODEL_PRESETS, RUNNABLE_PRESETS, TrainingJobSpec

ELASTIC = frozenset({"diloco", "local_sgd", "gossip", "async_ps"})


def topology_for(placement: list[dict[str, Any]], ring: list[str], links: list[LinkView]) -> dict[str, Any]:
    ranks: dict[str, int] = {}
    for p in placement:
        ranks[p["site"]] = ranks.get(p["site"], 0) + int(p["gpus"])
    order = [s for s in ring if s in ranks] + [s for s in ranks if s not in ring]
    return derive(order, ranks, links).model_dump(mode="json")


def train_config(spec: TrainingJobSpec, strategy: str, workers: int, resume: str | None) -> dict[str, Any]:
    """The runtime's TrainConfig (as JSON) for this job. The global batch is rounded to whole
    sequences per worker, which the runtime requires."""
    preset = spec.model.preset if not isinstance(spec.model, str) else spec.model  # type: ignore[union-attr]
    if preset not in RUNNABLE_PRESETS:
        raise ValueError(f"model {preset!r} has no runnable implementation in the CPN runtime; "
                         f"use one of {sorted(RUNNABLE_PRESETS)}")
    seq_len = MODEL_PRESETS[preset]["seqLen"]
    unit = seq_len * workers
    batch = max(unit, -(-spec.global_batch_tokens // unit) * unit)
    tokens = max(spec.tokens, batch)
    steps = max(1, tokens // batch)
    inner = max(1, min(spec.inner_steps, steps))
    cfg: dict[str, Any] = {
        "model": preset, "tokens": tokens, "global_batch_tokens": batch, "seq_len": seq_len,
        "strategy": {"name": strategy, "inner_steps": inner, "compression": spec.compression,
                     "overlap": spec.overlap and strategy in ("diloco", "local_sgd"), "staleness": spec.staleness},
        "val_every": max(1, steps // 10), "seed": 0,
        "checkpoint_every": inner if strategy in ELASTIC else max(1, steps // 5),
    }
    if resume:
        cfg["resume"] = resume
    return cfg
