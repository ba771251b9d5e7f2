"""A user's own module on a Dataset, end to end: examples/byo-text/with-dataset.yaml applied with
cpnctl registers the corpus as a Dataset with one replica (at fra-1) and EU residency; the job trains
with diloco on the two EU sites through the site agents, every worker reads the replica the contract
names (fra-1's own, or the nearest for ams-1), and the invoice carries gpu-hours, egress and the
data-transfer line for ams-1's copy."""

from __future__ import annotations

import shutil
from decimal import Decimal
from pathlib import Path

import pytest
import yaml

from tests.e2e.test_byo import EXAMPLES, cpnctl, val_losses
from tests.e2e.test_lifecycle import World

pytestmark = pytest.mark.slow


@pytest.fixture
def w(db_url: str, tmp_path: Path):  # type: ignore[no-untyped-def]
    world = World(db_url, tmp_path)
    yield world
    world.close()


def test_own_model_on_a_dataset_trains_in_its_regions_and_bills_the_copy(w: World, tmp_path: Path) -> None:
    code = tmp_path / "byo-text"
    shutil.copytree(EXAMPLES / "byo-text", code, ignore=shutil.ignore_patterns("__pycache__"))
    replica = tmp_path / "replica" / "corpus.txt"  # the "site's" copy, outside the bundle
    replica.parent.mkdir()
    shutil.copy(code / "corpus.txt", replica)
    dataset, job = yaml.safe_load_all((code / "with-dataset.yaml").read_text())
    dataset["spec"]["locations"] = [{"site": "fra-1", "uri": replica.as_uri()}]
    job["spec"]["tokens"] = 300_000
    (code / "with-dataset.yaml").write_text(yaml.safe_dump_all([dataset, job]))

    out = cpnctl(w, "apply", "-f", str(code / "with-dataset.yaml"))
    assert out.returncode == 0, out.stderr
    assert "dataset/byo-text-corpus created" in out.stdout and "trainingjob/byo-text-eu created" in out.stdout
    assert cpnctl(w, "accept", "byo-text-eu", "--quote", "balanced").returncode == 0
    out = cpnctl(w, "wait", "byo-text-eu", "--timeout", "600")
    got = w.call(w.user, "GET", "/api/v1/jobs/byo-text-eu")
    assert out.returncode == 0 and got["status"]["phase"] == "Succeeded", (out.stderr, got["status"])
    sites = {t["spec"]["site"] for t in w.call(w.user, "GET", "/api/v1/jobs/byo-text-eu/subtasks")["items"]}
    assert sites == {"fra-1", "ams-1"}  # nyc-1 (us-east) is outside the dataset's regions

    logs = cpnctl(w, "logs", "byo-text-eu")
    assert logs.returncode == 0, logs.stderr
    reads = [line for line in logs.stdout.splitlines() if "training on" in line]
    assert len(reads) == 2 and all(str(replica) in line for line in reads), logs.stdout[-2000:]

    losses = val_losses(w.call(w.user, "GET", "/api/v1/jobs/byo-text-eu/metrics")["items"])
    assert len(losses) >= 2 and losses[-1] < losses[0], losses
    lines = w.call(w.user, "GET", "/api/v1/invoices?job=byo-text-eu")["items"][0]["status"]["lines"]
    items = {x["item"] for x in lines}
    assert {"gpu-hours", "egress", "data-transfer"} <= items, lines
    (copy,) = [x for x in lines if x["item"] == "data-transfer"]
    assert copy["cluster"] == "ams-1-cpu" and Decimal(copy["quantity"]) == Decimal("0.00012"), copy
