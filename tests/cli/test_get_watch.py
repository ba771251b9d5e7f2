"""`cpnctl get KIND -w` (issue 32): the listing, then a row again for each object that changed, until
Ctrl-C; watching one job ends when the job ends."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.api.test_resource import WORLD_A


def _lines_until(proc: subprocess.Popen, wanted: str, timeout: float = 120) -> list[str]:
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            break
        seen.append(line.rstrip("\n"))
        if wanted in line:
            return seen
    raise AssertionError(f"no line with {wanted!r}: {seen}")


@pytest.mark.slow
def test_get_watch_prints_a_changed_cluster_again(live_server) -> None:
    provider = live_server.token("prov-a", "provider")
    headers = {"Authorization": f"Bearer {provider}"}
    httpx.post(f"{live_server.url}/api/v1/apply", json={"items": WORLD_A}, headers=headers,
               timeout=30).raise_for_status()
    exe = Path(sys.executable).parent / "cpnctl"
    proc = subprocess.Popen([str(exe), "get", "clusters", "-w", "--watch-interval", "0.3"],
                            env={**live_server.env, "CPN_SERVER": live_server.url, "CPN_TOKEN": provider},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # a Ctrl-C from a terminal: a suite started in the background (`pytest &`) passes
                            # SIGINT down ignored, and Python then never turns it into KeyboardInterrupt
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        first = _lines_until(proc, "fra-h100")
        assert first[0].split()[:2] == ["NAME", "READY"], first
        before = next(line for line in first if line.startswith("fra-h100"))
        httpx.post(f"{live_server.url}/api/v1/clusters/fra-h100/heartbeat", json={"allocatableGpus": 9},
                   headers=headers, timeout=30).raise_for_status()
        again = _lines_until(proc, "fra-h100")
        assert again[-1].startswith("fra-h100") and again[-1] != before and "9/16" in again[-1], (before, again)
        assert not any(line.startswith("NAME") for line in again)  # rows only, no second header
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err  # Ctrl-C ends a watch quietly
