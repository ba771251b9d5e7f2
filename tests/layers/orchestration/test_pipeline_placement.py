"""Pipeline placement (issue 14): per-stage memory, the 1F1B step model, the stage→site search, and
when `auto` takes a pipeline; D > 1 replicas of the pipeline (spec.parallelism.dataReplicas) on
disjoint chains of sites, priced with the stages' cross-replica averaging."""

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


def gpu(name: str, site: str, memory: float = 100, gpus: int = 8, model: str = "RTX4090", tflops: float = 165.0,
        price: str = "0.60") -> ClusterOffer:
    return ClusterOffer(name=name, site=site, region="r", provider="p", gpu_model=model, tflops=tflops,
                        memory_gb=memory, free_gpus=gpus, price_per_gpu_hour=Decimal(price), inter_node_gbps=100.0)


def link(a: str, b: str, gbps: float, rtt: float = 20.0) -> WanLink:
    return WanLink(a, b, gbps, rtt, Decimal("0.02"))


def llama(**kw) -> JobRequirements:  # type: ignore[no-untyped-def]
    """A 7 B model on 100 GB GPUs: 16 B a parameter do not fit one whole, half of them do. Not sharded
    inside a site (that would hold it too, tests/layers/orchestration/test_memory_plan.py): the pipeline's
    own choices are what these tests check."""
    return JobRequirements(**{"model": LLAMA, "tokens": 2_000_000_000, "global_batch_tokens": 1_048_576,
                              "shard": "none", **kw})


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
    assert whole > 100  # a whole 7B replica (with its 4k-token activations) does not fit a 100 GB GPU
    cuts = perf.stage_cuts(req, 4)
    assert abs(sum(p for p, _ in cuts) - LLAMA.parameters) < 10 and abs(sum(b for _, b in cuts) - 1) < 1e-9
    m = perf.micro_batches(req, 1)
    needs = [perf.stage_memory_gb(req, 4, s, m, cuts) for s in range(4)]
    params, blocks = cuts[0]
    assert needs[0] == pytest.approx((params * perf.TRAINING_STATE_BYTES
                                      + perf.ACTIVATION_BYTES * 4096 * 32 * 4096 * blocks * min(4, m)) / 1e9
                                     + perf.RUNTIME_OVERHEAD_GB)
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
    slow_big = gpu("big", "S", memory=160, gpus=2, model="A100", tflops=312.0, price="1.00")
    fast = [gpu("f1", "F1", gpus=8), gpu("f2", "F2", gpus=8), gpu("f3", "F3", gpus=8)]
    links = [link(a, b, 100.0) for a, b in (("S", "F1"), ("S", "F2"), ("F1", "F2"), ("F2", "F3"), ("F1", "F3"),
                                            ("S", "F3"))]
    plan = placement.plan(llama(), [slow_big, *fast], links, FASTEST)
    whole = placement.plan(llama(strategy="ddp"), [slow_big, *fast], links, FASTEST)
    assert whole.strategy == "ddp" and {a.site for a in whole.assignments} == {"S"}  # only S holds it whole
    assert plan.strategy == "pipeline" and plan.prediction.total_seconds < whole.prediction.total_seconds
    roomy = [replace(o, memory_gb=160) for o in fast]
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
    uncut = llama(workload="code:abc", model=replace(LLAMA, parameters=12 * 10**9, layers=1))  # no layers stated
    assert "spec.model.layers" in (pipeline.allowed(uncut) or "")
    with pytest.raises(Infeasible) as caught:  # auto: it stays whole, as before a user's model could be cut
        placement.plan(uncut, offers, links, BALANCED)
    assert caught.value.field == "spec.model"
    with pytest.raises(Infeasible) as caught:  # asked for: the reason, at the field to add
        placement.plan(replace(uncut, strategy="pipeline"), offers, links, BALANCED)
    assert caught.value.field == "spec.model.layers" and "add spec.model.layers" in caught.value.message
    cut = placement.plan(llama(workload="code:abc"), offers, links, BALANCED)  # 32 children: nothing else fits
    assert cut.strategy == "pipeline" and sorted(a.stage for a in cut.assignments) == [0, 1]


FOUR = "ABCD"


def _four(**kw) -> tuple[list[ClusterOffer], list[WanLink]]:  # type: ignore[no-untyped-def]
    offers = [gpu(x, x, **kw) for x in FOUR]
    return offers, [link(a, b, 100.0) for i, a in enumerate(FOUR) for b in FOUR[i + 1:]]


def test_two_replicas_run_on_disjoint_chains_with_their_replica_and_stage() -> None:
    offers, links = _four()
    req = llama(strategy="pipeline", data_replicas=2, stages=2)
    plan = placement.plan(req, offers, links, BALANCED)
    assert plan.strategy == "pipeline" and plan.solver == "heuristic"
    slots = {(a.replica, a.stage): a.site for a in plan.assignments}
    assert sorted(slots) == [(0, 0), (0, 1), (1, 0), (1, 1)], plan.assignments  # 4 lines of stage
    assert len(set(slots.values())) == 4, slots  # every (replica, stage) on a site of its own
    widths: dict[tuple[int | None, int | None], int] = {}
    for a in plan.assignments:
        widths[(a.replica, a.stage)] = widths.get((a.replica, a.stage), 0) + a.gpus
    assert len(set(widths.values())) == 1, widths  # one width W everywhere
    assert plan.ring == [slots[(d, s)] for d in (0, 1) for s in (0, 1)]  # replica-major, stage-minor
    one = placement.plan(llama(strategy="pipeline", stages=2), offers, links, BALANCED)
    assert all(a.replica is None for a in one.assignments)  # one pipeline: its lines as before


def test_the_replicas_step_is_the_slowest_replica_on_half_the_batch_plus_the_averaging() -> None:
    req = llama(strategy="pipeline", data_replicas=2, compression=None)
    offers = {"a": gpu("a", "A", memory=80, model="H100", tflops=989.0), "b": gpu("b", "B", memory=80, model="H100",
                                                                                   tflops=989.0),
              "c": gpu("c", "C"), "d": gpu("d", "D")}
    fast = [Assignment("a", "A", 8, "H100", stage=0, replica=0), Assignment("b", "B", 8, "H100", stage=1, replica=0)]
    slow = [Assignment("c", "C", 8, "RTX4090", stage=0, replica=1),
            Assignment("d", "D", 8, "RTX4090", stage=1, replica=1)]
    links = [link(a, b, 100.0) for i, a in enumerate(FOUR) for b in FOUR[i + 1:]]
    pred = perf.predict_pipeline(req, fast + slow, offers, links)
    half = replace(req, data_replicas=1, global_batch_tokens=req.global_batch_tokens // 2)
    alone = [perf.predict_pipeline(half, [replace(a, replica=None) for a in r], offers, links) for r in (fast, slow)]
    assert alone[1].step_seconds > alone[0].step_seconds  # the RTX replica is the slower
    h = perf.replica_inner_steps(req, 2, 2, pred.steps)
    assert h == req.inner_steps == pred.replica_inner_steps == 100  # the spec's H (not autotuned here)
    cuts = perf.stage_cuts(req, 2)
    averaging = max(perf.ring_allreduce_seconds(p * 4, 2, 100.0, 20.0 / 2e3) for p, _ in cuts) / h
    assert pred.replica_seconds_per_step == pytest.approx(averaging) and averaging > 0
    assert pred.step_seconds == pytest.approx(alone[1].step_seconds + averaging)
    # WAN bytes: each replica's cuts, tied table and targets on half the batch, plus every stage's
    # 2(D−1)/D · 4 B · K_s from each of its two sites every H steps
    act = req.global_batch_tokens // 2 * 4096 * 4
    tied = perf.PIPELINE_VOCAB * 4096 * 4
    per_replica = 2 * act + 2 * tied + req.global_batch_tokens // 2
    replica_bytes = sum(2 * (2 * (2 - 1) / 2 * p * 4) for p, _ in cuts) / h
    assert pred.replica_wan_bytes == pytest.approx(replica_bytes * pred.steps)
    assert pred.wan_bytes == pytest.approx((2 * per_replica + replica_bytes) * pred.steps)
    assert pred.egress_bytes_by_link[("A", "C")] == pytest.approx(cuts[0][0] * 4 / h * pred.steps)
    slower = perf.predict_pipeline(replace(req, inner_steps=1), fast + slow, offers, links)  # average every step
    assert slower.replica_seconds_per_step == pytest.approx(averaging * h)
    assert slower.wan_bytes > pred.wan_bytes + 50 * pred.replica_wan_bytes


def test_unset_h_is_the_runtimes_rule_for_replicas() -> None:
    from cpn.runtime.autotune import resolve
    from cpn.runtime.config import TrainConfig
    from cpn.runtime.topology import Topology

    shape = MODEL_PRESETS["tiny"]
    req = JobRequirements(model=ModelShape(shape["parameters"], shape["layers"], shape["hidden"], shape["seqLen"]),
                          tokens=2_000_000, global_batch_tokens=1024, strategy="pipeline", data_replicas=2,
                          autotuned=frozenset({"inner_steps", "compression", "overlap"}))
    steps = perf.budget_steps(req)
    cfg = TrainConfig.model_validate({"model": "tiny", "tokens": req.tokens, "global_batch_tokens": 1024,
                                      "seq_len": shape["seqLen"], "strategy": {"name": "pipeline", "stages": 2}})
    topo = Topology.model_validate({"sites": [{"name": f"s{i}", "ranks": 1} for i in range(4)]})
    runtime_h = resolve(cfg, topo).strategy.inner_steps
    assert perf.replica_inner_steps(req, 2, 2, steps) == runtime_h and runtime_h > 1


def test_replicas_that_the_sites_cannot_hold_name_data_replicas() -> None:
    offers, links = _four()
    with pytest.raises(Infeasible) as caught:  # 2 x 3 stages: 6 sites, 4 here
        placement.plan(llama(strategy="pipeline", data_replicas=2, stages=3), offers, links, BALANCED)
    assert caught.value.field == "spec.parallelism.dataReplicas" and "need 6 sites" in caught.value.message
    with pytest.raises(Infeasible) as caught:  # 3 replicas of the least pipeline (2 stages): 6 sites
        placement.plan(llama(strategy="pipeline", data_replicas=3), offers, links, BALANCED)
    assert caught.value.field == "spec.parallelism.dataReplicas", caught.value
    with pytest.raises(Infeasible) as caught:  # the same stage's sites must be linked: they average over it
        placement.plan(llama(strategy="pipeline", data_replicas=2, stages=2), offers,
                       [link("A", "B", 100.0), link("C", "D", 100.0)], BALANCED)
    assert caught.value.field == "spec.parallelism.dataReplicas", caught.value
    with pytest.raises(Infeasible) as caught:  # a user's model says how many children it has, or is not cut
        placement.plan(llama(strategy="pipeline", data_replicas=2, workload="code:abc", model=replace(LLAMA, layers=1)),
                       offers, links, BALANCED)
    assert caught.value.field == "spec.model.layers", caught.value
    code = placement.plan(llama(strategy="pipeline", data_replicas=2, workload="code:abc"), offers, links, BALANCED)
    assert sorted((a.replica, a.stage) for a in code.assignments) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def _code(**kw) -> JobRequirements:  # type: ignore[no-untyped-def]
    """A user's nn.Sequential (spec.code): 6 children, 2048 values per position across a cut, 16 positions."""
    return JobRequirements(**{"model": ModelShape(600_000_000, 6, 2048, 16), "tokens": 10_000_000,
                              "global_batch_tokens": 4096, "workload": "code:abc", **kw})


def test_a_users_sequential_is_cut_where_the_runtime_cuts_it_into_equal_children() -> None:
    from torch import nn

    from cpn.runtime.stages import cut_model

    children = nn.Sequential(*(nn.Linear(64, 64) for _ in range(6)))  # equal children, 4160 parameters each
    req = _code(model=ModelShape(6 * 4160, 6, 64, 1))
    assert perf.max_stages(req) == 6 and perf.max_stages(replace(req, workload="lm")) == 8
    for stages in (2, 3, 4, 5):
        real = [(c.end - c.start) * 4160 for c in cut_model(children, stages)]
        planned = perf.stage_cuts(req, stages)
        assert [round(p) for p, _ in planned] == real, (stages, planned, real)
        assert [b for _, b in planned] == pytest.approx([n / 4160 / 6 for n in real])  # every child is a block
    big = _code()
    cuts = perf.stage_cuts(big, 3)
    assert cuts == [(2e8, pytest.approx(1 / 3))] * 3
    micro = perf.micro_batches(big, 1)  # whole 16-unit sequences, at most the runtime's default
    assert micro == min(perf.PIPELINE_MICRO_BATCHES, 4096 // 16)
    activations = perf.ACTIVATION_BYTES * 2048 * 6 * 16 / 3  # one sequence through a third of the children
    for s in range(3):
        assert perf.stage_memory_gb(big, 3, s, micro, cuts) == pytest.approx(
            (2e8 * perf.TRAINING_STATE_BYTES + activations * min(3 - s, micro)) / 1e9 + perf.RUNTIME_OVERHEAD_GB)


def test_a_users_cut_carries_hidden_times_seq_len_and_no_tied_table() -> None:
    req = _code()
    offers = {"a": gpu("a", "A", memory=80, gpus=8, model="H100", tflops=989.0),
              "b": gpu("b", "B", memory=80, gpus=8, model="H100", tflops=989.0)}
    plan = [Assignment("a", "A", 8, "H100", stage=0), Assignment("b", "B", 8, "H100", stage=1)]
    for gbps in (100.0, 0.1):
        links = [link("A", "B", gbps)]
        pred = perf.predict_pipeline(req, plan, offers, links)
        act = 4096 * 2048 * 16 * 4  # units x hidden x seqLen x 4 B, each way
        assert pred.wan_bytes / pred.steps == pytest.approx(2 * act + 4096)  # and 1 B of targets per unit
        m = perf.micro_batches(req, 8)
        compute = perf.flops_per_step(req) / 2 / (8 * perf.calibration.effective_tflops("H100", 989.0) * 1e12)
        cut = act * 8 / (gbps * 1e9) + m * 20.0 / 2e3
        targets = 4096 * 8 / (gbps * 1e9) + 20.0 / 2e3
        intra = perf.intra_gbps_by_site(plan, offers)
        allreduce = float(perf.ring_allreduce_seconds(3e8 * perf.GRADIENT_BYTES, 8, intra["A"], perf.INTRA_ALPHA_SECONDS))
        assert pred.compute_seconds_per_step == pytest.approx(compute)
        assert pred.step_seconds == pytest.approx((m + 1) / m * max(compute, cut) + targets + allreduce)
        lm = perf.predict_pipeline(replace(req, workload="lm"), plan, offers, links)  # the LM's: hidden, tied table
        assert lm.wan_bytes / lm.steps == pytest.approx(4096 * 2048 * 4 * 2 + 2 * perf.PIPELINE_VOCAB * 2048 * 4 + 4096)


def test_auto_keeps_a_users_code_data_parallel_while_a_gpu_holds_it_whole() -> None:
    offers, links = _four(memory=80)
    assert placement.plan(_code(), offers, links, FASTEST).strategy != "pipeline"
    staged = placement.plan(_code(strategy="pipeline"), offers, links, FASTEST)
    assert staged.strategy == "pipeline" and len({a.stage for a in staged.assignments}) >= 2
    too_small = [replace(o, memory_gb=perf.worker_memory_gb(_code()) * 0.9) for o in offers]
    assert placement.plan(_code(), too_small, links, FASTEST).strategy == "pipeline"  # nothing else fits
    with pytest.raises(Infeasible) as caught:  # more stages than children
        placement.plan(_code(stages=7), [*offers, *(gpu(x, x, memory=80) for x in "EFG")],
                       [link(a, b, 100.0) for i, a in enumerate("ABCDEFG") for b in "ABCDEFG"[i + 1:]], FASTEST)
    assert caught.value.field == "spec.model.layers" and "spec.model.layers 6" in caught.value.message
