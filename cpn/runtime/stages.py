"""Cutting the built-in :class:`~cpn.runtime.model.TransformerLM` into contiguous pipeline stages.

The model is a chain of *units*: the embedding (token + position tables), each transformer block,
and the head (final norm + output projection). A cut is P contiguous runs of units chosen to make
the largest stage's parameter count as small as possible (an exact DP; a handful of units). The
head's projection is the token table (tied weights): the first and the last stage each hold a copy,
and the pipeline adds their two gradients every step so both copies stay equal (what one process's
autograd would do with the one shared tensor).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cpn.runtime.model import TransformerLM

__all__ = ["Stage", "StageCut", "cut_model", "partition", "unit_names", "unit_sizes"]


def unit_names(model: TransformerLM) -> list[str]:
    return ["embed", *(f"block{i}" for i in range(len(model.blocks))), "head"]


def _unit_params(model: TransformerLM, unit: int) -> list[nn.Parameter]:
    last = len(model.blocks) + 1
    if unit == 0:
        return [model.tok.weight, model.pos.weight]
    if unit == last:
        return [*model.ln_f.parameters(), model.tok.weight]
    return list(model.blocks[unit - 1].parameters())


def unit_sizes(model: TransformerLM) -> list[int]:
    """Parameters each unit holds (the head counts its copy of the tied token table)."""
    return [sum(p.numel() for p in _unit_params(model, u)) for u in range(len(model.blocks) + 2)]


def partition(sizes: list[int], parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous, non-empty ``[start, end)`` runs of ``sizes`` minimising the largest sum."""
    n = len(sizes)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot cut {n} units into {parts} stages: use between 1 and {n} stages")
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    inf = float("inf")
    # best[k][i]: the smallest max-stage sum covering units [0, i) with k stages; back[k][i]: the last cut
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    back = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], back[k][i] = cost, j
    runs, i = [], n
    for k in range(parts, 0, -1):
        runs.append((back[k][i], i))
        i = back[k][i]
    return runs[::-1]


@dataclass(frozen=True)
class StageCut:
    index: int
    count: int
    start: int  # first unit
    end: int  # one past the last unit

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


def cut_model(model: TransformerLM, stages: int) -> list[StageCut]:
    return [StageCut(i, stages, a, b) for i, (a, b) in enumerate(partition(unit_sizes(model), stages))]


class Stage(nn.Module):
    """One stage's slice of the model; its parameters are the full model's own tensors (shared)."""

    def __init__(self, model: TransformerLM, cut: StageCut):
        super().__init__()
        self.cut = cut
        self.full = [model]  # a list: not registered as a submodule (the stage owns only its slice)
        n = len(model.blocks)
        self.blocks = [model.blocks[u - 1] for u in range(max(cut.start, 1), min(cut.end, n + 1))]
        self.has_embed = cut.start == 0
        self.has_head = cut.end == n + 2

    def params(self) -> list[nn.Parameter]:
        """This stage's parameters, each once, in the model's order."""
        model, seen, out = self.full[0], set(), []
        for u in range(self.cut.start, self.cut.end):
            for p in _unit_params(model, u):
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def owned_params(self) -> list[nn.Parameter]:
        """:meth:`params` without a copy of the tied token table that the first stage also holds."""
        tok = self.full[0].tok.weight
        return [p for p in self.params() if p is not tok or self.has_embed]

    @property
    def ties_embedding(self) -> bool:
        """Holds one of two copies of the tied token table (first and last stage differ)."""
        return self.has_embed != self.has_head

    def forward(self, x: Tensor) -> Tensor:
        model = self.full[0]
        if self.has_embed:
            t = x.shape[1]
            x = model.tok(x) + model.pos(torch.arange(t, device=x.device))
        for block in self.blocks:
            x = block(x)
        if self.has_head:
            x = model.ln_f(x) @ model.tok.weight.T
        return x

    @staticmethod
    def loss(logits: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
