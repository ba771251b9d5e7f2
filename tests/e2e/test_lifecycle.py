"""End to end through real processes: a `cpn serve` with its reconciler, three local sites, a
diloco job across them, a site killed mid-run, and an API server killed mid-job."""

from __future__ import annotations

import json
import os
import signal
import time
from decimal import Decimal
from pathlib import Path

import httpx
import pytest

from cpn.cli.demo import PROVIDERS, world
from tests.conftest import LiveServer, start_server, stop_server

pytestmark = pytest.mark.slow
TOKENS = 240_000


def _job(name: str) -> dict:
    return {"apiVersion": "cpn/v1", "kind": "TrainingJob", "metadata": {"name": name},
            "spec": {"model": "tiny", "tokens": TOKENS, "globalBatchTokens": 3 * 128 * 8, "strategy": "diloco",
                     "innerSteps": 10, "gpus": {"min": 3, "max": 3}, "sites": {"min": 3, "max": 3}}}


class World:
    def __init__(self, server: LiveServer):
        self.server = server
        self.providers = {p: server.token(p, "provider") for p in PROVIDERS}
        self.user = server.token("alice", "user")
        self.admin = server.token("root", "admin")
        for provider in sorted(PROVIDERS, key=lambda p: p == "alpha-cloud"):
            self.call(self.providers[provider], "POST", "/api/v1/apply", {"items": world(provider)})
        self.beat()

    def call(self, token: str, method: str, path: str, body: dict | None = None) -> dict:
        resp = httpx.request(method, f"{self.server.url}{path}", json=body, timeout=30,
                             headers={"Authorization": f"Bearer {token}"})
        assert resp.status_code < 300, resp.text
        return resp.json()

    def beat(self) -> None:
        for provider, sites in PROVIDERS.items():
            for site in sites:
                self.call(self.providers[provider], "POST", f"/api/v1/clusters/{site}-cpu/heartbeat",
                          {"allocatableGpus": 1, "conditions": [{"type": "Ready", "status": "True"}]})

    def run(self, name: str, on_progress=None, timeout: float = 600) -> dict:  # type: ignore[no-untyped-def]
        self.call(self.user, "POST", "/api/v1/jobs", _job(name))
        self.call(self.user, "POST", f"/api/v1/jobs/{name}/accept", {"quote": "balanced"})
        deadline = time.monotonic() + timeout
        fired = False
        while time.monotonic() < deadline:
            self.beat()
            job = self.call(self.user, "GET", f"/api/v1/jobs/{name}")
            pct = (job["status"].get("progress") or {}).get("percent") or 0
            if on_progress and not fired and job["status"]["phase"] == "Running" and pct >= 30:
                on_progress(name)
                fired = True
            if job["status"]["phase"] in ("Succeeded", "Failed", "Cancelled"):
                return job
            time.sleep(1)
        raise AssertionError(f"{name} did not finish in {timeout}s: {job['status']}")

    def final_val_loss(self, name: str) -> float:
        items = self.call(self.user, "GET", f"/api/v1/jobs/{name}/metrics")["items"]
        vals = [m["valLoss"] for m in items if m["valLoss"] is not None and m["rank"] == 0]
        return vals[-1]

    def site_pids(self, name: str, site_index: int) -> list[int]:
        subtasks = self.call(self.user, "GET", f"/api/v1/jobs/{name}/subtasks")["items"]
        run_dir = Path(subtasks[0]["handle"]["runDir"])
        status = json.loads((run_dir / "status.json").read_text())
        return next(s["pids"] for s in status["sites"] if s["index"] == site_index)


def test_diloco_survives_a_killed_site_and_bills_consistently(db_url: str, tmp_path: Path) -> None:
    server = start_server(db_url, tmp_path, {"CPN_HEARTBEAT_TIMEOUT_SECONDS": "60"})
    try:
        w = World(server)
        ref = w.run("undisturbed")
        assert ref["status"]["phase"] == "Succeeded", ref["status"]
        killed: list[int] = []

        def kill_last_site(name: str) -> None:
            for pid in w.site_pids(name, 2):  # not site 0: it hosts the job's rendezvous store
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)

        hit = w.run("disturbed", on_progress=kill_last_site)
        assert killed, "the site was never killed"
        assert hit["status"]["phase"] == "Succeeded", hit["status"]
        ref_loss, hit_loss = w.final_val_loss("undisturbed"), w.final_val_loss("disturbed")
        assert abs(hit_loss - ref_loss) / ref_loss <= 0.05, (ref_loss, hit_loss)
        events = w.call(w.user, "GET", "/api/v1/events?job=disturbed")["items"]
        assert any(e["reason"] == "SiteFailed" for e in events)
        for job in ("undisturbed", "disturbed"):
            leases = w.call(w.admin, "GET", f"/api/v1/reservations?job={job}")["items"]
            assert leases and all(x["status"]["state"] != "active" for x in leases), leases
            invoices = w.call(w.user, "GET", f"/api/v1/invoices?job={job}")["items"]
            assert len(invoices) == 1
            inv = invoices[0]["status"]
            assert Decimal(inv["total"]) == sum(Decimal(x["amount"]) for x in inv["lines"])
            gpu_hours = [Decimal(x["quantity"]) for x in inv["lines"] if x["item"] == "gpu-hours"]
            assert gpu_hours and sum(gpu_hours) > 0  # metered from the workers' reports
        payouts = w.call(w.providers["beta-dc"], "GET", "/api/v1/invoices")["items"]
        assert payouts and all(line["provider"] == "beta-dc" for p in payouts for line in p["status"]["lines"])
    finally:
        stop_server(server)


def test_api_server_restart_mid_job_launches_nothing_twice(db_url: str, tmp_path: Path) -> None:
    server = start_server(db_url, tmp_path)
    restarted: list[LiveServer] = []
    try:
        w = World(server)

        def restart(_: str) -> None:
            server.proc.send_signal(signal.SIGKILL)
            server.proc.wait(timeout=10)
            new = start_server(db_url, tmp_path, port=int(server.url.rsplit(":", 1)[1]))
            restarted.append(new)
            w.server = new

        job = w.run("restart-me", on_progress=restart)
        assert restarted, "the server was never restarted"
        assert job["status"]["phase"] == "Succeeded", job["status"]
        subtasks = w.call(w.user, "GET", "/api/v1/jobs/restart-me/subtasks")["items"]
        assert len(subtasks) == 3 and all(t["launches"] == 1 and t["attempt"] == 1 for t in subtasks)
        run_root = Path(subtasks[0]["handle"]["runDir"]).parent
        assert sorted(p.name for p in run_root.iterdir() if p.name.startswith("attempt")) == ["attempt-1"]
        assert (run_root / "attempt-1" / "runner.pid").read_text().strip().isdigit()
    finally:
        for s in [server, *restarted]:
            if s.proc.poll() is None:
                stop_server(s)


def test_ddp_restarts_from_checkpoint_on_a_new_placement(db_url: str, tmp_path: Path) -> None:
    """A synchronous job that loses a site is re-placed on live capacity (the spare site here) and
    resumes from its latest checkpoint as attempt 2."""
    server = start_server(db_url, tmp_path, {"CPN_HEARTBEAT_TIMEOUT_SECONDS": "60"})
    try:
        w = World(server)
        job = _job("sync")
        job["spec"].update(strategy="ddp", gpus={"min": 2, "max": 2}, sites={"min": 2, "max": 2},
                           globalBatchTokens=2 * 128 * 8, tokens=160_000)
        w.call(w.user, "POST", "/api/v1/jobs", job)
        accepted = w.call(w.user, "POST", "/api/v1/jobs/sync/accept", {"quote": "balanced"})
        first_sites = {p["site"] for p in accepted["status"]["placement"]}
        deadline = time.monotonic() + 600
        killed = False
        while time.monotonic() < deadline:
            w.beat()
            got = w.call(w.user, "GET", "/api/v1/jobs/sync")
            pct = (got["status"].get("progress") or {}).get("percent") or 0
            if not killed and got["status"]["phase"] == "Running" and pct >= 40:
                for pid in w.site_pids("sync", 1):
                    os.kill(pid, signal.SIGKILL)
                killed = True
            if got["status"]["phase"] in ("Succeeded", "Failed", "Cancelled"):
                break
            time.sleep(1)
        assert killed and got["status"]["phase"] == "Succeeded", got["status"]
        assert got["status"]["attempt"] == 2
        second_sites = {p["site"] for p in got["status"]["placement"]}
        assert len(second_sites) == 2 and second_sites != first_sites
        reasons = [e["reason"] for e in w.call(w.user, "GET", "/api/v1/events?job=sync")["items"]]
        assert "Restarting" in reasons and reasons[-1] == "Succeeded"
        leases = w.call(w.admin, "GET", "/api/v1/reservations?job=sync")["items"]
        assert all(x["status"]["state"] != "active" for x in leases)
    finally:
        stop_server(server)
