"""`cpn bench pipeline`: the runtime's pipeline-against-ddp benchmark, with the planner's memory model.

The runs live in :mod:`cpn.runtime.bench_pipeline` (the runtime never imports the layers); with
``--gpu-memory-gb`` this face tells it which strategies' placements fit the declared GPUs, by the
same figures the planner places jobs with: ddp holds a whole replica on every GPU
(:func:`perf.worker_memory_gb`), the pipeline one stage per site (:func:`perf.stage_memory_gb`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from cpn.runtime.bench_pipeline import PipelineBenchOptions

__all__ = ["bench_pipeline_cmd", "placement_fit"]


def _requirements(opts: PipelineBenchOptions) -> Any:
    from cpn.runtime.presets import shapes
    from layers.orchestration.planning.types import JobRequirements, ModelShape

    shape = shapes()[opts.model]
    model = ModelShape(parameters=shape["parameters"], layers=shape["layers"], hidden=shape["hidden"],
                       seq_len=opts.seq_len)
    return JobRequirements(model=model, tokens=opts.tokens, global_batch_tokens=opts.global_batch)


def placement_fit(spec: str, opts: PipelineBenchOptions) -> str | None:
    """None when strategy ``spec`` fits GPUs of ``opts.gpu_memory_gb`` each (one pipeline stage per
    site), else why not: the planner's memory model (:mod:`layers.orchestration.planning.pipeline`)."""
    from cpn.runtime.bench_pipeline import memory
    from layers.orchestration.planning import perf

    req, declared = _requirements(opts), float(opts.gpu_memory_gb or 0)
    if not spec.startswith("pipeline"):
        need = perf.worker_memory_gb(req)
        return None if need <= declared else \
            f"the whole replica needs {memory(need)} per GPU; the sites declare {memory(declared)}"
    from cpn.runtime.bench_pipeline import replicas_of

    stages = opts.sites // replicas_of(spec)
    # the micro-batches 1F1B keeps in flight: the run's own, whole sequences per stage-0 worker
    micro = max(1, min(opts.micro_batches, opts.global_batch // opts.seq_len // opts.workers_per_site))
    cuts = perf.stage_cuts(req, stages)
    need, stage = max((perf.stage_memory_gb(req, stages, s, micro, cuts), s) for s in range(stages))
    return None if need <= declared else \
        f"stage {stage} of {stages} needs {memory(need)} per GPU; the sites declare {memory(declared)}"


@click.command("pipeline")
@click.option("--sites", type=int, default=3, help="sites = pipeline stages (x replicas for pipeline*D)")
@click.option("--workers-per-site", type=int, default=1)
@click.option("--wan-mbps", type=float, default=None, help="WAN rate per site in Mbit/s (needs root)")
@click.option("--model", default="small")
@click.option("--tokens", type=int, default=500_000)
@click.option("--seq-len", type=int, default=128)
@click.option("--global-batch", type=int, default=4096)
@click.option("--micro-batches", type=int, default=8)
@click.option("--lr", type=float, default=3e-3)
@click.option("--gpu-memory-gb", type=float, default=None,
              help="GB each site's GPU declares: a strategy whose placement does not fit is reported, not run")
@click.option("--strategies", default="ddp,pipeline", help="comma-separated: ddp, pipeline, pipeline*D (D replicas of a sites/D-stage pipeline), "
                   "pipeline+int8|fp16|bf16")
@click.option("--out", type=click.Path(file_okay=False), default="docs/benchmarks")
@click.option("--json", "as_json", is_flag=True)
def bench_pipeline_cmd(as_json: bool, strategies: str, out: str, **options: Any) -> None:
    """The pipeline strategy against ddp; writes pipeline.md, pipeline.json and a loss plot under --out."""
    from cpn.runtime.bench_pipeline import PipelineBenchOptions, run_benchmark

    try:
        opts = PipelineBenchOptions(strategies=[s.strip() for s in strategies.split(",") if s.strip()], **options)
        report = run_benchmark(opts, out_dir=Path(out), fit=placement_fit)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    except RuntimeError as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        click.echo(json.dumps({"results": report["results"]}, indent=2))
        return
    for r in report["results"]:
        if not r["feasible"]:
            click.echo(f"{r['strategy']:>14}: not run: {r['reason']}")
            continue
        bubble = "" if r["bubble_fraction"] is None else f"  bubble {r['bubble_fraction']:.2f}"
        click.echo(f"{r['strategy']:>14}: {r['wall_seconds']:8.1f}s  val {r['final_val_loss']:.4f}  "
                   f"WAN {r['wan_bytes'] / 1e6:9.2f} MB{bubble}")
