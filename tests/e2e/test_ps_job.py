"""Issue 15 end to end: a TrainingJob with `strategy: ps_backup` is quoted, accepted and trained to
`Succeeded` through a real `cpn serve` and one `cpn agent --local` per cluster (the demo's three
sites): its workers run the runtime's backup-worker parameter servers with the spec's knobs, and
`cpnctl describe` shows what the run ran with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.test_lifecycle import World

pytestmark = pytest.mark.slow


def test_a_ps_backup_job_runs_to_succeeded(db_url: str, tmp_path: Path) -> None:
    w = World(db_url, tmp_path)
    try:
        spec = {"strategy": "ps_backup", "backupWorkers": 1, "innerSteps": None, "tokens": 60_000,
                "globalBatchTokens": 3 * 128 * 2}
        w.call(w.user, "POST", "/api/v1/jobs", {"apiVersion": "cpn/v1", "kind": "TrainingJob",
                                               "metadata": {"name": "backup"},
                                               "spec": {"model": "tiny", "gpus": {"min": 3, "max": 3},
                                                        "sites": {"min": 3, "max": 3}, **spec}})
        quotes = w.call(w.user, "GET", "/api/v1/jobs/backup/quotes")["items"]
        assert quotes and all(q["strategy"] == "ps_backup" and q["predictedSeconds"] > 0 for q in quotes), quotes
        w.call(w.user, "POST", "/api/v1/jobs/backup/accept", {"quote": "balanced"})
        job = w.wait("backup", timeout=600)
        assert job["status"]["phase"] == "Succeeded", job["status"]
        assert job["status"]["strategy"] == "ps_backup" and job["status"]["progress"]["percent"] == 100.0
        assert w.final_val_loss("backup") < 5.6  # it learned something (ln 256 = 5.55 at the start)
        summaries = [json.loads(p.read_text()) for c in w.clusters for d in w.run_dirs("backup", c)
                     for p in d.rglob("summary.json")]
        assert summaries and all("ps_dropped" in s for s in summaries), summaries  # the backup servers ran
        text = w.server.cpnctl("--server", w.server.url, "--token", w.user, "describe", "job", "backup",
                               check=True).stdout
        assert "backupWorkers: 1" in text and "shards: 3" in text, text
    finally:
        w.close()
