"""Wire codecs for the WAN leg of an all-reduce, and error feedback for lossy ones.

A codec turns a float32 vector into a ``uint8`` wire buffer of a size known in advance (so
``all_to_all``/``all_gather`` can move equal blocks) and back into float32.  Summation always
happens in float32 after decoding: Gloo cannot sum int8 on the wire without overflow, and fp16 sums
over many sites lose precision.

``int8`` keeps one float32 scale per chunk of ``chunk`` values (max-abs / 127), so an outlier only
coarsens its own chunk; with the default 256-value chunk the wire is 1/4 + 1/64 of float32.

``int4`` keeps one fp16 scale per block of 64 values (max-abs / 7, rounded up so no value clips),
two values per byte: 1/8 + 1/128 of float32 (0.523x int8's wire).

``topk`` keeps the ``density`` share of the largest-magnitude values (default 1 %) as fp16, with
their sorted indices as uint16 offsets inside 65536-value ranges plus one uint32 count per range
(or a bitmap when that is smaller); the rest is dropped and the error feedback carries it into the
next send. Each rank's sparse part is decoded and summed in float32 by its owner, so the all-reduce
still sums every rank's contribution.

Every lossy codec wants error feedback (``needs_error_feedback``); the wire sizes per value are
declared torch-free in ``cpn.runtime.costmodel.WIRE_BYTES_PER_VALUE``.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = [
    "BF16", "CODECS", "FP16", "Codec", "ErrorFeedback", "FloatCodec", "Int4Codec", "Int8Codec", "TopKCodec",
    "get_codec", "needs_error_feedback",
]


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


class Int4Codec(Codec):
    """Symmetric 4-bit (levels -7..7) with an fp16 scale per block: ``[packed nibbles | fp16 scales]``.

    The scale is rounded *up* to the next fp16 so ``|x| <= 7 * scale`` and the error stays within
    ``scale / 2`` per value; values too small for any fp16 scale go to zero (error feedback keeps them).
    """

    name = "int4"

    def __init__(self, block: int = 64) -> None:
        if block < 2 or block % 2:
            raise ValueError(f"int4 block must be a positive even number, got {block}; 64 is the default")
        self.block = block
        self.align = block

    def _check(self, numel: int) -> None:
        if numel % self.block:
            raise ValueError(f"int4 codec needs a multiple of {self.block} values, got {numel}; pad first")

    def wire_bytes(self, numel: int) -> int:
        self._check(numel)
        return numel // 2 + 2 * (numel // self.block)

    def scales(self, x: Tensor) -> Tensor:
        """The fp16 scale of each block of ``x`` (as float32), as the encoder stores it."""
        amax = x.float().view(-1, self.block).abs().amax(dim=1)
        want = (amax / 7.0).clamp_(max=torch.finfo(torch.float16).max)
        s16 = want.to(torch.float16)
        low = s16.float() < want
        if bool(low.any()):
            s16 = torch.where(low, torch.nextafter(s16, torch.full_like(s16, math.inf)), s16)
        return s16.float()

    def encode(self, x: Tensor) -> Tensor:
        self._check(x.numel())
        rows = x.float().view(-1, self.block)
        scale = self.scales(x)
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        q = (rows * inv[:, None]).round_().clamp_(-7, 7).add_(8).to(torch.uint8).view(-1, 2)
        half = x.numel() // 2
        wire = torch.empty(self.wire_bytes(x.numel()), dtype=torch.uint8, device=x.device)
        wire[:half].copy_(q[:, 0] | (q[:, 1] << 4))
        wire[half:].view(torch.float16).copy_(scale.to(torch.float16))
        return wire

    def decode(self, wire: Tensor, numel: int) -> Tensor:
        half = numel // 2
        packed = wire[:half]
        q = torch.stack((packed & 0xF, packed >> 4), dim=1).view(-1, self.block).float().sub_(8.0)
        scale = wire[half : self.wire_bytes(numel)].view(torch.float16).float()
        return q.mul_(scale[:, None]).view(-1)


class TopKCodec(Codec):
    """The ``density`` share of the largest-magnitude values in fp16, with compactly coded positions.

    ``k = ceil(density * numel)`` values, so the wire size is known in advance. Positions, sorted, go
    as ``[fp16 values | uint16 offsets within their 65536-value range | uint32 count per range]``, or
    as ``[fp16 values | bitmap]`` when the bitmap is smaller (density above about 1/16).
    """

    align = 1
    RANGE = 1 << 16

    def __init__(self, density: float = 0.01) -> None:
        if not 0.0 < density <= 1.0:
            raise ValueError(f"topk density must be in (0, 1], got {density}; 0.01 keeps 1 % of the values")
        self.density = density
        self.name = "topk" if density == 0.01 else f"topk:{density:g}"

    def k(self, numel: int) -> int:
        return max(1, min(numel, math.ceil(self.density * numel - 1e-9)))

    def _ranges(self, numel: int) -> int:
        return -(-numel // self.RANGE)

    def _bitmap(self, numel: int) -> bool:
        return -(-numel // 8) < 2 * self.k(numel) + 4 * self._ranges(numel)

    def wire_bytes(self, numel: int) -> int:
        k = self.k(numel)
        index = -(-numel // 8) if self._bitmap(numel) else 2 * k + 4 * self._ranges(numel)
        return 2 * k + index

    def encode(self, x: Tensor) -> Tensor:
        flat = x.float().reshape(-1)
        n, k = flat.numel(), self.k(flat.numel())
        idx = flat.abs().topk(k, sorted=False).indices.sort().values
        wire = torch.zeros(self.wire_bytes(n), dtype=torch.uint8, device=x.device)
        wire[: 2 * k].view(torch.float16).copy_(flat[idx].to(torch.float16))
        rest = wire[2 * k :]
        if self._bitmap(n):
            bits = torch.zeros(-(-n // 8) * 8, dtype=torch.uint8, device=x.device)
            bits[idx] = 1
            weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=x.device)
            rest.copy_((bits.view(-1, 8) * weights).sum(dim=1).to(torch.uint8))
        else:
            rest[: 2 * k].view(torch.int16).copy_((idx & 0xFFFF).to(torch.int32).to(torch.int16))
            counts = torch.bincount(idx >> 16, minlength=self._ranges(n)).to(torch.int32)
            rest[2 * k :].view(torch.int32).copy_(counts)
        return wire

    def positions(self, wire: Tensor, numel: int) -> Tensor:
        """The sorted indices a wire buffer carries."""
        k = self.k(numel)
        rest = wire[2 * k : self.wire_bytes(numel)]
        if self._bitmap(numel):
            shifts = torch.arange(8, dtype=torch.uint8, device=wire.device)
            bits = (rest[:, None] >> shifts) & 1
            return bits.view(-1)[:numel].nonzero().view(-1)
        local = rest[: 2 * k].view(torch.int16).to(torch.int64) & 0xFFFF
        counts = rest[2 * k :].view(torch.int32).to(torch.int64)
        base = torch.repeat_interleave(torch.arange(counts.numel(), device=wire.device) * self.RANGE, counts)
        return base + local

    def decode(self, wire: Tensor, numel: int) -> Tensor:
        k = self.k(numel)
        out = torch.zeros(numel, dtype=torch.float32, device=wire.device)
        out[self.positions(wire, numel)] = wire[: 2 * k].view(torch.float16).float()
        return out


FP16 = FloatCodec(name="fp16", dtype=torch.float16)
BF16 = FloatCodec(name="bf16", dtype=torch.bfloat16)
CODECS: dict[str, Codec] = {"fp16": FP16, "bf16": BF16, "int8": Int8Codec(), "int4": Int4Codec(), "topk": TopKCodec()}
LOSSY = ("int8", "int4", "topk")  # codecs whose error is large enough to need error feedback


def get_codec(name: str | Codec | None) -> Codec | None:
    """Resolve ``None``/``"none"``/a codec name/a codec instance; ``"topk:0.05"`` sets top-k's density."""
    if name is None or isinstance(name, Codec):
        return name
    if name == "none":
        return None
    if name.startswith("topk:"):
        try:
            density = float(name.partition(":")[2])
        except ValueError:
            raise ValueError(f"compression {name!r}: give topk's density as a number, e.g. topk:0.01") from None
        return TopKCodec(density)
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(
            f"unknown compression {name!r}; choose one of none, {', '.join(CODECS)} (or topk:<density>)"
        ) from None


def needs_error_feedback(name: str | Codec | None) -> bool:
    """Whether a codec drops enough to carry its error into the next send (int8, int4, topk)."""
    codec = get_codec(name)
    return codec is not None and codec.name.partition(":")[0] in LOSSY


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
