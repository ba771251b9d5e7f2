"""The ``ps-straggler`` benchmark's runs over several seeds: how much of ps_backup's loss gap is noise.

``cpn bench training`` has no ``--seed``; this runs the configuration it builds for
``--strategies ps_sync,ps_backup --sites 3 --workers-per-site 1 --tokens 600000 --model tiny
--slow-site 2 --slowdown 2`` (3 PS shards, validation every 14 steps on 4 batches) once per seed and
strategy, back to back, and prints one JSON line per run:

    python docs/benchmarks/ps_straggler_seeds.py 0 1 2 3 4
"""

from __future__ import annotations

import json
import sys
import tempfile

from cpn.runtime.autotune import resolve
from cpn.runtime.bench_training import BenchOptions, train_config
from cpn.runtime.topology import Topology
from cpn.runtime.train import run_local

STRATEGIES = ["ps_sync", "ps_backup"]


def main(seeds: list[int]) -> None:
    opts = BenchOptions(strategies=STRATEGIES, sites=3, workers_per_site=1, tokens=600_000, model="tiny",
                        slow_site=2, slowdown=2.0)
    topology = Topology.uniform(opts.sites, opts.workers_per_site)
    for seed in seeds:
        for name in STRATEGIES:
            cfg = train_config(name, opts, kill=False).model_copy(update={"seed": seed})
            cfg = resolve(cfg, topology, None)
            s = run_local(cfg, topology, run_dir=tempfile.mkdtemp(prefix=f"cpn-ps-seeds-{name}-{seed}-"))
            print(json.dumps({"seed": seed, "strategy": name, "wall_seconds": s["wall_seconds"],
                              "final_val_loss": round(s["final_val_loss"], 4), "tokens": s["tokens"],
                              "ps_dropped": s.get("ps_dropped")}), flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [0])
