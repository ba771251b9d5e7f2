"""`cpn bench pipeline --gpu-memory-gb`: issue 14's case where the model does not fit one site. With
1 MB declared per GPU (as tests/e2e/test_staged_job.py declares), `tiny` needs 1.09 MB for a whole
replica and 0.82 MB for its larger half: ddp is reported infeasible and not run, the pipeline runs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cpn.cli.bench_pipeline import placement_fit
from cpn.runtime.bench_pipeline import PipelineBenchOptions, run_benchmark, write_markdown
from tests.api.test_pipeline_jobs import SMALL_GB
from tests.conftest import run_cli

# 16 B per parameter of tiny, one sequence's activations and the runtime's 1 GB (perf.worker_memory_gb)
DDP_REASON = "the whole replica needs 1002.68 MB per GPU; the sites declare 1002.15 MB"


def test_only_the_pipeline_runs_when_the_replica_does_not_fit_a_site(tmp_path: Path) -> None:
    out = run_cli(["cpn", "bench", "pipeline", "--model", "tiny", "--sites", "2", "--workers-per-site", "1",
                   "--tokens", "40000", "--global-batch", "1024", "--micro-batches", "4",
                   "--gpu-memory-gb", str(SMALL_GB), "--out", str(tmp_path), "--json"], env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    ddp, pipeline = json.loads(out.stdout)["results"]
    assert ddp["strategy"] == "ddp" and ddp["feasible"] is False and ddp["reason"] == DDP_REASON, ddp
    assert ddp["wall_seconds"] is None and ddp["final_val_loss"] is None, ddp
    assert pipeline["strategy"] == "pipeline" and pipeline["feasible"] is True and pipeline["reason"] is None
    assert pipeline["final_val_loss"] < pipeline["initial_val_loss"] and pipeline["wall_seconds"] > 0, pipeline
    assert len(pipeline["stages"]) == 2 and pipeline["time_to_ddp_loss_seconds"] is None, pipeline
    report = json.loads((tmp_path / "pipeline.json").read_text())
    assert set(report["curves"]) == {"pipeline"} and report["targets"]["pipeline"]["wan_ratio"] is None
    assert f"--gpu-memory-gb {SMALL_GB}" in report["command"], report["command"]
    md = (tmp_path / "pipeline.md").read_text()
    assert f"| ddp | not run: {DDP_REASON} |" in md and "each site's GPUs declaring 1002.15 MB" in md, md


def test_the_memory_check_names_the_stage_that_does_not_fit(tmp_path: Path) -> None:
    half = PipelineBenchOptions(model="tiny", sites=2, gpu_memory_gb=SMALL_GB / 2)
    assert placement_fit("pipeline+int8", half) == "stage 0 of 2 needs 1001.62 MB per GPU; the sites declare 501.08 MB"
    with pytest.raises(ValueError, match="no strategy fits: ddp: the whole replica needs 1002.68 MB"):
        run_benchmark(half, tmp_path, fit=placement_fit)
    with pytest.raises(ValueError, match="needs the planner's memory model"):  # the runtime cannot judge alone
        run_benchmark(half, tmp_path)
    with pytest.raises(ValueError, match="gpu_memory_gb -1: give the GB"):
        PipelineBenchOptions(gpu_memory_gb=-1)
    three = PipelineBenchOptions(model="tiny", sites=3, gpu_memory_gb=SMALL_GB)
    assert placement_fit("ddp", three) == DDP_REASON and placement_fit("pipeline", three) is None
    # the report states the declared memory
    report = {"command": "c", "options": vars(three), "results": [], "targets": {},
              "machine": {"cpus": 2, "when": "now"}}
    assert "declaring 1002.15 MB" in write_markdown(report, tmp_path).read_text()
