"""``cpn bench pipeline``: the pipeline strategy against ddp on the same sites, model and token budget.

Each run goes through :func:`cpn.runtime.train.run_local` (WAN-shaped network namespaces when
``wan_mbps`` is set, one stage per site). A spec is ``ddp``, ``pipeline`` or ``pipeline+int8`` (also
``+fp16``, ``+bf16``: the codec on the cuts). The report lands in ``<out>/pipeline.json`` with a loss
plot, and ``<out>/pipeline.md`` is regenerated from it with the issue's targets checked:
the pipeline's WAN bytes at most a tenth of ddp's, the pipeline reaching ddp's final loss (within
1 %) sooner than ddp, and its bubble at most ``(P-1)/(M+P-1)`` + 0.10.

With ``gpu_memory_gb`` (the memory each site's GPU declares) a strategy whose placement does not fit
is not run: its row says ``feasible: false`` and why. The verdict is the planner's memory model, which
the runtime does not import: the face (:mod:`cpn.cli.bench_pipeline`) passes it in as a :data:`Fit`.
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cpn.runtime.config import StrategyConfig, TrainConfig
from cpn.runtime.topology import Topology

CODECS = ("int8", "fp16", "bf16")
WAN_RATIO_TARGET = 0.1  # pipeline WAN bytes / ddp WAN bytes
LOSS_TOLERANCE = 0.01  # "the same final loss": within 1 % of ddp's
BUBBLE_SLACK = 0.10  # measured bubble may exceed the ideal (P-1)/(M+P-1) by this much


@dataclass(kw_only=True)
class PipelineBenchOptions:
    strategies: list[str] = field(default_factory=lambda: ["ddp", "pipeline"])
    sites: int = 3
    workers_per_site: int = 1
    wan_mbps: float | None = None
    model: str = "small"
    tokens: int = 500_000
    seq_len: int = 128
    global_batch: int = 4096
    micro_batches: int = 8
    lr: float = 3e-3
    gpu_memory_gb: float | None = None  # what each site's GPU (slot) declares; None: no memory check

    def __post_init__(self) -> None:
        if self.gpu_memory_gb is not None and self.gpu_memory_gb <= 0:
            raise ValueError(f"gpu_memory_gb {self.gpu_memory_gb:g}: give the GB each GPU declares, above 0")
        for spec in self.strategies:
            head, *mods = spec.split("+")
            name, star, count = head.partition("*")
            if name not in ("ddp", "pipeline") or (mods and (name != "pipeline" or len(mods) > 1 or mods[0] not in CODECS)) \
                    or (star and (name != "pipeline" or not count.isdigit() or int(count) < 1)):
                raise ValueError(f"strategy {spec!r}: use ddp, pipeline, pipeline*D (D replicas) or pipeline+CODEC "
                                 f"with CODEC one of {', '.join(CODECS)}")
            if star and self.sites % int(count):
                raise ValueError(f"strategy {spec!r}: {count} replicas do not divide the {self.sites} sites")

    @property
    def steps(self) -> int:
        return -(-self.tokens // self.global_batch)


def replicas_of(spec: str) -> int:
    """D of ``pipeline*D`` (1 otherwise): the run is D replicas of a sites/D-stage pipeline."""
    head = spec.split("+")[0]
    return int(head.partition("*")[2] or 1)


def train_config(spec: str, opts: PipelineBenchOptions) -> TrainConfig:
    name, *mods = spec.split("+")
    name = name.partition("*")[0]
    replicas = replicas_of(spec)
    strategy = StrategyConfig(name=name, compression=mods[0] if mods else "none",
                              micro_batches=opts.micro_batches, wan_timeout_seconds=300.0,
                              stages=opts.sites // replicas if replicas > 1 else None)
    return TrainConfig(model=opts.model, tokens=opts.tokens, global_batch_tokens=opts.global_batch,
                       seq_len=opts.seq_len, lr=opts.lr, strategy=strategy,
                       val_every=max(1, opts.steps // 10), val_batches=4)


def command_line(opts: PipelineBenchOptions) -> str:
    words = ["cpn", "bench", "pipeline"]
    for name, value in asdict(opts).items():
        if value is None:
            continue
        value = ",".join(value) if isinstance(value, list) else value
        words += [f"--{name.replace('_', '-')}", f"{value:g}" if isinstance(value, float) else str(value)]
    return " ".join([*words, "--json"])


def time_to_loss(curve: list[dict[str, Any]], target: float | None) -> float | None:
    if target is None:
        return None
    return next((p["wall"] for p in curve if p["val"] is not None and p["val"] <= target), None)


# (strategy spec, options) -> None when its placement fits the declared GPU memory, else why not
Fit = Callable[[str, PipelineBenchOptions], str | None]
RESULT_KEYS = ("wall_seconds", "final_val_loss", "wan_bytes", "bubble_fraction", "tokens", "wan_activation_bytes",
               "wan_gradient_bytes", "wan_eval_bytes", "bubble_ideal", "stages", "initial_val_loss",
               "compute_utilization", "time_to_ddp_loss_seconds", "replicas", "inner_steps", "wan_replica_bytes")


def infeasible_result(label: str, reason: str) -> dict[str, Any]:
    """The row of a strategy that was not run: every figure None."""
    return {"strategy": label, "feasible": False, "reason": reason, **dict.fromkeys(RESULT_KEYS)}


def verdicts(opts: PipelineBenchOptions, fit: Fit | None) -> dict[str, str | None]:
    """Each strategy's reason not to run (None: it runs); every one runs without a declared memory."""
    if opts.gpu_memory_gb is None:
        return dict.fromkeys(opts.strategies)
    if fit is None:
        raise ValueError("gpu_memory_gb needs the planner's memory model: run `cpn bench pipeline --gpu-memory-gb`")
    out = {spec: fit(spec, opts) for spec in opts.strategies}
    if all(out.values()):
        raise ValueError("--gpu-memory-gb: no strategy fits: " + "; ".join(f"{k}: {v}" for k, v in out.items()))
    return out


def result_of(label: str, s: dict[str, Any], ddp_loss: float | None) -> dict[str, Any]:
    pipeline = s["strategy"] == "pipeline"
    return {
        "strategy": label, "feasible": True, "reason": None, "wall_seconds": s["wall_seconds"], "final_val_loss": s["final_val_loss"],
        "wan_bytes": s["wan_bytes"], "bubble_fraction": s.get("bubble_fraction"), "tokens": s["tokens"],
        "wan_activation_bytes": s.get("wan_activation_bytes", 0),
        "wan_gradient_bytes": s.get("wan_gradient_bytes", 0) if pipeline else s["wan_bytes"],
        "wan_eval_bytes": s.get("wan_eval_bytes", 0), "bubble_ideal": s.get("bubble_ideal"),
        "stages": s.get("stages"), "initial_val_loss": s["initial_val_loss"],
        "compute_utilization": s["compute_utilization"],
        "replicas": s.get("replicas"), "inner_steps": s.get("inner_steps"), "wan_replica_bytes": s.get("wan_replica_bytes"),
        "time_to_ddp_loss_seconds": time_to_loss(s["val_curve"], ddp_loss * (1 + LOSS_TOLERANCE) if ddp_loss else None),
    }


def targets(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each pipeline run held against the issue's three targets (None: no ddp run to compare with)."""
    ddp = next((r for r in results if r["strategy"] == "ddp" and r.get("feasible", True)), None)
    out = {}
    for r in results:
        if r["bubble_fraction"] is None:
            continue
        ratio = r["wan_bytes"] / ddp["wan_bytes"] if ddp and ddp["wan_bytes"] else None
        reached = r["time_to_ddp_loss_seconds"]
        out[r["strategy"]] = {
            "wan_ratio": None if ratio is None else round(ratio, 4),
            "wan_met": None if ratio is None else ratio <= WAN_RATIO_TARGET,
            "loss_gap": None if ddp is None else round(r["final_val_loss"] / ddp["final_val_loss"] - 1, 4),
            "sooner_met": None if ddp is None else reached is not None and reached < ddp["wall_seconds"],
            "bubble_bound": round(r["bubble_ideal"] + BUBBLE_SLACK, 4),
            "bubble_met": r["bubble_fraction"] <= r["bubble_ideal"] + BUBBLE_SLACK,
        }
    return out


def run_benchmark(opts: PipelineBenchOptions, out_dir: Path, fit: Fit | None = None) -> dict[str, Any]:
    from cpn.runtime.autotune import resolve
    from cpn.runtime.train import preflight, run_local

    topology = Topology.uniform(opts.sites, opts.workers_per_site)
    why_not = verdicts(opts, fit)
    planned = [(spec, resolve(train_config(spec, opts), topology, opts.wan_mbps))
               for spec in opts.strategies if why_not[spec] is None]
    for _, cfg in planned:  # every run's config is checked before the first one starts
        preflight(cfg, topology)
    summaries = {}
    runs_dir = Path(tempfile.mkdtemp(prefix="cpn-bench-pipeline-"))  # two benches at once stay apart
    for label, cfg in planned:
        run_dir = runs_dir / label
        summaries[label] = run_local(cfg, topology, wan_mbps=opts.wan_mbps, run_dir=run_dir, timeout=3 * 3600)
    ddp_loss = summaries["ddp"]["final_val_loss"] if "ddp" in summaries else None
    results = [infeasible_result(label, why_not[label]) if why_not[label] else result_of(label, summaries[label], ddp_loss)
               for label in opts.strategies]
    report = {
        "command": command_line(opts), "options": asdict(opts), "results": results, "targets": targets(results),
        "curves": {label: s["val_curve"] for label, s in summaries.items()},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "pipeline.json").write_text(json.dumps(report, indent=2))
    plot(report, out_dir)
    write_markdown(report, out_dir)
    return report


def plot(report: dict[str, Any], out_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, curve in report["curves"].items():
        points = [(p["wall"], p["val"]) for p in curve if p["val"] is not None]
        if points:
            ax.plot(*zip(*points, strict=True), marker=".", label=label)
    ax.set_xlabel("wall-clock seconds")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_title("pipeline vs ddp")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path = out_dir / "pipeline-loss-vs-wall.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def memory(gb: float) -> str:
    """GB as the reasons and the report print it: MB below 10 GB (the planner counts 1 GB for the runtime
    itself, so a toy GPU's declared megabytes sit just above it)."""
    return f"{gb * 1000:.2f} MB" if gb < 10 else f"{gb:.2f} GB"


def _yes(flag: bool | None) -> str:
    return "–" if flag is None else "met" if flag else "not met"


def write_markdown(report: dict[str, Any], out_dir: Path) -> Path:
    o = report["options"]
    lines = [
        "# Pipeline benchmark", "",
        "Generated by `cpn bench pipeline` (`cpn/runtime/bench_pipeline.py`): the `pipeline` strategy (one stage "
        "per site, 1F1B micro-batches) against `ddp` on the same sites, model and token budget. Wall seconds "
        "exclude process start-up. WAN bytes are what crossed sites: for the pipeline, activations (and the "
        "targets, one byte a token) forward, their gradients and the tied token table's gradient backward, and "
        "`eval`: each validation's windows through the stages (activations, targets and the loss back to rank 0) "
        "plus the later stages' parameters sent to rank 0 once at the end, for the final weights. The bubble is the share of the "
        "schedule a rank sat waiting for a neighbour (pipeline fill and drain *and* WAN transfer).", "",
        f"`{report['command']}`", "",
        f"{o['sites']} sites × {o['workers_per_site']} workers, "
        + (f"WAN {o['wan_mbps']:g} Mbit/s per site, " if o["wan_mbps"] else "unshaped network, ")
        + f"model `{o['model']}`, {o['tokens']:,} tokens, global batch {o['global_batch']} tokens, seq {o['seq_len']}, "
        f"{o['micro_batches']} micro-batches"
        + (f", each site's GPUs declaring {memory(o['gpu_memory_gb'])}" if o.get("gpu_memory_gb") else "")
        + f"; {report['machine']['cpus']} CPUs, {report['machine']['when']}.", "",
        "| strategy | wall s | final val loss | WAN MB | activations MB | gradients MB | eval MB | replicas MB | bubble | ideal | time to ddp loss (+1 %) s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["results"]:
        if not r.get("feasible", True):
            lines.append(f"| {r['strategy']} | not run: {r['reason']} |" + " – |" * 9)
            continue
        bubble = "–" if r["bubble_fraction"] is None else f"{r['bubble_fraction']:.3f}"
        ideal = "–" if r["bubble_ideal"] is None else f"{r['bubble_ideal']:.3f}"
        ttl = r["time_to_ddp_loss_seconds"]
        lines.append(
            f"| {r['strategy']} | {r['wall_seconds']:.1f} | {r['final_val_loss']:.4f} | {r['wan_bytes'] / 1e6:.2f} | "
            f"{r['wan_activation_bytes'] / 1e6:.2f} | {r['wan_gradient_bytes'] / 1e6:.2f} | {r['wan_eval_bytes'] / 1e6:.2f} | "
            f"{(r.get('wan_replica_bytes') or 0) / 1e6:.2f} | {bubble} | {ideal} | {'–' if ttl is None else f'{ttl:.1f}'} |")
    lines += ["", "| pipeline run | WAN ÷ ddp (target ≤ 0.10) | loss vs ddp | reaches ddp's loss sooner | bubble bound | bubble |",
              "|---|---:|---:|---|---:|---|"]
    for label, t in report["targets"].items():
        ratio = "–" if t["wan_ratio"] is None else f"{t['wan_ratio']:.3f} ({_yes(t['wan_met'])})"
        gap = "–" if t["loss_gap"] is None else f"{100 * t['loss_gap']:+.2f} %"
        lines.append(f"| {label} | {ratio} | {gap} | {_yes(t['sooner_met'])} | {t['bubble_bound']:.3f} | {_yes(t['bubble_met'])} |")
    lines += ["", "![val loss vs wall-clock](pipeline-loss-vs-wall.png)", ""]
    notes = out_dir / "pipeline-notes.md"  # hand-written reading of the numbers, kept across re-runs
    if notes.exists():
        lines += [notes.read_text()]
    md = out_dir / "pipeline.md"
    md.write_text("\n".join(lines))
    return md
