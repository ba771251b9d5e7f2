"""ps_backup drops the late pushes of every step, and under a straggler they are nearly always the same
worker's: its data must still reach the model, so ps_backup's workers draw from the whole training
split (StrategyConfig.data_sampling) while the other strategies keep one contiguous shard per worker."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from cpn.runtime.config import STRATEGIES, FaultConfig, StrategyConfig
from cpn.runtime.data import ShardSampler, load_corpus, split_corpus
from cpn.runtime.topology import Topology

from .test_strategies import run, tiny

WORLD, SEQ = 3, 64


@pytest.fixture(scope="module")
def train() -> np.ndarray:
    return split_corpus(load_corpus(8_000_000)).train


def samplers(train: np.ndarray, strategy: str) -> list[ShardSampler]:
    sampling = StrategyConfig(name=strategy).data_sampling
    return [ShardSampler(train, shard=r, num_shards=WORLD, seq_len=SEQ, seed=0, sampling=sampling)
            for r in range(WORLD)]


def shards_read(sampler: ShardSampler, train: np.ndarray, steps: int) -> np.ndarray:
    """How many windows of ``steps`` batches of 8 start in each of the WORLD contiguous thirds of
    ``train``, found by content (the first occurrence: a repeated window counts at or before its place)."""
    text = train.tobytes()
    starts = []
    for step in range(steps):
        x, y = sampler.batch(step, 8)
        for a, b in zip(x.numpy(), y.numpy(), strict=True):
            window = bytes(a.tolist()) + bytes(b[-1:].tolist())
            at = text.find(window)
            assert at >= 0  # the window is a piece of the training split
            starts.append(at)
    return np.bincount(np.array(starts) // (len(train) // WORLD), minlength=WORLD)[:WORLD]


def test_only_ps_backup_draws_from_the_whole_split_by_default() -> None:
    assert StrategyConfig(name="ps_backup").data_sampling == "whole"
    assert {s for s in STRATEGIES if StrategyConfig(name=s).data_sampling == "whole"} == {"ps_backup"}
    assert StrategyConfig(name="ps_backup", sampling="shard").data_sampling == "shard"
    assert StrategyConfig(name="ddp", sampling="whole").data_sampling == "whole"
    with pytest.raises(ValueError, match="pipeline"):
        StrategyConfig(name="pipeline", sampling="whole")


def test_ps_backup_learns_every_shard_when_the_slow_ranks_pushes_are_all_dropped(train: np.ndarray) -> None:
    """Rank 2 straggles and every push of it is dropped: the applied batches are ranks 0 and 1's. Under
    ps_backup they still start in every third of the split, about evenly; with one shard per worker
    (what every strategy did before) the last third would get none of them."""
    fast = samplers(train, "ps_backup")[:2]
    counts = sum(shards_read(s, train, steps=3 * WORLD) for s in fast)
    assert counts.sum() == 2 * 3 * WORLD * 8
    assert counts.min() >= 0.2 * counts.sum(), counts  # each third about a third of 144 windows
    sharded = samplers(train, "ps_sync")[:2]
    assert sum(shards_read(s, train, steps=WORLD) for s in sharded)[2] == 0


def test_whole_split_batches_are_deterministic_per_rank_and_step(train: np.ndarray) -> None:
    a, b = samplers(train, "ps_backup"), samplers(train, "ps_backup")
    assert all(s.data is train for s in a)
    assert torch.equal(a[1].batch(5, 8)[0], b[1].batch(5, 8)[0])  # a resumed run sees the same batches
    assert not torch.equal(a[1].batch(5, 8)[0], a[2].batch(5, 8)[0])  # ranks draw different windows
    assert not torch.equal(a[1].batch(5, 8)[0], a[1].batch(6, 8)[0])


def test_other_strategies_keep_their_shards(train: np.ndarray) -> None:
    size = len(train) // WORLD
    for strategy in ("ddp", "async_ps", "ps_sync", "diloco"):
        for r, s in enumerate(samplers(train, strategy)):
            assert len(s.data) == size and s.data[0] == train[r * size]


def test_ps_backup_counts_drops_per_rank_and_its_loss_still_falls(tmp_path: Path) -> None:
    """The servers' per-rank counters (the measurement behind the default) add up, and a run drawing
    from the whole split still learns. Which rank's pushes are dropped depends on the machine's load
    (under load the emulated straggler is not always the one late), so it is not asserted."""
    cfg = tiny("ps_backup", steps=30, faults=FaultConfig(slow_site=2, slowdown=4.0), ps=1, backup_workers=1)
    summary = run(cfg, tmp_path, Topology.uniform(3, 1))
    assert summary["config"]["strategy"]["sampling"] is None  # the default: ps_backup's data_sampling, whole
    dropped, pushed = summary["ps_dropped_by_rank"], summary["ps_pushed_by_rank"]
    assert len(dropped) == len(pushed) == 3 and sum(dropped) == summary["ps_dropped"] > 0, summary
    assert all(0 <= d <= p for d, p in zip(dropped, pushed, strict=True)) and min(pushed) > 0, (dropped, pushed)
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 1.5, summary
