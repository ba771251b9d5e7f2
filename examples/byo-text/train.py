"""A user's own model on a local text file, trained by CPN across sites.

Nothing here is CPN's model: a character-level GRU language model on ``corpus.txt`` (which ships in
this directory, so the bundle carries it). CPN contributes only ``cpn.train``: the job's ranks and
budget, the cross-site strategy around the optimiser, the metrics stream and the final weights.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlparse

import torch
from torch import nn

import cpn.train


class CharGRU(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.rnn = nn.GRU(hidden, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(x))
        return self.head(out)


def _local(uri: str | None) -> str:
    """The text file to read: the site's replica of the job's Dataset when it names a local file
    (``file:`` URIs; with-dataset.yaml), else the copy in this bundle."""
    if uri and uri.startswith("file:"):
        return unquote(urlparse(uri).path)
    return "corpus.txt"


def main() -> None:
    job = cpn.train.init()
    cfg = {"hidden": 96, "layers": 1, "seq": 64, "lr": 3e-3, "file": _local(job.data_uri), **job.config}
    text = Path(cfg["file"]).read_bytes()
    print(f"rank {job.rank} at {job.site_name}: training on {cfg['file']} ({len(text):,} bytes)", flush=True)
    data = torch.tensor(list(text), dtype=torch.long)  # bytes: a 256-symbol vocabulary, no tokenizer
    split = int(len(data) * 0.95)
    train, val = data[:split], data[split:]
    windows = range(0, len(train) - cfg["seq"] - 1, cfg["seq"])
    mine = job.shard(list(windows))  # this rank's windows; the ranks together cover the file
    # the global batch is spec.globalBatchTokens characters: this rank's share of it, in windows
    per_rank = max(1, job.budget.per_step // (cfg["seq"] * job.world_size))

    model = CharGRU(256, cfg["hidden"], cfg["layers"])
    trainer = job.wrap(model, torch.optim.AdamW(model.parameters(), lr=cfg["lr"]))
    loss_fn = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(job.seed + job.rank)

    def batch(starts: list[int], source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.stack([source[s:s + cfg["seq"] + 1] for s in starts]).to(job.device)
        return rows[:, :-1], rows[:, 1:]

    val_starts = list(range(0, len(val) - cfg["seq"] - 1, cfg["seq"]))[:32]

    def evaluate() -> float:
        model.eval()
        with torch.no_grad():
            x, y = batch(val_starts, val)
            out = float(loss_fn(model(x).reshape(-1, 256), y.reshape(-1)))
        model.train()
        return out

    trainer.report(val_loss=evaluate())
    while not trainer.done:
        pick = torch.randint(len(mine), (per_rank,), generator=g).tolist()
        x, y = batch([mine[i] for i in pick], train)
        loss = loss_fn(model(x).reshape(-1, 256), y.reshape(-1))
        trainer.step(loss, tokens=x.numel())
        if trainer.steps % 20 == 0:
            trainer.report(val_loss=evaluate())
    trainer.report(val_loss=evaluate())
