"""Sharding inside a site (shard="site"): less state per rank, the same training, checkpoints that reshard."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from cpn.runtime import checkpoint
from cpn.runtime.config import (
    SHARDABLE_STRATEGIES,
    STRATEGIES,
    UNSHARDABLE_REASONS,
    StrategyConfig,
    TrainConfig,
)
from cpn.runtime.topology import Topology
from cpn.runtime.train import preflight, run_local


def cfg(strategy: str = "diloco", **over: object) -> TrainConfig:
    return TrainConfig(model="tiny", seq_len=64, global_batch_tokens=1024, tokens=1024 * 12, val_every=4, val_batches=2,
                       strategy=StrategyConfig(name=strategy, inner_steps=4, wan_timeout_seconds=20.0,
                                               compression="none", balance=False), **over)


def test_every_strategy_is_either_shardable_or_refused_with_its_reason() -> None:
    assert set(SHARDABLE_STRATEGIES) | set(UNSHARDABLE_REASONS) == set(STRATEGIES)
    for name in UNSHARDABLE_REASONS:
        with pytest.raises(ValidationError, match=rf"strategy '{name}' cannot run with shard='site' .*use shard='none'"):
            cfg(name, shard="site")
    for name in SHARDABLE_STRATEGIES:
        assert cfg(name, shard="site").shard == "site"


def test_preflight_refuses_sites_that_cannot_shard() -> None:
    with pytest.raises(ValueError, match="with one worker per site it saves nothing"):
        preflight(cfg(shard="site"), Topology.uniform(2, 1))
    with pytest.raises(ValueError, match=r"same number of workers at every site, got \[2, 3\]"):
        preflight(cfg("ddp", shard="site"), Topology(sites=[{"name": "a", "ranks": 2}, {"name": "b", "ranks": 3}]))
    preflight(cfg(shard="site"), Topology.uniform(2, 2))


@pytest.mark.slow
def test_sharded_state_per_rank_is_a_quarter_on_four_ranks_as_predicted(tmp_path: Path) -> None:
    from cpn.runtime.bench_memory import run

    report = run("llama-nano", 4, seq_len=32, batch=1, work_dir=tmp_path)
    none, site = report["results"]
    assert site["state_bytes_per_rank"] <= 0.30 * none["state_bytes_per_rank"]
    assert site["params_bytes_per_rank"] < none["params_bytes_per_rank"] / 3
    assert site["optimizer_bytes_per_rank"] < none["optimizer_bytes_per_rank"] / 3
    for r in (none, site):
        assert r["prediction_error"] <= 0.10


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["diloco", "hierarchical"])
def test_sharded_training_matches_unsharded(strategy: str, tmp_path: Path) -> None:
    """The sharded model starts from the same weights and its site's reduce-scatter plus the
    cross-site exchange of shards average what the unsharded strategy averages."""
    topo = Topology.uniform(2, 2)
    losses = {}
    for shard in ("none", "site"):
        summary = run_local(cfg(strategy, shard=shard), topo, run_dir=tmp_path / shard, start_method="forkserver", timeout=240)
        losses[shard] = summary["final_val_loss"]
        assert summary["val_curve"][-1]["val"] < summary["val_curve"][0]["val"] - 0.5
    assert losses["site"] == pytest.approx(losses["none"], rel=1e-3)


@pytest.mark.slow
def test_a_checkpoint_of_two_ranks_per_site_resumes_on_one(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    first = run_local(cfg(shard="site", checkpoint_every=4, checkpoint_dir=str(ckpt), stop_at_step=8),
                      Topology.uniform(2, 2), run_dir=tmp_path / "a", start_method="forkserver", timeout=240)
    info = checkpoint.latest(ckpt)
    assert info["step"] == 8 and info["format"] == "dcp" and ".metadata" in info["files"]
    before = next(p["val"] for p in first["val_curve"] if p["step"] == 8)
    resumed = run_local(cfg(shard="site", resume=str(ckpt), checkpoint_dir=str(ckpt), checkpoint_every=4),
                        Topology.uniform(2, 1),
                        run_dir=tmp_path / "b", start_method="forkserver", timeout=240)
    after = resumed["val_curve"][0]
    assert after["step"] == 8 and after["val"] == pytest.approx(before, rel=0.01)
    assert resumed["val_curve"][-1]["step"] == 12
    assert json.loads((ckpt / checkpoint.LATEST).read_text())["step"] == 12
    with pytest.raises(ValueError, match=r"is sharded: resume it with shard='site'"):
        preflight(cfg(resume=str(ckpt)), Topology.uniform(2, 1))


def test_bench_memory_names_a_bad_model_before_starting_any_rank() -> None:
    from click.testing import CliRunner

    from cpn.cli.bench import bench_memory_cmd

    result = CliRunner().invoke(bench_memory_cmd, ["--model", '{"layers": 2}', "--workers", "2"])
    assert result.exit_code == 2 and "--model: model shape needs 'hidden'" in result.output
