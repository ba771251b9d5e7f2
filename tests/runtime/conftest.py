"""Shared helpers for runtime tests: run a worker function on S x W real Gloo processes."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

from cpn.runtime.launcher import launch
from cpn.runtime.topology import Topology


@pytest.fixture
def root() -> None:
    """Skip unless root: network namespaces, veths and tc qdiscs need it."""
    if os.geteuid() != 0:
        pytest.skip("needs root for network namespaces, veths and tc qdiscs (os.geteuid() != 0)")


def _run_workers(
    sites: int, workers_per_site: int, fn: Callable[..., Any], *args: Any, wan_mbps: float | None = None
) -> list[Any]:
    topo = Topology.uniform(sites, workers_per_site)
    method = "spawn" if wan_mbps else "forkserver"
    results = launch(
        topo,
        fn,
        args,
        wan_mbps=wan_mbps,
        capture_output=True,
        timeout=120,
        failure_grace=5,
        start_method=method,
    )
    return [r.result for r in results]


@pytest.fixture
def run_workers() -> Callable[..., list[Any]]:
    """``run_workers(S, W, fn, *args, wan_mbps=None)``: ``fn(*args)`` on every rank; each rank's value."""
    return _run_workers
