"""Injected faults for experiments: a straggler site, a site that dies mid-run, a parameter server lost.

``--slow-site K --slowdown F``: every rank of site K sleeps (F-1) times its compute time after each
micro-batch, so the site computes F times slower (the sleep counts as compute).
``--kill-site K --at-step N``: every rank of site K exits abruptly (``os._exit``, no clean-up, like
a lost machine) when it reaches step N. Exit code :data:`KILLED_EXIT_CODE` tells the launcher's
caller that the death was planned.
``--kill-ps K --at-step N`` (async_ps, ps_sync, ps_backup with ``--ps-replicas``): the process that
serves parameter shard K's primary exits the same way at its step N (the strategy checks, since
only it knows where the primary runs); a secondary takes over.
"""

from __future__ import annotations

import os
import sys
import time

from cpn.runtime.config import FaultConfig

KILLED_EXIT_CODE = 75


def slow_down(faults: FaultConfig, site: int, compute_seconds: float) -> float:
    """Sleep to emulate a slow site; returns the seconds slept."""
    if faults.slow_site != site or faults.slowdown <= 1:
        return 0.0
    extra = (faults.slowdown - 1) * compute_seconds
    time.sleep(extra)
    return extra


def should_kill(faults: FaultConfig, site: int, step: int) -> bool:
    return faults.kill_site == site and faults.kill_at_step is not None and step >= faults.kill_at_step


def should_kill_ps(faults: FaultConfig, primaries: set[int], step: int) -> bool:
    """True in the process serving shard ``faults.kill_ps``'s primary (``primaries``: the shards it serves)."""
    return faults.kill_ps in primaries and faults.kill_at_step is not None and step >= faults.kill_at_step


def die(flush: list) -> None:
    """Exit now, as a crashed site would (after flushing the metrics so the run can be analysed)."""
    for f in flush:
        try:
            f()
        except Exception:  # noqa: BLE001
            pass
    sys.stderr.write("cpn: site killed by fault injection\n")
    sys.stderr.flush()
    os._exit(KILLED_EXIT_CODE)
