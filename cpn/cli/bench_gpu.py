"""`cpn bench gpu`: the runtime's device self-check, with peaks from the resource layer's GPU catalogue.

The measuring lives in :mod:`cpn.runtime.bench_gpu` (the runtime never imports the layers); this
face supplies the peak TFLOP/s that turn measured throughput into MFU.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

__all__ = ["bench_gpu_cmd"]


def catalogue_peak(name: str) -> tuple[str, float] | None:
    """A CUDA device name -> (CPN GPU model, peak dense bf16 TFLOP/s); ``CPU`` -> one local slot."""
    from layers.resource import gpus

    if name == gpus.CPU_SLOT_MODEL:
        return gpus.CPU_SLOT_MODEL, gpus.CPU_SLOT_TFLOPS
    info = gpus.lookup(name)
    return (info.model, info.tflops) if info else None


@click.command("gpu")
@click.option("--presets", default=None, help="comma-separated model presets (default: all on a GPU, tiny,small on the CPU)")
@click.option("--seconds", type=float, default=5.0, show_default=True, help="measuring time per preset")
@click.option("--size-mb", type=float, default=64.0, show_default=True, help="all-reduce message size (MiB)")
@click.option("--repeats", type=int, default=5, show_default=True, help="all-reduce repetitions (median)")
@click.option("--tests/--no-tests", "run_tests", default=True, help="run the cuda-marked tests (needs a checkout)")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="also write gpu.json and gpu.md here (e.g. docs/benchmarks)")
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
def bench_gpu_cmd(presets: str | None, seconds: float, size_mb: float, repeats: int, run_tests: bool,
                  out: Path | None, as_json: bool) -> None:
    """Devices, NCCL/Gloo all-reduce bandwidth, tokens/s and MFU of the presets, CUDA tests.

    \b
      cpn bench gpu --json
    """
    from cpn.runtime.bench_gpu import GpuBenchOptions, markdown, run_gpu_bench

    try:
        opts = GpuBenchOptions(presets=presets.split(",") if presets else None, seconds=seconds,
                               size_mb=size_mb, repeats=repeats, run_tests=run_tests)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    report = run_gpu_bench(opts, catalogue_peak)
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu.json").write_text(json.dumps(report, indent=2))
        (out / "gpu.md").write_text(markdown(report))
    click.echo(json.dumps(report, indent=2) if as_json else markdown(report))
