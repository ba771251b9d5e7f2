"""ps_backup decides each step's accepted workers once for the job: every shard applies the same workers'
pushes (Chen et al.'s step), instead of each shard taking its own first N−b arrivals -- which updated
different parts of the model with different workers' gradients in one step."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from cpn.runtime.config import FaultConfig
from cpn.runtime.strategies.sync_ps import RoundServer, split_steps
from cpn.runtime.topology import Topology

from .test_strategies import run, tiny

WORKERS = 3


def servers(shards: int) -> list[RoundServer]:
    """`shards` one-element shards of a 3-worker job with one backup worker, sharing one store."""
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=5))
    cfg = tiny("ps_backup", backup_workers=1, optimizer="sgd", lr=1.0, warmup_fraction=0.0)
    ctx = SimpleNamespace(cfg=cfg, store=store, timers=None)
    return [RoundServer(ctx, k, torch.zeros(1), WORKERS, 0, backups=1, shards=shards) for k in range(shards)]  # type: ignore[arg-type]


def push(server: RoundServer, worker: int, value: float, step: int = 0) -> threading.Thread:
    """A push of gradient `value` on its own thread (a push blocks until its step is applied)."""
    t = threading.Thread(target=server.push, args=(worker, torch.tensor([value]), 0.0, step), daemon=True)
    t.start()
    return t


def settle(server: RoundServer, arrived: int) -> None:
    for _ in range(500):
        with server.cond:
            if len(server.arrived) >= arrived or server.version:
                return
        threading.Event().wait(0.01)


def test_a_shard_applies_the_set_another_shard_decided_waiting_for_its_missing_push() -> None:
    """Shard 0 gets workers 0 and 1 first and decides {0, 1}; shard 1 gets 2 and 0 first. Shard 1 must
    not apply {2, 0}: it waits for worker 1's push, applies {0, 1}, and drops worker 2's."""
    a, b = servers(2)
    threads = [push(a, 0, 1.0), push(a, 1, 3.0)]
    settle(a, 2)
    assert a.version == 1 and a.rounds == {0: [0, 1]}
    threads += [push(b, 2, 100.0), push(b, 0, 1.0)]
    settle(b, 2)
    with b.cond:
        assert b.version == 0 and b.accepted == (0, 1)  # decided elsewhere; worker 1's push still missing
    threads += [push(b, 1, 3.0), push(a, 2, 100.0)]
    for t in threads:
        t.join(timeout=5)
        assert not t.is_alive()
    assert b.rounds == a.rounds == {0: [0, 1]}
    assert torch.equal(a.param.detach(), b.param.detach())  # the same mean, -2, at both
    assert a.param.item() == -2.0
    assert a.dropped_by == b.dropped_by == {2: 1}


def test_split_steps_counts_steps_applied_with_different_sets() -> None:
    assert split_steps({"0.0": {0: [0, 1], 1: [0, 2]}, "1.0": {0: [0, 1], 1: [1, 2]}, "2.0": {2: [0]}}) == (2, 1)
    assert split_steps({"0.0": {0: [0, 1]}, "1.0": {0: [0, 1]}}) == (1, 0)


def test_three_shards_apply_the_same_workers_every_step(tmp_path: Path) -> None:
    """3 shards, one site 4× slower: every step two shards or more applied, they applied with the same
    workers' pushes, so each rank's drops are a multiple of the shard count; the loss still falls."""
    cfg = tiny("ps_backup", steps=30, faults=FaultConfig(slow_site=2, slowdown=4.0), ps=3, backup_workers=1)
    summary = run(cfg, tmp_path, Topology.uniform(3, 1))
    dropped, pushed = summary["ps_dropped_by_rank"], summary["ps_pushed_by_rank"]
    assert summary["ps_dropped"] > 0 and all(d % 3 == 0 for d in dropped), summary
    assert all(p % 3 == 0 and p > 0 for p in pushed), summary
    assert summary["ps_steps_compared"] >= 20 and summary["ps_split_steps"] == 0, summary
    assert summary["ps_short_steps"] == 0, summary
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 1.5, summary


def test_a_promoted_secondary_applies_the_sets_the_other_shards_do(tmp_path: Path) -> None:
    """Shard 1's primary (rank 1, also a worker) dies at step 12: its secondary on rank 2 takes over and
    applies the steps' posted sets, the same as shards 0 and 2 apply, and the run completes."""
    cfg = tiny("ps_backup", steps=40, ps=3, ps_replicas=1, backup_workers=1,
               faults=FaultConfig(kill_ps=1, kill_at_step=12))
    summary = run(cfg, tmp_path, Topology.uniform(3, 1))
    assert summary["finished_ranks"] == [0, 2], summary
    assert [(f["shard"], f["rank"]) for f in summary["ps_failovers"]] == [(1, 2)], summary
    assert summary["ps_steps_compared"] >= 10 and summary["ps_split_steps"] == 0, summary
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 1.5, summary
