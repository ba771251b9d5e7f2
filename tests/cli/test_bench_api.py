"""`cpn bench api` runs end to end (small numbers, SQLite): every phase reports updates and no errors.
Its figures are benchmarks (docs/benchmarks/api.md), not checked here."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.conftest import run_cli


def test_bench_api_reports_each_phase(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'bench.db'}"
    out = run_cli(["cpn", "bench", "api", "--clusters", "40", "--concurrency", "4", "--seconds", "1",
                   "--batch", "5", "--quotes", "3", "--quote-clusters", "10", "--database-url", url,
                   "--baseline", str(Path(__file__).resolve().parents[2]),  # this checkout as its own baseline
                   "--json", "--no-write-docs"], env={**os.environ, "CPN_DATA_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    single, batched = result["heartbeat"], result["heartbeats_batched"]
    assert single["errors"] == {} and batched["errors"] == {}
    assert single["cluster_updates_per_second"] > 0 and single["requests"] > 0
    # a batch carries 5 clusters: five times the updates of its requests
    assert abs(batched["cluster_updates_per_second"] - 5 * batched["requests_per_second"]) < 0.5
    assert result["quotes"]["errors"] == 0 and result["quotes"]["quotes_per_job"] == 3
    assert set(single["latency_ms"]) == {"p50", "p95", "p99"}
    paced = result["heartbeats_batched_at_rate"]  # 1000 updates/s offered: far more than 1 s can show
    assert paced["errors"] == {} and paced["target_updates_per_second"] == 1000 and paced["requests"] > 0
    # the server's own CPU per request (from /proc), steadier than wall time on a shared machine
    assert result["quotes"]["server_cpu_ms_per_request"] > 0 and single["server_cpu_ms_per_request"] > 0
    # --baseline runs the quote burst and the paced phase on a second server from the given checkout
    base = result["quotes_baseline"]
    assert base["errors"] == 0 and base["quotes_per_job"] == 3 and base["commit"]
    assert result["heartbeats_batched_at_rate_baseline"]["errors"] == {}


def test_new_figures_keep_the_written_sections(tmp_path: Path, monkeypatch) -> None:
    from cpn.cli import bench_heartbeats

    monkeypatch.setattr(bench_heartbeats, "DOCS", tmp_path)
    phase = {"requests": 1, "errors": {}, "cluster_updates_per_second": 1.0, "requests_per_second": 1.0,
             "latency_ms": {"p50": 1.0, "p95": 2.0, "p99": 3.0}, "target_updates_per_second": 1000}
    result = {"backend": "SQLite", "heartbeat": phase, "heartbeats_batched": phase,
              "heartbeats_batched_at_rate": phase}
    (tmp_path / "api.md").write_text("# old figures\n\n## Where the time went\n\nthe profile\n")
    bench_heartbeats._write_docs("cpn bench api", result, 5)
    text = (tmp_path / "api.md").read_text()
    assert "old figures" not in text and "| heartbeat | 1 |" in text
    assert text.endswith("## Where the time went\n\nthe profile\n")
