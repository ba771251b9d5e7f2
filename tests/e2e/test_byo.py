"""Bring your own model and data, end to end: the examples in examples/byo-text and
examples/byo-vision — modules CPN's code never imports — are packed and uploaded by `cpnctl apply`,
fetched by the site agents, trained across two sites (diloco, ddp), their metrics reach the API, the
final weights come back with `cpnctl cp`, and the invoice bills the GPU hours."""

from __future__ import annotations

import shutil
from decimal import Decimal
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import run_cli
from tests.e2e.test_lifecycle import World

pytestmark = pytest.mark.slow
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
def w(db_url: str, tmp_path: Path):  # type: ignore[no-untyped-def]
    world = World(db_url, tmp_path)
    yield world
    world.close()


def example(tmp: Path, name: str, manifest: str = "job.yaml", **spec: object) -> Path:
    """A copy of examples/NAME with its job pinned to two sites (and any other spec changes)."""
    dest = tmp / name
    shutil.copytree(EXAMPLES / name, dest, ignore=shutil.ignore_patterns("__pycache__"))
    doc = yaml.safe_load((dest / manifest).read_text())
    doc["spec"].update({"gpus": {"min": 2, "max": 2}, "sites": {"min": 2, "max": 2}, **spec})
    (dest / manifest).write_text(yaml.safe_dump(doc))
    return dest / manifest


def cpnctl(w: World, *args: str):  # type: ignore[no-untyped-def]
    env = {**w.server.env, "CPN_SERVER": w.server.url, "CPN_TOKEN": w.user}
    return run_cli(["cpnctl", *args], env)


def trains(w: World, manifest: Path, name: str, tmp: Path) -> dict:
    out = cpnctl(w, "apply", "-f", str(manifest))
    assert out.returncode == 0, out.stderr
    assert f"trainingjob/{name} created" in out.stdout and "uploaded" in out.stderr, (out.stdout, out.stderr)
    again = cpnctl(w, "apply", "-f", str(manifest))  # same tree, same digest: not uploaded twice
    assert again.returncode == 0 and "already uploaded" in again.stderr, again.stderr
    out = cpnctl(w, "accept", name, "--quote", "balanced")
    assert out.returncode == 0, out.stderr
    out = cpnctl(w, "wait", name, "--timeout", "600")
    job = w.call(w.user, "GET", f"/api/v1/jobs/{name}")
    assert out.returncode == 0 and job["status"]["phase"] == "Succeeded", (out.stderr, job["status"])
    said = [line for line in out.stdout.splitlines() if line.startswith(f"{name}: ")]  # not a terminal: lines, no bar
    assert any(" Running " in line for line in said) and f"{name}: Succeeded 100% loss" in said[-1], out.stdout
    subtasks = w.call(w.user, "GET", f"/api/v1/jobs/{name}/subtasks")["items"]
    assert len({t["spec"]["cluster"] for t in subtasks}) == 2, subtasks  # across two sites
    assert job["status"]["progress"]["percent"] == 100.0
    model = tmp / f"{name}.pt"
    out = cpnctl(w, "cp", f"job/{name}:final", str(model))
    assert out.returncode == 0 and model.stat().st_size > 0, out.stderr
    invoices = w.call(w.user, "GET", f"/api/v1/invoices?job={name}")["items"]
    lines = invoices[0]["status"]["lines"]
    assert sum(Decimal(x["quantity"]) for x in lines if x["item"] == "gpu-hours") > 0, lines
    return {"job": job, "weights": torch.load(model, weights_only=True),
            "metrics": w.call(w.user, "GET", f"/api/v1/jobs/{name}/metrics")["items"]}


def val_losses(metrics: list[dict]) -> list[float]:
    return [m["valLoss"] for m in metrics if m["rank"] == 0 and m.get("valLoss") is not None]


def test_own_text_model_trains_with_diloco_across_sites(w: World, tmp_path: Path) -> None:
    got = trains(w, example(tmp_path, "byo-text", tokens=300_000, strategy="diloco"), "byo-text", tmp_path)
    losses = val_losses(got["metrics"])
    assert len(losses) >= 2 and losses[-1] < 0.7 * losses[0], losses  # from ~ln 256 = 5.5 down
    assert {"embed.weight", "head.weight", "rnn.weight_ih_l0"} <= set(got["weights"])
    assert got["job"]["status"]["strategy"] == "diloco"


def test_own_image_model_trains_with_ddp_and_reports_its_metric(w: World, tmp_path: Path) -> None:
    got = trains(w, example(tmp_path, "byo-vision", tokens=24_000, strategy="ddp"), "byo-vision", tmp_path)
    losses = val_losses(got["metrics"])
    assert losses[-1] < 0.8 * losses[0], losses
    accuracy = [m["accuracy"] for m in got["metrics"] if m["rank"] == 0 and m.get("accuracy") is not None]
    assert accuracy and accuracy[-1] > 0.5, accuracy  # the user's own metric, chance is 0.25
    assert got["weights"]["0.weight"].shape == (8, 1, 3, 3)


def test_own_image_model_trains_as_a_pipeline_of_two_sites(w: World, tmp_path: Path) -> None:
    """examples/byo-vision/pipeline.yaml: the user's nn.Sequential cut into two stages, one per site."""
    manifest = example(tmp_path, "byo-vision", "pipeline.yaml", tokens=24_000)
    got = trains(w, manifest, "byo-vision-pipeline", tmp_path)
    quotes = w.call(w.user, "GET", "/api/v1/jobs/byo-vision-pipeline/quotes")["items"]
    assert quotes and all(sorted(x["stage"] for x in q["placement"]) == [0, 1] for q in quotes), quotes
    assert got["job"]["status"]["strategy"] == "pipeline"
    losses = val_losses(got["metrics"])
    assert losses[-1] < 0.8 * losses[0], losses
    # the final weights are the whole model, the dense layers trained at the second site
    assert got["weights"]["0.weight"].shape == (8, 1, 3, 3) and got["weights"]["7.weight"].shape == (64, 576)


def test_unsafe_or_missing_code_is_refused_before_anything_runs(w: World, tmp_path: Path) -> None:
    manifest = example(tmp_path, "byo-vision")
    doc = yaml.safe_load(manifest.read_text())
    doc["spec"]["code"]["path"] = "no-such-dir"
    manifest.write_text(yaml.safe_dump(doc))
    out = cpnctl(w, "apply", "-f", str(manifest))
    assert out.returncode == 1 and "spec.code.path" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    del doc["spec"]["code"]["path"]
    doc["spec"]["code"]["digest"] = "sha256:" + "ab" * 32
    manifest.write_text(yaml.safe_dump(doc))
    out = cpnctl(w, "apply", "-f", str(manifest))
    assert out.returncode == 1 and "spec.code.digest" in out.stderr, out.stderr
    assert w.call(w.user, "GET", "/api/v1/jobs/byo-vision", ok=False)["_status"] == 404
