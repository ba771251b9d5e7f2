"""spec.profile end to end: a user's own module (examples/byo-text), uploaded with `cpnctl apply`, is
not quoted at once — a site agent runs a few of its steps at one candidate site, the server takes
the measured step time, and the quotes are priced from it (basis: profiled). Accepting one runs
the job to Succeeded through the agents."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import yaml

from tests.e2e.test_byo import cpnctl, example
from tests.e2e.test_lifecycle import World

pytestmark = pytest.mark.slow
BATCH = 6144  # examples/byo-text: characters per optimiser step over all ranks


@pytest.fixture
def w(db_url: str, tmp_path: Path):  # type: ignore[no-untyped-def]
    world = World(db_url, tmp_path)
    yield world
    world.close()


def _wait_phase(w: World, name: str, phases: tuple[str, ...], timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = w.call(w.user, "GET", f"/api/v1/jobs/{name}")
        if job["status"]["phase"] in phases:
            return job
        time.sleep(0.5)
    raise AssertionError(f"{name} never reached {phases}: {job['status']}")


def test_profiled_quotes_come_from_the_measured_step_and_the_job_runs(w: World, tmp_path: Path) -> None:
    manifest = example(tmp_path, "byo-text", tokens=40 * BATCH, strategy="ddp", profile="maybe",
                       gpus={"min": 1, "max": 1}, sites={"min": 1, "max": 1})
    out = cpnctl(w, "apply", "-f", str(manifest))  # not a boolean: one line naming the field, nothing made
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 1 and len(errors) == 1 and "spec.profile" in errors[0], out.stderr
    assert w.call(w.user, "GET", "/api/v1/jobs/byo-text", ok=False)["_status"] == 404
    doc = yaml.safe_load(manifest.read_text())
    doc["spec"]["profile"] = True
    manifest.write_text(yaml.safe_dump(doc))
    out = cpnctl(w, "apply", "-f", str(manifest))
    assert out.returncode == 0 and "trainingjob/byo-text created" in out.stdout, out.stderr
    job = w.call(w.user, "GET", "/api/v1/jobs/byo-text")
    assert job["status"]["phase"] == "Profiling", job["status"]
    assert w.call(w.user, "GET", "/api/v1/jobs/byo-text/quotes")["items"] == []  # nothing quoted yet
    probe = job["status"]["profile"]
    assert probe["gpus"] == 1 and probe["unitsPerStep"] == BATCH and probe["measuredStepSeconds"] is None

    job = _wait_phase(w, "byo-text", ("Quoted", "Failed"))
    assert job["status"]["phase"] == "Quoted", job["status"]
    probe = job["status"]["profile"]
    measured = probe["measuredStepSeconds"]
    assert measured > 0 and probe["measuredSteps"] >= 2, probe
    assert probe["unitsPerSecond"] == pytest.approx(BATCH / measured, rel=1e-3)
    # the profile ran through an agent as attempt 0, on the site it names, and reported its steps
    subtasks = w.call(w.user, "GET", "/api/v1/jobs/byo-text/subtasks")["items"]
    assert [(t["spec"]["attempt"], t["spec"]["site"], t["status"]["phase"]) for t in subtasks] == \
        [(0, probe["site"], "Succeeded")], subtasks
    assert {"Profiling", "Profiled", "Quoted"} <= {e["reason"] for e in
                                                   w.call(w.user, "GET", "/api/v1/events?job=byo-text")["items"]}
    # free: nothing billed before a quote is accepted
    assert w.call(w.user, "GET", "/api/v1/invoices?job=byo-text")["items"] == []

    quotes = w.call(w.user, "GET", "/api/v1/jobs/byo-text/quotes")["items"]
    assert quotes and all(q["basis"] == "profiled" for q in quotes), quotes
    for q in quotes:  # one CPU slot at one site, as profiled: the predicted step is the measured one
        fig = q["profile"]
        assert fig["measuredStepSeconds"] == measured and sum(p["gpus"] for p in q["placement"]) == 1
        assert fig["stepSeconds"] == pytest.approx(measured, rel=1e-6), fig
        assert fig["steps"] == math.ceil(40 * BATCH / BATCH)
        assert q["predictedSeconds"] == pytest.approx(fig["steps"] * measured + q["model"]["startupSeconds"],
                                                      abs=0.02), q
        assert q["model"]["startupSeconds"] >= probe["startupSeconds"] - 0.01 > 0, (q, probe)
    table = cpnctl(w, "get", "quotes", "byo-text")
    assert table.returncode == 0 and "BASIS" in table.stdout and "profiled" in table.stdout, table.stdout

    # the same job as the compute model alone prices it (a dry run without spec.profile)
    spec = {k: v for k, v in job["spec"].items() if k != "profile"}
    dry = w.call(w.user, "POST", "/api/v1/jobs?dryRun=true", {"apiVersion": "cpn/v1", "kind": "TrainingJob",
                                                             "metadata": {"name": "byo-text-modelled"}, "spec": spec})
    modelled = {q["label"]: q for q in dry["status"]["quotes"]}
    assert all(q["basis"] == "modelled" for q in modelled.values())

    out = cpnctl(w, "accept", "byo-text", "--quote", "cheapest")
    assert out.returncode == 0, out.stderr
    out = cpnctl(w, "wait", "byo-text", "--timeout", "600")
    job = w.call(w.user, "GET", "/api/v1/jobs/byo-text")
    assert out.returncode == 0 and job["status"]["phase"] == "Succeeded", (out.stderr, job["status"])
    assert job["status"]["attempt"] == 1 and job["status"]["progress"]["percent"] == 100.0
    cheapest = next(q for q in quotes if q["label"] == "cheapest")
    run = w.call(w.user, "GET", "/api/v1/jobs/byo-text/metrics")["items"]
    walls = {m["step"]: m["wallSeconds"] for m in run if m["rank"] == 0 and m.get("trainLoss") is not None}
    first, last = min(walls), max(walls)
    figures = {"measuredProfileStepSeconds": measured, "profileStartupSeconds": probe["startupSeconds"],
               "runStepSeconds": (walls[last] - walls[first]) / (last - first),
               "profiledPredictedSeconds": cheapest["predictedSeconds"],
               "modelledPredictedSeconds": modelled["cheapest"]["predictedSeconds"],
               "measuredWallSeconds": job["status"]["measured"]["wallSeconds"]}
    print("PROFILE FIGURES " + json.dumps(figures))
    describe = cpnctl(w, "describe", "job", "byo-text")
    assert describe.returncode == 0 and "measuredStepSeconds" in describe.stdout, describe.stdout
