"""`cpn serve` as several worker processes on one port (PostgreSQL): both answer, one leads the
reconciler, /metrics counts every worker's requests, and the workers die with the parent. On SQLite
more than one worker is refused in one line before anything starts."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from cpn.api.workers import worker_pids
from tests.conftest import DatabaseFactory, start_server
from tests.e2e.test_replicas import _pg


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


@pytest.mark.postgres  # several workers need PostgreSQL: only CI's PostgreSQL pass runs it
def test_two_workers_share_the_port_one_leads_and_metrics_count_both(tmp_path: Path) -> None:
    factory = DatabaseFactory(tmp_path / "db", _pg())
    server = start_server(factory.new(), tmp_path, {"CPN_WORKERS": "2", "CPN_METRICS_PUBLIC": "true"})
    try:
        workers = worker_pids(server.proc.pid)
        assert len(workers) == 2, workers
        roles: dict[str, int] = {}
        deadline = time.monotonic() + 30
        while (len(roles) < 2 or sum(roles.values()) < 60) and time.monotonic() < deadline:
            role = httpx.get(f"{server.url}/healthz", timeout=5).json()["reconciler"]  # a new connection each time
            roles[role] = roles.get(role, 0) + 1
        assert set(roles) == {"leader", "standby"}, roles
        calls = sum(roles.values())
        for _ in range(3):  # whichever worker answers counts every worker's requests
            text = httpx.get(f"{server.url}/metrics", timeout=5).text
            served = re.search(r'cpn_http_requests_total\{method="GET",route="/healthz",status="200"\} (\S+)', text)
            assert served is not None and float(served.group(1)) >= calls, (roles, text[:1500])
        log = "\n".join(p.read_text() for p in tmp_path.glob("server-*.log"))
        assert log.count("CPN API serving on") == 1 and "2 worker processes" in log, log[-2000:]
        server.proc.send_signal(signal.SIGKILL)  # no goodbye: the workers must not keep serving
        server.proc.wait()
        deadline = time.monotonic() + 15
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(w) for w in workers), "a worker outlived the killed server"
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
        factory.cleanup()


def test_more_than_one_worker_on_sqlite_is_refused_in_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "CPN_DATA_DIR": str(tmp_path), "HOME": str(tmp_path)}
    env.pop("CPN_DATABASE_URL", None)
    out = subprocess.run([str(Path(sys.executable).parent / "cpn"), "serve", "--workers", "2"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out
    lines = [x for x in out.stderr.splitlines() if x.strip() and not x.startswith(("Usage:", "Try "))]
    assert lines == ["error: workers 2 needs PostgreSQL: the embedded SQLite database is served by one process "
                     "(set CPN_DATABASE_URL, or drop --workers)"], out.stderr


def test_the_workers_listen_on_every_address_the_host_names() -> None:
    """``localhost`` may name IPv4 and IPv6; ``::1`` is IPv6 only (an AF_INET socket could not bind it)."""
    import socket

    from cpn.api.workers import bind

    socks = bind("127.0.0.1", 0, 16)
    assert [x.family for x in socks] == [socket.AF_INET]
    for x in socks:
        x.close()
    if socket.has_ipv6:
        try:
            six = bind("::1", 0, 16)
        except OSError as exc:  # no IPv6 loopback in this container
            assert exc.errno is not None
        else:
            assert [x.family for x in six] == [socket.AF_INET6]
            for x in six:
                x.close()
