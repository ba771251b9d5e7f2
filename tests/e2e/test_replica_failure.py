"""Issue 14, item 3 ("Failure"), end to end for a pipeline with replicas: `tiny` as 2 stages × 2 data
replicas averaged every 4 steps, on four sites (the demo's three and a fourth, waw-1) through a real
`cpn serve` and one `cpn agent --local` per cluster. A site of replica 1 dies mid-run (its agent and its
workers killed together): replica 1's other site leaves cleanly (its sub-task Succeeded, early), the
dead site's sub-task is Lost or Failed, and replica 0 trains the budget to its end — the job ends
`Succeeded` in the same attempt, never re-placed."""

from __future__ import annotations

import json

import pytest

from cpn.agent.localsites import LocalCluster, LocalSites
from cpn.cli.demo import LINKS, PROVIDERS, consents, world
from cpn.runtime.launcher import free_port
from layers.resource.gpus import CPU_SLOT_TFLOPS
from tests.conftest import start_server
from tests.e2e.test_lifecycle import World
from tests.e2e.test_staged_failure import _events, _kill_site

pytestmark = pytest.mark.slow

FOURTH = "waw-1"  # alpha-cloud's, linked to the demo's three sites
FOURTH_LINKS = [(FOURTH, "fra-1", 0.2, 20.0, "0.02"), (FOURTH, "ams-1", 0.2, 25.0, "0.02"),
                (FOURTH, "nyc-1", 0.1, 90.0, "0.05")]
# 2 stages x 2 replicas, each replica 1/2 of every step; averaged every 4 steps (H > 1: a replica may be lost)
SPEC = {"model": "tiny", "tokens": 60_000, "globalBatchTokens": 1024, "innerSteps": 4,
        "parallelism": {"pipelineStages": 2, "dataReplicas": 2}}


def _fourth_site() -> list[dict]:
    return [{"apiVersion": "cpn/v1", "kind": "Site", "metadata": {"name": FOURTH},
             "spec": {"region": "eu-east", "location": {"lat": 52.23, "lon": 21.01}}},
            {"apiVersion": "cpn/v1", "kind": "Cluster", "metadata": {"name": f"{FOURTH}-cpu"},
             "spec": {"site": FOURTH, "driver": "local", "nodePools": [{
                 "name": "slots", "gpu": {"model": "CPU", "memoryGB": 4, "tflops": CPU_SLOT_TFLOPS},
                 "gpusPerNode": 1, "nodes": 1, "pricePerGpuHour": "0.50"}],
                 "interconnect": {"intraNodeGbps": 50, "interNodeGbps": 10}}},
            *({"apiVersion": "cpn/v1", "kind": "Link", "metadata": {"name": f"{a}--{b}"},
               "spec": {"a": a, "b": b, "bandwidthGbps": gbps, "rttMs": rtt, "pricePerGB": price}}
              for a, b, gbps, rtt, price in FOURTH_LINKS)]


class FourSites(World):
    """:class:`World` with a fourth site: its agent (and, as root, its network namespace behind the
    emulated WAN) exists from the start, so the WAN is built for four sites."""

    def __init__(self, db_url: str, tmp, env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
        self.db_url, self.tmp, self.env = db_url, tmp, {"CPN_HEARTBEAT_TIMEOUT_SECONDS": "10", **(env or {})}
        self.port = free_port()
        owners = {**{s: p for p, sites in PROVIDERS.items() for s in sites}, FOURTH: "alpha-cloud"}
        links = [(a, b, g * 1000) for a, b, g, _, _ in [*LINKS, *FOURTH_LINKS]]
        self.sites = LocalSites(self.port, [LocalCluster(f"{s}-cpu", s, "") for s in owners], links, tmp / "sites",
                                wan=LocalSites.can_emulate(), heartbeat_seconds=1.0, keep_runs=True)
        self.sites.__enter__()
        try:
            self.server = start_server(db_url, tmp, self.env, port=self.port, host=self.sites.server_host)
            self.providers = {p: self.server.token(p, "provider") for p in PROVIDERS}
            self.user = self.server.token("alice", "user")
            self.admin = self.server.token("root", "admin")
            for provider in sorted(PROVIDERS, key=lambda p: p == "alpha-cloud"):  # alpha links to beta's site
                self.call(self.providers[provider], "POST", "/api/v1/apply", {"items": world(provider)})
            self.call(self.providers["alpha-cloud"], "POST", "/api/v1/apply", {"items": _fourth_site()})
            # beta-dc accepts alpha's links to nyc-1 by applying them too (issue 35 M4)
            to_nyc = [d for d in _fourth_site() if d["kind"] == "Link" and d["spec"]["b"] == "nyc-1"]
            self.call(self.providers["beta-dc"], "POST", "/api/v1/apply", {"items": [*consents("beta-dc"), *to_nyc]})
            self.clusters = {f"{s}-cpu": LocalCluster(f"{s}-cpu", s, self.providers[p]) for s, p in owners.items()}
            self.sites.clusters = list(self.clusters.values())
            self.sites.start_all()
            self.wait_ready(len(self.clusters))
        except BaseException:
            self.sites.__exit__(None, None, None)
            raise


@pytest.fixture
def w(db_url: str, tmp_path):  # type: ignore[no-untyped-def]
    world_ = FourSites(db_url, tmp_path)
    yield world_
    world_.close()


def test_a_pipeline_replica_that_loses_a_site_leaves_and_replica_0_finishes_in_the_same_attempt(w: World) -> None:
    w.call(w.user, "POST", "/api/v1/jobs", {"apiVersion": "cpn/v1", "kind": "TrainingJob",
                                           "metadata": {"name": "twice"}, "spec": SPEC})
    accepted = w.call(w.user, "POST", "/api/v1/jobs/twice/accept", {"quote": "balanced"})["status"]
    assert accepted["strategy"] == "pipeline", accepted
    placement = accepted["placement"]
    slots = {(p["replica"], p["stage"]): p for p in placement}
    assert sorted(slots) == [(0, 0), (0, 1), (1, 0), (1, 1)], placement  # 2 stages x 2 replicas
    assert len({p["cluster"] for p in placement}) == 4, placement  # disjoint chains: one site per line
    lost, partner = slots[1, 1]["cluster"], slots[1, 0]["cluster"]  # replica 1: not rank 0's
    seen: dict[str, object] = {}

    def kill(name: str) -> None:  # Running, past 25 %: a few averagings done, most of the budget ahead
        job = w.call(w.user, "GET", f"/api/v1/jobs/{name}")["status"]
        seen.update(elastic=job.get("elastic"), percent=job["progress"]["percent"])
        _kill_site(w, name, lost)
        seen["killed"] = lost

    job = w.wait("twice", on_progress=kill, at=25, timeout=400)
    status = job["status"]
    events = _events(w, "twice")
    story = [(e["reason"], e["message"]) for e in events]
    subtasks = w.call(w.user, "GET", "/api/v1/jobs/twice/subtasks")["items"]
    phases = {t["spec"]["cluster"]: (t["spec"]["attempt"], t["spec"]["firstRank"], t["status"]["phase"],
                                     t["status"].get("message")) for t in subtasks}
    assert seen.get("killed") == lost, ("the site was never killed", seen, status)
    assert seen["elastic"] is True, seen  # written when the attempt was prepared: D = 2, H = 4
    assert status["phase"] == "Succeeded", (status, story, phases)
    assert status["attempt"] == 1 and status["elastic"] is True, status  # never re-placed
    assert status["progress"]["percent"] == 100.0, status
    assert "Restarting" not in {r for r, _ in story}, story

    # site index d·P + s runs stage s of replica d; one sub-task each, all of attempt 1, launched once
    assert len(subtasks) == 4 and all(t["status"]["launches"] == 1 for t in subtasks), subtasks
    by_rank = sorted(subtasks, key=lambda t: t["spec"]["firstRank"])
    assert [t["spec"]["cluster"] for t in by_rank] == [slots[d, s]["cluster"] for d in (0, 1) for s in (0, 1)], phases
    assert phases[lost][2] in ("Lost", "Failed"), phases
    assert phases[partner][2] == "Succeeded", phases  # replica 1's live site left cleanly, not Failed
    assert all(phases[slots[0, s]["cluster"]][2] == "Succeeded" for s in (0, 1)), phases  # replica 0 finished

    failed = [m for r, m in story if r == "SiteFailed"]
    assert len(failed) == 1 and lost in failed[0] and "continues on the other sites" in failed[0], story
    assert story[-1][0] == "Succeeded", story
    assert all(lost in m for r, m in story if r in ("SubtaskLost", "SubtaskFailed")), story  # no one else failed

    # the partner's worker said why it stopped: its replica lost a site, the other replicas go on
    (run,) = w.run_dirs("twice", partner)
    partner_log = "".join(f.read_text(errors="replace") for f in sorted(run.rglob("rank*.log")))
    assert "pipeline replica 1 lost a site" in partner_log and "the other replicas go on" in partner_log, partner_log
    # rank 0's summary: the stages' last averagings held replica 0 alone
    (first,) = w.run_dirs("twice", slots[0, 0]["cluster"])
    summary = json.loads((first / "summary.json").read_text())
    assert summary["live_replicas"] == [0] and summary["live_sites"] == [0, 1], summary
    leases = w.call(w.admin, "GET", "/api/v1/reservations?job=twice")["items"]
    assert leases and all(x["status"]["state"] != "active" for x in leases), leases
    assert w.final_val_loss("twice") < 5.6  # it learned something (ln 256 = 5.55 at the start)
