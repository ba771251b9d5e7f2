"""Cutting a model into contiguous pipeline stages.

A model is a chain of *units*, cut into P contiguous runs chosen to make the largest stage's
parameter count as small as possible (an exact DP; a handful of units), or where the user says
(``cuts``). Two kinds of model can be cut:

- CPN's built-in LMs, either arch (:class:`LMUnits`): the embedding (the token table, and the gpt
  arch's position table), each transformer block, and the head (final norm + output projection). When
  the head's projection is the token table (tied weights: every gpt preset, a llama with
  ``tie_embeddings``) the first and the last stage each hold a copy, and the pipeline adds their two
  gradients every step so both copies stay equal (what one process's autograd would do with the one
  shared tensor).
- A user's ``nn.Sequential`` (:class:`SequentialUnits`): its children, in order. Parameters shared by
  children of different stages (tied weights) are refused: each stage owns its own tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch.nn.functional as F
from torch import Tensor, nn

from cpn.runtime.model import LlamaLM, TransformerLM
from cpn.runtime.partition import partition

__all__ = ["LMUnits", "SequentialUnits", "Stage", "StageCut", "Units", "cut_model", "cut_units", "partition",
           "unit_names", "unit_sizes", "units_of"]


class Units:
    """A model seen as a chain of units: their names, parameters and the forward pass through a run."""

    tied: nn.Parameter | None = None  # a tensor the first and the last unit share (the LM's token table)

    def __init__(self, model: nn.Module):
        self.model = model

    def __len__(self) -> int:
        return len(self.names())

    def names(self) -> list[str]:
        raise NotImplementedError

    def params(self, unit: int) -> list[nn.Parameter]:
        raise NotImplementedError

    def forward(self, start: int, end: int, x: Tensor) -> Tensor:
        raise NotImplementedError

    def sizes(self) -> list[int]:
        """Parameters each unit holds (the LM's head counts its copy of the tied token table)."""
        return [sum(p.numel() for p in self.params(u)) for u in range(len(self))]

    def weights(self) -> list[int]:
        """What the automatic cut balances: the parameters (the planner prices the same cut)."""
        return self.sizes()


class LMUnits(Units):
    model: TransformerLM | LlamaLM

    @property
    def tied(self) -> nn.Parameter | None:  # type: ignore[override]
        return self.model.tied

    def names(self) -> list[str]:
        return ["embed", *(f"block{i}" for i in range(len(self.model.blocks))), "head"]

    def params(self, unit: int) -> list[nn.Parameter]:
        model = self.model
        if unit == 0:
            return model.embed_params()
        if unit == len(model.blocks) + 1:
            return model.head_params()
        return list(model.blocks[unit - 1].parameters())

    def forward(self, start: int, end: int, x: Tensor) -> Tensor:
        model, n = self.model, len(self.model.blocks)
        if start == 0:
            x = model.embed(x)
        for u in range(max(start, 1), min(end, n + 1)):
            x = model.blocks[u - 1](x)
        if end == n + 2:
            x = model.head(x)
        return x


class SequentialUnits(Units):
    model: nn.Sequential

    def __init__(self, model: nn.Sequential):
        super().__init__(model)
        self.children = list(model.children())

    def names(self) -> list[str]:
        return [f"{name}:{type(child).__name__}" for name, child in self.model.named_children()]

    def params(self, unit: int) -> list[nn.Parameter]:
        return list(self.children[unit].parameters())

    def weights(self) -> list[int]:
        """Parameters plus one: a run of parameter-free children (activations, pooling) still counts."""
        return [s + 1 for s in self.sizes()]

    def forward(self, start: int, end: int, x: Tensor) -> Tensor:
        for child in self.children[start:end]:
            x = child(x)
        return x


def units_of(model: nn.Module) -> Units:
    """The units of a model the pipeline can cut; a ValueError that says what to do for any other."""
    if isinstance(model, TransformerLM | LlamaLM):
        return LMUnits(model)
    if isinstance(model, nn.Sequential):
        if len(model) < 1:
            raise ValueError("the pipeline cuts an nn.Sequential's children into stages: this one is empty")
        return SequentialUnits(model)
    raise ValueError(f"the pipeline strategy cuts an nn.Sequential (its children, in order, are the units cut into "
                     f"stages) or CPN's built-in LM, not a {type(model).__name__}: wrap your layers in nn.Sequential, "
                     "or use a data-parallel strategy")


def unit_names(model: nn.Module) -> list[str]:
    return units_of(model).names()


def unit_sizes(model: nn.Module) -> list[int]:
    """Parameters each unit holds (the LM's head counts its copy of the tied token table)."""
    return units_of(model).sizes()


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


def cut_units(units: Units, stages: int, cuts: Sequence[int] | None = None) -> list[StageCut]:
    """``stages`` contiguous runs of ``units``: by parameter count, or starting at the unit indices
    ``cuts`` (the first unit of every stage after the first, increasing)."""
    n = len(units)
    if cuts is None:
        runs = partition(units.weights(), stages)
    else:
        starts = [0, *cuts]
        if len(starts) != stages or any(not 0 < c < n for c in cuts) or any(a >= b for a, b in pairwise(starts)):
            raise ValueError(f"stages={list(cuts)} must be {stages - 1} increasing unit indices between 1 and {n - 1} "
                             f"(the first unit of each stage after the first) for {stages} stages of {n} units")
        runs = list(zip(starts, [*cuts, n], strict=True))
    out = [StageCut(i, stages, a, b) for i, (a, b) in enumerate(runs)]
    _refuse_shared(units, out)
    return out


def _refuse_shared(units: Units, cuts: list[StageCut]) -> None:
    """A parameter held by units of two stages (other than the LM's tied table, which the pipeline keeps
    equal) cannot be cut apart."""
    owner: dict[int, int] = {}
    names = units.names()
    for cut in cuts:
        for u in range(cut.start, cut.end):
            for p in units.params(u):
                if p is units.tied:
                    continue
                first = owner.setdefault(id(p), u)
                if first < cut.start:
                    raise ValueError(f"units {names[first]!r} and {names[u]!r} share a parameter (tied weights) but "
                                     f"fall in different stages: cut elsewhere (stages=) or untie them")


def cut_model(model: nn.Module, stages: int, cuts: Sequence[int] | None = None) -> list[StageCut]:
    return cut_units(units_of(model), stages, cuts)


class Stage(nn.Module):
    """One stage's slice of the model; its parameters are the full model's own tensors (shared)."""

    def __init__(self, model: nn.Module | Units, cut: StageCut):
        super().__init__()
        self.cut = cut
        self.units = model if isinstance(model, Units) else units_of(model)  # not a submodule: owns only its slice
        self.has_embed = cut.start == 0  # the first stage: takes the inputs
        self.has_head = cut.end == len(self.units)  # the last: gives the outputs the loss reads

    def params(self) -> list[nn.Parameter]:
        """This stage's parameters, each once, in the model's order."""
        seen, out = set(), []
        for u in range(self.cut.start, self.cut.end):
            for p in self.units.params(u):
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def owned_params(self) -> list[nn.Parameter]:
        """:meth:`params` without a copy of the tied token table that the first stage also holds."""
        tied = self.units.tied
        return [p for p in self.params() if p is not tied or self.has_embed]

    @property
    def ties_embedding(self) -> bool:
        """Holds one of two copies of the tied token table (first and last stage differ)."""
        return self.units.tied is not None and self.has_embed != self.has_head

    def forward(self, x: Tensor) -> Tensor:
        return self.units.forward(self.cut.start, self.cut.end, x)

    @staticmethod
    def loss(logits: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
