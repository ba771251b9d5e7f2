"""`cpn bench scheduler`: the placement solvers' optimality gap and latency, written to docs/benchmarks/."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import click

__all__ = ["bench_memory_cmd", "bench_scheduler_cmd"]


@click.command("scheduler")
@click.option("--clusters", type=click.IntRange(min=1), default=5000, show_default=True,
              help="Catalogue size for the latency run.")
@click.option("--links", type=click.IntRange(min=0), default=2000, show_default=True,
              help="Links in the latency catalogue.")
@click.option("--jobs", type=click.IntRange(min=1), default=100, show_default=True,
              help="Placements timed on the large catalogue.")
@click.option("--instances", type=click.IntRange(min=0), default=50, show_default=True,
              help="Random small catalogues solved by both solvers for the gap.")
@click.option("--gap-clusters", type=click.IntRange(min=2), default=30, show_default=True,
              help="Clusters per gap instance.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("docs/benchmarks"),
              show_default=True, help="Directory for scheduler.json and scheduler.md (empty string: none).")
def bench_scheduler_cmd(clusters: int, links: int, jobs: int, instances: int, gap_clusters: int, seed: int,
                        as_json: bool, out: Path) -> None:
    """Heuristic vs exact placement gap on random catalogues, and heuristic latency on a large one.

    \b
      cpn bench scheduler --clusters 5000 --links 2000 --jobs 100 --instances 50 --json
    """
    from layers.orchestration.planning import bench

    with _native_stdout_to_stderr():
        report = bench.run(clusters, links, jobs, instances, gap_clusters, seed)
    command = (f"cpn bench scheduler --clusters {clusters} --links {links} --jobs {jobs} "
               f"--instances {instances} --gap-clusters {gap_clusters} --seed {seed}")
    if str(out):
        out.mkdir(parents=True, exist_ok=True)
        (out / "scheduler.json").write_text(json.dumps({**report, "command": command}, indent=2) + "\n")
        (out / "scheduler.md").write_text(bench.markdown(report, command))
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        gap, lat = report["gap"], report["latency_ms"]
        click.echo(f"gap max {gap['max'] * 100:.2f} % mean {gap['mean'] * 100:.3f} % over {gap['instances']} "
                   f"instances; latency p50 {lat['p50']} ms p95 {lat['p95']} ms p99 {lat['p99']} ms")


@click.command("memory")
@click.option("--model", default="llama-nano", show_default=True,
              help="A preset name, or a llama shape as JSON: '{\"layers\": 16, \"hidden\": 768, ...}'.")
@click.option("--workers", type=click.IntRange(min=2), default=4, show_default=True, help="Local ranks (one site).")
@click.option("--seq-len", type=click.IntRange(min=8), default=128, show_default=True)
@click.option("--batch", type=click.IntRange(min=1), default=2, show_default=True, help="Sequences per rank.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Add the report to DIR/memory.json (keyed by model and workers).")
def bench_memory_cmd(model: str, workers: int, seq_len: int, batch: int, as_json: bool, out: Path | None) -> None:
    """Per-rank training state (parameters, gradients, Adam) and peak RSS, shard none vs site.

    \b
      cpn bench memory --model llama-nano --workers 4 --json
    """
    import tempfile

    from cpn.runtime.bench_memory import run
    from cpn.runtime.presets import resolve

    spec: object = json.loads(model) if model.lstrip().startswith("{") else model
    try:
        resolve(spec)  # type: ignore[arg-type]
    except ValueError as exc:
        raise click.UsageError(f"--model: {exc}") from exc
    with tempfile.TemporaryDirectory(prefix="cpn-bench-memory-") as tmp:
        report = run(spec, workers, seq_len=seq_len, batch=batch, work_dir=Path(tmp))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        path = out / "memory.json"
        saved = json.loads(path.read_text()) if path.exists() else {"runs": {}}
        key = f"{model if isinstance(spec, str) else json.dumps(spec, sort_keys=True)} x{workers}"
        saved["runs"][key] = report
        path.write_text(json.dumps(saved, indent=2) + "\n")
    if as_json:
        click.echo(json.dumps({"results": report["results"], "sharded_ratio": report["sharded_ratio"]}, indent=2))
    else:
        for r in report["results"]:
            click.echo(f"shard {r['shard']:>4}: state {r['state_bytes_per_rank'] / 2**20:9.1f} MiB/rank "
                       f"(predicted {r['predicted_state_bytes_per_rank'] / 2**20:.1f}), "
                       f"peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB")
        click.echo(f"sharded / unsharded state: {report['sharded_ratio']:.3f}")


@contextmanager
def _native_stdout_to_stderr() -> Iterator[None]:
    """HiGHS prints the odd debug line straight to file descriptor 1; keep it off the JSON on stdout."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
