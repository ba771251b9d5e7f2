"""A user's own nn.Sequential under the pipeline strategy (cpn.train's public API), on real Gloo
processes: the children are cut into one stage per site, the first stage's ranks feed the rows, the
last computes the user's loss; two stages end with the weights one process reaches on the same
batches, and the summary reports the cut, the bubble and the bytes at the cut."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from cpn.runtime.config import ENV_RUN_DIR, StrategyConfig, TrainConfig
from cpn.runtime.contract import ENV
from cpn.runtime.launcher import launch
from cpn.runtime.topology import Topology
from cpn.train.api import FINAL_MODEL
from tests.train import userpipe

STEPS, BATCH = 12, 32


def config(**knobs: object) -> TrainConfig:
    return TrainConfig(model="tiny", seq_len=8, global_batch_tokens=BATCH, tokens=BATCH * STEPS, val_every=1000,
                       strategy=StrategyConfig(**{"name": "pipeline", "compression": "none", "micro_batches": 4,
                                                  "wan_timeout_seconds": 30.0, **knobs}))


def run(cfg: TrainConfig, topology: Topology, run_dir: Path, args: dict | None = None,
        ok: bool = True) -> tuple[list[dict], list]:
    env = {**cfg.to_env(), ENV_RUN_DIR: str(run_dir), ENV.CODE_ARGS: json.dumps(args or {})}
    results = launch(topology, "tests.train.userpipe:main", [], env=env, timeout=180, capture_output=True,
                     check=False, start_method="forkserver")
    if not ok:
        return [], results
    bad = [f"rank {r.rank} exited {r.exit_code}: {r.log[-2000:]}" for r in results if r.exit_code != 0]
    assert not bad, "\n".join(bad)
    return [json.loads((run_dir / f"user-rank{r}.json").read_text()) for r in range(topology.world_size)], results


def reference(feeders: int, steps: int, lr: float = 0.01, hidden: int = 32) -> nn.Module:
    """One process, one Adam, each step's loss the mean over every feeder's rows of that step."""
    model = userpipe.net(hidden)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    xs, ys = userpipe.dataset(2048)
    per = BATCH // feeders
    streams = [userpipe.batches(xs[f * 2048 // feeders:(f + 1) * 2048 // feeders],
                                ys[f * 2048 // feeders:(f + 1) * 2048 // feeders], [per] * steps) for f in range(feeders)]
    for k in range(steps):
        x = torch.cat([s[k][0] for s in streams])
        y = torch.cat([s[k][1] for s in streams])
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model


@pytest.mark.parametrize(("sites", "workers"), [(2, 1), (2, 2)])
def test_two_stages_of_a_users_sequential_train_what_one_process_does(sites: int, workers: int,
                                                                     tmp_path: Path) -> None:
    out, _ = run(config(), Topology.uniform(sites, workers), tmp_path)
    feeders = [o for o in out if o["feeds"]]
    assert [o["site"] for o in feeders] == [0] * workers  # only the first stage's ranks feed
    assert all(o["fed"] == [BATCH // workers] * STEPS for o in feeders)
    assert all(o["steps"] == STEPS for o in out)
    assert sorted(o["shard"][0] for o in feeders) == [j * 2048 // workers for j in range(workers)]
    assert out[0]["last"] < 0.7 * out[0]["first"], out[0]
    final = torch.load(tmp_path / FINAL_MODEL, weights_only=True)
    ref = reference(workers, STEPS).state_dict()
    assert set(final) == set(ref)
    for name, tensor in ref.items():
        torch.testing.assert_close(final[name], tensor, atol=2e-5, rtol=1e-4, msg=name)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stages"] == [["0:Linear", "1:Tanh"], ["2:Linear", "3:Tanh", "4:Linear", "5:Flatten"]]
    # forward: a header and 32 x hidden floats per step cross the cut (plus step headers and the targets)
    assert summary["wan_activation_bytes"] >= STEPS * BATCH * 32 * 4
    assert summary["wan_gradient_bytes"] == STEPS * BATCH * 32 * 4
    assert 0 <= summary["bubble_fraction"] <= 1


def test_two_replicas_of_a_users_pipeline_averaging_every_step_train_what_one_process_does(tmp_path: Path) -> None:
    """4 sites, 2 stages: 2 replicas, each fed by its first stage's rank from its own half of the data."""
    out, _ = run(config(stages=2, inner_steps=1), Topology.uniform(4, 1), tmp_path)
    assert [o["site"] for o in out if o["feeds"]] == [0, 2]
    assert sorted(o["shard"][0] for o in out if o["feeds"]) == [0, 1024]
    final = torch.load(tmp_path / FINAL_MODEL, weights_only=True)
    for name, tensor in reference(2, STEPS).state_dict().items():
        torch.testing.assert_close(final[name], tensor, atol=2e-5, rtol=1e-4, msg=name)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["replicas"] == 2 and summary["wan_replica_bytes"] > 0


def test_three_stages_where_the_user_cuts_with_int8_at_the_cuts(tmp_path: Path) -> None:
    out, _ = run(config(compression="int8"), Topology.uniform(3, 1), tmp_path, args={"stages": [2, 4]})
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stages"] == [["0:Linear", "1:Tanh"], ["2:Linear", "3:Tanh"], ["4:Linear", "5:Flatten"]]
    assert out[0]["last"] < 0.8 * out[0]["first"], out[0]
    assert summary["wan_gradient_bytes"] < STEPS * BATCH * 32 * 4  # int8: about a quarter of float32 per cut


def test_a_stage_whose_output_needs_no_gradient_neither_sends_nor_waits_for_one(tmp_path: Path) -> None:
    """A parameter-free first stage (Flatten): no gradient crosses its cut back, and nobody waits for one."""
    out, _ = run(config(), Topology.uniform(2, 1), tmp_path, args={"lead": True, "stages": [1]})
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stages"][0] == ["0:Flatten"] and summary["wan_gradient_bytes"] == 0, summary["stages"]
    assert out[0]["last"] < 0.7 * out[0]["first"], out[0]


def test_a_model_the_pipeline_cannot_cut_is_refused_saying_why(tmp_path: Path) -> None:
    _, results = run(config(), Topology.uniform(2, 1), tmp_path, args={"stages": [9]}, ok=False)
    assert any(r.exit_code != 0 for r in results)
    logs = "\n".join(r.log for r in results)
    assert "stages=[9] must be 1 increasing unit indices between 1 and 5" in logs, logs[-3000:]
