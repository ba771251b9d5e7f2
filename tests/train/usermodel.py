"""A user's training script, written against cpn.train only: a small MLP learns a fixed random
regression task. The tests launch it on 2-4 CPU ranks (Gloo) under every strategy they check."""

from __future__ import annotations

import hashlib
import json

import torch
from torch import nn

import cpn.train

DIM = 16


class Net(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(DIM, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).squeeze(-1)


def dataset(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    w = torch.randn(DIM, generator=g)
    xs = torch.randn(n, DIM, generator=g)
    ys = torch.tanh(xs @ w / DIM**0.5) + 0.01 * torch.randn(n, generator=g)
    return list(zip(xs, ys, strict=True))


def main() -> None:
    job = cpn.train.init()
    cfg = {"hidden": 32, "lr": 0.01, "batch": 16, **job.config}
    torch.manual_seed(job.rank)  # different inits on purpose: wrap() must align them
    model = Net(cfg["hidden"])
    trainer = job.wrap(model, torch.optim.Adam(model.parameters(), lr=cfg["lr"]))
    data = dataset(4096)
    mine = job.shard(data)
    val = data[:256]
    vx, vy = torch.stack([x for x, _ in val]), torch.stack([y for _, y in val])

    def evaluate() -> float:
        with torch.no_grad():
            return float(nn.functional.mse_loss(model(vx), vy))

    first = evaluate()
    trainer.report(val_loss=first)
    losses, i = [], 0
    while not trainer.done:
        size = trainer.units if cfg.get("units") else cfg["batch"]  # units: this rank's share of the step
        batch = [mine[(i + k) % len(mine)] for k in range(size)]
        i += size
        x, y = torch.stack([b[0] for b in batch]), torch.stack([b[1] for b in batch])
        loss = nn.functional.mse_loss(model(x), y)
        trainer.step(loss, tokens=len(batch))
        losses.append(float(loss))
        if trainer.steps % 10 == 0:
            trainer.report(val_loss=evaluate(), mean_abs_weight=float(model.body[0].weight.abs().mean()))
    last = evaluate()
    trainer.report(val_loss=last)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    out = job.run_dir / f"user-rank{job.rank}.json"
    out.write_text(json.dumps({"rank": job.rank, "site": job.site, "site_name": job.site_name, "world": job.world_size, "strategy": job.strategy,
                               "first": first, "last": last, "steps": trainer.steps, "digest": digest,
                               "shard": [float(mine[0][0][0]), len(mine)],
                               "budget": [job.budget.units, job.budget.per_step, job.budget.steps],
                               "last_step": job.budget.last_step,
                               "config": job.config}))
