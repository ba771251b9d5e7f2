"""`cpn serve` where the port is taken: one line and exit 1, before the database is touched (it printed
tracebacks and a false "serving" line, and had created and migrated a fresh database first)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx

from tests.conftest import wait_healthy


def _env(tmp_path: Path) -> dict[str, str]:
    env = {**os.environ, "CPN_DATA_DIR": str(tmp_path), "CPN_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'cpn.db'}"}
    env.pop("CPN_TOKEN", None)
    return env


def test_a_taken_port_is_one_line_and_no_database(tmp_path: Path) -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        out = subprocess.run([sys.executable, "-m", "cpn.cli.server", "serve", "--port", str(port)],
                             env=_env(tmp_path), capture_output=True, text=True, timeout=60)
    finally:
        holder.close()
    assert out.returncode == 1, out
    assert out.stderr.strip().splitlines() == [
        f"error: cannot listen on 127.0.0.1:{port}: Address already in use (another cpn serve there? choose "
        "another with --port or CPN_PORT)"], out.stderr
    assert "Traceback" not in out.stderr + out.stdout and "serving" not in out.stderr
    assert not (tmp_path / "cpn.db").exists()


def test_a_free_port_serves(tmp_path: Path) -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    log = tmp_path / "server.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "cpn.cli.server", "serve", "--port", str(port)],
                                env=_env(tmp_path), stdout=fh, stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, log)
        assert httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200
        assert f"CPN API serving on http://127.0.0.1:{port}" in log.read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
