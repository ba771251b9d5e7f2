"""hierarchical on sites spanning regions runs the multilevel all-reduce and trains what the two-level does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cpn.runtime.config import StrategyConfig, TrainConfig
from cpn.runtime.model import build_model
from cpn.runtime.strategies.hierarchical import allreduce_of
from cpn.runtime.topology import Topology
from cpn.runtime.train import FINAL_MODEL, run_local


def test_the_algorithm_follows_the_regions() -> None:
    regional = Topology.regional(2, 2, 1)
    assert allreduce_of(regional, None) == ("multilevel", None)
    assert allreduce_of(regional, "int8") == ("multilevel", "none/int8")  # metro plain, long-haul coded
    assert allreduce_of(Topology.uniform(4, 1), "int8") == ("flat", "int8")  # one worker per site: the ring
    assert allreduce_of(Topology.uniform(2, 2), "int8") == ("hierarchical", "int8")  # one region per site
    assert allreduce_of(Topology.regional(2, 1, 2), None) == ("hierarchical", None)  # no metro level
    uneven = Topology.model_validate({"sites": [{"name": "a", "ranks": 1, "region": "eu"},
                                                {"name": "b", "ranks": 1, "region": "eu"},
                                                {"name": "c", "ranks": 1, "region": "us"}]})
    assert allreduce_of(uneven, None) == ("flat", None)  # unequal sites per region: no multilevel (one worker each: the ring)


def config() -> TrainConfig:
    return TrainConfig(model="tiny", seq_len=64, global_batch_tokens=1024, tokens=1024 * 12 + 200, val_every=6,
                       val_batches=2, strategy=StrategyConfig(name="hierarchical", balance=False,
                                                              compression="none", wan_timeout_seconds=8.0))


def test_two_regions_train_with_multilevel_to_the_two_level_parameters(tmp_path: Path) -> None:
    """2 regions x 2 sites x 1 worker (gloo): the same 4 sites without region labels run the two-level
    all-reduce (with one worker per site, the flat ring); both reach the same parameters (float rounding), and the long-haul links carry a third."""
    runs = {"regions": Topology.regional(2, 2, 1), "flat": Topology.uniform(4, 1)}
    summaries = {name: run_local(config(), topo, run_dir=tmp_path / name, timeout=180, start_method="forkserver")
                 for name, topo in runs.items()}
    multi, two = summaries["regions"], summaries["flat"]
    assert multi["allreduce"] == "multilevel" and two["allreduce"] == "flat"
    assert two["wan_metro_bytes"] == 0 < multi["wan_metro_bytes"]
    # per rank and gradient: two-level 2(S-1)/S = 1.5 K on WAN links; multilevel K metro + 2(G-1)/G * K/R = 0.5 K long-haul
    assert multi["wan_metro_bytes"] / two["wan_bytes"] == pytest.approx(2 / 3, rel=0.02)
    assert (multi["wan_bytes"] - multi["wan_metro_bytes"]) / two["wan_bytes"] == pytest.approx(1 / 3, rel=0.02)
    got = torch.load(tmp_path / "regions" / FINAL_MODEL, weights_only=True)
    want = torch.load(tmp_path / "flat" / FINAL_MODEL, weights_only=True)
    start = build_model("tiny", seed=0).state_dict()
    assert any(not torch.equal(want[k], start[k]) for k in want)  # it trained
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4, msg=name)
