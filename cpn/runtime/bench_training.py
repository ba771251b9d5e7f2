"""``cpn bench training``: every strategy on the same token budget, on S x W local processes.

A strategy is named with optional modifiers: ``diloco+int8+overlap``, ``hierarchical+int8``. Each
run goes through :func:`cpn.runtime.train.run_local` (WAN-shaped network namespaces when
``wan_mbps`` is set). Results land in ``<out>/training-<scenario>.json`` with two plots (validation
loss against wall-clock and against tokens), and ``<out>/training.md`` is regenerated from every
scenario's JSON, with the command that produced it.
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cpn.runtime.config import PS_STRATEGIES, FaultConfig, StrategyConfig, TrainConfig
from cpn.runtime.topology import Topology

MODIFIERS = {"int8", "int4", "topk", "fp16", "bf16", "fp32", "overlap", "sync", "equal", "balanced"}
# a name without modifiers takes the defaults :func:`cpn.runtime.autotune.resolve` picks; modifiers pin a
# knob: int8/int4/topk/fp16/bf16/fp32 the WAN codec, overlap/sync the outer step, balanced/equal the batch shares


@dataclass(kw_only=True)
class BenchOptions:
    strategies: list[str] = field(default_factory=lambda: ["ddp", "diloco+int8+overlap"])
    sites: int = 2
    workers_per_site: int = 2
    wan_mbps: float | None = None
    tokens: int = 1_000_000
    model: str = "tiny"
    seq_len: int = 128
    global_batch: int = 4096
    lr: float = 3e-3
    inner_steps: int | None = None
    outer_lr: float | None = None
    outer_momentum: float | None = None
    staleness: int = 10
    slow_site: int | None = None
    slowdown: float = 1.0
    kill_site: int | None = None
    at_fraction: float | None = None
    ps_replicas: int = 0  # async_ps, ps_sync, ps_backup: secondaries of each shard
    kill_ps: int | None = None  # kill the process serving this shard's primary at --at-fraction
    name: str | None = None

    def __post_init__(self) -> None:
        for spec in self.strategies:
            name, *mods = spec.split("+")
            if set(mods) - MODIFIERS:
                raise ValueError(f"unknown modifier(s) {sorted(set(mods) - MODIFIERS)} in {spec!r}: use {sorted(MODIFIERS)}")
        kills = (self.kill_site is not None) + (self.kill_ps is not None)
        if kills > 1:
            raise ValueError("--kill-site and --kill-ps are two faults: give one")
        if kills != (self.at_fraction is not None):
            raise ValueError("--kill-site (or --kill-ps) and --at-fraction go together: give both")

    @property
    def scenario(self) -> str:
        if self.name:
            return self.name
        if self.kill_site is not None:
            return "kill"
        if self.kill_ps is not None:
            return "ps-kill"
        if self.slow_site is not None:
            return "straggler"
        return f"wan{self.wan_mbps:g}" if self.wan_mbps else "local"

    @property
    def steps(self) -> int:
        return self.tokens // self.global_batch


def strategy_config(spec: str, opts: BenchOptions) -> StrategyConfig:
    name, *mods = spec.split("+")
    codec = next((m for m in mods if m in ("int8", "int4", "topk", "fp16", "bf16", "fp32")), "auto")
    every = opts.inner_steps
    if every is not None and name not in ("diloco", "local_sgd"):
        every = max(1, every // 4)
    overlap = True if "overlap" in mods else False if "sync" in mods else None
    balance = True if "balanced" in mods else False if "equal" in mods else None
    return StrategyConfig(
        name=name, inner_steps=every, compression="none" if codec == "fp32" else codec, overlap=overlap,
        balance=balance, staleness=opts.staleness, ps=opts.sites, outer_lr=opts.outer_lr,
        ps_replicas=opts.ps_replicas if name in PS_STRATEGIES else 0,
        outer_momentum=opts.outer_momentum, nesterov=None if opts.outer_momentum is None else opts.outer_momentum > 0,
        wan_timeout_seconds=20.0 if opts.at_fraction is not None else 300.0,
    )


def train_config(spec: str, opts: BenchOptions, kill: bool) -> TrainConfig:
    faults = FaultConfig(slow_site=opts.slow_site, slowdown=opts.slowdown)
    if kill:
        faults = faults.model_copy(update={"kill_site": opts.kill_site, "kill_ps": opts.kill_ps,
                                           "kill_at_step": int(opts.steps * (opts.at_fraction or 0))})
    return TrainConfig(
        model=opts.model, tokens=opts.tokens, global_batch_tokens=opts.global_batch, seq_len=opts.seq_len,
        lr=opts.lr, strategy=strategy_config(spec, opts), faults=faults,
        val_every=max(1, opts.steps // 10), val_batches=4,
    )


def runs(opts: BenchOptions) -> list[tuple[str, TrainConfig]]:
    out = []
    for spec in opts.strategies:
        out.append((spec, train_config(spec, opts, kill=False)))
        if opts.at_fraction is not None:
            victim = f"site {opts.kill_site}" if opts.kill_site is not None else f"PS shard {opts.kill_ps} primary"
            label = f"{spec} ({victim} killed at {opts.at_fraction:.0%})"
            out.append((label, train_config(spec, opts, kill=True)))
    return out


def time_to_loss(curve: list[dict[str, Any]], target: float | None) -> float | None:
    if target is None:
        return None
    return next((p["wall"] for p in curve if p["val"] is not None and p["val"] <= target), None)


def command_line(opts: BenchOptions) -> str:
    """The ``cpn bench training`` invocation that reproduces ``opts``."""
    defaults = BenchOptions()
    words = ["cpn", "bench", "training"]
    for name, value in asdict(opts).items():
        if value is None or (value == getattr(defaults, name) and name not in ("sites", "workers_per_site", "tokens", "model", "strategies")):
            continue
        value = ",".join(value) if isinstance(value, list) else value
        words += [f"--{name.replace('_', '-')}", f"{value:g}" if isinstance(value, float) else str(value)]
    return " ".join([*words, "--json"])


def run_benchmark(opts: BenchOptions, out_dir: Path, command: str = "") -> dict[str, Any]:
    from cpn.runtime.autotune import explain, resolve
    from cpn.runtime.train import preflight, run_local

    topology = Topology.uniform(opts.sites, opts.workers_per_site)
    planned = runs(opts)
    planned = [(label, resolve(cfg, topology, opts.wan_mbps)) for label, cfg in planned]
    for _, cfg in planned:  # every run's config is checked before the first one starts
        preflight(cfg, topology)
    summaries = []
    runs_dir = Path(tempfile.mkdtemp(prefix=f"cpn-bench-training-{opts.scenario}-"))  # two benches at once stay apart
    for label, cfg in planned:
        t0 = time.monotonic()
        run_dir = runs_dir / label
        summary = run_local(cfg, topology, wan_mbps=opts.wan_mbps, run_dir=run_dir, timeout=3 * 3600)
        summary["label"], summary["launch_seconds"] = label, round(time.monotonic() - t0, 1)
        summary["resolved"] = explain(cfg) + idle_words(summary)
        summaries.append(summary)
    ddp = next((s for s in summaries if s["strategy"] == "ddp" and s["label"] == "ddp"), None)
    target = ddp["final_val_loss"] if ddp else None
    results = [
        {
            "strategy": s["label"], "wall_seconds": s["wall_seconds"], "final_val_loss": s["final_val_loss"],
            "wan_bytes": s["wan_bytes"], "compute_utilization": s["compute_utilization"], "tokens": s["tokens"],
            "time_to_ddp_loss_seconds": time_to_loss(s["val_curve"], target),
            "comm_fraction": s["comm_fraction"], "initial_val_loss": s["initial_val_loss"],
            "live_sites": s["live_sites"], "resolved": s["resolved"],
            "gpu_seconds": s.get("gpu_seconds"), "intra_bytes": s.get("intra_bytes"),
            **{k: s[k] for k in ("shares", "idle_trial", "idle_gain", "ps_dropped", "ps_failovers", "ps_staleness_mean") if k in s},
        }
        for s in summaries
    ]
    report = {
        "scenario": opts.scenario, "command": command or command_line(opts), "options": asdict(opts), "results": results,
        "curves": {s["label"]: s["val_curve"] for s in summaries},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"training-{opts.scenario}.json").write_text(json.dumps(report, indent=2))
    plot(report, out_dir)
    write_markdown(out_dir)
    return report


def plot(report: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for axis, xlabel in (("wall", "wall-clock seconds"), ("tokens", "tokens")):
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for label, curve in report["curves"].items():
            points = [(p[axis], p["val"]) for p in curve if p["val"] is not None]
            if points:
                ax.plot(*zip(*points, strict=True), marker=".", label=label)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss (nats/byte)")
        ax.set_title(f"training benchmark: {report['scenario']}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        path = out_dir / f"training-{report['scenario']}-loss-vs-{axis}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def _table(report: dict[str, Any]) -> list[str]:
    results = report["results"]
    ddp = next((r for r in results if r["strategy"] == "ddp"), None)
    lines = ["| strategy | resolved to | wall s | speed-up vs ddp | final val loss | vs ddp | WAN MB | WAN ÷ | compute util | comm share | time to ddp loss s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        speed = f"{ddp['wall_seconds'] / r['wall_seconds']:.2f}×" if ddp else "–"
        gap = f"{100 * (r['final_val_loss'] / ddp['final_val_loss'] - 1):+.2f}%" if ddp else "–"
        ratio = f"{ddp['wan_bytes'] / r['wan_bytes']:.0f}×" if ddp and r["wan_bytes"] else "–"
        ttl = r["time_to_ddp_loss_seconds"]
        lines.append(
            f"| {r['strategy']} | {r.get('resolved', '–')} | {r['wall_seconds']:.1f} | {speed} | {r['final_val_loss']:.4f} | {gap} | "
            f"{r['wan_bytes'] / 1e6:.2f} | {ratio} | {r['compute_utilization']:.2f} | {r['comm_fraction']:.2f} | "
            f"{'–' if ttl is None else f'{ttl:.1f}'} |"
        )
    return lines


def idle_words(summary: dict[str, Any]) -> str:
    """What the run's trial of its slowest ranks idle decided, in words ("" without one)."""
    # imported here: the strategies import torch, and `cpn --help` loads this module
    from cpn.runtime.strategies.idle import IDLE_WORDS

    return IDLE_WORDS.get(summary.get("idle_trial"), "")


def write_markdown(out_dir: Path) -> Path:
    sections = ["# Training benchmark", "",
                "Generated by `cpn bench training` (`cpn/runtime/bench_training.py`); one run per row on this "
                "machine, every strategy on the same token budget. Wall seconds exclude process start-up. "
                "`comm share` is the fraction of all ranks' wall time spent moving data (waiting for "
                "slower peers is counted separately). Loss is cross-entropy in nats per byte on the held-out tail "
                "of the Python standard library corpus. See `docs/runtime-training.md` for what each strategy does.", ""]
    order = {"wan": 0, "straggler": 1, "kill": 2}
    for path in sorted(out_dir.glob("training-*.json"), key=lambda p: (order.get(p.stem[9:], 9), p.name)):
        report = json.loads(path.read_text())
        o = report["options"]
        sections += [
            f"## {report['scenario']}", "",
            f"`{command_line(BenchOptions(**o))}`", "",
            f"{o['sites']} sites × {o['workers_per_site']} workers, "
            + (f"WAN {o['wan_mbps']:g} Mbit/s per site, " if o["wan_mbps"] else "unshaped network, ")
            + f"model `{o['model']}`, {o['tokens']:,} tokens, global batch {o['global_batch']} tokens, seq {o['seq_len']}"
            + (f", H={o['inner_steps']}" if o.get("inner_steps") else "") + (f", site {o['slow_site']} {o['slowdown']}× slower" if o["slow_site"] is not None else "")
            + f"; {report['machine']['cpus']} CPUs, {report['machine']['when']}.", "",
            *_table(report), "",
            f"![val loss vs wall-clock](training-{report['scenario']}-loss-vs-wall.png)",
            f"![val loss vs tokens](training-{report['scenario']}-loss-vs-tokens.png)", "",
        ]
    notes = out_dir / "training-notes.md"  # hand-written reading of the numbers, kept across re-runs
    if notes.exists():
        sections += [notes.read_text()]
    md = out_dir / "training.md"
    md.write_text("\n".join(sections))
    return md
