"""What the orchestrator hands the runtime: unset strategy knobs stay unset for the autotune; the
parameter-server layout is the one the compute model prices; the budget is the spec's, exactly."""

from __future__ import annotations

from dataclasses import replace

from cpn.runtime.autotune import resolve
from cpn.runtime.config import TrainConfig
from cpn.runtime.topology import Topology
from layers.orchestration.lifecycle.plan import budget_note, train_config
from layers.service.schemas import TrainingJobSpec


def spec(**fields: object) -> TrainingJobSpec:
    return TrainingJobSpec.model_validate({"model": "tiny", "tokens": 1_000_000, "globalBatchTokens": 4096, **fields})


def test_unset_knobs_are_left_to_the_autotune_as_for_cpn_train() -> None:
    train = train_config(spec(), "diloco", workers=4, resume=None, sites=2)
    s = train["strategy"]
    assert (s["inner_steps"], s["compression"], s["overlap"]) == (None, "auto", None)
    cfg = TrainConfig.model_validate(train)
    api = resolve(cfg, Topology.uniform(2, 2), wan_mbps=20).strategy
    cli = resolve(TrainConfig(model="tiny", tokens=1_000_000, global_batch_tokens=4096, strategy={"name": "diloco"}),
                  Topology.uniform(2, 2), wan_mbps=20).strategy
    assert api == cli and api.compression == "int8" and api.overlap is True


def test_explicit_knobs_are_passed_through() -> None:
    train = train_config(spec(innerSteps=7, compression="none", overlap=False), "diloco", workers=4, resume=None,
                         sites=2)
    s = train["strategy"]
    assert (s["inner_steps"], s["compression"], s["overlap"]) == (7, "none", False)


def test_async_ps_gets_one_server_per_site_as_the_compute_model_prices() -> None:
    assert train_config(spec(), "async_ps", workers=6, resume=None, sites=3)["strategy"]["ps"] == 3
    assert "ps" not in train_config(spec(), "ddp", workers=6, resume=None, sites=3)["strategy"]


def test_the_budget_is_the_specs_exactly_and_a_changed_batch_is_announced() -> None:
    odd = spec(tokens=100_000, globalBatchTokens=10_000)
    train = train_config(odd, "ddp", workers=3, resume=None, sites=1)
    assert (train["tokens"], train["global_batch_tokens"]) == (100_000, 10_112)
    assert TrainConfig.model_validate(train).tokens_through(10**6) == 100_000
    assert budget_note(odd, train).startswith("trains 100,000 tokens: 9 steps × 10,112 and a last step of 8,992")
    assert budget_note(spec(), train_config(spec(), "ddp", workers=4, resume=None)) is None


def test_the_quote_prices_the_knobs_the_runtime_will_choose() -> None:
    """A spec without innerSteps/compression/overlap: the compute model prices the H, int8 and overlap
    that the runtime's autotune picks on the same placement, not the planner's own defaults."""
    from cpn.runtime.autotune import Job, Link, choose
    from layers.orchestration.jobs.requirements import requirements
    from layers.orchestration.planning import perf
    from tests.layers.orchestration.test_perf import two_sites

    offers, links, placement = two_sites(gbps=0.02, rtt_ms=20.0)
    req = requirements(spec(model="small", tokens=20_000_000))
    assert req.autotuned == {"inner_steps", "compression", "overlap"}
    quoted = perf.predict(req, placement, "diloco", offers, links)
    compute = quoted.compute_seconds_per_step
    h, compression, overlap, _ = choose("diloco", Job(req.model.parameters, 2, 16, -(-20_000_000 // 4096)),
                                        Link(20.0, 20.0), compute)
    assert (compression, h > 1) == ("int8", True)
    pinned = replace(req, inner_steps=h, compression="int8", overlap=overlap, autotuned=frozenset())
    assert quoted == perf.predict(pinned, placement, "diloco", offers, links)
    defaults = replace(req, autotuned=frozenset())  # what was priced before: H=100, fp32, overlap on
    assert perf.predict(defaults, placement, "diloco", offers, links).wan_bytes != quoted.wan_bytes
