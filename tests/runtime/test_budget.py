"""Faithful budgets: a run trains exactly ``tokens``, the last step trimmed to what is left."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cpn.runtime.config import StrategyConfig, TrainConfig, trim_shares
from cpn.runtime.topology import Topology
from cpn.runtime.train import run_local

ODD = 1024 * 6 + 333  # six global batches, then 5 sequences of 64 tokens and 13 tokens of a sixth


def odd_job(strategy: str, **knobs: object) -> TrainConfig:
    return TrainConfig(model="tiny", seq_len=64, global_batch_tokens=1024, tokens=ODD, val_every=4, val_batches=2,
                       strategy=StrategyConfig(name=strategy, inner_steps=3, wan_timeout_seconds=8.0, **knobs))


def test_the_last_step_is_trimmed_to_what_is_left_of_the_budget() -> None:
    cfg = odd_job("ddp")
    assert cfg.total_steps == 7
    assert [cfg.step_tokens(s) for s in range(7)] == [1024] * 6 + [333]
    assert cfg.tokens_through(7) == cfg.tokens_through(100) == ODD
    share = trim_shares(333, [6, 5, 5], 64)  # whole sequences by the ranks' shares, the partial one to the fewest
    assert sum(share) == 333 and share == [128, 128, 64 + 13]
    assert trim_shares(20, [1, 1, 1], 64) == [20, 0, 0]  # a rank may have nothing in the trimmed step


@pytest.mark.parametrize(("strategy", "knobs"), [("ddp", {}), ("diloco", {"balance": False}),
                                                 ("gossip", {})])
def test_an_odd_budget_on_three_workers_trains_exactly_its_tokens(strategy: str, knobs: dict, tmp_path: Path) -> None:
    summary = run_local(odd_job(strategy, **knobs), Topology.uniform(3, 1), run_dir=tmp_path, timeout=120,
                        start_method="forkserver")
    assert summary["finished_ranks"] == [0, 1, 2]
    assert summary["tokens"] == ODD, summary["tokens"]
    finals = [[m for m in map(json.loads, (tmp_path / "metrics" / f"rank{r}.jsonl").read_text().splitlines())
               if m["final"]] for r in range(3)]
    assert all(len(f) == 1 for f in finals), finals  # one final report per rank
    assert all(f[0]["jobTokens"] == ODD for f in finals), [f[0]["jobTokens"] for f in finals]
    assert summary["final_val_loss"] < summary["initial_val_loss"]
