"""The compute model with a measured profile (spec.profile): the profiled placement is predicted at its
measured step; more GPUs, another GPU model and other sites follow the model's own factors."""

from __future__ import annotations

from dataclasses import replace
from decimal import Decimal

import pytest

from layers.orchestration.planning import perf
from layers.orchestration.planning.calibration import effective_tflops
from layers.orchestration.planning.types import Assignment, Learned, Lesson, Profiled, WanLink
from tests.layers.orchestration.test_perf import BATCH, P, job
from tests.layers.orchestration.test_perf import offer as _offer


def offer(*args, **kw):  # type: ignore[no-untyped-def]
    """test_perf's offer with no GPU memory reported (taken to fit): the 7B model's 112 GB of training
    state would make the memory plan shard or checkpoint, priced on top of the measured step; the profile
    run measured whatever plan it ran with, and this file is about the profile factor alone."""
    return replace(_offer(*args, **kw), memory_gb=0)

MEASURED = 9.0  # seconds per step on 4 H100s of one site: ~1.5x what the model expects (6.3 s + all-reduce)


def profiled(**kw) -> Profiled:  # type: ignore[no-untyped-def]
    base = {"gpu_model": "H100", "tflops": 989.0, "gpus": 4, "intra_gbps": 900.0, "units_per_step": BATCH,
            "step_seconds": MEASURED, "startup_seconds": 150.0}
    return Profiled(**{**base, **kw})


def test_the_profiled_placement_is_predicted_at_its_measured_step_and_others_scale():
    req = job(profiled=profiled())
    offers = {"a": offer("a", "s1"), "c": offer("c", "s1", model="A100", tflops=312.0)}
    same = perf.predict(req, [Assignment("a", "s1", 4, "H100")], "ddp", offers, [])
    assert same.step_seconds == pytest.approx(MEASURED, rel=1e-12)
    # the profile's start-up is a floor over the sites' own (a Kubernetes site's 120 s here)
    assert same.total_seconds == pytest.approx(same.steps * MEASURED + 150.0)
    short = perf.predict(job(profiled=profiled(startup_seconds=42.0)), [Assignment("a", "s1", 4, "H100")], "ddp",
                         offers, [])
    assert short.startup_seconds == perf.STARTUP_BY_DRIVER["kubernetes"]
    intra4 = perf.ring_allreduce_seconds(4 * P, 4, 900.0, perf.INTRA_ALPHA_SECONDS)
    compute4 = MEASURED - intra4
    modelled = perf.predict(job(), [Assignment("a", "s1", 4, "H100")], "ddp", offers, [])
    assert perf.profile_factor(req) == pytest.approx(compute4 / modelled.compute_seconds_per_step)

    eight = perf.predict(req, [Assignment("a", "s1", 8, "H100")], "ddp", offers, [])
    assert eight.compute_seconds_per_step == pytest.approx(compute4 / 2)  # twice the GPUs, half the compute
    assert eight.comm_seconds_per_step == pytest.approx(float(perf.ring_allreduce_seconds(4 * P, 8, 900.0, 10e-6)))
    a100 = perf.predict(req, [Assignment("c", "s1", 4, "A100")], "ddp", offers, [])
    ratio = effective_tflops("H100", 989.0) / effective_tflops("A100", 312.0)
    assert a100.compute_seconds_per_step == pytest.approx(compute4 * ratio)  # the per-GPU factors

    offers2 = {"a": offer("a", "s1"), "b": offer("b", "s2")}
    links = [WanLink("s1", "s2", 10.0, 20.0, Decimal("0.02"))]
    two = perf.predict(req, [Assignment("a", "s1", 4, "H100"), Assignment("b", "s2", 4, "H100")], "hierarchical",
                       offers2, links)
    unprofiled = perf.predict(job(), [Assignment("a", "s1", 4, "H100"), Assignment("b", "s2", 4, "H100")],
                              "hierarchical", offers2, links)
    assert two.compute_seconds_per_step == pytest.approx(compute4 / 2)
    assert two.comm_seconds_per_step == pytest.approx(unprofiled.comm_seconds_per_step)  # the WAN stays modelled


def test_a_measurement_replaces_a_learned_step_factor_and_floors_its_start_up():
    lesson = Lesson("H100", "ddp", "lm", step_factor=3.0, startup_seconds=80.0, samples=4)
    offers = {"a": offer("a", "s1")}
    req = job(profiled=profiled(), learned=Learned((lesson,)))
    p = perf.predict(req, [Assignment("a", "s1", 4, "H100")], "ddp", offers, [])
    assert (p.step_factor, p.step_seconds, p.startup_seconds) == (1.0, pytest.approx(MEASURED), 150.0)
    capped = perf.predict(replace(req, profiled=profiled(startup_seconds=None)), [Assignment("a", "s1", 4, "H100")],
                          "ddp", offers, [])
    assert capped.startup_seconds == 80.0
