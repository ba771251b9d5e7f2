"""The worker entry point: ``python -m cpn.runtime.train`` under a torchrun-compatible environment.

Reads ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``/``CPN_TOPOLOGY`` (the groups),
``CPN_TRAIN_CONFIG`` (a :class:`TrainConfig` as JSON), and optionally ``CPN_RUN_DIR`` (metrics and
summary), ``CPN_CHECKPOINT_DIR``, ``CPN_METRICS_URL`` + ``CPN_METRICS_TOKEN`` (HTTP metrics sink).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from cpn.runtime import checkpoint, faults
from cpn.runtime.autotune import resolve
from cpn.runtime.config import ENV_CHECKPOINT_DIR, ENV_RUN_DIR, TrainConfig
from cpn.runtime.data import ShardSampler, load_corpus, split_corpus, val_batches
from cpn.runtime.device import autocast, select_device, synchronize
from cpn.runtime.groups import init_groups
from cpn.runtime.launcher import launch
from cpn.runtime.metrics import Recorder, default_sinks, gather_finals, summarize, write_summary
from cpn.runtime.model import build_model
from cpn.runtime.strategies import Context, Strategy, build_strategy, strategy_class
from cpn.runtime.strategies.async_ps import PS_STRATEGIES, check_ps
from cpn.runtime.topology import Topology

FINAL_MODEL = "final_model.pt"


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list, precision: str = "fp32") -> float:
    if not batches:
        return float("nan")
    device = batches[0][0].device
    with autocast(device, precision):
        return sum(model.loss(x, y).item() for x, y in batches) / len(batches)


def setup(cfg: TrainConfig) -> tuple[Context, Strategy]:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    bound_at = time.perf_counter()
    device = select_device(cfg.device.kind)
    groups = init_groups(timeout=timedelta(seconds=max(600.0, 4 * cfg.strategy.wan_timeout_seconds)),
                         device=device, wan_backend=cfg.device.wan_backend)
    cfg = resolve(cfg, groups.topology)  # a no-op when the launcher resolved the defaults already
    split = split_corpus(load_corpus(cfg.corpus_bytes))
    world = groups.world_size
    sampler = ShardSampler(split.train, shard=groups.rank, num_shards=world, seq_len=cfg.seq_len, seed=cfg.seed)
    ckpt_dir = cfg.checkpoint_dir or os.environ.get(ENV_CHECKPOINT_DIR)
    shares = cfg.shares(world)
    ctx = Context(cfg=cfg, groups=groups, store=dist.distributed_c10d._get_default_store(),
                  model=build_model(cfg.model, seed=cfg.seed, device=device), sampler=sampler,
                  micro_batch=shares[groups.rank], shares=shares, checkpoint_dir=Path(ckpt_dir) if ckpt_dir else None,
                  bound_at=bound_at)
    val = val_batches(split.val, seq_len=cfg.seq_len, batches=cfg.val_batches) if groups.rank == 0 else []
    ctx.val = [(x.to(device), y.to(device)) for x, y in val]
    strategy = build_strategy(ctx)
    if ctx.checkpoint_dir is not None and groups.rank == 0:  # what `cpn train --resume DIR` restarts from
        checkpoint.atomic_write_json(cfg.model_dump(), ctx.checkpoint_dir / "config.json")
        checkpoint.atomic_write_json(groups.topology.model_dump(), ctx.checkpoint_dir / "topology.json")
    if cfg.resume:
        restored = checkpoint.load(cfg.resume, groups.site)
        if restored is None:
            raise FileNotFoundError(f"no checkpoint under {cfg.resume}: check --resume (it needs a latest.json)")
        step, site_state, global_state = restored
        strategy.load_state(site_state, global_state)
        strategy.start_step = step
    return ctx, strategy


def forward_backward(ctx: Context, step: int) -> float | None:
    """This rank's tokens of ``step``: whole sequences, and in a trimmed step maybe the front of one
    more; the gradient is the mean over those tokens. None when the rank has no tokens in the step."""
    cfg, device = ctx.cfg, ctx.device
    full, tail = divmod(ctx.step_tokens, cfg.seq_len)
    if not full and not tail:
        return None
    x, y = (t.to(device, non_blocking=True) for t in ctx.sampler.batch(step, full + (1 if tail else 0)))
    with autocast(device, cfg.device.precision):
        if tail:
            parts = [(x[:full], y[:full], full * cfg.seq_len)] if full else []
            parts.append((x[full:, :tail], y[full:, :tail], tail))
            loss = sum(ctx.model.loss(a, b) * (n / ctx.step_tokens) for a, b, n in parts)
        else:
            loss = ctx.model.loss(x, y)
    loss.backward()
    synchronize(device)
    return loss.item()


def train(ctx: Context, strategy: Strategy, recorder: Recorder) -> tuple[int, int]:
    """The loop: micro-batch forward/backward here, everything else in the strategy."""
    cfg, model, timers = ctx.cfg, ctx.model, ctx.timers
    precision = cfg.device.precision
    step, tokens = strategy.start_step, 0
    if ctx.rank == 0:
        recorder.report(step=step, tokens=0, timers=timers, train_loss=None,
                        val_loss=evaluate(model, ctx.val, precision), jobTokens=cfg.tokens_through(step))
    while not strategy.should_stop(step):
        if faults.should_kill(cfg.faults, ctx.site, step):
            faults.die([recorder.close])
        strategy.before_step(step)
        strategy.plan_step(step)
        strategy.set_lr(step)
        t0 = time.perf_counter()
        loss = strategy.forward_backward(step) if strategy.owns_forward_backward else forward_backward(ctx, step)
        compute = time.perf_counter() - t0
        busy = compute + faults.slow_down(cfg.faults, ctx.site, compute)
        timers.add("compute", busy)
        ctx.busy_seconds += busy
        ctx.sequences_done += ctx.micro_batch
        strategy.after_backward(step)
        step, tokens = step + 1, tokens + ctx.step_tokens
        strategy.rebalance(step)
        val = None
        if ctx.rank == 0 and step % cfg.val_every == 0:
            with timers.timed("compute"):
                val = evaluate(model, ctx.val, precision)
        recorder.report(step=step, tokens=tokens, timers=timers, train_loss=loss, val_loss=val,
                        jobTokens=int(strategy.progress * cfg.tokens))
        if strategy.checkpoint_due(step):
            checkpoint.save(ctx.checkpoint_dir, step, site=ctx.site, is_leader=ctx.is_leader, is_rank0=ctx.rank == 0,
                            site_state=strategy.site_state(),
                            global_state=strategy.global_state() if ctx.rank == 0 else {},
                            store=ctx.store, live_sites=strategy.live_sites())
    strategy.finish(step)
    return step, tokens


def run_worker(cfg: TrainConfig, run_dir: str | None = None) -> dict | None:
    """One rank's whole life; rank 0 returns (and writes) the run summary."""
    ctx, strategy = setup(cfg)
    recorder = Recorder(rank=ctx.rank, site=ctx.site, sinks=default_sinks(ctx.rank, run_dir), device_since=ctx.bound_at)
    step, tokens = train(ctx, strategy, recorder)
    val = evaluate(ctx.model, ctx.val, cfg.device.precision) if ctx.rank == 0 else None
    final = recorder.report(step=step, tokens=tokens, timers=ctx.timers, train_loss=None, val_loss=val, final=True,
                            jobTokens=int(strategy.progress * cfg.tokens) if strategy.global_budget else cfg.tokens_through(step))
    recorder.close()
    ctx.store.set(f"cpn/final/{ctx.rank}", json.dumps(final))
    if ctx.rank != 0:
        return None
    if run_dir:
        checkpoint.atomic_save(ctx.model.state_dict(), Path(run_dir) / FINAL_MODEL)
    return _summary(ctx, strategy, run_dir, recorder)


def _summary(ctx: Context, strategy: Strategy, run_dir: str | None, recorder: Recorder) -> dict:
    topo = ctx.groups.topology
    expected = [r for s in strategy.live_sites() for r in topo.ranks_of(s)]
    finals = gather_finals(ctx.store, expected, list(range(topo.world_size)),
                           timeout=max(60.0, ctx.cfg.strategy.wan_timeout_seconds))
    curve = recorder.curve
    summary = summarize(finals, curve, strategy=ctx.cfg.strategy.name, model=ctx.cfg.model,
                        sites=topo.num_sites, world_size=topo.world_size, live_sites=strategy.live_sites(),
                        config=ctx.cfg.model_dump(), **strategy.summary_extras())
    if run_dir:
        write_summary(run_dir, summary)
    return summary


def main() -> int:
    cfg = TrainConfig.from_env()
    summary = run_worker(cfg, os.environ.get(ENV_RUN_DIR))
    if summary is not None:
        print(json.dumps({k: v for k, v in summary.items() if k != "valCurve"}), flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # live Gloo pairs to dead or finished peers can hang a clean teardown


if __name__ == "__main__":
    sys.exit(main())


def preflight(config: TrainConfig, topology: Topology) -> None:
    """What a worker would find wrong with this config on this topology, found before any starts."""
    from cpn.runtime.data import VAL_FRACTION

    world, sites = topology.world_size, topology.num_sites
    config = resolve(config, topology)
    config.shares(world)
    s, f = config.strategy, config.faults
    if s.name in PS_STRATEGIES and s.ps > world:
        raise ValueError(f"strategy.ps {s.ps} exceeds the {world} ranks of the job: use at most {world}")
    if s.name == "ps_backup" and s.backup_workers >= world:
        raise ValueError(f"strategy.backup_workers {s.backup_workers} must be below the {world} workers of the job")
    check_ps(config, topology)
    strategy_class(s.name).check(config, topology)
    if s.name == "hierarchical" and not topology.is_uniform:
        raise ValueError(f"hierarchical needs the same number of workers at every site, got "
                         f"{[x.ranks for x in topology.sites]}: use ddp or even out the sites")
    for name, site in (("faults.slow_site", f.slow_site), ("faults.kill_site", f.kill_site)):
        if site is not None and site >= sites:
            raise ValueError(f"{name} {site} is not one of the {sites} sites (0..{sites - 1})")
    shard = int(config.corpus_bytes * (1 - VAL_FRACTION)) // world
    if shard <= config.seq_len + 1:
        raise ValueError(f"each of {world} workers would get {shard} bytes of corpus, too few for seq_len "
                         f"{config.seq_len}: raise corpus_bytes or use fewer workers")


def failure_lines(results: list, planned: set[int]) -> list[str]:
    """Each failing rank's last error line (the exception, not the traceback around it)."""
    lines = []
    for r in results:
        if r.exit_code == 0 or r.exit_code in planned:
            continue
        tail = [line.strip() for line in r.log.splitlines() if line.strip()]
        errors = [line for line in tail if "Error" in line or "Exception" in line or line.startswith("RuntimeError")]
        cause = (errors or tail or ["(no output)"])[-1]
        lines.append(f"rank {r.rank} (site {r.site}) exited {r.exit_code}: {cause[:300]}")
    return lines


def run_local(config: TrainConfig, topology: Topology, wan_mbps: float | None = None,
              run_dir: str | Path | None = None, timeout: float = 3600.0,
              env: dict[str, str] | None = None, start_method: str = "spawn") -> dict:
    """Run the job on this machine, S x W processes through the launcher (WAN-shaped if ``wan_mbps``).

    ``start_method="fork"`` (no WAN emulation) skips each rank's torch import: what the tests use.
    """
    config = resolve(config, topology, wan_mbps)
    preflight(config, topology)
    run_dir = Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix="cpn-train-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "summary.json").unlink(missing_ok=True)
    worker_env = {**config.to_env(), ENV_RUN_DIR: str(run_dir), **(env or {})}
    killing = config.faults.kill_at_step is not None  # a site or a PS primary (faults.kill_ps)
    entry = "cpn.runtime.train:main" if start_method == "fork" else "cpn.runtime.train"
    results = launch(topology, entry, [], wan_mbps=wan_mbps, env=worker_env, timeout=timeout,
                     failure_grace=timeout if killing else 10.0, capture_output=True, check=False,
                     start_method=start_method)
    planned = {faults.KILLED_EXIT_CODE} if killing else set()
    logs = run_dir / "logs"
    logs.mkdir(exist_ok=True)
    for r in results:
        (logs / f"rank{r.rank}.log").write_text(r.log)
    bad = failure_lines(results, planned)
    summary_path = run_dir / "summary.json"
    if bad or not summary_path.exists():
        causes = "; ".join(bad) or "no summary was written"
        raise RuntimeError(f"training failed: {causes} (logs in {logs})")
    return json.loads(summary_path.read_text())
