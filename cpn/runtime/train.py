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
from cpn.runtime.config import ENV_CHECKPOINT_DIR, ENV_RUN_DIR, TrainConfig
from cpn.runtime.data import ShardSampler, load_corpus, split_corpus, val_batches
from cpn.runtime.groups import init_groups
from cpn.runtime.launcher import launch
from cpn.runtime.metrics import Recorder, default_sinks, gather_finals, summarize, write_summary
from cpn.runtime.model import build_model
from cpn.runtime.siteenv import globalise
from cpn.runtime.strategies import Context, Strategy, build_strategy
from cpn.runtime.topology import Topology

FINAL_MODEL = "final_model.pt"


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list) -> float:
    return sum(model.loss(x, y).item() for x, y in batches) / len(batches)


def setup(cfg: TrainConfig) -> tuple[Context, Strategy]:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    groups = init_groups(timeout=timedelta(seconds=max(600.0, 4 * cfg.strategy.wan_timeout_seconds)))
    split = split_corpus(load_corpus(cfg.corpus_bytes))
    world = groups.world_size
    sampler = ShardSampler(split.train, shard=groups.rank, num_shards=world, seq_len=cfg.seq_len, seed=cfg.seed)
    ckpt_dir = cfg.checkpoint_dir or os.environ.get(ENV_CHECKPOINT_DIR)
    ctx = Context(cfg=cfg, groups=groups, store=dist.distributed_c10d._get_default_store(),
                  model=build_model(cfg.model, seed=cfg.seed), sampler=sampler,
                  micro_batch=cfg.sequences_per_worker(world), checkpoint_dir=Path(ckpt_dir) if ckpt_dir else None)
    ctx.val = val_batches(split.val, seq_len=cfg.seq_len, batches=cfg.val_batches) if groups.rank == 0 else []
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


def train(ctx: Context, strategy: Strategy, recorder: Recorder) -> tuple[int, int]:
    """The loop: micro-batch forward/backward here, everything else in the strategy."""
    cfg, model, timers = ctx.cfg, ctx.model, ctx.timers
    step, tokens = strategy.start_step, 0
    if ctx.rank == 0:
        recorder.report(step=step, tokens=0, timers=timers, train_loss=None, val_loss=evaluate(model, ctx.val),
                        jobTokens=step * cfg.global_batch_tokens)
    while not strategy.should_stop(step):
        if faults.should_kill(cfg.faults, ctx.site, step):
            faults.die([recorder.close])
        x, y = ctx.sampler.batch(step, ctx.micro_batch)
        strategy.before_step(step)
        strategy.set_lr(step)
        t0 = time.perf_counter()
        loss = model.loss(x, y)
        loss.backward()
        compute = time.perf_counter() - t0
        timers.add("compute", compute + faults.slow_down(cfg.faults, ctx.site, compute))
        strategy.after_backward(step)
        step, tokens = step + 1, tokens + ctx.step_tokens
        val = None
        if ctx.rank == 0 and step % cfg.val_every == 0:
            with timers.timed("compute"):
                val = evaluate(model, ctx.val)
        recorder.report(step=step, tokens=tokens, timers=timers, train_loss=loss.item(), val_loss=val,
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
    recorder = Recorder(rank=ctx.rank, site=ctx.site, sinks=default_sinks(ctx.rank, run_dir))
    step, tokens = train(ctx, strategy, recorder)
    val = evaluate(ctx.model, ctx.val) if ctx.rank == 0 else None
    final = recorder.report(step=step, tokens=tokens, timers=ctx.timers, train_loss=None, val_loss=val, final=True,
                            jobTokens=int(strategy.progress * cfg.tokens) if strategy.global_budget else step * cfg.global_batch_tokens)
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
                        config=ctx.cfg.model_dump())
    if run_dir:
        write_summary(run_dir, summary)
    return summary


def main() -> int:
    globalise()  # site-local torchrun ranks → CPN's job-wide ranks (kubernetes driver)
    cfg = TrainConfig.from_env()
    summary = run_worker(cfg, os.environ.get(ENV_RUN_DIR))
    if summary is not None:
        print(json.dumps({k: v for k, v in summary.items() if k != "valCurve"}), flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # live Gloo pairs to dead or finished peers can hang a clean teardown


if __name__ == "__main__":
    sys.exit(main())


def run_local(config: TrainConfig, topology: Topology, wan_mbps: float | None = None,
              run_dir: str | Path | None = None, timeout: float = 3600.0,
              env: dict[str, str] | None = None, start_method: str = "spawn") -> dict:
    """Run the job on this machine, S x W processes through the launcher (WAN-shaped if ``wan_mbps``).

    ``start_method="fork"`` (no WAN emulation) skips each rank's torch import: what the tests use.
    """
    run_dir = Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix="cpn-train-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "summary.json").unlink(missing_ok=True)
    worker_env = {**config.to_env(), ENV_RUN_DIR: str(run_dir), **(env or {})}
    killing = config.faults.kill_site is not None
    entry = "cpn.runtime.train:main" if start_method == "fork" else "cpn.runtime.train"
    results = launch(topology, entry, [], wan_mbps=wan_mbps, env=worker_env, timeout=timeout,
                     failure_grace=timeout if killing else 10.0, capture_output=True, check=False,
                     start_method=start_method)
    planned = {faults.KILLED_EXIT_CODE} if killing else set()
    bad = [r for r in results if r.exit_code != 0 and r.exit_code not in planned]
    summary_path = run_dir / "summary.json"
    if bad or not summary_path.exists():
        logs = "\n".join(f"--- rank {r.rank} exited {r.exit_code}:\n{r.log[-1500:]}" for r in (bad or results))
        raise RuntimeError(f"training failed ({len(bad)} ranks), logs in rank order:\n{logs}")
    return json.loads(summary_path.read_text())
