"""Every strategy trains on 2 sites x 2 workers (real Gloo processes); DiLoCo's special cases; metrics."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import torch

from cpn.runtime.config import FaultConfig, StrategyConfig, TrainConfig
from cpn.runtime.metrics import HttpSink
from cpn.runtime.strategies import STRATEGIES
from cpn.runtime.topology import Topology
from cpn.runtime.train import FINAL_MODEL, run_local

TWO_BY_TWO = Topology.uniform(2, 2)


def tiny(strategy: str, *, steps: int = 40, **knobs: object) -> TrainConfig:
    faults = knobs.pop("faults", FaultConfig())
    top = {k: knobs.pop(k) for k in ("optimizer", "lr", "warmup_fraction") if k in knobs}
    return TrainConfig(
        model="tiny", seq_len=64, global_batch_tokens=1024, tokens=1024 * steps, val_every=20, val_batches=2,
        strategy=StrategyConfig(**{"name": strategy, "inner_steps": 5, "wan_timeout_seconds": 8.0, **knobs}),
        faults=faults, **top,
    )


def run(cfg: TrainConfig, run_dir: Path, topology: Topology = TWO_BY_TWO) -> dict:
    return run_local(cfg, topology, run_dir=run_dir, timeout=120, start_method="forkserver")


def final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / FINAL_MODEL, weights_only=True)


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_every_strategy_lowers_val_loss(strategy: str, tmp_path: Path) -> None:
    knobs = {"inner_steps": 2} if strategy in ("gossip", "ssp") else {}
    summary = run(tiny(strategy, **knobs), tmp_path)
    assert summary["strategy"] == strategy
    assert summary["finished_ranks"] == [0, 1, 2, 3]
    assert summary["initial_val_loss"] > 5.0
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 1.5, summary
    assert summary["tokens"] >= 1024 * 40
    assert summary["wan_bytes"] > 0 and summary["compute_seconds"] > 0
    lines = (tmp_path / "metrics" / "rank1.jsonl").read_text().splitlines()
    last = json.loads(lines[-1])
    assert last["final"] and last["rank"] == 1 and last["site"] == 0
    assert {"trainLoss", "valLoss", "tokensPerSecond", "commSeconds", "waitSeconds", "wanBytes"} <= last.keys()


def test_diloco_with_h1_and_plain_averaging_equals_synchronous_training(tmp_path: Path) -> None:
    sync = tiny("ddp", steps=12, optimizer="sgd", lr=0.5)
    diloco = tiny("diloco", steps=12, optimizer="sgd", lr=0.5, inner_steps=1, outer_lr=1.0,
                  outer_momentum=0.0, nesterov=False, compression="none", balance=False)
    run(sync, tmp_path / "ddp")
    run(diloco, tmp_path / "diloco")
    a, b = final_params(tmp_path / "ddp"), final_params(tmp_path / "diloco")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=2e-5, rtol=1e-4, msg=name)


def test_diloco_int8_overlap_sends_far_fewer_wan_bytes_than_ddp(tmp_path: Path) -> None:
    ddp = run(tiny("ddp"), tmp_path / "ddp")
    diloco = run(tiny("diloco", compression="int8", overlap=True, inner_steps=10), tmp_path / "diloco")
    assert diloco["wan_bytes"] * 30 < ddp["wan_bytes"]
    assert diloco["final_val_loss"] < diloco["initial_val_loss"] - 1.5


def test_a_killed_site_does_not_stop_a_diloco_run(tmp_path: Path) -> None:
    cfg = tiny("diloco", faults=FaultConfig(kill_site=1, kill_at_step=22), wan_timeout_seconds=4.0)
    summary = run(cfg, tmp_path)
    assert summary["live_sites"] == [0]
    assert summary["finished_ranks"] == [0, 1]
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 1.5
    rank2 = [json.loads(line) for line in (tmp_path / "metrics" / "rank2.jsonl").read_text().splitlines()]
    assert rank2[-1]["step"] == 22 and not rank2[-1]["final"]


def test_config_errors_say_how_to_fix() -> None:
    with pytest.raises(ValueError, match="multiple of"):
        TrainConfig(seq_len=64, global_batch_tokens=1000)
    with pytest.raises(ValueError, match="give both"):
        FaultConfig(kill_site=1)
    with pytest.raises(ValueError, match="drop --overlap"):
        StrategyConfig(name="ddp", overlap=True)
    assert TrainConfig(seq_len=64, global_batch_tokens=1024).shares(3) == [6, 5, 5]
    with pytest.raises(ValueError, match="raise global_batch_tokens to at least 1280"):
        TrainConfig(seq_len=64, global_batch_tokens=1024).shares(20)
    cfg = tiny("diloco", compression="int8")
    assert TrainConfig.from_env(cfg.to_env()) == cfg


class _Collector(BaseHTTPRequestHandler):
    bodies: list[tuple[str, dict]] = []

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append((self.headers["Authorization"], body))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_http_sink_posts_batches_with_bearer_token_and_never_raises() -> None:
    server = HTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        sink = HttpSink(f"http://127.0.0.1:{server.server_port}/v1/metrics", "tok", batch_size=2)
        sink.emit({"rank": 0, "step": 1, "final": False})
        sink.emit({"rank": 0, "step": 2, "final": False})
        sink.emit({"rank": 0, "step": 3, "final": True})
        assert [b["reports"][0]["step"] for _, b in _Collector.bodies] == [1, 3]
        assert _Collector.bodies[0][0] == "Bearer tok"
    finally:
        server.shutdown()
    dead = HttpSink("http://127.0.0.1:9/nowhere", "tok", batch_size=1, timeout=0.5)
    dead.emit({"rank": 0, "step": 1, "final": True})  # the collector is down: logged, not raised
    assert dead.failures == 1


def test_gossip_graph_varies_and_ps_shards_cover_the_vector() -> None:
    from cpn.runtime.strategies.async_ps import shard_bounds
    from cpn.runtime.strategies.gossip import neighbours

    assert [neighbours(0, 8, r, 1) for r in range(4)] == [[1], [2], [4], [1]]
    assert neighbours(0, 8, 0, 2) == [1, 7]
    assert neighbours(1, 2, 5, 2) == [0] and neighbours(0, 1, 0, 2) == []
    bounds = shard_bounds(10, 3)
    assert bounds == [(0, 4), (4, 8), (8, 10)]


def test_learning_rate_warms_up_then_decays_to_a_tenth() -> None:
    from cpn.runtime.strategies.base import lr_at

    cfg = tiny("ddp")
    assert lr_at(cfg, 0.0) < 0.01 * cfg.lr
    assert lr_at(cfg, cfg.warmup_fraction) == pytest.approx(cfg.lr)
    assert lr_at(cfg, 1.0) == pytest.approx(0.1 * cfg.lr)


@pytest.mark.parametrize("strategy", ["ddp", "diloco"])
def test_three_single_worker_sites_split_an_uneven_batch(strategy: str, tmp_path: Path) -> None:
    """16 sequences over 3 ranks: 6, 5, 5; gradients and pseudo-gradients weighted by them."""
    summary = run(tiny(strategy, steps=20, balance=False), tmp_path, Topology.uniform(3, 1))
    assert summary["finished_ranks"] == [0, 1, 2]
    assert summary["tokens"] == 1024 * 20  # every step is exactly one global batch
    first = [json.loads(line) for line in (tmp_path / "metrics" / "rank0.jsonl").read_text().splitlines()][-1]
    last = [json.loads(line) for line in (tmp_path / "metrics" / "rank2.jsonl").read_text().splitlines()][-1]
    assert (first["tokens"], last["tokens"]) == (6 * 64 * 20, 5 * 64 * 20)
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 1.0
    assert summary["gpu_seconds"] >= summary["wall_seconds"]  # three ranks, each holding its device


def test_config_errors_are_found_before_any_worker_starts_and_failures_name_the_cause() -> None:
    from click.testing import CliRunner

    from cpn.runtime.cli_train import train_cmd
    from cpn.runtime.launcher import WorkerResult
    from cpn.runtime.train import failure_lines, preflight

    with pytest.raises(ValueError, match="strategy.ps 5 exceeds the 3 ranks"):
        preflight(tiny("async_ps", ps=5), Topology.uniform(3, 1))
    with pytest.raises(ValueError, match="faults.slow_site 4 is not one of the 2 sites"):
        preflight(tiny("ddp", faults=FaultConfig(slow_site=4, slowdown=2)), TWO_BY_TWO)
    out = CliRunner().invoke(train_cmd, ["--sites", "3", "--workers-per-site", "1", "--strategy", "async_ps",
                                         "--ps", "4"])
    assert out.exit_code == 2 and "--ps 4 exceeds the 3 ranks" in out.output and "Traceback" not in out.output
    log = "Traceback (most recent call last):\n  File \"x.py\", line 1\nValueError: shard too small\n"
    results = [WorkerResult(0, 0, 0), WorkerResult(1, 0, 1, log=log), WorkerResult(2, 1, -9, log="")]
    assert failure_lines(results, set()) == ["rank 1 (site 0) exited 1: ValueError: shard too small",
                                             "rank 2 (site 1) exited -9: (no output)"]


def test_balanced_shares_follow_measured_speed(tmp_path: Path) -> None:
    """One site 3x slower: after the first measurement window it gets a smaller share of each global
    batch, every step is still exactly one global batch, and the model still learns."""
    cfg = tiny("hierarchical", steps=30, balance=True, faults=FaultConfig(slow_site=2, slowdown=3.0))
    summary = run(cfg, tmp_path, Topology.uniform(3, 1))
    assert summary["tokens"] == 1024 * 30
    tokens = [[json.loads(line) for line in (tmp_path / "metrics" / f"rank{r}.jsonl").read_text().splitlines()][-1]["tokens"]
              for r in range(3)]
    assert tokens[2] < min(tokens[0], tokens[1]), tokens
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 1.0
    shares = summary["shares"]  # the last split, in the summary (cpn train and the bench print it)
    assert sum(shares) == cfg.global_sequences and shares[2] < min(shares[:2]), shares


def test_balanced_shares_learn_from_ddps_windows(tmp_path: Path) -> None:
    """Throughput-proportional shares move sequences between ranks, not the step's data: every step
    learns from the windows ddp's equal shares read (the trimmed last step too), so with a slow site
    the balanced run ends with ddp's parameters."""
    slow = FaultConfig(slow_site=2, slowdown=3.0)
    three = Topology.uniform(3, 1)
    knobs = {"optimizer": "sgd", "lr": 0.5, "faults": slow}
    ddp = tiny("ddp", steps=30, balance=False, **knobs)
    balanced = tiny("hierarchical", steps=30, balance=True, **knobs)
    ddp = ddp.model_copy(update={"tokens": ddp.tokens + 200})  # a trimmed last step of 200 tokens
    balanced = balanced.model_copy(update={"tokens": ddp.tokens})
    run(ddp, tmp_path / "ddp", three)
    run(balanced, tmp_path / "balanced", three)
    tokens = [[json.loads(line) for line in (tmp_path / "balanced" / "metrics" / f"rank{r}.jsonl").read_text()
               .splitlines()][-1]["tokens"] for r in range(3)]
    assert tokens[2] < min(tokens[0], tokens[1]), tokens  # the shares did move
    a, b = final_params(tmp_path / "ddp"), final_params(tmp_path / "balanced")
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=5e-5, rtol=1e-4, msg=name)


def test_balance_windows_split_early_then_keep_following_the_speeds() -> None:
    from cpn.runtime.strategies.base import BALANCE_EVERY, BALANCE_WINDOWS, balance_window

    (first, second), (_, last) = BALANCE_WINDOWS[0], BALANCE_WINDOWS[-1]
    assert balance_window(first) == (None, first)  # measuring starts
    assert balance_window(second) == (first, second)  # a split, and the next window starts
    assert balance_window(last + BALANCE_EVERY) == (last, last + BALANCE_EVERY)
    assert balance_window(last + 3 * BALANCE_EVERY) == (last + 2 * BALANCE_EVERY, last + 3 * BALANCE_EVERY)
    assert balance_window(last + 1) == (None, None)


def test_speeds_within_the_noise_of_each_other_take_one_class() -> None:
    """Two equal sites measured 20 % apart take equal shares (not 15 and 13 of 32, which made every step
    wait for the larger); a site 3x slower stays apart; a chain of small steps splits where it leaves the
    threshold of its class's slowest."""
    from cpn.runtime.strategies.base import BALANCE_THRESHOLD, proportional_shares, speed_classes

    assert speed_classes([348.0, 291.0, 88.0]) == [319.5, 319.5, 88.0]
    assert proportional_shares(32, speed_classes([348.0, 291.0, 88.0])) == [14, 14, 4]
    assert proportional_shares(32, [348.0, 291.0, 88.0]) == [15, 13, 4]  # what the raw speeds gave
    assert speed_classes([1.0, 1.2, 1.44], threshold=BALANCE_THRESHOLD) == [1.1, 1.1, 1.44]
    assert speed_classes([5.0, 1.0, 1.1, 4.5]) == [4.75, 1.05, 1.05, 4.75]
    assert speed_classes([2.0]) == [2.0]


def test_proportional_shares_sum_to_the_batch_and_leave_nobody_empty() -> None:
    from cpn.runtime.strategies.base import proportional_shares

    assert proportional_shares(16, [1.0, 1.0, 0.5]) == [7, 6, 3]
    assert proportional_shares(16, [1.0, 1.0, 1.0, 1.0]) == [4, 4, 4, 4]
    assert proportional_shares(4, [100.0, 1.0, 1.0, 1.0]) == [1, 1, 1, 1]
    assert sum(proportional_shares(33, [3.0, 0.1, 2.2])) == 33


def test_ps_sync_with_one_server_equals_synchronous_training(tmp_path: Path) -> None:
    """Servers that average every worker's push and step once are synchronous SGD (seed 001)."""
    sync = tiny("ddp", steps=12, optimizer="sgd", lr=0.5, balance=False)
    ps = tiny("ps_sync", steps=12, optimizer="sgd", lr=0.5, ps=1)
    run(sync, tmp_path / "ddp")
    summary = run(ps, tmp_path / "ps")
    assert summary["ps_dropped"] == 0
    a, b = final_params(tmp_path / "ddp"), final_params(tmp_path / "ps")
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=2e-5, rtol=1e-4, msg=name)


def test_ps_backup_drops_the_slow_sites_pushes_and_finishes_sooner(tmp_path: Path) -> None:
    slow = FaultConfig(slow_site=1, slowdown=4.0)
    three = Topology.uniform(3, 1)
    sync = run(tiny("ps_sync", steps=30, faults=slow, ps=1), tmp_path / "sync", three)
    backup = run(tiny("ps_backup", steps=30, faults=slow, ps=1, backup_workers=1), tmp_path / "backup", three)
    assert sync["ps_dropped"] == 0 and backup["ps_dropped"] > 0, (sync, backup)
    assert backup["wall_seconds"] < sync["wall_seconds"], (backup["wall_seconds"], sync["wall_seconds"])
    assert backup["final_val_loss"] < backup["initial_val_loss"] - 1.5


def test_a_rank_that_never_posts_its_speed_costs_one_timeout_not_one_per_window() -> None:
    """A dead site's rank never posts again: the first balance window after its death waits the WAN
    timeout for it; the later windows leave it out (they used to wait the timeout every 25 steps) and
    still split the batch by the live ranks' speeds."""
    import time
    from types import SimpleNamespace

    import torch.distributed as dist

    from cpn.runtime.metrics import Timers
    from cpn.runtime.strategies.base import Strategy
    from cpn.runtime.strategies.idle import IdleTrial

    store = dist.HashStore()
    cfg = tiny("diloco", balance=True, wan_timeout_seconds=2.0)
    ctx = SimpleNamespace(busy_seconds=0.0, sequences_done=0, store=store, groups=SimpleNamespace(world_size=3),
                          rank=0, shares=None, micro_batch=None, timers=Timers(), step_walls=[])
    rank0 = SimpleNamespace(balanced=True, cfg=cfg, ctx=ctx, idle_trial=IdleTrial(), may_idle=False, sharded=False)
    posts = dist.PrefixStore("cpn/balance", store)
    Strategy.rebalance(rank0, 1)  # the first window starts
    ctx.busy_seconds, ctx.sequences_done = 1.0, 10
    posts.set("5/1", "10.0")  # rank 1 posts; rank 2's site is dead
    started = time.monotonic()
    Strategy.rebalance(rank0, 5)
    assert time.monotonic() - started >= 2.0 and ctx.shares is None and rank0._silent == {2}
    # rank 2 was only late: it finds every speed posted, yet takes the window's verdict, as rank 0 did
    late_ctx = SimpleNamespace(**{**vars(ctx), "rank": 2, "shares": None, "timers": Timers()})
    late = SimpleNamespace(balanced=True, cfg=cfg, ctx=late_ctx, _window=(0.0, 0), idle_trial=IdleTrial(),
                           may_idle=False, sharded=False)
    late_ctx.busy_seconds, late_ctx.sequences_done = 1.0, 10
    Strategy.rebalance(late, 5)
    assert late_ctx.shares is None and late._silent == {2}
    ctx.busy_seconds, ctx.sequences_done = 2.0, 30  # rank 0: 20 sequences per busy second
    posts.set("25/1", "5.0")
    started = time.monotonic()
    Strategy.rebalance(rank0, 25)
    assert time.monotonic() - started < 1.0  # rank 2 is not waited for again
    assert ctx.shares is not None and ctx.shares[0] > ctx.shares[1] and sum(ctx.shares) == cfg.global_sequences
    assert ctx.micro_batch == ctx.shares[0]


def test_balance_windows_do_not_wait_for_the_sites_the_exchange_dropped() -> None:
    """Once a check-in has dropped a site (it did not arrive within the WAN timeout), a balance window
    does not wait the timeout for its ranks again: the live ranks' speeds split the batch at once,
    the dropped rank is not silenced for good (it is waited for again if it checks in again), and a
    rank that comes later takes the same verdict without waiting either."""
    import time
    from types import SimpleNamespace

    import torch.distributed as dist

    from cpn.runtime.metrics import Timers
    from cpn.runtime.strategies.base import Strategy
    from cpn.runtime.strategies.idle import IdleTrial

    store = dist.HashStore()
    cfg = tiny("diloco", balance=True, wan_timeout_seconds=3.0)
    groups = SimpleNamespace(world_size=3, topology=Topology.uniform(3, 1))
    store.set("cpn/wan/dropped", json.dumps([2]))  # what the coordinator's last check-in recorded
    ctx = SimpleNamespace(busy_seconds=0.0, sequences_done=0, store=store, groups=groups, rank=0, shares=None,
                          micro_batch=None, timers=Timers(), step_walls=[])
    rank0 = SimpleNamespace(balanced=True, cfg=cfg, ctx=ctx, idle_trial=IdleTrial(), may_idle=False, sharded=False)
    Strategy.rebalance(rank0, 1)
    ctx.busy_seconds, ctx.sequences_done = 1.0, 20  # rank 0: 20 sequences per busy second
    dist.PrefixStore("cpn/balance", store).set("5/1", "5.0")
    started = time.monotonic()
    Strategy.rebalance(rank0, 5)
    assert time.monotonic() - started < 1.0  # not the 3 s timeout
    assert ctx.shares is not None and ctx.shares[0] > ctx.shares[1] and sum(ctx.shares) == cfg.global_sequences
    assert rank0._silent == set()
    late_ctx = SimpleNamespace(**{**vars(ctx), "rank": 1, "shares": None, "timers": Timers()})
    store.set("cpn/wan/dropped", json.dumps([]))  # site 2 checked in again meanwhile: the verdict still stands
    late = SimpleNamespace(balanced=True, cfg=cfg, ctx=late_ctx, _window=(0.0, 0), idle_trial=IdleTrial(),
                           may_idle=False, sharded=False)
    late_ctx.busy_seconds, late_ctx.sequences_done = 1.0, 5
    started = time.monotonic()
    Strategy.rebalance(late, 5)
    assert time.monotonic() - started < 1.0 and late_ctx.shares == ctx.shares


def test_a_check_in_after_a_failed_exchange_waits_for_the_silent_site_only_until_its_timeout() -> None:
    """The coordinator's exchange of round 4 began waiting 1.5 s ago and failed (timeout 2.5 s). Site 1
    recorded the failure too (it is alive), site 2 did not (its death failed the exchange): round 5's
    check-in waits for site 2 only the 1 s left of one timeout, drops it and records it on the store;
    after an exchange that timed out it does not wait for it at all. A site that recorded the failure
    and is merely slow is waited for the whole timeout, as before, and taken back."""
    import threading
    import time
    from types import SimpleNamespace

    import torch.distributed as dist

    from cpn.runtime.metrics import Timers
    from cpn.runtime.strategies.base import SiteExchange, dropped_sites

    store = dist.HashStore()
    cfg = tiny("diloco", compression="none", wan_timeout_seconds=2.5)
    coordinator = SiteExchange(SimpleNamespace(store=store, site=0, num_sites=3, cfg=cfg, timers=Timers()))

    def check_in(rnd: int, waited: float, failed: tuple[int, ...], arrived: tuple[int, ...]) -> float:
        """Round ``rnd``'s check-in after round rnd-1's exchange failed at ``failed`` (its wait began
        ``waited`` seconds ago), with ``arrived`` checked in; returns the seconds it took."""
        coordinator.members = [0, 1, 2]
        for site in failed:
            coordinator.store.set(f"r{rnd - 1}/failed/{site}", "RuntimeError('Connection closed by peer')")
        coordinator.failed = (rnd - 1, time.monotonic() - waited)
        for site in arrived:
            coordinator.store.set(f"r{rnd}/arrive/{site}", "1")
        started = time.monotonic()
        coordinator._decide(rnd)
        return time.monotonic() - started

    assert 0.7 < check_in(5, 1.5, failed=(0, 1), arrived=(0, 1)) < 1.5
    assert json.loads(coordinator.store.get("r5/members"))["members"] == [0, 1]
    assert dropped_sites(store) == {2}
    assert check_in(6, 2.5, failed=(0, 1), arrived=(0, 1)) < 0.5  # the exchange timed out: no second wait
    assert dropped_sites(store) == {2}

    # a failed round 6 that every site recorded: slow site 2 checks in 2 s late and is waited for
    late = threading.Timer(2.0, coordinator.store.set, ("r7/arrive/2", "1"))
    late.start()
    assert check_in(7, 1.5, failed=(0, 1, 2), arrived=(0, 1)) >= 1.9
    late.join()
    assert json.loads(coordinator.store.get("r7/members"))["members"] == [0, 1, 2]
    assert dropped_sites(store) == set()
