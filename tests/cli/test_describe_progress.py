"""`cpnctl describe job` / `get jobs -o wide`: progress counts against what the run really trains (the
budget asked for is named when they differ), and the ETA reads in minutes and hours, not raw seconds."""

from __future__ import annotations

from cpn.cli.ctl import output


def _job(spec_tokens: int, trained: int | None, done: int, eta: float) -> dict:
    status = {"phase": "Running", "progress": {"percent": 50.0, "tokens": done, "tokensPerSecond": 120.0,
                                               "etaSeconds": eta}}
    if trained is not None:
        status["train"] = {"tokens": trained, "global_batch_tokens": 10_368}
    return {"apiVersion": "cpn/v1", "kind": "TrainingJob", "metadata": {"name": "lm"},
            "spec": {"tokens": spec_tokens}, "status": status}


def test_progress_counts_the_trained_total_and_names_a_rounded_budget() -> None:
    rounded = output.job_view(_job(100_000, 103_680, 51_840, 200.0))["status"]["progress"]
    assert rounded["tokens"] == "51,840 of 103,680 (spec.tokens 100,000, rounded to whole steps)"
    exact = output.job_view(_job(100_000, 100_000, 50_000, 200.0))["status"]["progress"]
    assert exact["tokens"] == "50,000 of 100,000"  # a run trimmed to the budget says nothing more
    unplanned = output.job_view(_job(100_000, None, 0, 0.0))["status"]["progress"]
    assert unplanned["tokens"] == "0 of 100,000"


def test_eta_reads_in_human_units_in_describe_and_the_wide_table() -> None:
    assert output.job_view(_job(100_000, 100_000, 50_000, 200.0))["status"]["progress"]["eta"] == "3 min 20 s"
    text = output.describe(_job(100_000, 100_000, 50_000, 3900.0))
    assert "1 h 05 min" in text and "3900" not in text
    eta = {"name": "ETA", "template": "{status.progress.etaSeconds}", "wide": True, "format": "duration"}
    assert output.render_cell(_job(100_000, 100_000, 50_000, 200.0), eta) == "3 min 20 s"
    assert output.render_cell({"status": {}}, eta) == "-"
    table = output.table([_job(100_000, 100_000, 50_000, 3900.0)], [eta], wide=True)
    assert table.splitlines()[1].split() == ["lm", "1", "h", "05", "min"]


def test_a_cell_with_nothing_known_yet_reads_a_bare_dash() -> None:
    progress = {"name": "PROGRESS", "template": "{status.progress.percent}%"}
    cost = {"name": "COST", "template": "{status.cost.total} {status.cost.currency}"}
    quoted = {"metadata": {"name": "lm"}, "status": {"phase": "Quoted"}}
    assert output.render_cell(quoted, progress) == "-" and output.render_cell(quoted, cost) == "-"
    running = _job(100_000, 100_000, 50_000, 200.0)
    running["status"]["cost"] = {"total": "0.02"}
    assert output.render_cell(running, progress) == "50.0%"
    assert output.render_cell(running, cost) == "0.02 -"  # one part known: the other stays marked
