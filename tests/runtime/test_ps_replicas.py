"""Parameter-shard replicas and their fail-over, staleness damping, and the checks on both (issue 15)."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from cpn.runtime.config import PS_STRATEGIES, FaultConfig, TrainConfig
from cpn.runtime.strategies.async_ps import Server, staleness_damping
from cpn.runtime.strategies.ps_replicas import replica_ranks
from cpn.runtime.topology import Topology
from cpn.runtime.train import preflight
from tests.runtime.test_strategies import run, tiny

THREE = Topology.uniform(3, 1)


@pytest.mark.parametrize("strategy", PS_STRATEGIES)
def test_a_killed_primary_fails_over_to_its_secondary_with_every_applied_update(strategy: str, tmp_path: Path) -> None:
    """Shard 1's primary (rank 1) dies at step 15 of 40; its secondary (rank 2, the next site's leader)
    takes over holding exactly what the primary had applied, the workers re-route, the run completes."""
    cfg = tiny(strategy, steps=40, ps=3, ps_replicas=1, faults=FaultConfig(kill_ps=1, kill_at_step=15))
    summary = run(cfg, tmp_path, THREE)
    assert summary["finished_ranks"] == [0, 2], summary
    [failover] = summary["ps_failovers"]
    assert (failover["shard"], failover["replica"], failover["rank"]) == (1, 1, 2)
    killed = torch.load(tmp_path / "ps" / "shard1-killed.pt", weights_only=True)
    promoted = torch.load(tmp_path / "ps" / "shard1-promoted.pt", weights_only=True)
    assert killed["version"] >= 15 and promoted["version"] == killed["version"] == failover["version"]
    torch.testing.assert_close(promoted["param"], killed["param"], atol=1e-6, rtol=0)
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 1.5, summary
    if strategy == "async_ps":
        assert summary["ps_staleness_mean"] > 0


def test_replicas_sit_on_the_next_sites_leaders() -> None:
    topo = Topology.uniform(3, 2)
    assert replica_ranks(topo, 0, 2) == [0, 2, 4]
    assert replica_ranks(topo, 4, 1) == [4, 0]
    assert replica_ranks(topo, 3, 1) == [3, 4]  # a non-leader primary (ps > sites): the next site's leader
    assert replica_ranks(topo, 2, 0) == [2]


@pytest.mark.parametrize(("cfg", "message"), [
    (tiny("async_ps", ps=3, ps_replicas=3), "strategy.ps_replicas 3 needs 4 sites"),
    (tiny("ddp", ps_replicas=1), "strategy.ps_replicas is for async_ps"),
    (tiny("ps_sync", ps=3, faults=FaultConfig(kill_ps=1, kill_at_step=5)), "faults.kill_ps 1 leaves shard 1 without a copy"),
    (tiny("ps_sync", ps=3, ps_replicas=1, faults=FaultConfig(kill_ps=0, kill_at_step=5)),
     "faults.kill_ps 0: shard 0's primary runs in rank 0, which hosts the job's store"),
    (tiny("ps_backup", ps=2, ps_replicas=1, faults=FaultConfig(kill_ps=2, kill_at_step=5)),
     r"faults.kill_ps 2 is not one of the 2 shards \(0..1\)"),
    (tiny("diloco", faults=FaultConfig(kill_ps=1, kill_at_step=5)), "faults.kill_ps is for async_ps"),
])
def test_replica_and_kill_settings_are_refused_before_any_worker_starts(cfg: TrainConfig, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        preflight(cfg, THREE)


def test_the_cli_names_the_field_of_a_bad_ps_setting() -> None:
    from cpn.runtime.cli_train import train_cmd

    out = CliRunner().invoke(train_cmd, ["--sites", "2", "--workers-per-site", "1", "--strategy", "ps_sync",
                                         "--ps", "2", "--ps-replicas", "2"])
    assert out.exit_code == 2 and "--ps-replicas 2 needs 3 sites" in out.output, out.output
    out = CliRunner().invoke(train_cmd, ["--strategy", "async_ps", "--kill-ps", "1"])
    assert out.exit_code == 2 and "kill_ps and kill_at_step go together" in out.output, out.output
    assert "Traceback" not in out.output
    with pytest.raises(ValueError, match="kill_site and kill_ps are two faults"):
        FaultConfig(kill_site=1, kill_ps=1, kill_at_step=3)


def _server(damping: bool, workers: int) -> Server:
    cfg = tiny("async_ps", ps_damping=damping, warmup_fraction=0.0).model_copy(update={"weight_decay": 0.0})
    return Server(SimpleNamespace(cfg=cfg), 0, torch.zeros(64), workers)  # type: ignore[arg-type]


@pytest.mark.parametrize("damping", [True, False])
def test_a_stale_push_moves_the_shard_less_by_the_staleness_factor(damping: bool) -> None:
    """AdamW's first step moves each coordinate by ~lr, so the step's size is the learning rate used."""
    grad = torch.randn(64)
    fresh, stale = _server(damping, workers=2), _server(damping, workers=2)
    stale.version = 10
    fresh_params, _ = fresh.apply(grad.clone(), 0.0, seen=0)
    stale_params, version = stale.apply(grad.clone(), 0.0, seen=0)
    assert version == 11 and stale.stale_sum == 10
    ratio = (stale_params.abs().mean() / fresh_params.abs().mean()).item()
    assert ratio == pytest.approx(2 / 11 if damping else 1.0, rel=1e-3)


def test_staleness_damping_keeps_on_pace_pushes_at_full_rate() -> None:
    assert [staleness_damping(4, s) for s in (0, 3, 7, 15)] == [1.0, 1.0, 0.5, 0.25]
    assert staleness_damping(1, 0) == 1.0 and staleness_damping(3, -2) == 1.0


def test_replicas_do_not_change_what_ps_sync_computes(tmp_path: Path) -> None:
    """Forwarding to secondaries is invisible to the workers: the same final model with and without
    (up to the order in which a step's pushes are summed, which arrival decides)."""
    from tests.runtime.test_strategies import final_params

    plain = tiny("ps_sync", steps=12, optimizer="sgd", lr=0.5, ps=2)
    replicated = tiny("ps_sync", steps=12, optimizer="sgd", lr=0.5, ps=2, ps_replicas=1)
    run(plain, tmp_path / "plain")
    summary = run(replicated, tmp_path / "replicated")
    assert summary["ps_failovers"] == [] and summary["wan_bytes"] > 0
    a, b = final_params(tmp_path / "plain"), final_params(tmp_path / "replicated")
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=2e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("kind", ["async_ps", "ps_sync"])
def test_a_secondary_that_never_serves_refuses_after_the_wan_timeout(kind: str) -> None:
    """A worker whose own link to a live primary broke reaches the secondary, which never takes over: the
    call is refused after ``wan_timeout_seconds`` (the worker moves on), not left waiting for ever."""
    from cpn.runtime.strategies.async_ps import NOT_SERVING, OP_PULL
    from cpn.runtime.strategies.sync_ps import RoundServer

    cfg = tiny(kind, wan_timeout_seconds=0.2)
    ctx = SimpleNamespace(cfg=cfg)
    server = (Server(ctx, 0, torch.ones(8), 2, index=1) if kind == "async_ps"  # type: ignore[arg-type]
              else RoundServer(ctx, 0, torch.ones(8), 2, index=1, backups=0))  # type: ignore[arg-type]
    started = time.monotonic()
    reply = server.handle(1, torch.zeros(8), 0.0, OP_PULL, 0)
    assert 0.15 < time.monotonic() - started < 5
    assert reply[-1].item() == NOT_SERVING and reply.numel() == 9
    server.serving.set()  # promoted: the same call is answered with the shard
    reply = server.handle(1, torch.zeros(8), 0.0, OP_PULL, 0)
    assert reply[-1].item() == 0 and torch.equal(reply[:-1], torch.ones(8))


def test_a_refused_call_moves_to_the_next_replica_and_the_last_refusal_names_the_shard() -> None:
    from concurrent.futures import Future

    from cpn.runtime.strategies.async_ps import NOT_SERVING, AsyncPS

    def answered(version: float) -> Future:
        f: Future = Future()
        f.set_result(torch.tensor([3.0, 4.0, version]))
        return f

    worker = AsyncPS.__new__(AsyncPS)
    worker.route, worker.replicas, worker.tags = [0], [[1, 2]], {0: 0}
    worker._start = lambda k, grad, op: answered(7.0)  # type: ignore[method-assign]
    params = worker._finish(0, torch.zeros(2), 0.0, answered(NOT_SERVING))
    assert worker.route == [1] and worker.tags[0] == 7 and params.tolist() == [3.0, 4.0]
    worker._start = lambda k, grad, op: answered(NOT_SERVING)  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match=r"every replica of parameter shard 0 is lost or does not serve"):
        worker._finish(0, torch.zeros(2), 0.0, answered(NOT_SERVING))
