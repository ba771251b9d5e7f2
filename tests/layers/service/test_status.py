"""A job's status is typed: its writers are checked against JobStatus where they write."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cpn.core.phases import JOB_TERMINAL, JobPhase
from layers.service.jobs import set_phase, update_status
from layers.service.models import JobRow
from layers.service.status import status_of


def _row() -> JobRow:
    return JobRow(name="j", phase="Pending", status={"conditions": [], "legacyKey": 1})


def test_writes_keep_camel_case_keys_and_typed_reads_work() -> None:
    row = _row()
    update_status(row, attempt=2, failedSites=[{"attempt": 1, "site": "fra-1", "killed": True}],
                  progress={"percent": 50.0, "tokens": 1000, "valLoss": None})
    assert row.status["attempt"] == 2 and row.status["progress"] == {"percent": 50.0, "tokens": 1000, "valLoss": None}
    assert row.status["legacyKey"] == 1  # what older servers stored stays readable
    st = status_of(JobRow(name="j", phase="Pending", status={k: v for k, v in row.status.items() if k != "legacyKey"}))
    assert st.attempt == 2 and st.failed_sites[0]["site"] == "fra-1" and st.progress.tokens == 1000


def test_an_unknown_key_or_a_wrong_type_fails_where_it_is_written() -> None:
    row = _row()
    with pytest.raises(ValidationError, match="masterPort"):
        update_status(row, masterPort=1234)
    with pytest.raises(ValidationError, match="attempt"):
        update_status(row, attempt="second")
    assert "masterPort" not in row.status


def test_phases_are_an_enum() -> None:
    row = _row()
    assert set_phase(row, JobPhase.QUOTED, "Quoted", "3 quotes") == "Pending"
    assert row.phase == "Quoted" and row.status["phaseTimes"]["Quoted"] and row.status["message"] == "3 quotes"
    with pytest.raises(ValueError, match="Finished"):
        set_phase(row, "Finished", "x", "y")
    assert row.phase == "Quoted" and "Succeeded" in JOB_TERMINAL and not JobPhase.RUNNING.terminal


def test_only_the_current_phases_condition_is_true() -> None:
    """A probe: a Succeeded job's `describe` still said `Running True WorkersRunning`."""
    row = _row()
    set_phase(row, JobPhase.QUOTED, "Quoted", "3 quotes")
    set_phase(row, JobPhase.RUNNING, "WorkersRunning", "1 of 1 sub-tasks running")
    set_phase(row, JobPhase.SUCCEEDED, "Succeeded", "1 of 1 site(s) finished")
    by_type = {c["type"]: c for c in row.status["conditions"]}
    assert by_type["Succeeded"]["status"] == "True"
    assert by_type["Running"]["status"] == "False" and by_type["Running"]["reason"] == "WorkersRunning"  # history
    assert by_type["Quoted"]["status"] == "False"
    assert [c["type"] for c in row.status["conditions"] if c["status"] == "True"] == ["Succeeded"]
