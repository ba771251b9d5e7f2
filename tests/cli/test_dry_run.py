"""`cpnctl apply --dry-run=server`: the server checks and prices the file, and nothing is stored."""

from __future__ import annotations

from pathlib import Path

from tests.cli.test_first_hour import hour  # noqa: F401 - the fixture

AUTO = Path(__file__).resolve().parents[2] / "examples" / "jobs" / "auto.yaml"


def test_apply_dry_run_server_shows_quotes_and_creates_nothing(hour) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    out = hour.cpnctl("apply", "-f", str(AUTO), "--dry-run=server")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "trainingjob/first-job created (server dry run)"
    assert lines[1].split()[:3] == ["NAME", "CHOSEN", "STRATEGY"] and "NOTE" in lines[1]
    assert [line.split()[0] for line in lines[2:5]] == ["cheapest", "fastest", "balanced"]
    assert "recommended" in lines[4]
    gone = hour.cpnctl("get", "job", "first-job")
    assert gone.returncode == 1 and "not found" in gone.stderr
    assert hour.cpnctl("apply", "-f", str(AUTO)).returncode == 0
    again = hour.cpnctl("apply", "-f", str(AUTO), "--dry-run=server")
    assert again.stdout.splitlines()[0] == "trainingjob/first-job configured (server dry run)"
