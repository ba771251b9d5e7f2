"""`cpn bench api --seconds 0`: the quote burst alone, no heartbeat phases (small numbers, SQLite)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.conftest import run_cli


def test_seconds_zero_runs_the_quote_burst_only(tmp_path: Path) -> None:
    """…on both servers, the baseline's first when asked (--baseline-first)."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'bench.db'}"
    out = run_cli(["cpn", "bench", "api", "--seconds", "0", "--quotes", "3", "--quote-clusters", "10",
                   "--database-url", url, "--baseline", str(Path(__file__).resolve().parents[2]), "--baseline-first",
                   "--json", "--no-write-docs"], env={**os.environ, "CPN_DATA_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert not {"heartbeat", "heartbeats_batched", "heartbeats_batched_at_rate"} & set(result)
    assert result["quotes"]["errors"] == 0 and result["quotes"]["quotes_per_job"] == 3
    assert result["quotes_baseline"]["errors"] == 0 and result["quotes_baseline"]["commit"]
    assert list(result).index("quotes_baseline") < list(result).index("quotes")  # run (and stored) first


def test_seconds_zero_does_not_write_the_figures(tmp_path: Path) -> None:
    out = run_cli(["cpn", "bench", "api", "--seconds", "0", "--database-url", f"sqlite+aiosqlite:///{tmp_path / 'b.db'}"],
                  env={**os.environ, "CPN_DATA_DIR": str(tmp_path)})
    assert out.returncode != 0 and "--no-write-docs" in out.stderr
