"""Click commands for the collectives: ``cpn bench collectives`` and ``cpn netem clean``.

The lead mounts ``bench_collectives_cmd`` and ``netem_clean_cmd`` in ``cpn/cli/server.py``.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import click

__all__ = ["bench_collectives_cmd", "netem_clean_cmd"]


def _csv(kind: type, text: str, flag: str) -> list:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{flag} takes a comma-separated list, e.g. 1,16,64; got {text!r}") from None


@click.command("collectives")
@click.option("--sites", default="2", show_default=True, help="number of sites S; a list like 2,3 runs each")
@click.option("--workers-per-site", default=2, show_default=True, type=click.IntRange(min=1), help="W")
@click.option("--sizes-mb", default="1,16,64", show_default=True, help="all-reduce sizes in MiB")
@click.option(
    "--wan-mbps",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="emulated per-site WAN rate in Mbit/s (needs root); omit for unshaped loopback",
)
@click.option(
    "--regions",
    type=click.IntRange(min=1),
    default=None,
    help="split the sites into this many regions: per-pair links, --metro-mbps inside, --wan-mbps between",
)
@click.option(
    "--metro-mbps",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="emulated rate of each link between sites of one region (with --regions), Mbit/s",
)
@click.option(
    "--algorithms",
    default="flat,hierarchical,leader",
    show_default=True,
    help="algorithms, optionally +fp16/+bf16/+int8 (e.g. hierarchical+int8; multilevel+none/int8 per level)",
)
@click.option(
    "--repeats", default=5, show_default=True, type=click.IntRange(min=1), help="timed runs per case"
)
@click.option("--warmup", default=1, show_default=True, type=click.IntRange(min=0), help="untimed runs first")
@click.option("--bucket-mb", default=25.0, show_default=True, type=float, help="bucket size in MiB")
@click.option("--chunk-mb", default=4.0, show_default=True, type=float, help="pipeline slice in MiB")
@click.option("--name", default="collectives", show_default=True, help="file stem of the reports")
@click.option(
    "--rtt-ms",
    default=0.0,
    show_default=True,
    type=float,
    help="WAN round trip for the cost model's prediction (not emulated: tc netem is unavailable)",
)
@click.option(
    "--out-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("docs/benchmarks"),
    show_default=True,
    help="where the markdown table, PNG and JSON go",
)
@click.option("--no-write", is_flag=True, help="do not write report files")
@click.option("--json", "as_json", is_flag=True, help='print {"results": [...]} as JSON')
def bench_collectives_cmd(
    sites: str,
    sizes_mb: str,
    algorithms: str,
    out_dir: Path,
    name: str,
    no_write: bool,
    as_json: bool,
    **opts: Any,
) -> None:
    """Time flat / hierarchical / leader / multilevel all-reduce on S x W local processes behind an emulated WAN."""
    from cpn.runtime.bench_collectives import BenchConfig, run_bench, summary, write_reports
    from cpn.runtime.launcher import LaunchError
    from cpn.runtime.netem import NetemError

    load_before = os.getloadavg()
    try:
        cfg = BenchConfig(
            sites=_csv(int, sites, "--sites"),
            sizes_mb=_csv(float, sizes_mb, "--sizes-mb"),
            algorithms=_csv(str, algorithms, "--algorithms"),
            **opts,
        )
        rows = run_bench(cfg)
    except (ValueError, NetemError, LaunchError) as exc:
        raise click.ClickException(str(exc)) from exc
    if not no_write:
        load = f"load average (1 min) {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after, on {os.cpu_count()} cores"
        paths = write_reports(rows, cfg, _command_line(), out_dir, stem=name, notes=[load])
        click.echo(f"wrote {', '.join(map(str, paths))}", err=True)
    if as_json:
        click.echo(json.dumps({"results": rows}, indent=1))
        return
    _print_table(rows)
    for line in summary(rows):
        click.echo(line)


def _command_line() -> str:
    words = sys.argv[sys.argv.index("collectives") + 1 :] if "collectives" in sys.argv else []
    return " ".join(["cpn bench collectives", *map(shlex.quote, words)])


def _print_table(rows: list[dict]) -> None:
    head = f"{'S':>2} {'algorithm':<20} {'MiB':>6} {'seconds':>8} {'predict':>8} {'bound':>8} {'eff':>5} {'WAN bytes':>13}"
    click.echo(head)
    for r in rows:
        eff = f"{r['efficiency']:.2f}" if r["efficiency"] else "-"
        pred = f"{r['predicted_seconds']:.3f}" if r["predicted_seconds"] else "-"
        bound = f"{r['lower_bound_seconds']:.3f}" if r["lower_bound_seconds"] else "-"
        click.echo(
            f"{r['sites']:>2} {r['algorithm']:<20} {r['size_bytes'] / 2**20:>6g} {r['seconds']:>8.3f} "
            f"{pred:>8} {bound:>8} {eff:>5} {r['wan_bytes']:>13,}"
        )


@click.command("clean")
@click.option("--all", "remove_all", is_flag=True, help="also remove objects of runs that are still alive")
def netem_clean_cmd(remove_all: bool) -> None:
    """Remove WAN-emulation namespaces, veths and bridges (cpnw*) left by killed runs."""
    from cpn.runtime.netem import NetemError, clean, require_root

    try:
        require_root()
        removed = clean(stale_only=not remove_all)
    except NetemError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo("\n".join(removed) if removed else "nothing to clean")
