"""`cpnctl accept --quote WRONG` lists the labels the job's open quotes go by, on one line."""

from __future__ import annotations

from pathlib import Path

from tests.cli.test_first_hour import demo_world

AUTO = Path(__file__).resolve().parents[2] / "examples" / "jobs" / "auto.yaml"


def test_an_unknown_quote_label_lists_the_valid_ones(live_server) -> None:  # type: ignore[no-untyped-def]
    demo_world(live_server)
    assert live_server.cpnctl("apply", "-f", str(AUTO)).returncode == 0
    out = live_server.cpnctl("accept", "first-job", "--quote", "nosuch")
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("error: job 'first-job' has no open quote 'nosuch': use one of "), lines[0]
    listed = lines[0].split("use one of ")[1].removesuffix(" (or a quote id)").split(", ")
    assert listed and set(listed) <= {"cheapest", "fastest", "balanced"}, lines[0]
