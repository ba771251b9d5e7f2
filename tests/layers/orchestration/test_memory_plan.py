"""The planner's memory model (issue 28): what one GPU holds, sharded or not, with and without
activation checkpointing, and the plan it picks per placement — whole when it fits, sharded over the
site when not, checkpointing only when sharding is not enough — each priced."""

from __future__ import annotations

from dataclasses import replace

import pytest

from layers.orchestration.planning import perf
from layers.orchestration.planning.types import JobRequirements, ModelShape

P, L, H, S, V = 7_000_000_000, 32, 4096, 4096, 32_000
SEVEN_B = JobRequirements(model=ModelShape(P, L, H, S, vocab=V), tokens=10**9, global_batch_tokens=2**20)
GB = 1e9


def test_one_gpu_holds_sixteen_bytes_a_parameter_its_activations_and_the_runtime() -> None:
    whole = perf.worker_memory_gb(SEVEN_B)
    activations = (34 * S * H * L + 6 * S * V) / GB  # Korthikanti et al.'s 34·s·h per layer, the logits
    assert whole == pytest.approx(16 * P / GB + activations + 1.0)
    block = 12 * H**2 + 13 * H  # FSDP2's gathered blocks: 2 x 2 B of bf16 parameters + 4 B of fp32 gradients
    assert perf.worker_memory_gb(SEVEN_B, shard=8) == pytest.approx(16 * P / 8 / GB + 8 * block / GB + activations + 1.0)
    kept = (2 * S * H * L + 34 * S * H + 6 * S * V) / GB  # each block's input, one block recomputed
    assert perf.worker_memory_gb(SEVEN_B, checkpointing=True) == pytest.approx(16 * P / GB + kept + 1.0)
    assert perf.worker_memory_gb(SEVEN_B, shard=1) == whole  # one rank: nothing to shard over, no buffers


def _plan(req: JobRequirements, ranks: int, memory: float, compute: float = 1.0) -> perf.MemoryPlan:
    return perf.memory_plan(req, "diloco", {"a": ranks, "b": ranks}, {"a": memory, "b": memory},
                            {"a": 600.0, "b": 600.0}, compute)


def test_the_plan_shards_only_when_whole_does_not_fit_and_recomputes_only_when_sharding_is_not_enough() -> None:
    small = replace(SEVEN_B, model=ModelShape(100_000_000, 12, 768, 1024, vocab=V))
    assert (_plan(small, 8, 80).shard, _plan(small, 8, 80).checkpointing) == ("none", "none")
    sharded = _plan(SEVEN_B, 8, 80)  # 112 GB of state: 14 GB a GPU over 8, activations fit beside it
    assert (sharded.shard, sharded.checkpointing, sharded.fits) == ("site", "none", True)
    assert sharded.extra_compute == 0 and sharded.extra_comm == pytest.approx(perf.shard_gather_seconds(SEVEN_B, 8, 600))
    assert sharded.extra_comm == pytest.approx(2 * (7 / 8 * 2 * P * 8 / 600e9 + 7 * perf.INTRA_ALPHA_SECONDS))
    both = _plan(SEVEN_B, 4, 48, compute=3.0)  # 28 GB of state + 23 GB of activations > 48: recompute too
    assert (both.shard, both.checkpointing, both.fits) == ("site", "full", True)
    assert both.extra_compute == pytest.approx(1.0) and both.gb_per_gpu <= 48
    hopeless = _plan(SEVEN_B, 1, 80)  # one GPU a site: the least it could need, and not fitting
    assert not hopeless.fits and hopeless.checkpointing == "full"
    assert hopeless.gb_per_gpu == pytest.approx(perf.worker_memory_gb(SEVEN_B, checkpointing=True))


def test_what_the_spec_fixes_is_kept_and_strategies_that_cannot_shard_hold_whole_replicas() -> None:
    pinned = _plan(replace(SEVEN_B, shard="none"), 8, 80)
    assert pinned.shard == "none" and not pinned.fits
    assert _plan(replace(SEVEN_B, activation_checkpointing="full"), 8, 80).checkpointing == "full"
    assert perf.memory_options(SEVEN_B, "gossip") == [("none", "none"), ("none", "full")]
    assert perf.memory_options(replace(SEVEN_B, workload="code:abc"), "ddp") == [("none", "none")]


def test_a_prediction_carries_its_plan_and_pays_for_it() -> None:
    from decimal import Decimal

    from layers.orchestration.planning.types import Assignment, ClusterOffer

    offers = {c: ClusterOffer(name=c, site=c, region="r", provider="p", gpu_model="H100", tflops=989.0, memory_gb=48,
                              free_gpus=8, price_per_gpu_hour=Decimal("2"), intra_node_gbps=600.0) for c in "ab"}
    placement = [Assignment("a", "a", 4, "H100"), Assignment("b", "b", 4, "H100")]
    from layers.orchestration.planning.types import WanLink

    links = [WanLink("a", "b", 10.0, 20.0, Decimal("0.02"))]
    req = replace(SEVEN_B, inner_steps=50, overlap=False)
    pred = perf.predict(req, placement, "diloco", offers, links)
    roomy = perf.predict(req, placement, "diloco", {c: replace(o, memory_gb=0) for c, o in offers.items()}, links)
    assert (pred.shard, pred.activation_checkpointing, pred.fits_memory) == ("site", "full", True)
    assert (roomy.shard, roomy.activation_checkpointing) == ("none", "none")  # not reported: taken to fit
    assert pred.compute_seconds_per_step == pytest.approx(roomy.compute_seconds_per_step * 4 / 3)
    assert pred.comm_seconds_per_step == pytest.approx(roomy.comm_seconds_per_step
                                                       + perf.shard_gather_seconds(req, 4, 600.0))
    assert pred.memory_gb_per_gpu == pytest.approx(perf.worker_memory_gb(req, shard=4, checkpointing=True))


def test_the_state_bytes_are_what_cpn_bench_memory_measured() -> None:
    """docs/benchmarks/memory.json (`cpn bench memory`, 4 CPU ranks): the tensors' storage per rank, whole
    and sharded over the site, against the planner's 16 B per parameter (÷ W sharded); within 10 %."""
    import json
    from pathlib import Path

    runs = json.loads((Path(__file__).parents[3] / "docs/benchmarks/memory.json").read_text())["runs"]
    checked = 0
    for run in runs.values():
        for r in run["results"]:
            ranks = r["workers"] if r["shard"] == "site" else 1
            predicted = r["parameters"] * perf.TRAINING_STATE_BYTES / ranks
            assert abs(r["state_bytes_per_rank"] - predicted) <= 0.10 * predicted, (run["model"], r)
            checked += 1
    assert checked >= 4  # two models, shard none and site
