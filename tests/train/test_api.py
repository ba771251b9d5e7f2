"""cpn.train on real Gloo processes: a user-defined model trains under ddp and diloco on 2-4 ranks,
its loss falls, every rank ends with the same weights, user metrics come out camelCased."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cpn.runtime.config import ENV_RUN_DIR, StrategyConfig, TrainConfig
from cpn.runtime.contract import ENV
from cpn.runtime.launcher import launch
from cpn.runtime.topology import Topology
from cpn.train.api import FINAL_MODEL
from tests.train import usermodel

STEPS = 60


def config(strategy: str, **knobs: object) -> TrainConfig:
    return TrainConfig(model="tiny", seq_len=16, global_batch_tokens=16 * 4, tokens=16 * 4 * STEPS,
                       strategy=StrategyConfig(**{"name": strategy, "inner_steps": 5, "compression": "none",
                                                  "overlap": False, "balance": False, "wan_timeout_seconds": 8.0,
                                                  **knobs}))


def run(cfg: TrainConfig, topology: Topology, run_dir: Path, args: dict | None = None) -> list[dict]:
    env = {**cfg.to_env(), ENV_RUN_DIR: str(run_dir), ENV.CODE_ARGS: json.dumps(args or {})}
    results = launch(topology, "tests.train.usermodel:main", [], env=env, timeout=180, capture_output=True,
                     check=False, start_method="forkserver")
    bad = [f"rank {r.rank} exited {r.exit_code}: {r.log[-2000:]}" for r in results if r.exit_code != 0]
    assert not bad, "\n".join(bad)
    return [json.loads((run_dir / f"user-rank{r}.json").read_text()) for r in range(topology.world_size)]


@pytest.mark.parametrize(("strategy", "topology"), [("ddp", Topology.uniform(2, 1)), ("ddp", Topology.uniform(2, 2)),
                                                    ("diloco", Topology.uniform(2, 2)), ("diloco", Topology.uniform(3, 1))])
def test_user_model_trains_and_ranks_agree(strategy: str, topology: Topology, tmp_path: Path) -> None:
    out = run(config(strategy), topology, tmp_path, args={"hidden": 24})
    world = topology.world_size
    assert [o["rank"] for o in out] == list(range(world))
    assert [o["site_name"] for o in out] == [topology.sites[topology.site_of(r)].name for r in range(world)]
    assert all(o["strategy"] == strategy and o["world"] == world and o["config"]["hidden"] == 24 for o in out)
    assert all(o["steps"] == STEPS for o in out), [o["steps"] for o in out]  # the budget: 60 steps
    assert all(o["budget"] == [16 * 4 * STEPS, 64, STEPS] for o in out)
    assert len({o["digest"] for o in out}) == 1, "ranks ended with different weights"
    assert len({o["first"] for o in out}) == 1, "wrap() did not start every rank from rank 0's weights"
    assert out[0]["last"] < 0.5 * out[0]["first"], out[0]
    sizes = [o["shard"][1] for o in out]
    assert sum(sizes) == 4096 and max(sizes) - min(sizes) <= 1
    data = usermodel.dataset(4096)
    assert [o["shard"][0] for o in out] == [float(data[r * 4096 // world][0][0]) for r in range(world)]
    lines = [json.loads(x) for x in (tmp_path / "metrics" / "rank0.jsonl").read_text().splitlines()]
    assert any("meanAbsWeight" in m for m in lines) and not any("mean_abs_weight" in m for m in lines)
    vals = [m["valLoss"] for m in lines if m.get("valLoss") is not None]
    assert vals[0] == pytest.approx(out[0]["first"]) and vals[-1] == pytest.approx(out[0]["last"])
    steps = [m for m in lines if m.get("trainLoss") is not None]
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    assert steps[0]["tokens"] == 16 and steps[-1]["tokens"] == 16 * STEPS  # this rank's samples
    final = [m for m in lines if m["final"]]
    assert len(final) == 1 and final[0]["step"] == STEPS and final[0]["jobTokens"] == 16 * 4 * STEPS
    if topology.num_sites > 1:
        assert final[0]["wanBytes"] > 0
    final = torch.load(tmp_path / FINAL_MODEL, weights_only=True)
    assert set(final) == {"body.0.weight", "body.0.bias", "body.2.weight", "body.2.bias"}


def test_a_script_that_sizes_its_batch_by_trainer_units_trains_exactly_the_budget(tmp_path: Path) -> None:
    """10 steps of 64 units and 40 left: an 11th step trimmed to 40, split 16/16/8 over 3 ranks."""
    cfg = config("ddp").model_copy(update={"tokens": 64 * 10 + 40})
    out = run(cfg, Topology.uniform(3, 1), tmp_path, args={"units": True})
    assert all(o["budget"] == [680, 64, 11] and o["last_step"] == 40 and o["steps"] == 11 for o in out)
    finals = [[json.loads(x) for x in (tmp_path / "metrics" / f"rank{r}.jsonl").read_text().splitlines()
               if json.loads(x)["final"]][0] for r in range(3)]
    assert [f["tokens"] for f in finals] == [32 * 10 + 16, 16 * 10 + 16, 16 * 10 + 8]
    assert sum(f["tokens"] for f in finals) == 680 and all(f["jobTokens"] == 680 for f in finals)
    assert out[0]["last"] < out[0]["first"]


def test_diloco_talks_across_sites_less_than_ddp(tmp_path: Path) -> None:
    topo = Topology.uniform(2, 1)
    run(config("ddp"), topo, tmp_path / "ddp")
    run(config("diloco", inner_steps=10), topo, tmp_path / "diloco")

    def wan(d: Path) -> int:
        return json.loads((d / "metrics" / "rank0.jsonl").read_text().splitlines()[-1])["wanBytes"]

    assert 0 < wan(tmp_path / "diloco") * 4 < wan(tmp_path / "ddp")
