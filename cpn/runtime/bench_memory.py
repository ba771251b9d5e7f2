"""``cpn bench memory``: what a rank holds of a model's training state, unsharded and sharded over a site.

For ``shard: none`` and ``shard: site`` in turn, W local processes (one site, Gloo, CPU) each build the
model, take one AdamW training step (a random batch of ``batch`` sequences of ``seq_len`` tokens per
rank; unsharded ranks average their gradients with an all-reduce, sharded ones reduce-scatter in
backward), then measure:

- ``state_bytes_per_rank``: parameters + gradients + optimiser state, from the tensors' storage (the
  local shards of DTensors, padding included), the largest over the ranks;
- ``peak_rss_bytes``: the process's peak resident set (``ru_maxrss``), the largest over the ranks: the
  interpreter and torch (about 0.3 GB here), the state, activations and communication buffers;
- ``predicted_state_bytes_per_rank``: the planner's rule, 16 bytes per parameter (fp32 weights 4,
  gradients 4, Adam's two moments 8) divided by the shard degree.

The sharded model is built on the meta device and each rank initialises only its shards
(:func:`cpn.runtime.sharding.build_sharded`, ``meta`` mode), so no rank ever holds the whole model.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import sys
from pathlib import Path
from typing import Any

BYTES_PER_PARAMETER = 16  # fp32 Adam: weights 4 + gradients 4 + two moments 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, model: Any, shard: str, seq_len: int, batch: int,
               out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    from cpn.runtime.config import TrainConfig
    from cpn.runtime.groups import init_groups
    from cpn.runtime.model import build_model, count_parameters
    from cpn.runtime.presets import resolve
    from cpn.runtime.sharding import build_sharded, state_bytes
    from cpn.runtime.strategies.base import make_optimizer
    from cpn.runtime.topology import Topology

    torch.set_num_threads(1)
    groups = init_groups(Topology.uniform(1, world), device=torch.device("cpu"))
    spec = resolve(model)
    cfg = TrainConfig(model="tiny", shard=shard, seq_len=seq_len)  # the knobs only; the model is ``spec``
    net = build_sharded(cfg, groups, model=spec, mode="meta") if shard == "site" else build_model(spec, seed=0)
    opt = make_optimizer(cfg, list(net.parameters()))
    gen = torch.Generator().manual_seed(rank)
    x = torch.randint(0, spec.vocab_size, (batch, seq_len), generator=gen)
    net.loss(x, x.roll(-1, dims=1)).backward()
    if shard == "none":
        for p in net.parameters():
            dist.all_reduce(p.grad, group=groups.world)
            p.grad.div_(world)
    opt.step()
    held = state_bytes(net, opt)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    params = spec.parameters if shard == "site" else count_parameters(net)
    Path(out, f"rank{rank}.json").write_text(json.dumps({**held, "peak_rss_bytes": rss, "parameters": params}))
    dist.barrier()  # no rank leaves while another is still in a collective
    os._exit(0)  # tearing down the site mesh's groups can hang (as in cpn.runtime.train.main)


def measure(model: Any, workers: int, shard: str, *, seq_len: int = 128, batch: int = 2,
            work_dir: Path) -> dict[str, Any]:
    """One configuration on ``workers`` fresh processes (so each one's peak RSS is its own)."""
    import torch.multiprocessing as mp

    out = work_dir / shard
    out.mkdir(parents=True, exist_ok=True)
    mp.start_processes(_rank_main, args=(workers, _free_port(), model, shard, seq_len, batch, str(out)),
                       nprocs=workers, start_method="spawn")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(workers)]
    parameters = ranks[0]["parameters"]
    degree = workers if shard == "site" else 1
    state = [r["params"] + r["grads"] + r["optimizer"] for r in ranks]
    return {"shard": shard, "workers": workers, "parameters": parameters,
            "state_bytes_per_rank": max(state),
            "params_bytes_per_rank": max(r["params"] for r in ranks),
            "grads_bytes_per_rank": max(r["grads"] for r in ranks),
            "optimizer_bytes_per_rank": max(r["optimizer"] for r in ranks),
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks),
            "predicted_state_bytes_per_rank": BYTES_PER_PARAMETER * parameters // degree}


def run(model: Any, workers: int, *, seq_len: int = 128, batch: int = 2, work_dir: Path) -> dict[str, Any]:
    """Both configurations, unsharded first; ``sharded_ratio`` is sharded / unsharded state per rank and
    ``prediction_error`` each one's |predicted − measured| / measured."""
    results = [measure(model, workers, shard, seq_len=seq_len, batch=batch, work_dir=work_dir)
               for shard in ("none", "site")]
    for r in results:
        r["prediction_error"] = round(abs(r["predicted_state_bytes_per_rank"] - r["state_bytes_per_rank"])
                                      / r["state_bytes_per_rank"], 4)
    ratio = results[1]["state_bytes_per_rank"] / results[0]["state_bytes_per_rank"]
    return {"model": model, "workers": workers, "seq_len": seq_len, "batch": batch,
            "sharded_ratio": round(ratio, 4), "results": results}


def markdown_rows(report: dict[str, Any]) -> list[str]:
    """One table row per configuration of ``report``."""
    name = report["model"] if isinstance(report["model"], str) else json.dumps(report["model"], separators=(",", ":"))
    rows = []
    for r in report["results"]:
        rows.append(f"| `{name}` | {r['parameters'] / 1e6:.1f} M | {r['workers']} | {r['shard']} | "
                    f"{r['state_bytes_per_rank'] / 2**20:.1f} | {r['predicted_state_bytes_per_rank'] / 2**20:.1f} | "
                    f"{100 * r['prediction_error']:.1f} % | {r['peak_rss_bytes'] / 2**20:.0f} |")
    return rows
