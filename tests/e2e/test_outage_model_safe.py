"""Issue 36, item 1: a Succeeded job always has its model. One `cpn agent --local` site runs a short
job; the API is stopped while its workers finish and started again within the runner's outage window:
the runner keeps retrying, and the job ends Succeeded with its final weights stored. When the blob
store cannot take the final weights for longer than the window, the job ends Failed
(OutputsNotStored), the event says so, and the site keeps the weights on its disk."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cpn.agent.localsites import LocalCluster, LocalSites
from cpn.runtime.config import FINAL_MODEL
from tests.api.test_resource import cluster, site
from tests.conftest import start_server, stop_server

pytestmark = pytest.mark.slow
DONE = ("Succeeded", "Failed", "Cancelled")


class OneSite:
    """A server and one 1-slot local site."""

    def __init__(self, db_url: str, tmp: Path, env: dict[str, str] | None = None) -> None:
        self.db_url, self.tmp, self.env = db_url, tmp, {"CPN_HEARTBEAT_TIMEOUT_SECONDS": "60", **(env or {})}
        self.server = start_server(db_url, tmp, self.env)
        self.port = int(self.server.url.rsplit(":", 1)[1])
        self.provider, self.user = self.server.token("prov", "provider"), self.server.token("alice", "user")
        self.call(self.provider, "POST", "/api/v1/apply", {"items": [
            site("fra-1"), cluster("fra-cpu", "fra-1", gpus_per_node=1, nodes=1, price="0.90")]})
        self.agent = LocalCluster("fra-cpu", "fra-1", self.provider, slots=1)
        self.sites = LocalSites(self.port, [self.agent], [], tmp / "sites", heartbeat_seconds=1.0).__enter__()
        self.sites.start(self.agent)
        self.wait_ready()

    def wait_ready(self) -> None:
        """The agent heartbeats its free slot (a stopped agent's goodbye marked the cluster not Ready)."""
        def ready() -> bool:
            status = self.call(self.provider, "GET", "/api/v1/clusters/fra-cpu")["status"]
            return status.get("allocatable", {}).get("gpus") == 1 and any(
                c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", []))
        wait(ready, 90)

    def call(self, token: str, method: str, path: str, body: dict | None = None) -> dict[str, Any]:
        resp = httpx.request(method, f"{self.server.url}{path}", json=body, timeout=60,
                             headers={"Authorization": f"Bearer {token}"})
        assert resp.status_code < 300, resp.text
        return resp.json()

    def submit(self, name: str) -> dict[str, Any]:
        job = self.call(self.user, "POST", "/api/v1/jobs", {
            "apiVersion": "cpn/v1", "kind": "TrainingJob", "metadata": {"name": name},
            "spec": {"model": "tiny", "tokens": 40_000, "globalBatchTokens": 1024, "strategy": "ddp",
                     "gpus": {"min": 1, "max": 1}, "sites": {"max": 1}}})
        self.call(self.user, "POST", f"/api/v1/jobs/{name}/accept", {"quote": "balanced"})
        return job

    def run_dir(self, name: str) -> Path | None:
        found = sorted((self.tmp / "sites" / "fra-cpu" / "runs").glob(f"*_{name}.*/attempt-*/*"))
        return found[0] if found else None

    def worker_pids(self, name: str) -> list[int]:
        directory = self.run_dir(name)
        try:
            return json.loads((directory / "status.json").read_text())["subtask"]["pids"] if directory else []
        except (OSError, ValueError, KeyError):
            return []

    def finished(self, name: str, timeout: float = 300) -> dict[str, Any]:
        return wait(lambda: (j := self.call(self.user, "GET", f"/api/v1/jobs/{name}"))["status"]["phase"] in DONE
                    and j, timeout)

    def close(self) -> None:
        if self.server.proc.poll() is None:
            stop_server(self.server)
        self.sites.__exit__(None, None, None)


@pytest.fixture(autouse=True)
def patient_server_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loaded machine (several agents' test runs on 2 cores) can take over a minute to start a server."""
    import tests.conftest as conftest

    slow = conftest.wait_healthy
    monkeypatch.setattr(conftest, "wait_healthy", lambda url, proc, log, timeout=60: slow(url, proc, log, 240))


def wait(check: Callable[[], Any], timeout: float, every: float = 0.3) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s")


def alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text(errors="replace")


@pytest.fixture
def world(db_url: str, tmp_path: Path) -> Iterator[OneSite]:
    one = OneSite(db_url, tmp_path)
    yield one
    one.close()


def test_the_api_down_as_training_ends_still_stores_the_model(world: OneSite) -> None:
    world.submit("steady")
    pids = wait(lambda: world.worker_pids("steady"), 180)
    runner_log = world.run_dir("steady") / "runner.log"  # type: ignore[operator]
    world.server.proc.send_signal(signal.SIGKILL)  # down before the workers finish
    world.server.proc.wait(timeout=10)
    wait(lambda: not any(alive(p) for p in pids), 300)  # training ended while the API was away
    wait(lambda: "outputs not stored yet" in runner_log.read_text(), 60)  # the runner waits it out
    time.sleep(3)
    world.server = start_server(world.db_url, world.tmp, world.env, port=world.port)  # within the window
    job = world.finished("steady")
    assert job["status"]["phase"] == "Succeeded", job["status"]
    final = httpx.get(f"{world.server.url}/api/v1/jobs/steady/final", timeout=60,
                      headers={"Authorization": f"Bearer {world.user}"})
    assert final.status_code == 200 and len(final.content) > 1000, final.text[:300]


def test_a_blob_store_failing_past_the_window_ends_honestly(world: OneSite, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CPN_OUTAGE_WINDOW_SECONDS", "3")  # the agent (restarted below) hands it to its runners
    world.sites.stop("fra-cpu")
    world.sites.start(world.agent)
    world.wait_ready()
    job = world.submit("unlucky")
    # the store cannot take this job's final weights (a directory where the file goes: every PUT fails, 5xx)
    blocked = world.tmp / "blobs" / job["metadata"]["uid"] / "final" / "model.pt"
    blocked.mkdir(parents=True)
    (blocked / "occupied").write_text("x")
    done = world.finished("unlucky")
    failed = next(c for c in done["status"]["conditions"] if c["type"] == "Failed")
    assert done["status"]["phase"] == "Failed" and failed["reason"] == "OutputsNotStored", done["status"]
    events = world.call(world.user, "GET", "/api/v1/events?job=unlucky")["items"]
    assert any(e["reason"] == "Failed" and "final weights never reached" in e["message"] for e in events), events
    directory = world.run_dir("unlucky")
    assert directory is not None and (directory / FINAL_MODEL).stat().st_size > 1000  # kept on the site's disk
    assert json.loads((directory / "status.json").read_text())["outputs"] == "unsaved"
    assert "final weights" in (directory / "runner.log").read_text()
    assert os.path.exists(directory / "spec.json")  # not cleaned up: the site keeps what it could not hand over
