"""calibrate.compare: a bench row re-predicted on the same placement, with the machine's cores shared."""

import pytest

from layers.orchestration.planning import perf
from layers.orchestration.planning.calibrate import TINY, compare
from layers.orchestration.planning.calibration import CPU_TFLOPS, mfu


def bench(sites: int, workers: int, rows: list[dict], **opts) -> dict:
    return {"machine": {"cpus": 2}, "options": {"sites": sites, "workers_per_site": workers, "wan_mbps": None,
                                                "tokens": 409_600, "global_batch": 4096, **opts},
            "results": rows}


def row(strategy: str, wall: float, resolved: str | None = None) -> dict:
    return {"strategy": strategy, "wall_seconds": wall, "wan_bytes": 1, "resolved": resolved or strategy}


def test_four_slots_on_two_cores_take_twice_the_compute():
    """Unshaped ddp is nearly all compute (the 10 Gbit/s all-reduce adds ~1.5 %): 4 slots sharing 2 cores
    run as 2 slots would, 100 steps."""
    (r,) = compare(bench(2, 2, [row("ddp", 10.0)]))
    rate = CPU_TFLOPS * mfu("CPU") * 1e12
    assert r["predicted_s"] == pytest.approx(100 * 6 * TINY.parameters * 4096 / (2 * rate), rel=0.03)
    assert r["ratio"] == pytest.approx(10.0 / r["predicted_s"])


def test_a_slow_site_holds_up_equal_shares_but_not_balanced_ones():
    rows = [row("ddp", 10.0), row("auto", 10.0, "hierarchical, balanced shares")]
    equal, balanced = compare(bench(3, 1, rows, slow_site=2, slowdown=2.0))
    assert equal["predicted_s"] > 1.5 * balanced["predicted_s"]
    assert perf.host_stretch(3, 2.0) == 1.5 and perf.host_stretch(1, 2.0) == 1.0 and perf.host_stretch(8, None) == 1.0


def test_on_shared_cores_the_balanced_split_is_priced_with_its_slowest_slot_idle():
    """3 slots on 2 cores, slot 2 twice as slow: all three working share the cores (1.5x stretch) for
    2.5 slots' throughput; the two fast ones alone run unstretched on 2 slots' throughput, which is the
    faster (the runtime's idle trial keeps it). A slot only 1.2x slower counts as equal: not idled."""
    rows = [row("auto", 10.0, "hierarchical, balanced shares")]
    (slow,) = compare(bench(3, 1, rows, slow_site=2, slowdown=2.0))
    (even,) = compare(bench(3, 1, rows))
    (near,) = compare(bench(3, 1, rows, slow_site=2, slowdown=1.2))
    assert slow["predicted_s"] == pytest.approx(even["predicted_s"], rel=0.05)  # F/(2t) both; without idle 1.2x
    assert near["predicted_s"] > even["predicted_s"]  # all three work: the near-equal slot holds the step
