"""Every all-reduce algorithm and codec against torch's own all-reduce, on real Gloo processes.

One launch per (S, W) runs every case, because starting processes dominates the cost: S=1..3 x
W=1..3, tensor lists of odd sizes (not divisible by W or S, empty tensors, empty lists) and a tiny
bucket size so that many buckets are exercised.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cpn.runtime.bucketing import make_buckets
from cpn.runtime.codecs import BF16, FP16, ErrorFeedback, Int8Codec, get_codec
from cpn.runtime.collectives import allreduce, parse_algorithm
from cpn.runtime.groups import current_groups, init_groups, shutdown

SHAPES = [[], [0, 1], [7, 13, 1], [1001, 0, 3, 257, (5, 9)]]
CASES = [(alg, comp) for alg in ("flat", "hierarchical", "leader") for comp in (None, "fp16", "bf16", "int8")]
TOL = {None: 1e-5, "fp16": 4e-3, "bf16": 3e-2, "int8": 3e-2}


def _tensors(shapes: list, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s if isinstance(s, tuple) else (s,), generator=gen) for s in shapes]


def _reference(shapes: list, op: str) -> list[torch.Tensor]:
    """torch's all-reduce over the default group: the ground truth."""
    expected = _tensors(shapes, seed=1000 + dist.get_rank())
    for t in expected:
        dist.all_reduce(t)
        if op == "avg":
            t.div_(dist.get_world_size())
    return expected


def _check_case(
    alg: str,
    comp: str | None,
    shapes: list,
    expected: list[torch.Tensor],
    bucket_bytes: int,
    op: str,
    chunk_bytes: int = 4 * 2**20,
) -> str | None:
    mine = _tensors(shapes, seed=1000 + dist.get_rank())
    allreduce(
        mine, algorithm=alg, compression=comp, bucket_bytes=bucket_bytes, op=op, chunk_bytes=chunk_bytes
    )
    for got, want in zip(mine, expected, strict=True):
        scale = max(want.abs().max().item(), 1.0) if want.numel() else 1.0
        if not torch.allclose(got, want, rtol=TOL[comp], atol=TOL[comp] * scale):
            err = (got - want).abs().max().item()
            return f"{alg}+{comp} shapes={shapes} bucket={bucket_bytes} op={op}: max error {err:.3g}"
    return None


def _check_stats(alg: str) -> str | None:
    """The algorithm's byte count for a known payload (1024 x W x S floats, divisible everywhere)."""
    g = current_groups()
    s, w = g.S, g.W
    n = 1024 * w * s
    stats = allreduce(torch.ones(n), algorithm=alg)
    nbytes = 4 * n
    if alg == "hierarchical":
        want = (2 * (w - 1) * nbytes // w, 2 * (s - 1) * (nbytes // w) // s)
        if (stats.intra_bytes, stats.wan_bytes) != want:
            return f"{alg}: counted {(stats.intra_bytes, stats.wan_bytes)}, expected {want}"
    int8 = allreduce(torch.ones(n), algorithm=alg, compression="int8")
    if s > 1 and stats.wan_bytes and not int8.wan_bytes <= 0.27 * stats.wan_bytes:
        return f"{alg}+int8 sends {int8.wan_bytes} of {stats.wan_bytes} WAN bytes"
    return None


def _error_feedback_helps() -> str | None:
    """Summed over rounds, EF keeps the int8 error bounded where plain rounding lets it drift."""
    g = current_groups()
    x = _tensors([4096], seed=7 + g.rank)[0] * 0.01 + 0.003
    truth = x.clone()
    dist.all_reduce(truth)
    drift = {}
    for use_ef in (False, True):
        ef = ErrorFeedback() if use_ef else None
        total = torch.zeros_like(x)
        for _ in range(20):
            y = x.clone()
            allreduce(y, algorithm="hierarchical" if g.W else "leader", compression="int8", error_feedback=ef)
            total += y
        drift[use_ef] = (total - 20 * truth).abs().mean().item()
    return None if g.S == 1 or drift[True] < drift[False] else f"error feedback did not help: {drift}"


def correctness_worker() -> list[str]:
    """Runs on every rank; returns the failures it saw (empty when all good)."""
    init_groups()
    failures = []
    refs = [_reference(shapes, "sum") for shapes in SHAPES]
    avg_shapes = [1001, 3]
    avg_ref = _reference(avg_shapes, "avg")
    for alg, comp in CASES:
        for shapes, ref in zip(SHAPES, refs, strict=True):
            failures.append(_check_case(alg, comp, shapes, ref, 25 * 2**20, "sum"))
        failures.append(_check_case(alg, comp, SHAPES[-1], refs[-1], 1024, "sum", chunk_bytes=300))
        failures.append(_check_case(alg, comp, avg_shapes, avg_ref, 2048, "avg"))
        failures.append(_check_stats(alg) if comp is None else None)
    failures.append(_error_feedback_helps())
    ints = [torch.arange(11, dtype=torch.int64) * (dist.get_rank() + 1)]
    allreduce(ints, algorithm="hierarchical", compression="int8")
    ws = dist.get_world_size()
    if not torch.equal(ints[0], torch.arange(11) * ws * (ws + 1) // 2):
        failures.append("int64 tensors must bypass compression and sum exactly")
    shutdown()
    return [f for f in failures if f]


@pytest.mark.parametrize("sites", [1, 2, 3])
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_allreduce_matches_torch(run_workers, sites: int, workers: int) -> None:
    results = run_workers(sites, workers, correctness_worker)
    failures = sorted({f for per_rank in results for f in per_rank})
    assert not failures, "\n".join(failures)


# ------------------------------------------------------------------ in-process unit tests
@pytest.mark.parametrize("codec", [FP16, BF16, Int8Codec(chunk=64)])
def test_codec_roundtrip_is_close_and_sized(codec) -> None:
    x = torch.randn(64 * 5) * 3
    wire = codec.encode(x)
    assert wire.dtype == torch.uint8 and wire.numel() == codec.wire_bytes(x.numel())
    assert torch.allclose(codec.decode(wire, x.numel()), x, atol=3 * x.abs().max().item() / 127)


def test_int8_chunk_scale_isolates_outliers() -> None:
    codec = Int8Codec(chunk=4)
    x = torch.tensor([1e4, 0.0, 0.0, 0.0, 0.1, 0.2, 0.3, 0.4])
    y = codec.roundtrip(x)
    assert torch.allclose(y[4:], x[4:], atol=0.4 / 254 + 1e-6)
    assert codec.wire_bytes(8) == 8 + 2 * 4


def test_int8_handles_zero_chunks_and_rejects_ragged() -> None:
    codec = Int8Codec(chunk=4)
    assert torch.equal(codec.roundtrip(torch.zeros(8)), torch.zeros(8))
    with pytest.raises(ValueError, match="multiple of 4"):
        codec.encode(torch.zeros(6))


def test_unknown_names_say_what_exists() -> None:
    with pytest.raises(ValueError, match="int8"):
        get_codec("int3")
    with pytest.raises(ValueError, match="hierarchical"):
        parse_algorithm("ring")
    assert parse_algorithm("hierarchical+int8") == ("hierarchical", "int8")


def test_buckets_split_by_size_and_dtype_and_skip_empty() -> None:
    ts = [torch.ones(10), torch.ones(0), torch.ones(10, dtype=torch.float64), torch.ones(10), torch.ones(30)]
    buckets = make_buckets(ts, bucket_bytes=80)
    assert [[t.numel() for t in b.tensors] for b in buckets] == [[10, 10], [30], [10]]
    b = buckets[0]
    b.flat.mul_(2)
    b.unpack()
    assert torch.equal(ts[0], torch.full((10,), 2.0)) and torch.equal(ts[3], torch.full((10,), 2.0))


def test_error_feedback_carries_residual() -> None:
    ef = ErrorFeedback()
    x = torch.tensor([1.0, 2.0])
    ef.record("k", x, torch.tensor([0.5, 2.0]))
    assert torch.equal(ef.compensate("k", x), torch.tensor([1.5, 2.0]))
    assert torch.equal(ef.compensate("k", torch.zeros(3)), torch.zeros(3))
