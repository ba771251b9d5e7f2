"""Issue 36, item 2: a lost sub-task's workers are stopped. A real `cpn agent --local` is SIGKILLed
mid-job and restarted after the heartbeat timeout, when the server has declared its sub-task Lost:
the restarted agent stops the orphaned runner and workers, offers no free slot while they still run,
then frees the slot and deletes the run."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.e2e.test_outage_model_safe import OneSite, alive, patient_server_start, wait  # noqa: F401 - autouse

pytestmark = pytest.mark.slow


def test_a_restarted_agent_stops_the_run_the_server_declared_lost(db_url: str, tmp_path: Path) -> None:
    world = OneSite(db_url, tmp_path, {"CPN_HEARTBEAT_TIMEOUT_SECONDS": "6"})
    try:
        world.call(world.user, "POST", "/api/v1/jobs", {
            "apiVersion": "cpn/v1", "kind": "TrainingJob", "metadata": {"name": "long"},
            "spec": {"model": "tiny", "tokens": 50_000_000, "globalBatchTokens": 1024, "strategy": "ddp",
                     "gpus": {"min": 1, "max": 1}, "sites": {"max": 1}}})
        world.call(world.user, "POST", "/api/v1/jobs/long/accept", {"quote": "balanced"})
        pids = wait(lambda: world.worker_pids("long"), 180)
        directory = world.run_dir("long")
        assert directory is not None
        runner = int((directory / "runner.pid").read_text())

        world.sites.kill("fra-cpu")  # SIGKILL: its runner and workers go on, detached
        lost = wait(lambda: [t for t in world.call(world.user, "GET", "/api/v1/jobs/long/subtasks")["items"]
                             if t["status"]["phase"] == "Lost"], 120)
        assert lost and all(alive(p) for p in [runner, *pids])  # the orphan still trains: the bug's state

        log = tmp_path / "sites" / "logs" / "agent-fra-cpu.log"
        before = len(log.read_text())
        world.sites.start(world.agent)
        wait(lambda: not any(alive(p) for p in [runner, *pids]), 60)  # stopped by the restarted agent
        wait(lambda: not directory.exists(), 60)  # and its run deleted
        wait(lambda: world.call(world.provider, "GET", "/api/v1/clusters/fra-cpu")["status"]
             .get("allocatable", {}).get("gpus") == 1, 60)  # the slot is free again, now that it is
        time.sleep(1.5)
        after = log.read_text()[before:].splitlines()
        stopping = next(i for i, x in enumerate(after) if "stopping sub-task" in x and "no longer wants" in x)
        stopped = next(i for i, x in enumerate(after) if "has stopped" in x)
        free = [i for i, x in enumerate(after) if "heartbeat cluster=fra-cpu" in x and "allocatable=1/" in x]
        assert stopping < stopped and free and min(free) > stopped, after  # no free slot while the orphan ran
        job = world.call(world.user, "GET", "/api/v1/jobs/long")
        assert job["status"]["phase"] in ("Failed", "Reserved", "Launching", "Running"), job["status"]
    finally:
        world.close()
