"""The defaults a job gets when it names no knob (cpn.runtime.autotune)."""

from __future__ import annotations

import pytest

from cpn.runtime.autotune import explain, resolve
from cpn.runtime.config import StrategyConfig, TrainConfig
from cpn.runtime.topology import Topology


def job(name: str = "diloco", tokens: int = 1_000_000, **knobs: object) -> TrainConfig:
    return TrainConfig(model="tiny", tokens=tokens, global_batch_tokens=4096, strategy=StrategyConfig(name=name, **knobs))


def test_plain_diloco_across_a_20_mbit_link_gets_int8_plain_averaging_and_a_wan_budget_h() -> None:
    s = resolve(job(), Topology.uniform(2, 2), wan_mbps=20).strategy
    assert (s.name, s.compression, s.outer_lr, s.outer_momentum, s.nesterov) == ("diloco", "int8", 1.0, 0.0, False)
    # H keeps the WAN bytes under 1/110 of ddp's: 2 leaders x 1.016 B/param per round vs 12 B/param per ddp step
    assert s.inner_steps == 19
    # at 20 Mbit/s the int8 round takes ~0.054 s, 3.5 % of a 19-step round (~1.55 s): worth hiding
    assert s.overlap is True and s.overlap_steps == 1
    assert s.balance is True
    assert s.resolved


def test_a_slow_link_turns_on_the_tau_delayed_overlap() -> None:
    s = resolve(job(), Topology.uniform(2, 2), wan_mbps=5).strategy
    assert s.overlap is True and 1 <= s.overlap_steps <= s.inner_steps // 2


@pytest.mark.parametrize(("mbps", "overlap"), [(None, False), (1_000, False), (50, True), (20, True)])
def test_overlap_follows_the_exchange_share_of_a_round(mbps: float | None, overlap: bool) -> None:
    """On when the exchange costs more than OVERLAP_HIDE of a round's compute: not on an unshaped link
    (nothing to hide) nor at 1 Gbit/s (0.07 % of a round), but at 50 Mbit/s (1.4 %) and 20 Mbit/s (3.5 %)."""
    from cpn.runtime.autotune import OVERLAP_HIDE, _exchange_seconds, _step_compute_seconds, link_of

    cfg, topo = job(), Topology.uniform(2, 2)
    s = resolve(cfg, topo, wan_mbps=mbps).strategy
    share = _exchange_seconds(cfg, topo, link_of(topo, mbps), "int8") / (s.inner_steps * _step_compute_seconds(cfg, topo))
    assert s.overlap is overlap and (share > OVERLAP_HIDE) is overlap, share


def test_many_outer_rounds_get_diloco_nesterov_outer_step() -> None:
    s = resolve(job(tokens=40_000_000), Topology.uniform(2, 2), wan_mbps=20).strategy
    assert (s.outer_lr, s.outer_momentum, s.nesterov) == (0.7, 0.9, True)


def test_explicit_knobs_are_kept() -> None:
    cfg = job(inner_steps=7, outer_lr=0.5, outer_momentum=0.5, nesterov=True, compression="none", overlap=True,
              balance=False)
    s = resolve(cfg, Topology.uniform(2, 2), wan_mbps=20).strategy
    assert (s.inner_steps, s.outer_lr, s.outer_momentum, s.nesterov, s.compression, s.overlap, s.balance) == (
        7, 0.5, 0.5, True, "none", True, False)


@pytest.mark.parametrize(("sites", "workers", "mbps", "expected"), [
    (1, 4, None, "ddp"),
    (3, 1, None, "hierarchical"),  # unshaped: every-step sync costs little, diloco would need more tokens
    (2, 2, 20, "diloco"),  # a 20 Mbit/s WAN: every-step sync of 0.5 MB gradients costs more than compute
])
def test_auto_picks_the_strategy_the_planner_would(sites: int, workers: int, mbps: float | None, expected: str) -> None:
    cfg = resolve(job("auto", tokens=600_000), Topology.uniform(sites, workers), wan_mbps=mbps)
    assert cfg.strategy.name == expected
    assert explain(cfg).startswith(expected)


def test_ddp_keeps_torch_ddp_semantics() -> None:
    s = resolve(job("ddp"), Topology.uniform(3, 1)).strategy
    assert s.balance is False and s.compression == "none" and s.inner_steps == 1
