"""The worker entry point of a job without ``spec.code``: ``python -m cpn.runtime.train`` under a
torchrun-compatible environment trains the built-in LM (:mod:`cpn.train.lm`, written against the public
:mod:`cpn.train` API like any user's module); and the launcher side: :func:`preflight`, :func:`run_local`.

The worker reads ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``/``CPN_TOPOLOGY`` (the groups),
``CPN_TRAIN_CONFIG`` (a :class:`TrainConfig` as JSON), and optionally ``CPN_RUN_DIR`` (metrics and
summary), ``CPN_CHECKPOINT_DIR``, ``CPN_METRICS_URL`` + ``CPN_METRICS_TOKEN`` (HTTP metrics sink).
"""

from __future__ import annotations

import json
import os
import re
import sys
import sysconfig
import tempfile
from pathlib import Path

from cpn.runtime import faults
from cpn.runtime.autotune import resolve
from cpn.runtime.config import (
    ENV_RUN_DIR,
    FINAL_MODEL,
    PS_STRATEGIES,
    SHARDABLE_STRATEGIES,
    UNSHARDABLE_REASONS,
    TrainConfig,
)
from cpn.runtime.launcher import launch
from cpn.runtime.strategies import strategy_class
from cpn.runtime.strategies.async_ps import check_ps
from cpn.runtime.topology import Topology

__all__ = ["FINAL_MODEL", "failure_lines", "main", "preflight", "run_local"]


def main() -> int:
    from cpn.train.lm import main as train_builtin_lm  # the public API's user, imported in the worker only

    summary = train_builtin_lm()
    if summary is not None:
        print(json.dumps({k: v for k, v in summary.items() if k != "valCurve"}), flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # live Gloo pairs to dead or finished peers can hang a clean teardown


if __name__ == "__main__":
    sys.exit(main())


def preflight(config: TrainConfig, topology: Topology, *, builtin_model: bool = True) -> None:
    """What a worker would find wrong with this config on this topology, found before any starts.
    ``builtin_model=False``: a user's code builds the model (its units are checked when it is wrapped)."""
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
    strategy_class(s.name).check(config, topology, builtin_model=builtin_model)
    if s.name == "hierarchical" and not topology.is_uniform:
        raise ValueError(f"hierarchical needs the same number of workers at every site, got "
                         f"{[x.ranks for x in topology.sites]}: use ddp or even out the sites")
    check_shard(config, topology)
    for name, site in (("faults.slow_site", f.slow_site), ("faults.kill_site", f.kill_site)):
        if site is not None and site >= sites:
            raise ValueError(f"{name} {site} is not one of the {sites} sites (0..{sites - 1})")
    shard = int(config.corpus_bytes * (1 - VAL_FRACTION)) // world
    if shard <= config.seq_len + 1:
        raise ValueError(f"each of {world} workers would get {shard} bytes of corpus, too few for seq_len "
                         f"{config.seq_len}: raise corpus_bytes or use fewer workers")


def check_shard(config: TrainConfig, topology: Topology) -> None:
    """``shard="site"`` on ``topology``: equal sites of more than one rank (a resumed run may go down to
    one: a sharded checkpoint loads on any number); a sharded checkpoint resumes only sharded."""
    from cpn.runtime.checkpoint import is_sharded_checkpoint

    if config.resume and is_sharded_checkpoint(config.resume) and config.shard != "site":
        raise ValueError(f"the checkpoint under {config.resume} is sharded: resume it with shard='site' (--shard site)")
    if config.shard != "site":
        return
    if config.strategy.name not in SHARDABLE_STRATEGIES:  # e.g. chosen by autotune for strategy 'auto'
        raise ValueError(f"strategy {config.strategy.name!r} cannot run with shard='site' "
                         f"({UNSHARDABLE_REASONS[config.strategy.name]}): use shard='none' or one of "
                         f"{', '.join(SHARDABLE_STRATEGIES)}")
    ranks = [site.ranks for site in topology.sites]
    if len(set(ranks)) > 1:
        raise ValueError(f"shard='site' needs the same number of workers at every site, got {ranks}: even out the "
                         "sites or use --shard none")
    if ranks[0] == 1 and not config.resume:
        raise ValueError("shard='site' shards the model over the workers of a site: with one worker per site it "
                         "saves nothing; use --shard none or --workers-per-site 2 or more")


_FRAME = re.compile(r'^\s+File "(?P<path>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
_LIBRARY = tuple({sysconfig.get_path("stdlib"), sysconfig.get_path("purelib"), sysconfig.get_path("platlib")})


def hung_at(log: str) -> str | None:
    """Where a worker stopped at the timeout waited: the innermost frame outside the standard library and
    installed packages (torch) of the thread that wrote the stacks (the main one), from the dump the
    launcher asks for; None without a dump."""
    head = max(log.rfind("Current thread 0x"), log.rfind("Stack (most recent call first)"))
    if head < 0:  # the signal landed on a thread Python does not run (Gloo's): every thread is "Thread 0x..."
        heads = [m.start() for m in re.finditer(r"^Thread 0x", log, re.M)]
        head = _main_thread_dump(log, heads)
    if head < 0:
        return None
    frames = [m for m in map(_FRAME.match, log[head:].splitlines()[1:]) if m]
    if not frames:
        return None
    own = [m for m in frames if not m["path"].startswith(_LIBRARY) or "/cpn/" in m["path"]]
    m = (own or frames)[0]
    return f"{m['func']} ({Path(m['path']).name}:{m['line']})"


def _main_thread_dump(log: str, heads: list[int]) -> int:
    """Of the dumped threads, the last whose stack holds the worker's entry (the main thread); -1 if none."""
    for h in reversed(heads):
        if "_worker_main" in log[h:].split("\n\n", 1)[0]:
            return h
    return heads[-1] if heads else -1


def failure_lines(results: list, planned: set[int], timeout: float | None = None) -> list[str]:
    """Each failing rank's last error line (the exception, not the traceback around it); a rank the
    launcher stopped says so (the timeout, or another rank's failure), not an exit code of its own."""
    lines = []
    for r in results:
        if r.exit_code == 0 or r.exit_code in planned:
            continue
        stopped = getattr(r, "stopped", None)
        if stopped == "timeout":
            within = f" within {timeout:.0f} s" if timeout else ""
            where = hung_at(r.log)
            at = f"; it was in {where} (every thread's stack is in its log)" if where else ""
            lines.append(f"rank {r.rank} (site {r.site}) had not finished{within}: stopped (raise the timeout){at}")
            continue
        if stopped == "failure":
            lines.append(f"rank {r.rank} (site {r.site}) was stopped after another rank failed")
            continue
        if stopped is not None:
            lines.append(f"rank {r.rank} (site {r.site}) was stopped ({stopped})")
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
    entry = "cpn.runtime.train:main" if start_method in ("fork", "forkserver") else "cpn.runtime.train"
    results = launch(topology, entry, [], wan_mbps=wan_mbps, env=worker_env, timeout=timeout,
                     failure_grace=timeout if killing else 10.0, capture_output=True, check=False,
                     start_method=start_method)
    planned = {faults.KILLED_EXIT_CODE} if killing else set()
    logs = run_dir / "logs"
    logs.mkdir(exist_ok=True)
    for r in results:
        (logs / f"rank{r.rank}.log").write_text(r.log)
    bad = failure_lines(results, planned, timeout)
    summary_path = run_dir / "summary.json"
    if bad or not summary_path.exists():
        causes = "; ".join(bad) or "no summary was written"
        raise RuntimeError(f"training failed: {causes} (logs in {logs})")
    return json.loads(summary_path.read_text())
