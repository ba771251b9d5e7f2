"""Issue 14's third target, end to end: a model declared too large for any single site's GPUs (the
demo's three sites, their slots declaring 1 MB each: `tiny` needs 1.09 MB for a whole replica, 0.82 MB
for its larger half) gets quotes with a staged placement, is accepted, and runs to `Succeeded`
through a real `cpn serve` and one `cpn agent --local` per cluster, each stage on the site the quote
named."""

from __future__ import annotations

from pathlib import Path

import pytest

from cpn.cli.demo import PROVIDERS, world
from tests.api.test_pipeline_jobs import SMALL_GB
from tests.e2e.test_lifecycle import World

pytestmark = pytest.mark.slow


SPEC = {"model": "tiny", "tokens": 40_000, "globalBatchTokens": 768}  # 53 steps, a checkpoint every 10


def small_gpu_world(w: World) -> None:
    """The demo's providers, their clusters declaring small GPUs (SMALL_GB): no site holds a whole replica."""
    for provider in PROVIDERS:
        docs = world(provider)
        for doc in docs:
            if doc["kind"] == "Cluster":
                for pool in doc["spec"]["nodePools"]:
                    pool["gpu"]["memoryGB"] = SMALL_GB
        w.call(w.providers[provider], "POST", "/api/v1/apply", {"items": docs})


def test_a_model_too_big_for_one_site_runs_as_a_pipeline_to_succeeded(db_url: str, tmp_path: Path) -> None:
    w = World(db_url, tmp_path)
    try:
        small_gpu_world(w)
        w.call(w.user, "POST", "/api/v1/jobs", {"apiVersion": "cpn/v1", "kind": "TrainingJob",
                                               "metadata": {"name": "staged"}, "spec": SPEC})
        quotes = w.call(w.user, "GET", "/api/v1/jobs/staged/quotes")["items"]
        assert quotes and all(q["strategy"] == "pipeline" for q in quotes), quotes
        balanced = next(q for q in quotes if q["label"] == "balanced")
        stages = sorted(balanced["placement"], key=lambda p: p["stage"])
        assert [p["stage"] for p in stages] == list(range(len(stages))) and len(stages) >= 2, stages
        table = w.server.cpnctl("--server", w.server.url, "--token", w.user, "get", "quotes", "staged",
                                check=True).stdout
        row = next(line for line in table.splitlines() if line.startswith("balanced"))
        assert "s0:1xCPU@" + stages[0]["site"] in row and ">s1:" in row, table  # cpnctl shows the stages
        w.call(w.user, "POST", "/api/v1/jobs/staged/accept", {"quote": "balanced"})
        job = w.wait("staged", timeout=600)
        assert job["status"]["phase"] == "Succeeded", job["status"]
        assert job["status"]["progress"]["percent"] == 100.0, job["status"]
        subtasks = w.call(w.user, "GET", "/api/v1/jobs/staged/subtasks")["items"]
        by_rank = sorted(subtasks, key=lambda t: t["spec"]["firstRank"])
        # site index s (ranks in topology order) runs stage s: the quoted stage order
        assert [t["spec"]["cluster"] for t in by_rank] == [p["cluster"] for p in stages], (by_rank, stages)
        assert job["status"]["strategy"] == "pipeline", job["status"]
        assert w.final_val_loss("staged") < 5.6  # it learned something (ln 256 = 5.55 at the start)
    finally:
        w.close()
