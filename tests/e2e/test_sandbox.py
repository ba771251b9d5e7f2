"""Issue 35, C2: user code on a `--local` site cannot take the site over. A real job whose bundle
(tests/e2e/probe/probe.py) tries to read every agent's /proc/<pid>/environ, the agents' provider
token files, another job's run directory and that job's runner's and workers' environments — while
that other job runs on the same machine — is refused each time, holds no token in its environment,
runs as a uid of its own, and its run directory is gone once the job has ended."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import httpx
import pytest
import yaml

from cpn.runtime import sandbox
from tests.conftest import run_cli
from tests.e2e.test_lifecycle import World

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sandbox.available(), reason="the per-job uid sandbox needs root on Linux")]
PROBE = Path(__file__).parent / "probe"


@pytest.fixture
def w(db_url: str, tmp_path: Path):  # type: ignore[no-untyped-def]
    world = World(db_url, tmp_path, keep_runs=False)
    yield world
    world.close()


@pytest.fixture(autouse=True)
def patient_server_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loaded machine (several agents' test runs on 2 cores) can take over a minute to start a server."""
    import tests.conftest as conftest

    slow = conftest.wait_healthy
    monkeypatch.setattr(conftest, "wait_healthy", lambda url, proc, log, timeout=60: slow(url, proc, log, 240))


def _running(w: World, name: str, timeout: float = 120) -> tuple[str, Path, dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = w.call(w.user, "GET", f"/api/v1/jobs/{name}")
        if job["status"]["phase"] == "Running":
            cluster = w.cluster_at(name, 0)
            with_pids = [d for d in w.run_dirs(name, cluster) if (d / "status.json").exists()
                         and json.loads((d / "status.json").read_text())["subtask"].get("pids")]
            if with_pids:
                return cluster, with_pids[0], json.loads((with_pids[0] / "status.json").read_text())
        assert job["status"]["phase"] not in ("Failed", "Succeeded", "Cancelled"), job["status"]
        time.sleep(0.5)
    raise AssertionError(f"{name} never ran")


def test_a_jobs_code_cannot_read_the_agent_its_token_or_another_job(w: World, tmp_path: Path) -> None:
    w.submit("victim", strategy="ddp", gpus={"min": 1, "max": 1}, sites={"min": 1, "max": 1},
             globalBatchTokens=128 * 8, tokens=50_000_000)
    cluster, victim_dir, status = _running(w, "victim")
    worker = status["subtask"]["pids"][0]
    runner = int((victim_dir / "runner.pid").read_text())
    assert os.stat(f"/proc/{worker}").st_uid != 0  # the victim's workers run as their own uid too

    targets = {f"agent-environ-{name}": f"/proc/{proc.pid}/environ" for name, proc in w.sites.procs.items()}
    targets |= {f"token-file-{name}": str(w.sites.state_root / name / "token") for name in w.clusters}
    targets |= {"other-job-folder": str(victim_dir.parent.parent), "other-job-run-dir": str(victim_dir),
                "other-job-spec": str(victim_dir / "spec.json"),
                "other-job-worker-environ": f"/proc/{worker}/environ",
                "other-job-runner-environ": f"/proc/{runner}/environ"}
    bundle = tmp_path / "probe"
    shutil.copytree(PROBE, bundle, ignore=shutil.ignore_patterns("__pycache__"))
    manifest = {"apiVersion": "cpn/v1", "kind": "TrainingJob", "metadata": {"name": "probe"},
                "spec": {"code": {"path": ".", "entrypoint": "probe:main", "args": {"targets": targets}},
                         "model": {"parameters": 5}, "tokens": 80, "globalBatchTokens": 8, "strategy": "ddp",
                         "gpus": {"min": 1, "max": 1}, "sites": {"min": 1, "max": 1}}}
    (bundle / "job.yaml").write_text(yaml.safe_dump(manifest))
    env = {**w.server.env, "CPN_SERVER": w.server.url, "CPN_TOKEN": w.user}
    out = run_cli(["cpnctl", "apply", "-f", str(bundle / "job.yaml")], env)
    assert out.returncode == 0, out.stderr
    w.call(w.user, "POST", "/api/v1/jobs/probe/accept", {"quote": "balanced"})
    job = w.wait("probe", timeout=300)
    assert job["status"]["phase"] == "Succeeded", job["status"]

    logs = httpx.get(f"{w.server.url}/api/v1/jobs/probe/logs", headers={"Authorization": f"Bearer {w.user}"},
                     timeout=30).text
    line = next((x for x in logs.splitlines() if "PROBE " in x), None)
    assert line is not None, logs
    found = json.loads(line.split("PROBE ", 1)[1])
    assert found["own-file"] == "read" and found["own-environ"] == "read", found  # the probe itself worked
    assert len(targets) >= 11
    assert {k: found[k] for k in targets if found[k] == "read"} == {}, found  # every other target refused
    low, high = sandbox.uid_range()
    assert low <= found["uid"] <= high and found["secrets-in-env"] == [], found

    probe_cluster = w.cluster_at("probe", 0)
    deadline = time.monotonic() + 30
    while w.run_dirs("probe", probe_cluster) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert w.run_dirs("probe", probe_cluster) == []  # reported, outputs on the server: deleted
    assert not list((w.sites.state_root / probe_cluster / "runs").glob("*_probe.*"))  # its folder too
    assert victim_dir.exists()  # the other job runs on, untouched
    w.call(w.user, "POST", "/api/v1/jobs/victim/cancel")
