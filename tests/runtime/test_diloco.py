"""DiLoCo's last outer step is a plain average of the sites' models, not an outer-momentum step; a
killed site costs the survivors one WAN timeout, not one per check-in and balance window."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cpn.runtime.config import FaultConfig, StrategyConfig, TrainConfig
from cpn.runtime.topology import Topology
from cpn.runtime.train import FINAL_MODEL, run_local


def one_round(strategy: str, **knobs: object) -> TrainConfig:
    """Eight steps in one round (H = 8): the run's only outer step is its last one."""
    return TrainConfig(model="tiny", seq_len=64, global_batch_tokens=512, tokens=512 * 8, val_every=8, val_batches=2,
                       strategy=StrategyConfig(name=strategy, inner_steps=8, compression="none", overlap=False,
                                               balance=False, wan_timeout_seconds=8.0, **knobs))


def test_the_last_outer_step_averages_the_sites_models(tmp_path: Path) -> None:
    """Outer lr 0.5 with Nesterov momentum 0.9 would move θ by 0.5·1.9 = 0.95 of the mean pseudo-gradient;
    the final step moves it by exactly 1 of it, as local_sgd's plain average does."""
    topo = Topology.uniform(2, 1)
    for name, cfg in (("diloco", one_round("diloco", outer_lr=0.5, outer_momentum=0.9, nesterov=True)),
                      ("local_sgd", one_round("local_sgd"))):
        run_local(cfg, topo, run_dir=tmp_path / name, timeout=120, start_method="forkserver")
    diloco = torch.load(tmp_path / "diloco" / FINAL_MODEL, weights_only=True)
    average = torch.load(tmp_path / "local_sgd" / FINAL_MODEL, weights_only=True)
    initial = TrainConfig(model="tiny")  # the same seed builds the same initial weights
    from cpn.runtime.model import build_model

    start = build_model(initial.model, seed=initial.seed).state_dict()
    moved = sum(float((average[k] - start[k]).abs().sum()) for k in average)
    assert moved > 0  # the sites trained, so the average is not the start
    for name in average:
        torch.testing.assert_close(diloco[name], average[name], atol=1e-6, rtol=1e-5, msg=name)


TIMEOUT = 4.0  # the WAN timeout of the killed-site runs (seconds)


@pytest.mark.parametrize("kill_at", [17, 20])
def test_a_killed_site_costs_the_survivors_one_wan_timeout(kill_at: int, tmp_path: Path) -> None:
    """3 sites x 1 worker, H = 5 with a τ = 2 overlap, site 2 killed at step 17 (before round 3's
    check-in at step 19: the check-in finds it) or 20 (after that check-in, with round 3's exchange in
    flight: the exchange fails, or the next check-in finds it). Either way the survivors wait the
    timeout once: neither the later check-ins nor the balance window at step 25 wait for the dead site
    again (they used to: two or three timeouts)."""
    cfg = TrainConfig(model="tiny", seq_len=64, global_batch_tokens=64 * 12, tokens=64 * 12 * 30, val_every=10,
                      val_batches=2, faults=FaultConfig(kill_site=2, kill_at_step=kill_at),
                      strategy=StrategyConfig(name="diloco", inner_steps=5, overlap=True, overlap_steps=2,
                                              balance=True, compression="none", wan_timeout_seconds=TIMEOUT))
    summary = run_local(cfg, Topology.uniform(3, 1), run_dir=tmp_path, timeout=120, start_method="forkserver")
    assert summary["live_sites"] == [0, 1] and summary["finished_ranks"] == [0, 1]
    for rank in (0, 1):
        records = [json.loads(line) for line in (tmp_path / "metrics" / f"rank{rank}.jsonl").read_text().splitlines()]
        waited = next(r["waitSeconds"] for r in records if r["final"])
        assert waited < 1.5 * TIMEOUT, (rank, waited)  # one timeout and the sites' usual waits for each other
