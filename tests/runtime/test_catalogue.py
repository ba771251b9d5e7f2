"""The strategy catalogue (torch-free) and the runtime's classes say the same thing about every strategy."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cpn.runtime.catalogue import CATALOGUE, ELASTIC, survives_site_loss
from cpn.runtime.config import SHARDABLE_STRATEGIES, StrategyConfig, TrainConfig
from cpn.runtime.strategies import STRATEGIES, strategy_class
from cpn.runtime.topology import Topology


@pytest.mark.parametrize("name", sorted(CATALOGUE))
def test_every_class_agrees_with_its_catalogue_entry(name: str) -> None:
    cls = strategy_class(name)
    assert cls.elastic == CATALOGUE[name].elastic, f"{name}: class says elastic={cls.elastic}"
    assert STRATEGIES[name] == f"{cls.__module__}:{cls.__name__}"
    assert CATALOGUE[name].shardable == (name in SHARDABLE_STRATEGIES)


def test_the_elastic_set_is_the_one_the_orchestrator_used() -> None:
    assert ELASTIC == {"local_sgd", "diloco", "gossip", "ssp", "async_ps"}


def test_a_pipeline_survives_only_with_replicas_averaged_every_h_steps() -> None:
    topo = Topology.uniform(4, 1)

    def pipe(**knobs: object) -> TrainConfig:
        return TrainConfig(model="tiny", strategy=StrategyConfig(name="pipeline", **knobs))

    assert survives_site_loss(pipe(stages=2, inner_steps=4), topo)
    assert not survives_site_loss(pipe(stages=2, inner_steps=1), topo)
    assert not survives_site_loss(pipe(stages=4, inner_steps=4), topo)  # one replica
    # the runtime's own class answers by the same rule
    resolved = pipe(stages=2, inner_steps=4)
    assert strategy_class("pipeline").survives(resolved, topo) is True
    assert survives_site_loss(TrainConfig(model="tiny", strategy=StrategyConfig(name="diloco")), topo)
    assert not survives_site_loss(TrainConfig(model="tiny", strategy=StrategyConfig(name="ddp")), topo)


def test_the_api_server_and_its_planner_never_import_torch() -> None:
    """The server plans, re-places and recovers from the catalogue; a pipeline's stage cut is priced
    by the same torch-free partition the runtime cuts by."""
    code = """
import sys
import cpn.api.app, cpn.cli.server
from layers.orchestration.lifecycle import plan, reconciler, replan
from layers.orchestration.planning import perf, placement, pipeline
from cpn.runtime.partition import partition
assert partition([3, 1, 1, 3], 2) == [(0, 2), (2, 4)]
assert "diloco" in plan.ELASTIC
print("torch" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", "the API server imported torch"
