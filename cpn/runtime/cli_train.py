"""``cpn train`` and ``cpn bench training``: click commands over :func:`run_local` and the benchmark.

The lead mounts :data:`train_cmd` as ``cpn train`` and :data:`bench_training_cmd` as
``cpn bench training``. Flags map one-to-one onto :class:`TrainConfig` fields (see :data:`FLAGS`);
``--resume DIR`` takes the run's saved config and topology from DIR and lets explicit flags override.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, get_args

import click
from click.core import ParameterSource
from pydantic import ValidationError

from cpn.runtime.config import AUTO, StrategyName, TrainConfig, auto_shard
from cpn.runtime.topology import Topology

# flag name -> (config path, click option kwargs)
FLAGS: dict[str, tuple[str, dict[str, Any]]] = {
    "strategy": ("strategy.name", {"type": click.Choice(["auto", *get_args(StrategyName)]), "default": "ddp",
                                   "help": "cross-site strategy (auto: chosen from the sites and links)"}),
    "model": ("model", {"default": "small", "help": "model preset: tiny, small, medium, base, large (byte LMs), "
                                                   "llama-nano, llama3-1b, llama3-8b, llama2-7b, …"}),
    "data": ("data.path", {"default": None, "help": "train on this token file (flat little-endian uint16, or uint32 "
                                                  "for --vocab > 65536) instead of the byte corpus; needs --vocab"}),
    "vocab": ("data.vocab", {"type": int, "default": None, "help": "--data: token ids (the model's vocabulary)"}),
    "tokens": ("tokens", {"type": int, "default": 2_000_000, "help": "token budget over all workers"}),
    "global_batch": ("global_batch_tokens", {"type": int, "default": 16_384, "help": "tokens per global step"}),
    "seq_len": ("seq_len", {"type": int, "default": 128}),
    "lr": ("lr", {"type": float, "default": 3e-3}),
    "inner_steps": ("strategy.inner_steps", {"type": int, "default": None,
                                             "help": "H (diloco, local_sgd, gossip, ssp, pipeline replicas); default: from budget, sites, link"}),
    "outer_lr": ("strategy.outer_lr", {"type": float, "default": None, "help": "default: 1 (plain averaging) for < 50 rounds, else 0.7"}),
    "outer_momentum": ("strategy.outer_momentum", {"type": float, "default": None, "help": "default: 0 for < 50 rounds, else 0.9"}),
    "nesterov/--no-nesterov": ("strategy.nesterov", {"default": None}),
    "compression": ("strategy.compression", {"type": click.Choice(["auto", "none", "fp16", "bf16", "int8", "int4", "topk"]), "default": "auto",
                                             "help": "WAN codec; auto: int8 for diloco/local_sgd across sites"}),
    "overlap/--no-overlap": ("strategy.overlap", {"default": None,
                                                  "help": "diloco: outer exchange in the background, merged τ steps later; "
                                                          "default: when the exchange would cost > 5 % of a round"}),
    "overlap_steps": ("strategy.overlap_steps", {"type": int, "default": None, "help": "τ (default: the exchange's time in steps)"}),
    "balance/--no-balance": ("strategy.balance", {"default": None, "help": "batch shares by measured throughput "
                                                  "(default: on for hierarchical, local_sgd, diloco)"}),
    "staleness": ("strategy.staleness", {"type": int, "default": 4, "help": "ssp: max steps ahead of the slowest site"}),
    "ps": ("strategy.ps", {"type": int, "default": 1, "help": "async_ps, ps_sync, ps_backup: parameter-server shards"}),
    "backup_workers": ("strategy.backup_workers", {"type": int, "default": 1,
                                                   "help": "ps_backup: late pushes of a step the servers drop"}),
    "ps_replicas": ("strategy.ps_replicas", {"type": int, "default": 0,
                                             "help": "PS modes: secondaries of each shard on other sites (fewer than --sites)"}),
    "ps_damping/--no-ps-damping": ("strategy.ps_damping", {"default": True,
                                                           "help": "async_ps: learning rate x min(1, N/(1+staleness)) per push"}),
    "gossip_neighbours": ("strategy.gossip_neighbours", {"type": int, "default": 1}),
    "stages": ("strategy.stages", {"type": int, "default": None,
                                   "help": "pipeline: stages, one per site (default: --sites; a divisor of it runs "
                                           "sites/stages replicas of the pipeline, averaged every --inner-steps)"}),
    "micro_batches": ("strategy.micro_batches", {"type": int, "default": 8, "help": "pipeline: micro-batches per rank and step"}),
    "wan_timeout": ("strategy.wan_timeout_seconds", {"type": float, "default": 60.0, "help": "seconds before a silent site is dropped"}),
    "shard": ("shard", {"type": click.Choice(["auto", "none", "site"]), "default": "auto",
                        "help": "site: shard the model over each site's workers (FSDP2); auto: site for a real-size "
                                "model (>= 500 M parameters) with > 1 worker per site, else none"}),
    "activation_checkpointing": ("activation_checkpointing", {
        "type": click.Choice(["auto", "none", "full"]), "default": "auto",
        "help": "full: recompute each block's activations in backward; auto: full for a real-size model"}),
    "val_every": ("val_every", {"type": int, "default": 50}),
    "seed": ("seed", {"type": int, "default": 0}),
    "slow_site": ("faults.slow_site", {"type": int, "default": None}),
    "slowdown": ("faults.slowdown", {"type": float, "default": 1.0}),
    "kill_site": ("faults.kill_site", {"type": int, "default": None}),
    "kill_ps": ("faults.kill_ps", {"type": int, "default": None,
                                   "help": "kill the process serving this shard's primary at --at-step (needs --ps-replicas)"}),
    "at_step": ("faults.kill_at_step", {"type": int, "default": None}),
    "checkpoint_every": ("checkpoint_every", {"type": int, "default": 0}),
    "checkpoint_dir": ("checkpoint_dir", {"default": None}),
}


def _param_name(flag: str) -> str:
    return flag.split("/")[0]


def _option(flag: str) -> str:
    """The command-line spelling of a FLAGS key: `inner_steps` → `--inner-steps`."""
    return f"--{_param_name(flag).replace('_', '-')}"


# config path → the option that sets it: a validation error names what the user typed
OPTION_OF = {path: _option(flag) for flag, (path, _) in FLAGS.items()}


def config_options(fn: Any) -> Any:
    for flag, (_, kwargs) in reversed(FLAGS.items()):
        fn = click.option(f"--{flag.replace('_', '-')}", _param_name(flag), show_default=True, **kwargs)(fn)
    return fn


def build_config(values: dict[str, Any], base: dict[str, Any] | None = None,
                 explicit: set[str] | None = None) -> TrainConfig:
    """Flags -> nested config dict -> validated :class:`TrainConfig` (errors name the flag)."""
    data: dict[str, Any] = json.loads(json.dumps(base or {}))
    for flag, (path, _) in FLAGS.items():
        name = _param_name(flag)
        if base is not None and explicit is not None and name not in explicit:
            continue
        node = data
        *parents, leaf = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = values[name]
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as exc:
        raise click.UsageError(_explain(exc)) from exc


def _explain(exc: ValueError) -> str:
    """One line: each bad value under the option that set it (`--inner-steps: …`), or the message
    itself; a union's per-branch errors (`strategy.name.literal[…]`) are folded into one."""
    if not isinstance(exc, ValidationError):
        return str(exc)
    said: dict[str, str] = {}
    for e in exc.errors():
        where = _where(tuple(str(part) for part in e["loc"]))
        msg = e["msg"].removeprefix("Value error, ")
        said.setdefault(where, f"{where}: {msg}" if where else _with_options(msg))
    return "; ".join(said.values())


def _with_options(msg: str) -> str:
    """A check across several fields (no location) names the config's fields: say the options instead."""
    for path, option in OPTION_OF.items():
        if "." in path or "_" in path:  # a config path, never a plain word such as "model" or "tokens"
            msg = re.sub(rf"(?<![\w.]){re.escape(path)}\b", option, msg)
    return msg


def _where(loc: tuple[str, ...]) -> str:
    """The option for a config location: the longest FLAGS path it starts with, else the dotted path."""
    for end in range(len(loc), 0, -1):
        option = OPTION_OF.get(".".join(loc[:end]))
        if option:
            return option
    return ".".join(loc)


@click.command("train")
@config_options
@click.option("--sites", type=click.IntRange(min=1), default=2, show_default=True, help="S sites")
@click.option("--workers-per-site", type=click.IntRange(min=1), default=2, show_default=True,
              help="W workers per site")
@click.option("--wan-mbps", type=float, default=None, help="emulate this WAN rate per site (needs root)")
@click.option("--run-dir", type=click.Path(file_okay=False), default=None, help="metrics and summary go here")
@click.option("--resume", "resume", type=click.Path(file_okay=False, exists=True), default=None,
              help="continue the run checkpointed in DIR")
@click.option("--json", "as_json", is_flag=True, help="print the run summary as JSON")
@click.pass_context
def train_cmd(ctx: click.Context, sites: int, workers_per_site: int, wan_mbps: float | None, run_dir: str | None,
              resume: str | None, as_json: bool, **values: Any) -> None:
    """Train a model on S x W local processes with a cross-site strategy."""
    from cpn.runtime.autotune import explain, resolve
    from cpn.runtime.train import preflight, run_local

    explicit = {k for k in values if ctx.get_parameter_source(k) == ParameterSource.COMMANDLINE}
    try:
        base, topology = None, Topology.uniform(sites, workers_per_site)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    if resume:
        saved = Path(resume) / "config.json"
        base = json.loads(saved.read_text()) if saved.exists() else None
        saved_topo = Path(resume) / "topology.json"
        if saved_topo.exists() and not {"sites", "workers_per_site"} & _explicit(ctx):
            topology = Topology.model_validate_json(saved_topo.read_text())
    shard, recompute = auto_shard(values["model"] if "model" in explicit or not base else base.get("model", ""),
                                  min(site.ranks for site in topology.sites))
    values = {**values, "shard": shard if values["shard"] == AUTO else values["shard"],
              "activation_checkpointing": recompute if values["activation_checkpointing"] == AUTO
              else values["activation_checkpointing"]}
    cfg = build_config(values, base, explicit)
    cfg = cfg.model_copy(update={"resume": resume, "checkpoint_dir": cfg.checkpoint_dir or resume})
    try:
        cfg = resolve(cfg, topology, wan_mbps)
        preflight(cfg, topology)
    except ValueError as exc:  # the runtime's checks name config fields: say the options instead
        raise click.UsageError(_with_options(str(exc))) from exc
    try:
        summary = run_local(cfg, topology, wan_mbps=wan_mbps, run_dir=run_dir)
    except RuntimeError as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        click.echo(json.dumps({**{k: v for k, v in summary.items() if k != "val_curve"}, "resolved": explain(cfg, topology)}, indent=2))
    else:
        shares = f" (last split {summary['shares']} sequences per rank)" if summary.get("shares") else ""
        from cpn.runtime.strategies.idle import IDLE_WORDS  # torch is loaded by now; `cpn --help` must not

        shares += IDLE_WORDS.get(summary.get("idle_trial"), "")
        click.echo(f"{explain(cfg, topology)}{shares}: {summary['tokens']} tokens in {summary['wall_seconds']:.1f}s, "
                   f"val loss {summary['initial_val_loss']:.3f} -> {summary['final_val_loss']:.3f}, "
                   f"WAN {summary['wan_bytes'] / 1e6:.1f} MB, compute utilisation {summary['compute_utilization']:.2f}")


def _explicit(ctx: click.Context) -> set[str]:
    return {k for k in ctx.params if ctx.get_parameter_source(k) == ParameterSource.COMMANDLINE}


@click.command("training")
@click.option("--sites", type=int, default=2)
@click.option("--workers-per-site", type=int, default=2)
@click.option("--wan-mbps", type=float, default=None, help="WAN rate per site in Mbit/s (needs root)")
@click.option("--strategies", default="ddp,diloco", help="comma-separated strategies, run in this order")
@click.option("--tokens", type=int, default=1_000_000)
@click.option("--model", default="tiny")
@click.option("--seq-len", type=int, default=128)
@click.option("--global-batch", type=int, default=4096)
@click.option("--lr", type=float, default=3e-3)
@click.option("--inner-steps", type=int, default=None, help="H for diloco / local_sgd; gossip and ssp use H/4 (default: auto)")
@click.option("--outer-lr", type=float, default=None, help="diloco's outer learning rate (default: auto)")
@click.option("--outer-momentum", type=float, default=None, help="diloco's outer Nesterov momentum (0: plain SGD; default: auto)")
@click.option("--staleness", type=int, default=10, help="ssp's bound")
@click.option("--slow-site", type=int, default=None)
@click.option("--slowdown", type=float, default=1.0)
@click.option("--kill-site", type=int, default=None)
@click.option("--at-fraction", type=float, default=None, help="kill the site at this fraction of the run")
@click.option("--ps-replicas", type=int, default=0, help="PS modes: secondaries of each parameter shard")
@click.option("--kill-ps", type=int, default=None, help="kill shard K's primary at --at-fraction (PS modes, --ps-replicas)")
@click.option("--name", default=None, help="scenario name for the docs files (default: from the flags)")
@click.option("--out", type=click.Path(file_okay=False), default="docs/benchmarks")
@click.option("--json", "as_json", is_flag=True)
def bench_training_cmd(as_json: bool, strategies: str, out: str, **options: Any) -> None:
    """Every strategy on the same token budget; writes a markdown table and loss plots under --out."""
    from cpn.runtime.bench_training import BenchOptions, run_benchmark

    try:
        opts = BenchOptions(strategies=[s.strip() for s in strategies.split(",") if s.strip()], **options)
    except ValueError as exc:
        raise click.UsageError(_explain(exc)) from exc
    try:
        report = run_benchmark(opts, out_dir=Path(out))
    except ValueError as exc:
        raise click.UsageError(_explain(exc)) from exc
    except RuntimeError as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        click.echo(json.dumps({"results": report["results"]}, indent=2))
    else:
        for r in report["results"]:
            click.echo(f"{r['strategy']:>22}: {r['wall_seconds']:8.1f}s  val {r['final_val_loss']:.4f}  "
                       f"WAN {r['wan_bytes'] / 1e6:9.2f} MB  util {r['compute_utilization']:.2f}")
