"""A hostile job for tests/e2e/test_sandbox.py: before a short honest training run, it tries to read
what a local site must keep from it (the paths and pids come in `code.args`) and prints one line
``PROBE {json}``: for each target, "read" or the error that stopped it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

import cpn.train


def attempt(path: str) -> str:
    try:
        p = Path(path)
        if p.is_dir():
            os.listdir(p)
            for f in p.rglob("*"):  # anything inside counts
                if f.is_file():
                    f.read_bytes()
        else:
            p.read_bytes()
        return "read"
    except OSError as exc:
        return type(exc).__name__


def main() -> None:
    job = cpn.train.init()
    cfg = job.config
    found = {name: attempt(path) for name, path in cfg["targets"].items()}
    # a control: the job's own things are there for it
    (job.run_dir / "mine.txt").write_text("ok")
    found["own-file"] = attempt(str(job.run_dir / "mine.txt"))
    found["own-environ"] = attempt("/proc/self/environ")
    found["uid"] = os.getuid()
    found["secrets-in-env"] = sorted(k for k in os.environ if "TOKEN" in k)
    print("PROBE " + json.dumps(found), flush=True)

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    trainer = job.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(8, 4), torch.randn(8)
    while not trainer.done:
        trainer.step(nn.functional.mse_loss(model(x).squeeze(-1), y), tokens=8)
    trainer.report(val_loss=float(nn.functional.mse_loss(model(x).squeeze(-1), y)))
