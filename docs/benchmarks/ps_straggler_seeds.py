"""The ``ps-straggler`` benchmark's runs over several seeds: how much of ps_backup's loss gap is noise.

``cpn bench training`` has no ``--seed``; this runs the configuration it builds for
``--strategies ps_sync,ps_backup --sites 3 --workers-per-site 1 --tokens 600000 --model tiny
--slow-site 2 --slowdown 2`` (3 PS shards, validation every 14 steps on 4 batches) once per seed and
strategy, back to back, and prints one JSON line per run (with the servers' per-rank push and drop
counts and the load average at its end):

    python docs/benchmarks/ps_straggler_seeds.py 0 1 2 3 4

A seed may repeat (``--runs ps_backup 0 0 0 0 0``: run-to-run spread of one seed). ``ps_split_steps``
counts the steps two shards applied with different workers' pushes (0 since the accepted set is
decided once per step). ``--runs ps_backup:shard,ps_backup:whole 0 1 2`` runs other variants: a strategy, optionally with
``strategy.sampling`` after a colon (``shard``: one contiguous shard per worker; ``whole``: every
worker draws from the whole training split, ps_backup's default).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

from cpn.runtime.autotune import resolve
from cpn.runtime.bench_training import BenchOptions, train_config
from cpn.runtime.topology import Topology
from cpn.runtime.train import run_local

RUNS = ["ps_sync", "ps_backup"]


def run(seed: int, variant: str) -> dict:
    name, _, sampling = variant.partition(":")
    opts = BenchOptions(strategies=[name], sites=3, workers_per_site=1, tokens=600_000, model="tiny",
                        slow_site=2, slowdown=2.0)
    cfg = train_config(name, opts, kill=False).model_copy(update={"seed": seed})
    if sampling:
        strategy = cfg.strategy.model_validate({**cfg.strategy.model_dump(), "sampling": sampling})
        cfg = cfg.model_copy(update={"strategy": strategy})
    topology = Topology.uniform(opts.sites, opts.workers_per_site)
    cfg = resolve(cfg, topology, None)
    s = run_local(cfg, topology, run_dir=tempfile.mkdtemp(prefix=f"cpn-ps-seeds-{name}-{seed}-"))
    return {"seed": seed, "strategy": variant, "sampling": getattr(cfg.strategy, "data_sampling", "shard"),
            "wall_seconds": s["wall_seconds"], "final_val_loss": round(s["final_val_loss"], 4),
            "tokens": s["tokens"], "ps_dropped": s.get("ps_dropped"),
            "ps_pushed_by_rank": s.get("ps_pushed_by_rank"), "ps_dropped_by_rank": s.get("ps_dropped_by_rank"),
            "ps_split_steps": s.get("ps_split_steps"), "ps_short_steps": s.get("ps_short_steps"),
            "loadavg": os.getloadavg()[0]}


def main(argv: list[str]) -> None:
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return
    runs = RUNS
    if argv[:1] == ["--runs"]:
        runs, argv = argv[1].split(","), argv[2:]
    for seed in [int(a) for a in argv] or [0]:
        for variant in runs:
            print(json.dumps(run(seed, variant)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
