"""End to end through real processes: a `cpn serve` with its reconciler, and one `cpn agent --local`
per cluster — each in its own network namespace behind the emulated WAN when run as root. Jobs run
across three sites; a site is killed mid-run, an agent is killed and restarted, the API server is
killed and restarted, a synchronous job is re-placed and resumes from the server's checkpoints, and
jobs that cannot run fail alone next to a good one."""

from __future__ import annotations

import json
import os
import signal
import time
from decimal import Decimal
from pathlib import Path

import httpx
import pytest

from cpn.agent.localsites import LocalCluster, LocalSites
from cpn.cli.demo import LINKS, PROVIDERS, consents, world
from cpn.runtime.launcher import free_port
from tests.conftest import LiveServer, start_server, stop_server

# slow; and run once, in CI's PostgreSQL pass (the production database), not again against SQLite: the other
# end-to-end modules run through agents on SQLite
pytestmark = [pytest.mark.slow, pytest.mark.postgres]
TOKENS = 240_000
DONE = ("Succeeded", "Failed", "Cancelled")


def _job(name: str, **spec: object) -> dict:
    base = {"model": "tiny", "tokens": TOKENS, "globalBatchTokens": 3 * 128 * 8, "strategy": "diloco",
            "innerSteps": 10, "gpus": {"min": 3, "max": 3}, "sites": {"min": 3, "max": 3}}
    return {"apiVersion": "cpn/v1", "kind": "TrainingJob", "metadata": {"name": name}, "spec": {**base, **spec}}


class World:
    """Server + the demo's three sites (two providers), with an agent per cluster."""

    def __init__(self, db_url: str, tmp: Path, env: dict[str, str] | None = None, spare: bool = False,
                 keep_runs: bool = True):
        self.db_url, self.tmp, self.env = db_url, tmp, {"CPN_HEARTBEAT_TIMEOUT_SECONDS": "10", **(env or {})}
        self.port = free_port()
        self.sites = LocalSites(self.port, [], [(a, b, g * 1000) for a, b, g, _, _ in LINKS], tmp / "sites",
                                wan=LocalSites.can_emulate(), heartbeat_seconds=1.0, keep_runs=keep_runs)
        self.sites.clusters = [LocalCluster(f"{s}-cpu", s, "") for sites in PROVIDERS.values() for s in sites]
        self.sites.__enter__()
        self.server = start_server(db_url, tmp, self.env, port=self.port, host=self.sites.server_host)
        self.providers = {p: self.server.token(p, "provider") for p in PROVIDERS}
        self.user = self.server.token("alice", "user")
        self.admin = self.server.token("root", "admin")
        for provider in sorted(PROVIDERS, key=lambda p: p == "alpha-cloud"):
            self.call(self.providers[provider], "POST", "/api/v1/apply", {"items": world(provider)})
        for provider in PROVIDERS:  # beta accepts alpha's links to its site (issue 35 M4)
            if consents(provider):
                self.call(self.providers[provider], "POST", "/api/v1/apply", {"items": consents(provider)})
        self.clusters = {f"{s}-cpu": LocalCluster(f"{s}-cpu", s, self.providers[p])
                         for p, sites in PROVIDERS.items() for s in sites}
        self.sites.clusters = list(self.clusters.values())
        self.sites.start_all()
        self.wait_ready(len(self.clusters))

    def close(self) -> None:
        self.sites.__exit__(None, None, None)  # the agents first: their long polls held the server's stop
        if self.server.proc.poll() is None:
            stop_server(self.server)

    def heal(self, timeout: float = 90) -> None:
        """Between tests sharing this world: the server and every agent running, every cluster Ready, no
        lease held (a cancelled or killed job's runs have ended)."""
        if self.server.proc.poll() is not None:
            self.server = start_server(self.db_url, self.tmp, self.env, port=self.port, host=self.sites.server_host)
        for name, cluster in self.clusters.items():
            proc = self.sites.procs.get(name)
            if proc is None or proc.poll() is not None:
                self.sites.start(cluster)
        self.wait_ready(len(self.clusters), timeout)
        deadline = time.monotonic() + timeout
        while True:
            held = [x for x in self.call(self.admin, "GET", "/api/v1/reservations")["items"]
                    if x["status"]["state"] == "active"]
            if not held:
                return
            assert time.monotonic() < deadline, f"leases still held {timeout:.0f} s after the last test: {held}"
            time.sleep(0.5)

    def call(self, token: str, method: str, path: str, body: dict | None = None, ok: bool = True) -> dict:
        resp = httpx.request(method, f"{self.server.url}{path}", json=body, timeout=60,
                             headers={"Authorization": f"Bearer {token}"})
        if ok:
            assert resp.status_code < 300, resp.text
        return resp.json() | {"_status": resp.status_code}

    def wait_ready(self, count: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            items = self.call(self.admin, "GET", "/api/v1/clusters")["items"]
            ready = [c for c in items if any(x["type"] == "Ready" and x["status"] == "True"
                                             for x in c["status"].get("conditions", []))]
            if len(ready) >= count:
                return
            time.sleep(0.5)
        raise AssertionError(f"agents did not report: {items}")

    def submit(self, name: str, **spec: object) -> dict:
        self.call(self.user, "POST", "/api/v1/jobs", _job(name, **spec))
        return self.call(self.user, "POST", f"/api/v1/jobs/{name}/accept", {"quote": "balanced"})

    def wait(self, name: str, on_progress=None, at: float = 30, timeout: float = 600) -> dict:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        fired = False
        while time.monotonic() < deadline:
            job = self.call(self.user, "GET", f"/api/v1/jobs/{name}")
            pct = (job["status"].get("progress") or {}).get("percent") or 0
            if on_progress and not fired and job["status"]["phase"] == "Running" and pct >= at:
                on_progress(name)
                fired = True
            if job["status"]["phase"] in DONE:
                return job
            time.sleep(0.5)
        raise AssertionError(f"{name} did not finish in {timeout}s: {job['status']}")

    def run(self, name: str, on_progress=None, at: float = 30, **spec: object) -> dict:  # type: ignore[no-untyped-def]
        self.submit(name, **spec)
        return self.wait(name, on_progress, at=at)

    def final_val_loss(self, name: str) -> float:
        items = self.call(self.user, "GET", f"/api/v1/jobs/{name}/metrics")["items"]
        return [m["valLoss"] for m in items if m["valLoss"] is not None and m["rank"] == 0][-1]

    def run_dirs(self, name: str, cluster: str) -> list[Path]:
        # an agent keeps a job's runs in "<owner>_<name>.<uid>"
        return sorted((self.sites.state_root / cluster / "runs").glob(f"*_{name}.*/attempt-*/*"))

    def status(self, name: str, cluster: str, attempt: int = 1) -> dict:
        directory = next(d for d in self.run_dirs(name, cluster) if d.parent.name == f"attempt-{attempt}")
        return json.loads((directory / "status.json").read_text())

    def cluster_at(self, name: str, index: int) -> str:
        subtasks = self.call(self.user, "GET", f"/api/v1/jobs/{name}/subtasks")["items"]
        return next(t["spec"]["cluster"] for t in subtasks if t["spec"]["firstRank"] == index)


@pytest.fixture(scope="module")
def shared_world(db_factory, tmp_path_factory):  # type: ignore[no-untyped-def]
    """One server and four agents for the module (their start and stop cost ~20 s a test); every test
    runs its own jobs, and `w` brings back what the previous test killed."""
    world_ = World(db_factory.new(), tmp_path_factory.mktemp("lifecycle"))
    yield world_
    world_.close()


@pytest.fixture
def w(shared_world: World) -> World:
    shared_world.heal()
    return shared_world


def _ancestors(pid: int) -> list[int]:
    out = []
    while pid > 1:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])
        out.append(pid)
    return out


def test_diloco_survives_a_killed_site_and_bills_consistently(w: World) -> None:
    ref = w.run("undisturbed")
    assert ref["status"]["phase"] == "Succeeded", ref["status"]
    assert ref["status"]["sites"] == "3/3" and ref["status"]["progress"]["percent"] == 100.0, ref["status"]
    killed: list[int] = []

    def kill_last_site(name: str) -> None:
        cluster = w.cluster_at(name, 2)  # not rank 0's site: it hosts the job's rendezvous store
        for pid in w.status(name, cluster)["subtask"]["pids"]:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    hit = w.run("disturbed", on_progress=kill_last_site)
    assert killed, "the site was never killed"
    assert hit["status"]["phase"] == "Succeeded", hit["status"]
    ref_loss, hit_loss = w.final_val_loss("undisturbed"), w.final_val_loss("disturbed")
    # one site of three lost at ~30 %: 0.10 held in quiet runs, 0.12 was seen once on a loaded machine
    assert abs(hit_loss - ref_loss) / ref_loss <= 0.15, (ref_loss, hit_loss)
    events = w.call(w.user, "GET", "/api/v1/events?job=disturbed")["items"]
    assert any(e["reason"] == "SiteFailed" for e in events)
    for job in ("undisturbed", "disturbed"):
        leases = w.call(w.admin, "GET", f"/api/v1/reservations?job={job}")["items"]
        assert leases and all(x["status"]["state"] != "active" for x in leases), leases
        invoices = w.call(w.user, "GET", f"/api/v1/invoices?job={job}")["items"]
        assert len(invoices) == 1
        inv = invoices[0]["status"]
        assert Decimal(inv["total"]) == sum(Decimal(x["amount"]) for x in inv["lines"]).quantize(
            Decimal("0.01"), rounding="ROUND_HALF_UP")  # lines exact to 6 places, the total rounded once
        gpu_hours = [Decimal(x["quantity"]) for x in inv["lines"] if x["item"] == "gpu-hours"]
        assert gpu_hours and sum(gpu_hours) > 0  # metered from the workers' reports
    payouts = w.call(w.providers["beta-dc"], "GET", "/api/v1/invoices")["items"]
    assert payouts and all(line["provider"] == "beta-dc" for p in payouts for line in p["status"]["lines"])
    logs = httpx.get(f"{w.server.url}/api/v1/jobs/undisturbed/logs", params={"rank": 0},
                     headers={"Authorization": f"Bearer {w.user}"}, timeout=30).text
    assert "rank0]" in logs and len(logs.splitlines()) >= 1  # shipped by the agents


def test_agents_run_the_work_and_a_killed_agent_readopts_its_workers(w: World) -> None:
    """Every training process descends from an agent, none from the API server; kill -9 of an agent
    leaves its workers training, the restarted agent re-adopts them, nothing is launched twice."""
    seen: dict[str, list[int]] = {}

    def kill_agent(name: str) -> None:
        cluster = w.cluster_at(name, 1)
        pids = w.status(name, cluster)["subtask"]["pids"]
        for c in w.clusters:
            for pid in w.status(name, c)["subtask"]["pids"]:
                assert w.server.proc.pid not in _ancestors(pid)
        w.sites.kill(cluster)
        time.sleep(1.5)
        assert all(Path(f"/proc/{pid}").exists() for pid in pids), "the workers died with their agent"
        seen[cluster] = pids
        w.sites.start(w.clusters[cluster])

    job = w.run("agent-kill", on_progress=kill_agent, at=20)
    assert seen, "the agent was never killed"
    assert job["status"]["phase"] == "Succeeded", job["status"]
    subtasks = w.call(w.user, "GET", "/api/v1/jobs/agent-kill/subtasks")["items"]
    assert len(subtasks) == 3 and all(t["status"]["launches"] == 1 and t["spec"]["attempt"] == 1 for t in subtasks)
    for cluster in w.clusters:
        assert [d.parent.name for d in w.run_dirs("agent-kill", cluster)] == ["attempt-1"]


def test_providers_see_and_claim_only_their_own_subtasks(w: World) -> None:
    def beta_new() -> list[dict]:  # the world is shared: beta-dc's sub-tasks of earlier tests' jobs are not this one's
        return [t for t in w.call(w.providers["beta-dc"], "GET", "/api/v1/subtasks")["items"]
                if t["metadata"]["uid"] not in earlier]

    earlier = {t["metadata"]["uid"] for t in w.call(w.providers["beta-dc"], "GET", "/api/v1/subtasks")["items"]}
    w.submit("isolated", tokens=120_000)
    try:
        deadline = time.monotonic() + 30
        while not (beta := beta_new()):
            assert time.monotonic() < deadline, "the reconciler wrote no sub-tasks"
            time.sleep(0.3)
        assert beta and {t["spec"]["cluster"] for t in beta} == {"nyc-1-cpu"}
        alpha_only = [t for t in w.call(w.admin, "GET", "/api/v1/subtasks?job=isolated")["items"]
                      if t["spec"]["cluster"] != "nyc-1-cpu"]
        for t in alpha_only:
            uid = t["metadata"]["uid"]
            assert w.call(w.providers["beta-dc"], "GET", f"/api/v1/subtasks/{uid}", ok=False)["_status"] == 404
            got = w.call(w.providers["beta-dc"], "POST", f"/api/v1/subtasks/{uid}/claim", {}, ok=False)
            assert got["_status"] == 404
        listing = w.call(w.providers["beta-dc"], "GET", "/api/v1/subtasks?cluster=fra-1-cpu", ok=False)
        assert listing["_status"] == 404
        assert w.call(w.user, "POST", f"/api/v1/subtasks/{alpha_only[0]['metadata']['uid']}/claim", {},
                      ok=False)["_status"] == 404
    finally:
        w.call(w.user, "POST", "/api/v1/jobs/isolated/cancel", ok=False)


def test_api_server_restart_mid_job_launches_nothing_twice(w: World) -> None:
    restarted: list[LiveServer] = []

    def restart(_: str) -> None:
        w.server.proc.send_signal(signal.SIGKILL)
        w.server.proc.wait(timeout=10)
        new = start_server(w.db_url, w.tmp, w.env, port=w.port, host=w.sites.server_host)
        restarted.append(new)
        w.server = new

    job = w.run("restart-me", on_progress=restart)
    assert restarted, f"the server was never restarted: {job['status']}"
    assert job["status"]["phase"] == "Succeeded", job["status"]
    subtasks = w.call(w.user, "GET", "/api/v1/jobs/restart-me/subtasks")["items"]
    assert len(subtasks) == 3 and all(t["status"]["launches"] == 1 and t["spec"]["attempt"] == 1 for t in subtasks)
    for cluster in w.clusters:
        assert [d.parent.name for d in w.run_dirs("restart-me", cluster)] == ["attempt-1"]


def test_ddp_restarts_from_the_servers_checkpoint_on_a_new_placement(w: World) -> None:
    """A synchronous job that loses a site is re-placed on live capacity (the spare site here) and
    resumes from the newest checkpoint in the server's blob store — at a site that never held it."""
    accepted = w.submit("sync", strategy="ddp", gpus={"min": 2, "max": 2}, sites={"min": 2, "max": 2},
                        globalBatchTokens=2 * 128 * 8, tokens=160_000,
                        maxPricePerGpuHour="10")  # the spare site may cost more than the quote's

    first_sites = {p["site"] for p in accepted["status"]["placement"]}

    def kill(name: str) -> None:
        for pid in w.status(name, w.cluster_at(name, 1))["subtask"]["pids"]:
            os.kill(pid, signal.SIGKILL)

    got = w.wait("sync", on_progress=kill, at=40)
    assert got["status"]["phase"] == "Succeeded", got["status"]
    assert got["status"]["attempt"] == 2
    second_sites = {p["site"] for p in got["status"]["placement"]}
    assert len(second_sites) == 2 and second_sites != first_sites
    new_site = (second_sites - first_sites).pop()
    log = (w.run_dirs("sync", f"{new_site}-cpu")[0] / "runner.log").read_text()
    assert "resuming from the checkpoint of step" in log, log
    reasons = [e["reason"] for e in w.call(w.user, "GET", "/api/v1/events?job=sync")["items"]]
    assert "Restarting" in reasons and reasons[-1] == "Succeeded"
    leases = w.call(w.admin, "GET", "/api/v1/reservations?job=sync")["items"]
    assert all(x["status"]["state"] != "active" for x in leases)


def test_a_site_whose_agent_and_workers_die_together_is_lost_and_credited(w: World) -> None:
    """kill -9 of an agent and its workers at once: the agent falls silent, its site turns Lost after
    the heartbeat timeout, the elastic job goes on with the other sites and the site's lost work is
    credited."""
    killed: list[str] = []

    def kill_site_and_agent(name: str) -> None:
        cluster = w.cluster_at(name, 2)  # not rank 0's site: it hosts the job's rendezvous store
        pids = w.status(name, cluster)["subtask"]["pids"]
        w.sites.kill(cluster)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        killed.append(cluster)

    job = w.run("site-gone", on_progress=kill_site_and_agent)
    assert killed, "the site was never killed"
    assert job["status"]["phase"] == "Succeeded", job["status"]
    subtasks = {t["spec"]["cluster"]: t for t in w.call(w.user, "GET", "/api/v1/jobs/site-gone/subtasks")["items"]}
    assert subtasks[killed[0]]["status"]["phase"] in ("Lost", "Failed"), subtasks[killed[0]]["status"]
    assert all(t["status"]["launches"] == 1 for t in subtasks.values())  # nothing re-launched
    events = w.call(w.user, "GET", "/api/v1/events?job=site-gone")["items"]
    failed = [e for e in events if e["reason"] == "SiteFailed"]
    assert failed and "credited" in failed[0]["message"] and "continues" in failed[0]["message"], failed
