"""A user's training script for the pipeline strategy, written against cpn.train only: an
``nn.Sequential`` regressor cut into stages, fed by the first stage's ranks. The tests launch it on
2-4 CPU ranks (Gloo) and compare its final weights with one process training the same batches."""

from __future__ import annotations

import json

import torch
from torch import nn

import cpn.train

DIM = 16


def net(hidden: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                         nn.Linear(hidden, 1), nn.Flatten(0))


def dataset(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    w = torch.randn(DIM, generator=g)
    xs = torch.randn(n, DIM, generator=g)
    return xs, torch.tanh(xs @ w / DIM**0.5)


def batches(xs: torch.Tensor, ys: torch.Tensor, sizes: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Consecutive rows of (xs, ys), wrapping around: what one feeder reads step after step."""
    out, i, n = [], 0, len(xs)
    for size in sizes:
        idx = [(i + k) % n for k in range(size)]
        out.append((xs[idx], ys[idx]))
        i += size
    return out


def main() -> None:
    job = cpn.train.init()
    cfg = {"hidden": 32, "lr": 0.01, "stages": None, **job.config}
    model = net(cfg["hidden"])
    if cfg.get("lead"):  # a parameter-free first child: its stage's output needs no gradient
        model = nn.Sequential(nn.Flatten(1), *model)
    xs, ys = dataset(2048)
    rows = job.shard(range(len(xs)))
    mine_x, mine_y = xs[list(rows)], ys[list(rows)]
    trainer = job.wrap(model, torch.optim.Adam(model.parameters(), lr=cfg["lr"]), loss_fn=nn.functional.mse_loss,
                       stages=cfg["stages"])
    vx, vy = xs[:256], ys[:256]

    def evaluate() -> float:
        trainer.gather()  # every rank: rank 0's model becomes the whole trained model
        with torch.no_grad():
            return float(nn.functional.mse_loss(model(vx), vy))

    first = evaluate()
    fed, i = [], 0
    while not trainer.done:
        if trainer.feeds:
            size = trainer.units
            idx = [(i + k) % len(mine_x) for k in range(size)]
            i += size
            fed.append(size)
            trainer.step(inputs=mine_x[idx], targets=mine_y[idx], tokens=size)
        else:
            trainer.step()
        if trainer.steps % 10 == 0 and not trainer.done:
            val = evaluate()
            if job.rank == 0:
                trainer.report(val_loss=val)
    last = evaluate()
    if job.rank == 0:
        trainer.report(val_loss=last)
    out = job.run_dir / f"user-rank{job.rank}.json"
    out.write_text(json.dumps({"rank": job.rank, "site": job.site, "first": first, "last": last, "fed": fed,
                               "feeds": trainer.feeds, "steps": trainer.steps, "shard": [rows[0], len(rows)]}))
    job.close()  # the run's summary (the job runner would call it after main returns)
