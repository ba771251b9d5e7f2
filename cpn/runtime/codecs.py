"""Wire codecs for the WAN leg of an all-reduce, and error feedback for lossy ones.

A codec turns a float32 vector into a ``uint8`` wire buffer of a size known in advance (so
``all_to_all``/``all_gather`` can move equal blocks) and back into float32.  Summation always
happens in float32 after decoding: Gloo cannot sum int8 on the wire without overflow, and fp16 sums
over many sites lose precision.

``int8`` keeps one float32 scale per chunk of ``chunk`` values (max-abs / 127), so an outlier only
coarsens its own chunk; with the default 256-value chunk the wire is 1/4 + 1/64 of float32.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["BF16", "CODECS", "FP16", "Codec", "ErrorFeedback", "FloatCodec", "Int8Codec", "get_codec"]


class Codec:
    """Base: fixed-size encoding of float32 vectors whose length is a multiple of ``align``."""

    name: str
    align: int

    def wire_bytes(self, numel: int) -> int:
        raise NotImplementedError

    def encode(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def decode(self, wire: Tensor, numel: int) -> Tensor:
        raise NotImplementedError

    def roundtrip(self, x: Tensor) -> Tensor:
        """What the receiver sees for ``x``: the lossy image the error feedback subtracts."""
        return self.decode(self.encode(x), x.numel())


class FloatCodec(Codec):
    """Cast to a 16-bit float type (fp16 or bf16) for the wire."""

    align = 1

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name = name
        self.dtype = dtype

    def wire_bytes(self, numel: int) -> int:
        return 2 * numel

    def encode(self, x: Tensor) -> Tensor:
        return x.to(self.dtype).view(torch.uint8)

    def decode(self, wire: Tensor, numel: int) -> Tensor:
        return wire.view(self.dtype).float()


class Int8Codec(Codec):
    """Symmetric int8 with a float32 scale per chunk: ``[int8 values | float32 scales]`` on the wire."""

    name = "int8"

    def __init__(self, chunk: int = 256) -> None:
        if chunk < 1:
            raise ValueError(f"int8 chunk must be positive, got {chunk}; 256 is the default")
        self.chunk = chunk
        self.align = chunk

    def _check(self, numel: int) -> None:
        if numel % self.chunk:
            raise ValueError(f"int8 codec needs a multiple of {self.chunk} values, got {numel}; pad first")

    def wire_bytes(self, numel: int) -> int:
        self._check(numel)
        return numel + 4 * (numel // self.chunk)

    def encode(self, x: Tensor) -> Tensor:
        self._check(x.numel())
        rows = x.float().view(-1, self.chunk)
        amax = rows.abs().amax(dim=1)
        inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
        wire = torch.empty(self.wire_bytes(x.numel()), dtype=torch.uint8, device=x.device)
        q = rows * inv[:, None]
        wire[: x.numel()].view(torch.int8).copy_(q.round_().view(-1))
        wire[x.numel() :].view(torch.float32).copy_(amax.div_(127.0))
        return wire

    def decode(self, wire: Tensor, numel: int) -> Tensor:
        q = wire[:numel].view(torch.int8).view(-1, self.chunk)
        scale = wire[numel:].view(torch.float32)
        return q.float().mul_(scale[:, None]).view(-1)


FP16 = FloatCodec(name="fp16", dtype=torch.float16)
BF16 = FloatCodec(name="bf16", dtype=torch.bfloat16)
CODECS: dict[str, Codec] = {"fp16": FP16, "bf16": BF16, "int8": Int8Codec()}


def get_codec(name: str | Codec | None) -> Codec | None:
    """Resolve ``None``/``"none"``/a codec name/a codec instance."""
    if name is None or isinstance(name, Codec):
        return name
    if name == "none":
        return None
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"unknown compression {name!r}; choose one of none, {', '.join(CODECS)}") from None


@dataclass
class ErrorFeedback:
    """Carries each sender's quantisation error into its next send (EF-SGD).

    Keyed by the caller's bucket key, so one instance serves a whole model as long as the bucket
    layout stays the same from step to step; a shape change resets that key's residual.
    """

    residuals: dict[Hashable, Tensor] = field(default_factory=dict)

    def compensate(self, key: Hashable, x: Tensor) -> Tensor:
        """``x`` plus the error left over from the last send under ``key`` (a new tensor)."""
        r = self.residuals.get(key)
        if r is None or r.shape != x.shape:
            return x.clone()
        return x + r

    def record(self, key: Hashable, intended: Tensor, sent: Tensor) -> None:
        self.residuals[key] = intended - sent

    def reset(self) -> None:
        self.residuals.clear()
