"""The `slow` marker from recorded durations (tests/durations.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import durations
from tests.conftest import SLOW_SECONDS


def test_junit_names_become_pytest_node_ids() -> None:
    assert durations.node_id("tests.api.test_jobs", "test_a[x-1]") == "tests/api/test_jobs.py::test_a[x-1]"
    assert durations.node_id("tests.layers.service.test_q.TestC", "test_b") == "tests/layers/service/test_q.py::TestC::test_b"
    assert durations.node_id("tests.test_kube_stub", "test_c") == "tests/test_kube_stub.py::test_c"


def test_a_report_is_read_per_test_skips_left_out(tmp_path: Path) -> None:
    report = tmp_path / "r.xml"
    report.write_text('<testsuites><testsuite><testcase classname="tests.api.test_x" name="test_slow" time="3.2"/>'
                      '<testcase classname="tests.api.test_x" name="test_skip" time="0.9"><skipped/></testcase>'
                      "</testsuite></testsuites>")
    assert durations.read([report]) == {"tests/api/test_x.py::test_slow": 3.2}


def test_no_test_recorded_as_slow_runs_unmarked(request: pytest.FixtureRequest) -> None:
    """In any run (the whole suite, `-m "not slow"`, a few files), a test recorded at SLOW_SECONDS or more
    carries `slow`: `-m "not slow"` leaves it out."""
    recorded = durations.load()
    assert len(recorded) > 50, "tests/durations.json is missing or empty: `python -m tests.durations REPORT.xml`"
    unmarked = [item.nodeid for item in request.session.items
                if recorded.get(item.nodeid, 0.0) >= SLOW_SECONDS and not item.get_closest_marker("slow")]
    assert not unmarked, unmarked
