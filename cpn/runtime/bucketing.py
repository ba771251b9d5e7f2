"""Pack many small tensors into flat buffers so each collective moves one large message.

A model has hundreds of parameter tensors; one all-reduce per tensor would pay the WAN latency
hundreds of times.  Tensors are grouped by dtype and device (a buffer has one of each) and packed
in order until a bucket reaches ``bucket_bytes``; a tensor larger than that gets a bucket alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Bucket", "make_buckets"]


@dataclass
class Bucket:
    """Tensors reduced together through ``flat``; call :meth:`unpack` after reducing ``flat``."""

    tensors: list[Tensor]
    flat: Tensor
    aliased: bool

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def unpack(self) -> None:
        if self.aliased:
            return
        offset = 0
        for t in self.tensors:
            n = t.numel()
            t.copy_(self.flat[offset : offset + n].view_as(t))
            offset += n


def _pack(tensors: list[Tensor]) -> Bucket:
    if len(tensors) == 1 and tensors[0].is_contiguous():
        return Bucket(tensors, tensors[0].view(-1), aliased=True)
    flat = torch.cat([t.reshape(-1) for t in tensors])
    return Bucket(tensors, flat, aliased=False)


def make_buckets(tensors: Sequence[Tensor], bucket_bytes: int) -> list[Bucket]:
    """Buckets in a deterministic order (same on every rank given the same tensor list)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}; 25 MiB is DDP's default")
    by_kind: dict[tuple[torch.dtype, torch.device], list[list[Tensor]]] = {}
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    for t in tensors:
        if t.numel() == 0:
            continue
        kind = (t.dtype, t.device)
        groups = by_kind.setdefault(kind, [[]])
        nbytes = t.numel() * t.element_size()
        if groups[-1] and sizes[kind] + nbytes > bucket_bytes:
            groups.append([])
            sizes[kind] = 0
        groups[-1].append(t)
        sizes[kind] = sizes.get(kind, 0) + nbytes
    return [_pack(g) for groups in by_kind.values() for g in groups]
