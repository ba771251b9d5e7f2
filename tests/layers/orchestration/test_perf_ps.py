"""The compute model's synchronous parameter servers (issue 15): ps_sync waits for the slowest worker,
ps_backup for the (N−b)-th fastest, both with async_ps's WAN traffic; replicas add their forwards.
The strategy names agree across the API schema, the planner and the runtime (one list each, kept equal)."""

from __future__ import annotations

import typing
from dataclasses import replace
from decimal import Decimal

import pytest

from cpn.runtime.config import PS_STRATEGIES as RUNTIME_PS
from cpn.runtime.strategies import STRATEGIES as RUNTIME_STRATEGIES
from layers.orchestration.planning import perf, types
from layers.orchestration.planning.types import Assignment, WanLink
from layers.service import schemas
from tests.layers.orchestration.test_perf import job, offer

SITES = ("s1", "s2", "s3")


def three_sites(slow: float = 2.0) -> tuple[dict, list[WanLink], list[Assignment]]:
    """Three sites of one H100 each, site s3's GPU `slow`× slower; 10 Gbit/s links. The GPUs report no
    memory (taken to fit): the 7B model's 112 GB of training state would otherwise make the memory plan
    checkpoint (+1/3 compute), which is not what these step formulas are about."""
    offers = {f"c{i}": replace(offer(f"c{i}", s, gpus=1, tflops=989.0 / (slow if s == "s3" else 1.0)), memory_gb=0)
              for i, s in enumerate(SITES)}
    links = [WanLink(a, b, 10.0, 20.0, Decimal("0.02")) for a, b in (("s1", "s2"), ("s2", "s3"), ("s1", "s3"))]
    placement = [Assignment(f"c{i}", s, 1, "H100") for i, s in enumerate(SITES)]
    return offers, links, placement


def test_one_slow_site_ps_backup_is_predicted_faster_than_ps_sync() -> None:
    offers, links, placement = three_sites(slow=2.0)
    sync = perf.predict(job(), placement, "ps_sync", offers, links)
    backup = perf.predict(job(backup_workers=1), placement, "ps_backup", offers, links)
    no_wait = perf.predict(job(), placement, "async_ps", offers, links)
    assert backup.total_seconds < sync.total_seconds
    # the same traffic: every push crosses the WAN (ps_backup's dropped ones too)
    assert sync.wan_bytes == backup.wan_bytes == no_wait.wan_bytes > 0
    assert sync.comm_seconds_per_step == backup.comm_seconds_per_step == no_wait.comm_seconds_per_step
    c = perf.flops_per_step(job()) / 3 / (989e12 * 0.40)  # one fast worker's compute (MFU 0.40 on H100)
    x = sync.comm_seconds_per_step
    assert sync.step_seconds == pytest.approx(2 * c + x)  # waits for the slow worker
    # the two fast workers wait for each other (the quorum is 2), the slow one pushes at its own pace
    assert backup.step_seconds == pytest.approx(3 / (2 / (c + x) + 1 / (2 * c + x)))


def test_without_a_straggler_or_without_backups_the_two_agree() -> None:
    offers, links, placement = three_sites(slow=1.0)
    sync = perf.predict(job(), placement, "ps_sync", offers, links)
    backup = perf.predict(job(backup_workers=1), placement, "ps_backup", offers, links)
    assert backup.step_seconds == pytest.approx(sync.step_seconds)
    offers, links, placement = three_sites(slow=2.0)
    sync = perf.predict(job(), placement, "ps_sync", offers, links)
    none = perf.predict(job(backup_workers=0), placement, "ps_backup", offers, links)
    assert none.step_seconds == pytest.approx(sync.step_seconds)
    two = perf.predict(job(backup_workers=2), placement, "ps_backup", offers, links)
    one = perf.predict(job(backup_workers=1), placement, "ps_backup", offers, links)
    assert two.step_seconds <= one.step_seconds < sync.step_seconds


def test_barrier_step_formula() -> None:
    assert perf.barrier_step([1.0, 1.0, 2.0], 0.0, 0) == pytest.approx(2.0)
    assert perf.barrier_step([1.0, 1.0, 2.0], 0.0, 1) == pytest.approx(3 / 2.5)
    assert perf.barrier_step([1.0, 3.0, 2.0], 1.0, 1) == pytest.approx(3 / (2 / 3 + 1 / 4))


def test_replicas_add_their_forwards_to_bytes_and_time() -> None:
    offers, links, placement = three_sites(slow=1.0)
    plain = perf.predict(job(), placement, "ps_sync", offers, links)
    copied = perf.predict(job(ps_replicas=1), placement, "ps_sync", offers, links)
    k = 4 * job().model.parameters  # fp32 gradients
    # one update a step per shard (K/3 each), to one secondary, from each of the three sites
    assert copied.wan_bytes - plain.wan_bytes == pytest.approx(3 * k / 3 * plain.steps)
    assert copied.comm_seconds_per_step > plain.comm_seconds_per_step
    async_plain = perf.predict(job(), placement, "async_ps", offers, links)
    async_copied = perf.predict(job(ps_replicas=1), placement, "async_ps", offers, links)
    # async_ps forwards every push: N = 3 times ps_sync's forward bytes
    assert async_copied.wan_bytes - async_plain.wan_bytes == pytest.approx(3 * (copied.wan_bytes - plain.wan_bytes))


def test_strategy_lists_agree_across_api_planner_and_runtime() -> None:
    assert set(typing.get_args(schemas.Strategy)) == {"auto", *types.STRATEGIES} == {"auto", *RUNTIME_STRATEGIES}
    assert schemas.PS_STRATEGIES == types.PS_STRATEGIES == RUNTIME_PS
    assert set(perf.TOKEN_EFFICIENCY) == set(types.STRATEGIES)
