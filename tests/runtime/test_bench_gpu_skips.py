"""`cpn bench gpu` reports skipped CUDA tests as skipped, not passed (issue 30, deliver 5): the
report's test runner on a real pytest run with one test that passes and one that skips."""

from __future__ import annotations

from pathlib import Path

import pytest

from cpn.runtime.bench_gpu import run_tests

TESTS = '''
import pytest

pytestmark = pytest.mark.cuda


def test_runs():
    assert 1 + 1 == 2


def test_two_gpus():
    pytest.skip("needs 2 CUDA devices, this machine has 1")
'''


@pytest.mark.slow
def test_a_skipped_cuda_test_is_reported_skipped_and_the_run_not_passed(tmp_path: Path) -> None:
    (tmp_path / "test_fake_cuda.py").write_text(TESTS)
    (tmp_path / "conftest.py").write_text("def pytest_configure(config):\n"
                                          "    config.addinivalue_line('markers', 'cuda: needs CUDA')\n")
    report = run_tests(tmp_path / "test_fake_cuda.py", cwd=tmp_path)
    assert report["ran"] and report["counts"] == {"passed": 1, "failed": 0, "skipped": 1}, report
    assert report["passed"] is False
    (skip,) = report["skipped"]
    assert skip["test"].endswith("test_two_gpus") and "needs 2 CUDA devices" in skip["reason"]
    (tmp_path / "test_fake_cuda.py").write_text(TESTS.split("\n\ndef test_two_gpus")[0] + "\n")
    assert run_tests(tmp_path / "test_fake_cuda.py", cwd=tmp_path)["passed"] is True
