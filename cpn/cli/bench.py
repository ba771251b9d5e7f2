"""`cpn bench scheduler`: the placement solvers' optimality gap and latency, written to docs/benchmarks/."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import click

__all__ = ["bench_scheduler_cmd"]


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
