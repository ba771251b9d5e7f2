"""The balanced strategy's trial of its slowest ranks idle (cpn/runtime/strategies/idle.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cpn.runtime.config import FaultConfig, StrategyConfig, TrainConfig
from cpn.runtime.strategies import idle
from cpn.runtime.strategies.base import proportional_shares
from cpn.runtime.strategies.idle import IdleTrial, TrialState, shares_with_idle
from cpn.runtime.topology import Topology
from cpn.runtime.train import FINAL_MODEL, run_local

SLOW = FaultConfig(slow_site=2, slowdown=3.0)


def test_a_trial_starts_after_an_uneven_window_and_stands_only_if_faster() -> None:
    trial = IdleTrial()
    assert trial.next_idle([300.0, 300.0, 100.0], rate=700.0) == frozenset()  # no uneven window ran yet
    trial.uneven = True
    assert trial.next_idle([300.0, 300.0, 100.0], rate=700.0) == {2}
    assert trial.state is TrialState.TRYING and trial.base_rate == 700.0
    assert trial.speeds_with_idle([350.0, 340.0, 0.0]) == [350.0, 340.0, 100.0]  # its last working speed
    assert trial.next_idle([345.0, 345.0, 100.0], rate=700.0 * idle.IDLE_GAIN) == {2}
    assert trial.state is TrialState.KEPT and trial.gain == pytest.approx(idle.IDLE_GAIN)
    assert trial.next_idle([345.0, 345.0, 100.0], rate=100.0) == {2}  # decided once


def test_a_trial_that_is_not_faster_is_tried_once_more_then_every_rank_works_for_good() -> None:
    trial = IdleTrial(uneven=True)
    assert trial.next_idle([300.0, 100.0, 100.0], rate=700.0) == {1, 2}  # the whole slowest class
    assert trial.next_idle([300.0, 100.0, 100.0], rate=690.0) == frozenset()
    assert trial.state is TrialState.READY and trial.gain == pytest.approx(690 / 700)  # one window may lie
    assert trial.next_idle([300.0, 100.0, 100.0], rate=720.0) == {1, 2}  # the next window is the new base
    assert trial.base_rate == 720.0 and trial.tries == idle.IDLE_TRIES
    assert trial.next_idle([300.0, 100.0, 100.0], rate=700.0) == frozenset()
    assert trial.state is TrialState.DROPPED
    assert trial.next_idle([300.0, 100.0, 100.0], rate=9000.0) == frozenset()  # not tried again


def test_a_trial_that_was_clearly_slower_is_not_repeated() -> None:
    """Separate hardware: idling a site half as fast as the other leaves 2/3 of the throughput."""
    trial = IdleTrial(uneven=True)
    assert trial.next_idle([300.0, 150.0], rate=450.0) == {1}
    assert trial.next_idle([300.0, 150.0], rate=300.0) == frozenset()
    assert trial.state is TrialState.DROPPED and trial.tries == 1


def test_a_window_without_timed_steps_decides_nothing() -> None:
    trial = IdleTrial(uneven=True)
    assert trial.next_idle([300.0, 100.0], rate=0.0) == frozenset() and trial.state is TrialState.READY
    assert trial.next_idle([300.0, 100.0], rate=700.0) == {1}
    assert trial.next_idle([300.0, 100.0], rate=0.0) == {1} and trial.state is TrialState.TRYING


def test_even_speeds_put_idle_ranks_back_to_work() -> None:
    trial = IdleTrial(uneven=True)
    trial.next_idle([300.0, 300.0, 100.0], rate=700.0)
    trial.next_idle([300.0, 300.0, 100.0], rate=800.0)
    assert trial.state is TrialState.KEPT and trial.idle == {2}
    trial.stop()  # the fast ranks slowed to rank 2's speed: idling it no longer follows from a trial
    assert trial.idle == frozenset() and trial.state is TrialState.READY and trial.tries == 1


def test_equal_speeds_never_idle_anyone() -> None:
    trial = IdleTrial(uneven=True)
    assert trial.next_idle([300.0, 300.0], rate=700.0) == frozenset()  # every rank is the slowest class
    assert trial.state is TrialState.READY


def test_idle_ranks_take_no_sequences_and_the_rest_split_the_batch() -> None:
    assert shares_with_idle(32, [320.0, 320.0, 88.0], frozenset({2}), proportional_shares) == [16, 16, 0]
    assert shares_with_idle(32, [320.0, 320.0, 88.0], frozenset(), proportional_shares) == [14, 14, 4]


def test_a_rank_of_weight_0_sends_zeros_even_after_an_empty_batchs_nan() -> None:
    from cpn.runtime.strategies.base import weigh

    grads = [torch.tensor([float("nan"), 1.0]), torch.tensor([float("inf")])]
    weigh(grads, (0, 32))  # an idle rank whose loop ran its model on no rows
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)
    grads = [torch.tensor([2.0, 4.0])]
    weigh(grads, (48, 32))
    assert torch.equal(grads[0], torch.tensor([3.0, 6.0]))


def _cfg(strategy: str, balance: bool) -> TrainConfig:
    return TrainConfig(
        model="tiny", seq_len=64, global_batch_tokens=1024, tokens=1024 * 30 + 200, val_every=20, val_batches=2,
        optimizer="sgd", lr=0.5, faults=SLOW,
        strategy=StrategyConfig(name=strategy, inner_steps=5, wan_timeout_seconds=8.0, balance=balance),
    )


def _last_tokens(run_dir: Path, rank: int) -> int:
    lines = (run_dir / "metrics" / f"rank{rank}.jsonl").read_text().splitlines()
    return json.loads(lines[-1])["tokens"]


@pytest.mark.parametrize(("gain", "state"), [(0.0, "kept"), (float("inf"), "dropped")])
def test_a_trial_either_way_learns_ddps_parameters(gain: float, state: str, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The slow site idle (its sequences dealt to the others, its replica still stepped with weight 0)
    or back at work, the run ends with ddp's parameters; the summary says what the trial decided."""
    monkeypatch.setattr(idle, "IDLE_GAIN", gain)  # forked workers inherit it: force either outcome
    three = Topology.uniform(3, 1)
    ddp = run_local(_cfg("ddp", False), three, run_dir=tmp_path / "ddp", timeout=120, start_method="fork")
    cfg = _cfg("hierarchical", True)
    summary = run_local(cfg, three, run_dir=tmp_path / "h", timeout=120, start_method="fork")
    assert summary["idle_trial"] == state and summary["idle_gain"] > 0
    shares = summary["shares"]
    assert sum(shares) == cfg.global_sequences and (shares[2] == 0) == (state == "kept"), shares
    assert summary["tokens"] == ddp["tokens"] == cfg.tokens
    assert _last_tokens(tmp_path / "h", 2) < _last_tokens(tmp_path / "h", 0)
    a = torch.load(tmp_path / "ddp" / FINAL_MODEL, weights_only=True)
    b = torch.load(tmp_path / "h" / FINAL_MODEL, weights_only=True)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=5e-5, rtol=1e-4, msg=name)
