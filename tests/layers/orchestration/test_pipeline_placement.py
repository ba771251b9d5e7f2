"""Pipeline placement (issue 14): per-stage memory, the 1F1B step model, the stage→site search, and
when `auto` takes a pipeline."""

from __future__ import annotations

import time
from dataclasses import replace
from decimal import Decimal

import pytest

from cpn.core.errors import Infeasible
from cpn.runtime.model import TransformerLM
from cpn.runtime.presets import PRESETS
from cpn.runtime.stages import unit_sizes
from layers.orchestration.planning import perf, pipeline, placement
from layers.orchestration.planning.types import (
    Assignment,
    ClusterOffer,
    JobRequirements,
    ModelShape,
    Objective,
    WanLink,
)
from layers.service.schemas import MODEL_PRESETS

BALANCED = Objective(cost=0.5, time=0.5)
FASTEST = Objective(cost=0.0, time=1.0)
LLAMA = ModelShape(6_700_000_000, 32, 4096, 4096)


def gpu(name: str, site: str, memory: float = 40, gpus: int = 8, model: str = "RTX4090", tflops: float = 165.0,
        price: str = "0.60") -> ClusterOffer:
    return ClusterOffer(name=name, site=site, region="r", provider="p", gpu_model=model, tflops=tflops,
                        memory_gb=memory, free_gpus=gpus, price_per_gpu_hour=Decimal(price), inter_node_gbps=100.0)


def link(a: str, b: str, gbps: float, rtt: float = 20.0) -> WanLink:
    return WanLink(a, b, gbps, rtt, Decimal("0.02"))


def llama(**kw) -> JobRequirements:  # type: ignore[no-untyped-def]
    return JobRequirements(**{"model": LLAMA, "tokens": 2_000_000_000, "global_batch_tokens": 1_048_576, **kw})


def test_the_planners_cut_is_the_runtimes_for_the_built_in_models() -> None:
    for name in ("small", "medium"):
        shape = MODEL_PRESETS[name]
        req = JobRequirements(model=ModelShape(shape["parameters"], shape["layers"], shape["hidden"], shape["seqLen"]),
                              tokens=1, global_batch_tokens=1)
        real = unit_sizes(TransformerLM(PRESETS[name]))
        blocks = perf._units(req)[1:-1]
        assert all(abs(b - r) / r < 1e-9 for b, r in zip(blocks, real[1:-1], strict=True)), (blocks, real)
        assert abs(sum(perf._units(req)) - shape["parameters"]) < 1


def test_a_stage_needs_its_share_of_the_state_and_its_activations_in_flight() -> None:
    req = llama()
    whole = perf.worker_memory_gb(req)
    assert whole > 40  # a whole 7B replica (with its 4k-token activations) does not fit a 40 GB GPU
    cuts = perf.stage_cuts(req, 4)
    assert abs(sum(p for p, _ in cuts) - LLAMA.parameters) < 10 and abs(sum(b for _, b in cuts) - 1) < 1e-9
    m = perf.micro_batches(req, 1)
    needs = [perf.stage_memory_gb(req, 4, s, m, cuts) for s in range(4)]
    params, blocks = cuts[0]
    assert needs[0] == pytest.approx((params * perf.TRAINING_STATE_BYTES
                                      + perf.ACTIVATION_BYTES * 4096 * 32 * 4096 * blocks * min(4, m)) / 1e9)
    assert needs[0] > needs[-1]  # stage 0 holds P micro-batches, the last stage one


def test_the_step_is_the_bubble_times_the_slower_of_compute_and_the_cut() -> None:
    req = llama(compression=None)
    offers = {"a": gpu("a", "A", memory=80, gpus=8, model="H100", tflops=989.0),
              "b": gpu("b", "B", memory=80, gpus=8, model="H100", tflops=989.0)}
    plan = [Assignment("a", "A", 8, "H100", stage=0), Assignment("b", "B", 8, "H100", stage=1)]
    for gbps in (100.0, 0.1):  # compute-bound, then link-bound
        pred = perf.predict_pipeline(req, plan, offers, [link("A", "B", gbps)])
        cuts = perf.stage_cuts(req, 2)
        per_stage = [perf.flops_per_step(req) * p / sum(q for q, _ in cuts) / (8 * 989.0 * 0.40 * 1e12)
                     for p, _ in cuts]
        m = perf.micro_batches(req, 8)
        act = req.global_batch_tokens * 4096 * 4
        cut = act * 8 / (gbps * 1e9) + m * 20.0 / 2e3
        schedule = (m + 1) / m * max(max(per_stage), cut)
        assert pred.bubble_fraction == pytest.approx(1 / (m + 1))
        assert pred.step_seconds > schedule and pred.step_seconds < schedule * 1.2 + 1.0, (pred.step_seconds, schedule)
        assert pred.compute_seconds_per_step == pytest.approx(max(per_stage))
        per_step = pred.wan_bytes / pred.steps
        tied = perf.PIPELINE_VOCAB * 4096 * 4
        assert per_step == pytest.approx(2 * act + 2 * tied + req.global_batch_tokens)
        if gbps < 1:
            assert cut > max(per_stage)  # the link binds
    int8 = perf.predict_pipeline(replace(req, compression="int8"), plan, offers, [link("A", "B", 0.1)])
    assert int8.step_seconds < pred.step_seconds and int8.wan_bytes < pred.wan_bytes / 3


def test_a_model_no_gpu_holds_is_cut_over_the_fast_links() -> None:
    offers = [gpu("a", "A"), gpu("b", "B"), gpu("c", "C")]
    links = [link("A", "B", 100.0), link("B", "C", 100.0), link("A", "C", 0.5)]
    plan = placement.plan(llama(), offers, links, BALANCED)
    assert plan.strategy == "pipeline" and plan.solver == "exact"
    order = [a.site for a in sorted(plan.assignments, key=lambda a: a.stage or 0)]
    assert plan.ring == list(dict.fromkeys(order))
    cuts = list(zip(plan.ring, plan.ring[1:], strict=False))
    assert ("A", "C") not in cuts and ("C", "A") not in cuts, plan.ring  # the slow link carries no cut
    widths = {}
    for a in plan.assignments:
        widths[a.stage] = widths.get(a.stage, 0) + a.gpus
    assert len(set(widths.values())) == 1  # the runtime needs the same workers at every stage
    three = placement.plan(llama(stages=3), offers, links, BALANCED)
    assert sorted({a.stage for a in three.assignments}) == [0, 1, 2] and three.ring[1] == "B"  # C–A: the tied ends


def test_auto_takes_a_pipeline_when_it_is_predicted_faster_and_keeps_data_parallel_otherwise() -> None:
    slow_big = gpu("big", "S", memory=80, gpus=2, model="A100", tflops=312.0, price="1.00")
    fast = [gpu("f1", "F1", gpus=8), gpu("f2", "F2", gpus=8), gpu("f3", "F3", gpus=8)]
    links = [link(a, b, 100.0) for a, b in (("S", "F1"), ("S", "F2"), ("F1", "F2"), ("F2", "F3"), ("F1", "F3"),
                                            ("S", "F3"))]
    plan = placement.plan(llama(), [slow_big, *fast], links, FASTEST)
    whole = placement.plan(llama(strategy="ddp"), [slow_big, *fast], links, FASTEST)
    assert whole.strategy == "ddp" and {a.site for a in whole.assignments} == {"S"}  # only S holds it whole
    assert plan.strategy == "pipeline" and plan.prediction.total_seconds < whole.prediction.total_seconds
    roomy = [replace(o, memory_gb=80) for o in fast]
    assert placement.plan(llama(), roomy, links, FASTEST).strategy != "pipeline"


def test_a_large_catalogue_is_searched_over_its_strongest_sites_in_bounded_time() -> None:
    offers = [gpu(f"g{k}", f"S{k}", gpus=4 + k % 5) for k in range(14)]
    links = [link(f"S{i}", f"S{j}", 10.0 + (i * j) % 7) for i in range(14) for j in range(i + 1, 14)]
    t0 = time.perf_counter()
    plan = placement.plan(llama(), offers, links, BALANCED)
    assert time.perf_counter() - t0 < 20
    assert plan.strategy == "pipeline" and plan.solver == "heuristic"


def test_limits_bind_the_pipeline_too() -> None:
    offers = [gpu("a", "A"), gpu("b", "B")]
    links = [link("A", "B", 100.0)]
    with pytest.raises(Infeasible) as caught:
        placement.plan(llama(deadline_seconds=60.0), offers, links, BALANCED)
    assert caught.value.field == "spec.model" and "No pipeline" in caught.value.message
    with pytest.raises(Infeasible) as caught:
        placement.plan(llama(stages=3), offers, links, BALANCED)
    assert caught.value.field == "spec.parallelism.pipelineStages" and "at most 2 stages" in caught.value.message
    code = llama(workload="code:abc")
    assert pipeline.allowed(code) is not None
    with pytest.raises(Infeasible) as caught:  # the runtime cuts its own LM only: spec.code stays whole
        placement.plan(code, offers, links, BALANCED)
    assert caught.value.field == "spec.model"
