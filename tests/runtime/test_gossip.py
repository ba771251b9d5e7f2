"""Gossip mixes by push-sum: consensus on the work-weighted mean, whatever the sites' speeds."""

from __future__ import annotations

import torch

from cpn.runtime.strategies.gossip import neighbours, push_sum

SITES = 4
WORK = [1.0, 2.0, 3.0, 10.0]  # global batches each site trained: one site did far more work than the others


def start() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(64, generator=g, dtype=torch.float64) for _ in range(SITES)]


def weighted_mean(thetas: list[torch.Tensor]) -> torch.Tensor:
    return sum(w * t for w, t in zip(WORK, thetas, strict=True)) / sum(WORK)


def test_push_sum_keeps_the_work_weighted_mean_and_reaches_it() -> None:
    thetas, weights = start(), list(WORK)
    target = weighted_mean(thetas)
    inbox: list[list[torch.Tensor]] = [[] for _ in range(SITES)]
    for rnd in range(40):
        sent: list[list[torch.Tensor]] = [[] for _ in range(SITES)]
        for i in range(SITES):
            targets = neighbours(i, SITES, rnd, 1)
            thetas[i], weights[i], message = push_sum(thetas[i], weights[i], inbox[i], len(targets))
            for j in targets:
                sent[j].append(message)
        inbox = sent
        in_flight = sum(m for box in inbox for m in box)
        mass = sum(w * t for w, t in zip(weights, thetas, strict=True)) + in_flight[:-1]
        total = sum(weights) + float(in_flight[-1])
        torch.testing.assert_close(mass / total, target)  # the invariant: Σ w·θ / Σ w never moves
    for theta in thetas:
        torch.testing.assert_close(theta, target, atol=1e-6, rtol=0)


def test_an_unweighted_mean_would_settle_elsewhere() -> None:
    """What gossip did before: θ ← mean(θ, arrivals). It reaches a consensus, but on the plain mean,
    which ignores that site 3 did 10 of the 16 batches' work."""
    thetas = start()
    target = weighted_mean(thetas)
    for rnd in range(40):
        posted = {i: (neighbours(i, SITES, rnd, 1), thetas[i].clone()) for i in range(SITES)}
        for i in range(SITES):
            got = [theta for j, (targets, theta) in posted.items() if i in targets]
            thetas[i] = (thetas[i] + sum(got)) / (1 + len(got))
    assert float((thetas[0] - target).abs().max()) > 0.1
    torch.testing.assert_close(thetas[0], sum(start()) / SITES, atol=1e-6, rtol=0)


class _Clocks:
    def __init__(self, **clocks: int):
        self.clocks = {k: str(v) for k, v in clocks.items()}

    def get(self, key: str) -> str:
        return self.clocks[key]

    def set(self, key: str, value: str) -> None:
        self.clocks[key] = value


def _ssp(clocks: _Clocks, staleness: int = 2, timeout: float = 0.05):
    """An ssp site leader (site 0 of 3) on fake clocks: only the staleness gate is exercised."""
    from types import SimpleNamespace

    from cpn.runtime.metrics import Timers
    from cpn.runtime.strategies.ssp import SSP

    ssp = object.__new__(SSP)
    ssp.ctx = SimpleNamespace(is_leader=True, site=0, num_sites=3, timers=Timers())
    ssp.cfg = SimpleNamespace(strategy=SimpleNamespace(wan_timeout_seconds=timeout))
    ssp.clocks, ssp.s, ssp.stop = clocks, staleness, False
    ssp.dropped, ssp.rejoined = {}, 0
    ssp.mail = SimpleNamespace(dead=set())
    ssp.budget = SimpleNamespace(total=10**9, spent=lambda: 0)
    return ssp


def test_an_ssp_site_dropped_after_a_stall_rejoins_when_its_clock_moves() -> None:
    clocks = _Clocks(**{"0": 0, "1": 10, "2": 3})
    ssp = _ssp(clocks)
    ssp.before_step(10)  # site 2 is 7 steps behind and its clock does not move: dropped after the timeout
    assert ssp.dropped == {2: 3} and ssp.live_sites() == [0, 1] and ssp.targets() == [1]
    ssp.before_step(11)  # still stalled: stays out and does not hold site 0 back
    assert 2 in ssp.dropped and ssp.rejoined == 0
    clocks.set("2", "10")  # it was slow, not lost: it caught up
    ssp.before_step(11)
    assert ssp.dropped == {} and ssp.rejoined == 1
    assert ssp.live_sites() == [0, 1, 2] and ssp.targets() == [1, 2]


def test_a_site_whose_channel_closed_stays_dropped() -> None:
    clocks = _Clocks(**{"0": 0, "1": 10, "2": 3})
    ssp = _ssp(clocks)
    ssp.before_step(10)
    ssp.mail.dead.add(2)
    clocks.set("2", "10")
    ssp.before_step(11)
    assert 2 in ssp.dropped and ssp.live_sites() == [0, 1]
